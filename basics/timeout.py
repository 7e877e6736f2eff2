"""Lesson 8: a collective that one rank never joins. Without a timeout the others wait forever (NCCL's default
is 10 minutes or more, and on some versions the job just hangs); with one, they stop with an error you can act on.

    torchrun --nproc_per_node=4 basics/timeout.py

The timeout is init_process_group's `timeout`. With NCCL, TORCH_NCCL_BLOCKING_WAIT=1 makes the waiting call raise
instead of a watchdog thread killing the process. A group that timed out is broken: exit, do not go on.
"""

import os
import time

os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import world  # noqa: E402

TIMEOUT_S = 3
rank, world_size, device = world.init(timeout_s=TIMEOUT_S)
absent = world_size - 1
dist.barrier()  # everyone is here so far

if rank == absent:
    world.log("skipping the all_reduce (as a crashed or stuck rank would)")
    time.sleep(TIMEOUT_S + 3)  # stay alive: the others must notice by their timeout, not by a closed socket
    os._exit(0)

start = time.perf_counter()
try:
    dist.all_reduce(torch.ones(1, device=device))
    world.check("the all_reduce must not complete without every rank", False)
except RuntimeError as error:  # gloo and NCCL raise a subclass (DistBackendError)
    waited = time.perf_counter() - start
    world.log(
        f"all_reduce gave up after {waited:.1f} s: rank {absent} never joined "
        f"({type(error).__name__}: {str(error).splitlines()[0].split('] ')[-1][:80]})"
    )
    world.check(f"stopped within the {TIMEOUT_S} s timeout (+3 s)", waited < TIMEOUT_S + 3)
os._exit(1 if world._failures else 0)  # no barrier or destroy: the group is broken
