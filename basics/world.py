"""Setup every lesson shares: join the process group, pick the device, print with the rank, check results.

torchrun starts N copies of a lesson and gives each RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
init_process_group reads them (the "env://" rendezvous). GPUs talk over NCCL, CPUs over gloo.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

_failures = 0


def init(min_world=2, timeout_s=120):
    """Join the group; returns (rank, world_size, device). Exits cleanly when the world is too small."""
    if "RANK" not in os.environ:
        sys.exit(f"run me with torchrun: torchrun --nproc_per_node={min_world} {sys.argv[0]}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < min_world:
        log(f"this lesson needs at least {min_world} processes: torchrun --nproc_per_node={min_world} {sys.argv[0]}")
        dist.destroy_process_group()
        sys.exit(0)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return rank, world_size, torch.device("cuda" if backend == "nccl" else "cpu")


def log(message):
    sys.stdout.write(f"[rank {dist.get_rank()}] {message}\n")  # one write per line: ranks' lines do not interleave
    sys.stdout.flush()


def check(name, ok):
    """Print the check's outcome; finish() exits non-zero if any failed."""
    global _failures
    _failures += not ok
    log(f"check {name}: {'ok' if ok else 'FAILED'}")


def finish():
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if _failures else 0)


def toy_problem(device):
    """The model and data lessons 4 and 5 train: a 2-layer MLP regression, 24 samples (splits evenly over 1 to 4
    ranks), the same on every rank because the seed is."""
    torch.manual_seed(0)
    # every size divides by 1, 2, 3 and 4: equal shards of the batch and of each parameter on any of those worlds
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 12)).to(device)
    x, y = torch.randn(24, 12, device=device), torch.randn(24, 12, device=device)
    return model, x, y


def train_one_process(model, x, y, steps, lr):
    """The reference: one process, the whole batch, Adam. Distributed training must end with these weights."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]
