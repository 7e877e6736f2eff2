"""Lesson 1: point-to-point messages. A token goes once around a ring of ranks, each adding its rank.

    torchrun --nproc_per_node=4 basics/p2p.py

send/recv block until the other side has the message. isend/irecv return at once with a request; wait() blocks
later, so a rank can post its receive and its send together and do other work meanwhile. A ring written with
blocking calls must order them (rank 0 sends first, everyone else receives first) or every rank waits forever.
"""

import torch
import torch.distributed as dist
import world

rank, world_size, device = world.init()
right, left = (rank + 1) % world_size, (rank - 1) % world_size
expected = sum(range(world_size))  # 0 + 1 + ... + (N-1): every rank added its number once

# Blocking: rank 0 starts the token; each rank receives from the left, adds its rank, sends to the right.
token = torch.zeros(1, device=device)
if rank == 0:
    dist.send(token, dst=right)
    dist.recv(token, src=left)  # the token comes back after a full round
    world.log(f"blocking ring: token came back as {token.item():.0f}")
else:
    dist.recv(token, src=left)
    world.log(
        f"blocking ring: got {token.item():.0f} from rank {left}, passing {token.item() + rank:.0f} to rank {right}"
    )
    token += rank
    dist.send(token, dst=right)
if rank == 0:
    world.check(f"blocking ring sum is {expected}", token.item() == expected)

# Non-blocking: every rank sends its own value right and receives from the left at the same time, N-1 times,
# accumulating what passes by. No ordering is needed because nobody blocks before both requests are posted.
outgoing, total = torch.full((1,), float(rank), device=device), torch.full((1,), float(rank), device=device)
for _ in range(world_size - 1):
    incoming = torch.empty(1, device=device)
    requests = [dist.isend(outgoing, dst=right), dist.irecv(incoming, src=left)]
    for request in requests:
        request.wait()
    total += incoming
    outgoing = incoming  # pass on what arrived
world.log(f"non-blocking ring: after {world_size - 1} hops the sum here is {total.item():.0f}")
world.check(f"non-blocking ring sum is {expected} on every rank", total.item() == expected)
world.finish()
