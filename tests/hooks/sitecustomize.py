"""What the suite asks of the processes it launches, kept out of the product: a test that needs a rank to behave
in some way puts this folder (and the repository) on PYTHONPATH with one of the variables below, and Python runs
this file as each process starts (its sitecustomize), patching finetune before the script runs.

FINETUNE_TEST_HOLD=N: a run that starts afresh waits after step N until a signal reaches a rank (training.Stop),
    so that a signal sent through a scheduler's queues (seconds on a busy machine) finds the tiny run training.
FINETUNE_TEST_STALL=rank:step[,rank:step:freeze]: each such rank stops after that step (hangs.Watchdog.beat): it
    sleeps (its watchdog reports), or it freezes (SIGSTOP, as a frozen node: nothing of it reports).
FINETUNE_TEST_JOIN=rank:seconds or rank:path: that rank joins the process group late, after the seconds or once the
    file exists, so that another launch's ranks reach this one's store while it forms (distributed.launch_token).
"""

import os

HOLD, STALL = os.environ.get("FINETUNE_TEST_HOLD"), os.environ.get("FINETUNE_TEST_STALL")
JOIN = os.environ.get("FINETUNE_TEST_JOIN")


def hold_after(step):
    import time
    from pathlib import Path

    from finetune import training

    made, due = training.Stop.__init__, training.Stop.due

    def init(self, out, **kwargs):
        made(self, out, **kwargs)
        self.test_hold = step if not (Path(out) / "checkpoints" / "latest").exists() else 0
        self.test_steps = 0

    def due_or_hold(self):
        self.test_steps += 1
        while True:  # every rank asks again, together (due's all-reduce)
            stopping = due(self)
            if stopping or self.test_steps != self.test_hold:
                return stopping
            time.sleep(0.1)

    training.Stop.__init__, training.Stop.due = init, due_or_hold


def stall(plan):
    import signal
    import time

    from finetune.internals import hangs

    stalls = [part.split(":") for part in plan.split(",") if part]
    watched = hangs.Watchdog.beat

    def beat(self, step):
        watched(self, step)
        for rank, at, *how in stalls:
            if (int(rank), int(at)) == (self.rank, step):
                os.kill(os.getpid(), signal.SIGSTOP) if how == ["freeze"] else time.sleep(3600)

    hangs.Watchdog.beat = beat


def join_late(plan):
    import time
    from pathlib import Path

    from finetune import distributed

    rank, when = plan.split(":", 1)
    joins, seconds = distributed.init_distributed, when.replace(".", "").isdigit()

    def init(*args, **kwargs):
        if os.environ.get("RANK") == rank:
            time.sleep(float(when) if seconds else 0)
            while not seconds and not Path(when).exists():
                time.sleep(0.1)
        return joins(*args, **kwargs)

    distributed.init_distributed = init


if HOLD:
    hold_after(int(HOLD))
if STALL:
    stall(STALL)
if JOIN:
    join_late(JOIN)
