"""Lesson 3: ring all-reduce from scratch with send/recv, equal to dist.all_reduce, and the time of both.

    torchrun --nproc_per_node=4 basics/ring_allreduce.py

The tensor is cut into N chunks. Phase 1, reduce-scatter: in N-1 steps each rank sends one chunk to its right
neighbour and adds the chunk arriving from its left; afterwards rank r holds the full sum of chunk (r+1) % N.
Phase 2, all-gather: in N-1 more steps the finished chunks travel around the ring. Each rank sends 2(N-1)/N of
the tensor in all, whatever N: that is why NCCL uses rings (and trees) for large tensors.
"""

import time

import torch
import torch.distributed as dist
import world

rank, world_size, device = world.init()
right, left = (rank + 1) % world_size, (rank - 1) % world_size


def ring_all_reduce(tensor):
    chunks = list(tensor.chunk(world_size))  # views: the sums are written in place
    incoming = torch.empty_like(chunks[0])
    for step in range(world_size - 1):  # reduce-scatter
        send, recv = (rank - step) % world_size, (rank - step - 1) % world_size
        requests = [dist.isend(chunks[send].contiguous(), right), dist.irecv(incoming[: len(chunks[recv])], left)]
        [r.wait() for r in requests]
        chunks[recv] += incoming[: len(chunks[recv])]
    for step in range(world_size - 1):  # all-gather: pass the finished chunks on
        send, recv = (rank + 1 - step) % world_size, (rank - step) % world_size
        requests = [dist.isend(chunks[send].contiguous(), right), dist.irecv(incoming[: len(chunks[recv])], left)]
        [r.wait() for r in requests]
        chunks[recv].copy_(incoming[: len(chunks[recv])])
    return tensor


def timed(fn, tensor, repeats=5):
    times = []
    for _ in range(repeats):
        copy = tensor.clone()
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(copy)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return copy, sorted(times)[len(times) // 2]  # the median


torch.manual_seed(rank)
small = torch.randn(10, device=device)  # 10 does not split evenly into 4: the last chunks are shorter
expected = small.clone()
dist.all_reduce(expected)
world.check("ring on 10 numbers equals dist.all_reduce", torch.allclose(ring_all_reduce(small.clone()), expected))

big = torch.randn(4_000_000, device=device)  # 16 MB of fp32
ours, ours_s = timed(ring_all_reduce, big)
theirs, theirs_s = timed(dist.all_reduce, big)
world.log(f"16 MB: ring from scratch {ours_s * 1e3:.1f} ms, dist.all_reduce {theirs_s * 1e3:.1f} ms")
world.check("ring on 4M numbers equals dist.all_reduce", torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5))
world.finish()
