"""Lesson 2: collectives, each checked against what it must give. Rank r contributes the value r (or r+1).

torchrun --nproc_per_node=4 basics/collectives.py
"""

import torch
import torch.distributed as dist
import world

rank, world_size, device = world.init()
N = world_size
mine = lambda: torch.tensor([float(rank)], device=device)

t = torch.tensor([7.0], device=device) if rank == 0 else torch.zeros(1, device=device)  # rank 0's 7 reaches all
dist.broadcast(t, src=0)
world.check(f"broadcast from rank 0 gives 7 -> {t.item():.0f}", t.item() == 7)

t = mine()
dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only the destination's result is defined
if rank == 0:
    world.check(f"reduce(sum) to rank 0 gives {N * (N - 1) // 2} -> {t.item():.0f}", t.item() == N * (N - 1) / 2)

t = mine()
dist.all_reduce(t, op=dist.ReduceOp.SUM)
world.check(f"all_reduce(sum) gives {N * (N - 1) // 2} -> {t.item():.0f}", t.item() == N * (N - 1) / 2)
t = mine()
dist.all_reduce(t, op=dist.ReduceOp.MAX)
world.check(f"all_reduce(max) gives {N - 1} -> {t.item():.0f}", t.item() == N - 1)

gathered = [torch.zeros(1, device=device) for _ in range(N)]
dist.all_gather(gathered, mine())
world.check(
    f"all_gather gives {list(range(N))} -> {[int(g.item()) for g in gathered]}",
    [g.item() for g in gathered] == list(range(N)),
)

gathered = [torch.zeros(1, device=device) for _ in range(N)] if rank == 0 else None
dist.gather(mine(), gathered, dst=0)
if rank == 0:
    world.check(f"gather to rank 0 gives {list(range(N))}", [g.item() for g in gathered] == list(range(N)))

t = torch.zeros(1, device=device)  # scatter: rank 0 sends element i to rank i
dist.scatter(t, [torch.tensor([10.0 * i], device=device) for i in range(N)] if rank == 0 else None, src=0)
world.check(f"scatter from rank 0 gives {10 * rank} -> {t.item():.0f}", t.item() == 10 * rank)

# reduce_scatter: element i of the sum lands on rank i. Rank r contributes [r+1, r+1, ...], so each gets N(N+1)/2.
t = torch.zeros(1, device=device)
dist.reduce_scatter(t, [torch.tensor([rank + 1.0], device=device) for _ in range(N)])
world.check(f"reduce_scatter gives {N * (N + 1) // 2} -> {t.item():.0f}", t.item() == N * (N + 1) / 2)

# all_to_all: rank r sends 100*r + i to rank i, so rank r receives [100*i + r for each sender i] (a transpose)
received = [torch.zeros(1, device=device) for _ in range(N)]
dist.all_to_all(received, [torch.tensor([100.0 * rank + i], device=device) for i in range(N)])
want = [100 * i + rank for i in range(N)]
world.check(f"all_to_all gives {want} -> {[int(r.item()) for r in received]}", [r.item() for r in received] == want)

dist.barrier()  # nobody passes until everybody has arrived
world.check("barrier passed", True)

# A sub-group: every rank must call new_group, even those not in it; collectives then run among its members only.
evens = list(range(0, N, 2))
group = dist.new_group(evens)
if rank in evens:
    t = mine()
    dist.all_reduce(t, group=group)
    world.check(f"all_reduce in group {evens} gives {sum(evens)} -> {t.item():.0f}", t.item() == sum(evens))
world.finish()
