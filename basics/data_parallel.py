"""Lesson 4: data parallelism from scratch. Each rank trains on its shard of the batch; averaging the gradients
with all_reduce makes every rank take the step one process would take on the whole batch.

    torchrun --nproc_per_node=4 basics/data_parallel.py

After a few Adam steps the weights equal those of DistributedDataParallel and of one process on the whole batch.
(A classic bug: looping over parameters with `type(p) is torch.Tensor` skips them all, since parameters are
nn.Parameter, and then no gradient is ever averaged. Iterate over model.parameters() itself.)
"""

import copy

import torch
import torch.distributed as dist
import world
from torch.nn.parallel import DistributedDataParallel

STEPS, LR = 5, 0.01
rank, world_size, device = world.init()
model, x, y = world.toy_problem(device)
reference = world.train_one_process(copy.deepcopy(model), x, y, STEPS, LR)
mine = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)  # this rank's shard of the batch

ours = copy.deepcopy(model)
optimizer = torch.optim.Adam(ours.parameters(), lr=LR)
for step in range(STEPS):
    loss = torch.nn.functional.mse_loss(ours(x[mine]), y[mine])  # the mean over this rank's shard
    loss.backward()
    for p in ours.parameters():
        dist.all_reduce(p.grad)  # sum over ranks ...
        p.grad /= world_size  # ... then the mean: equal shards, so the mean of means is the whole batch's mean
    optimizer.step()
    optimizer.zero_grad()
    world.log(f"step {step}: loss on my {len(x[mine])} samples {loss.item():.5f}")

ddp = DistributedDataParallel(copy.deepcopy(model))  # the same, with bucketed all-reduces overlapping backward
optimizer = torch.optim.Adam(ddp.parameters(), lr=LR)
for _ in range(STEPS):
    torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
    optimizer.step()
    optimizer.zero_grad()

same = lambda a, b: all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a, b))
world.check("from-scratch weights equal one process on the whole batch", same(ours.parameters(), reference))
world.check("from-scratch weights equal DistributedDataParallel", same(ours.parameters(), ddp.module.parameters()))
world.finish()
