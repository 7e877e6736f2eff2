"""Lesson 7: pipeline parallelism with the GPipe schedule. The model's layers are split into stages, one per rank;
the batch is cut into micro-batches that flow through the stages so that several ranks work at once.

    torchrun --nproc_per_node=4 basics/pipeline_parallel.py

GPipe: all micro-batches go forward (activations sent to the next stage), then all go backward (gradients sent
to the previous stage); gradients accumulate over micro-batches and the step sees the whole batch's gradient.
The idle time at the start and end (the "bubble") shrinks as the number of micro-batches grows.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import world

MICRO_BATCHES = 4
rank, stages, device = world.init()
torch.manual_seed(0)  # every rank builds the whole model, to compare with, and keeps its own stage
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(stages)])
model = model.to(device)
x, y = torch.randn(8 * MICRO_BATCHES, 16, device=device), torch.randn(8 * MICRO_BATCHES, 16, device=device)
stage = copy.deepcopy(model[rank])
first, last = rank == 0, rank == stages - 1

inputs, outputs, loss = [], [], torch.zeros((), device=device)
for m, (xm, ym) in enumerate(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))):  # forward, micro-batch by one
    if first:
        inp = xm
    else:
        inp = torch.empty_like(xm)
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()  # we will need the gradient with respect to what we received
    out = stage(inp)
    if last:
        out = F.mse_loss(out, ym) / MICRO_BATCHES  # the whole batch's mean is the mean of equal micro-batches'
        loss += out.detach()
    else:
        dist.send(out.detach(), dst=rank + 1)
    inputs.append(inp)
    outputs.append(out)
    world.log(f"forward micro-batch {m}")

for m in reversed(range(MICRO_BATCHES)):  # backward, last micro-batch first
    if last:
        outputs[m].backward()
    else:
        grad = torch.empty_like(outputs[m])
        dist.recv(grad, src=rank + 1)
        outputs[m].backward(grad)
    if not first:
        dist.send(inputs[m].grad, dst=rank - 1)
    world.log(f"backward micro-batch {m}")

reference_loss = F.mse_loss(model(x), y)
reference_loss.backward()
if last:
    world.log(f"pipeline loss {loss.item():.6f}, unsplit model {reference_loss.item():.6f}")
    world.check("pipeline loss equals the unsplit model's", torch.allclose(loss, reference_loss, atol=1e-6))
world.check(
    f"stage {rank} gradients equal the unsplit model's layer {rank}",
    all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(stage.parameters(), model[rank].parameters())),
)
world.finish()
