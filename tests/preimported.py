"""A parent that imports torch, DeepSpeed and transformers once, then forks the ranks of each launch.

Each process a real launcher starts spends about 7 s on 2 cores importing the same libraries before it trains for a
second or two, and the deepspeed launcher runs two such processes of its own before the ranks. Where the launcher is
not what a test checks, helpers.launch("forked", ...) sends the launch here instead: each rank is a fork of this
already-imported parent that runs the script as `python script.py ARGS` would (`__main__`, its own sys.argv, sys.path
and environment), with the variables torchrun sets; "forked-python" is one process without them (a plain `python`
run, a world of one). As torchrun does, when a rank fails the others are stopped. The launchers' own
behaviour (signals, exit codes, SSH, SLURM) is tested with the real ones.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout."""

import json
import os
import signal
import sys
import time
from pathlib import Path

# what the scripts and the test helpers import; imported here once, before any rank is forked
PREIMPORTED = (
    "torch",
    "numpy",
    "deepspeed",
    "deepspeed.comm.torch",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.ops.adam",
    "transformers",
    "transformers.trainer",
    "transformers.integrations.deepspeed",
    "transformers.models.opt.modeling_opt",
    "peft",
    "datasets",
    "accelerate",
    "safetensors.torch",
    "tqdm",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "finetune.zero",
    "finetune.zero_config",
    "finetune.models",
    "finetune.data",
    "finetune.distributed",
    "finetune.internals.demo",
)
GRACE = 10  # seconds the other ranks get to leave on their own once one failed, as a launcher's would


def serve():
    import importlib

    for name in PREIMPORTED:
        importlib.import_module(name)
    # what py-cpuinfo says of the CPU, asked once here for every rank's offloaded optimizer (as the mend cpu_info_once
    # asks it once per process)
    import functools

    cpuinfo = importlib.import_module("cpuinfo")
    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info()
    # a fork copies one thread: a lock another thread held would stay held in the child. pyarrow's jemalloc runs a
    # background thread, and jemalloc takes its locks around a fork itself (pthread_atfork): any other is refused
    threads = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    if len([t for t in threads if t != "jemalloc_bg_thd"]) != 1:
        raise SystemExit(f"preimported: threads {threads} after the imports; cannot fork safely")
    for line in sys.stdin:
        request = json.loads(line)
        reply = launch(**request)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def launch(script, argv, nproc, env, cwd, timeout, logs, torchrun):
    """Fork the ranks, wait for them (stopping the rest when one fails), return the exit status and their output."""
    port = env.get("MASTER_PORT", "29500")
    pids = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(nproc):
        ranks = (
            {}
            if not torchrun
            else {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
        )
        out, err = f"{logs}/rank-{rank}.out", f"{logs}/rank-{rank}.err"
        pid = os.fork()
        if pid == 0:
            run_rank(script, argv, {**env, **ranks}, cwd, out, err)  # never returns
        pids[pid] = rank
    codes, deadline, failed_at = {}, time.monotonic() + timeout, None
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + GRACE):
            for p, rank in pids.items():
                if rank not in codes:
                    os.kill(p, signal.SIGKILL)
            if now > deadline and failed_at is None:
                for p, rank in pids.items():
                    if rank not in codes:
                        os.waitpid(p, 0)
                return {"timed_out": True, "returncode": None}
        time.sleep(0.05)
    # the launcher's status: the first rank that failed (by its own status, not a kill that followed it)
    failures = [c for r, c in sorted(codes.items()) if c != 0 and c != -signal.SIGKILL] or [
        c for c in codes.values() if c != 0
    ]
    return {"timed_out": False, "returncode": failures[0] if failures else 0}


def run_rank(script, argv, env, cwd, out, err):
    """In the forked child: become `python script argv` with this environment, then exit with its status."""
    import atexit
    import runpy
    import traceback

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: KeyboardInterrupt
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    sys.stdin = open(os.devnull)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    path = os.path.abspath(script)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(path)
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter treats it: a number is the status, anything else is printed
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (trackers' handlers, logging)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve()
