"""Lesson 5: ZeRO from scratch. Data parallelism (lesson 4) keeps a full copy of everything on every rank; ZeRO
splits it over the N ranks: stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the parameters.

    torchrun --nproc_per_node=4 basics/zero.py

Each stage ends with the weights of one process on the whole batch (as lesson 4 does), and prints the bytes each
rank holds next to the ZeRO paper's arithmetic. Training here is fp32, where Adam keeps 8 bytes of state per
parameter and no separate master copy: plain data parallelism holds 4+4+8 = 16 bytes per parameter (Psi).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import world
from torch.distributed.nn.functional import all_gather as differentiable_all_gather
from torch.utils.checkpoint import checkpoint

STEPS, LR = 5, 0.01
rank, N, device = world.init()
model, x, y = world.toy_problem(device)
reference = world.train_one_process(copy.deepcopy(model), x, y, STEPS, LR)
mine = slice(rank * len(x) // N, (rank + 1) * len(x) // N)
shapes = [p.shape for p in model.parameters()]  # w1, b1, w2, b2
padded = lambda t: F.pad(t.detach().flatten(), (0, -t.numel() % N))  # flat, length a multiple of N
unpad = lambda flat, shape: flat[: shape.numel()].view(shape)
nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
psi = sum(len(padded(p)) for p in model.parameters())


def mlp(params, inputs):  # the toy model as a function of its parameters
    w1, b1, w2, b2 = params
    return F.linear(torch.tanh(F.linear(inputs, w1, b1)), w2, b2)


def layer(inputs, w_shard, b_shard, i):  # stage 3: assemble the layer's weights just before use
    gather = lambda shard, shape: unpad(torch.cat(differentiable_all_gather(shard)), shape)  # backward: reduce-scatter
    return F.linear(inputs, gather(w_shard, shapes[i]), gather(b_shard, shapes[i + 1]))


for stage in (1, 2, 3):
    flats = [padded(p) for p in model.parameters()]  # the full parameters, flat
    # this rank's 1/N slice of each parameter, the only part its optimizer updates (and holds state for)
    shards = [torch.nn.Parameter(f.chunk(N)[rank].clone() if stage == 3 else f.chunk(N)[rank]) for f in flats]
    if stage == 3:
        flats = []  # stage 3 keeps no full parameter between steps
    optimizer = torch.optim.Adam(shards, lr=LR)
    for _ in range(STEPS):
        if stage < 3:
            params = [unpad(f, s).requires_grad_() for f, s in zip(flats, shapes)]  # views of the full parameters
            F.mse_loss(mlp(params, x[mine]), y[mine]).backward()
            for p, shard in zip(params, shards):
                grad = padded(p.grad)
                if stage == 1:  # every rank receives all the averaged gradients and uses its slice
                    dist.all_reduce(grad)
                    shard.grad = grad.chunk(N)[rank] / N
                else:  # stage 2: each rank receives only the sum for its slice
                    shard.grad = torch.empty_like(shard)
                    dist.reduce_scatter_tensor(shard.grad, grad)
                    shard.grad /= N
            grads = [p.grad for p in params] if stage == 1 else [s.grad for s in shards]
        else:  # checkpoint: the gathered weights are dropped after use and gathered again for the backward pass
            hidden = torch.tanh(checkpoint(layer, x[mine], shards[0], shards[1], 0, use_reentrant=False))
            F.mse_loss(checkpoint(layer, hidden, shards[2], shards[3], 2, use_reentrant=False), y[mine]).backward()
            for shard in shards:
                shard.grad /= N  # the gather's backward summed the gradients over ranks
            grads = [s.grad for s in shards]
        optimizer.step()  # updates the slices (in stages 1-2 inside the full parameters: they are views)
        optimizer.zero_grad(set_to_none=False)
        for flat, shard in zip(flats, shards):  # stages 1-2: everyone gets everyone's updated slice
            dist.all_gather_into_tensor(flat, shard.detach().clone())

    held = {
        "parameters": nbytes(flats or shards),
        "gradients": nbytes(grads),
        "optimizer": nbytes(t for s in optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])),
    }
    fp32 = {1: 8 * psi + 8 * psi / N, 2: 4 * psi + 12 * psi / N, 3: 16 * psi / N}[stage]
    paper = {1: "4Psi + 12Psi/N", 2: "2Psi + 14Psi/N", 3: "16Psi/N"}[stage]
    world.log(
        f"ZeRO-{stage}: holds {held} = {sum(held.values())} bytes; fp32 arithmetic "
        f"{['', '8Psi + 8Psi/N', '4Psi + 12Psi/N', '16Psi/N'][stage]} = {fp32:.0f} (Psi = {psi}; "
        f"plain data parallel 16Psi = {16 * psi}; the paper's mixed precision: {paper})"
    )
    world.check(f"ZeRO-{stage} bytes held match the arithmetic", sum(held.values()) == fp32)
    if stage == 3:
        final = [unpad(torch.cat(differentiable_all_gather(s.detach())), shape) for s, shape in zip(shards, shapes)]
    else:
        final = [unpad(f, shape) for f, shape in zip(flats, shapes)]
    world.check(
        f"ZeRO-{stage} weights equal one process on the whole batch",
        all(torch.allclose(p, q, atol=1e-6) for p, q in zip(final, reference)),
    )
world.finish()
