"""Lesson 6: tensor parallelism. One layer's weight matrix is split over the ranks, each computing a part.

    torchrun --nproc_per_node=4 basics/tensor_parallel.py

Column-parallel: split the output features; rank r computes its slice of the output from the full input.
Row-parallel: split the input features; each rank multiplies its slice of the input, and a sum (all_reduce) adds
the partial products. Megatron-LM's MLP puts a column-parallel layer before a row-parallel one: the activation
between them is already split the right way, so the whole MLP needs one all_reduce in the forward pass.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import world

rank, world_size, device = world.init()
if 96 % world_size:
    world.log(f"this lesson splits 96 features evenly: run it with 2, 3 or 4 processes, not {world_size}")
    world.finish()
torch.manual_seed(0)  # the same full weights on every rank, to compare with
d_model, d_ff = 24, 96  # d_ff divides by 1, 2, 3 and 4: equal slices (all_gather needs them)
x = torch.randn(4, d_model, device=device)
w1, b1 = torch.randn(d_ff, d_model, device=device), torch.randn(d_ff, device=device)
w2, b2 = torch.randn(d_model, d_ff, device=device), torch.randn(d_model, device=device)

# column-parallel: this rank's rows of w1 (its output features)
w1_mine, b1_mine = w1.chunk(world_size, dim=0)[rank], b1.chunk(world_size)[rank]
part = F.linear(x, w1_mine, b1_mine)
world.log(f"column-parallel: w1 slice {tuple(w1_mine.shape)} of {tuple(w1.shape)} -> output slice {tuple(part.shape)}")
parts = [torch.empty_like(part) for _ in range(world_size)]
dist.all_gather(parts, part)
world.check(
    "column-parallel outputs, gathered, equal the full layer",
    torch.allclose(torch.cat(parts, dim=1), F.linear(x, w1, b1), atol=1e-5),
)

# row-parallel: this rank's columns of w2 (its input features) and the matching slice of the input
h = torch.randn(4, d_ff, device=device)
w2_mine = w2.chunk(world_size, dim=1)[rank]
partial = F.linear(h.chunk(world_size, dim=1)[rank], w2_mine)
world.log(f"row-parallel: w2 slice {tuple(w2_mine.shape)} of {tuple(w2.shape)} -> a partial sum {tuple(partial.shape)}")
dist.all_reduce(partial)
world.check(
    "row-parallel partial sums, all-reduced, equal the full layer",
    torch.allclose(partial + b2, F.linear(h, w2, b2), atol=1e-4),
)

# Megatron MLP: column-parallel, GeLU on the local slice (elementwise: no communication), row-parallel, one all_reduce
out = F.linear(F.gelu(F.linear(x, w1_mine, b1_mine)), w2_mine)
dist.all_reduce(out)
out += b2  # the bias is added once, after the sum
full = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
world.log(f"Megatron MLP: each rank holds {w1_mine.numel() + w2_mine.numel()} of {w1.numel() + w2.numel()} weights")
world.check("tensor-parallel MLP output equals the unsplit MLP", torch.allclose(out, full, atol=1e-4))
world.finish()
