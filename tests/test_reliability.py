"""Crashes, signals and hangs under the real launchers: a killed, signalled or stalled rank ends the job in bounded
time with one line, and the run resumes to the uninterrupted one (checkpoints themselves: test_checkpoints.py)."""

import contextlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    ROOT,
    TEST_HOOKS,
    assert_close_losses,
    assert_same_weights,
    base_args,
    check,
    free_port,
    launch,
    load_script,
    long_run,
    results,
    stop_everything,
    weights,
)

from finetune import checkpoints, progress, training
from finetune.internals import hangs

single = load_script("single-gpu.py")
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


def start(argv, log, ranks=2, **env):
    """The deepspeed launcher with CPU ranks, in the background."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    cmd = [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(free_port()), "zero-optimization.py", *argv]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )  # a process group of its own, as a SLURM step or a container


def rank_pid(launcher, rank, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if f"--local_rank={rank}" in " ".join(child.cmdline()):
                    return child.pid
            except psutil.Error:  # a rank that has exited (a zombie until the launcher reaps it)
                continue
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never started")


def wait_for(path, launcher, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        assert launcher.poll() is None and time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def signal_rank_1_after_a_checkpoint(launcher, out, sig, timeout):
    """Once the first checkpoint is published, send `sig` to rank 1; the seconds until the launcher exits."""
    try:
        wait_for(out / "checkpoints" / "latest", launcher)
        os.kill(rank_pid(launcher, 1), sig)
        sent_at = time.time()
        launcher.wait(timeout=timeout)
        return time.time() - sent_at
    finally:
        stop_everything(launcher)


@pytest.mark.quick
def test_a_signal_in_one_process_stops_after_the_step_in_flight(tiny, tmp_path, monkeypatch):
    """SIGTERM and a second signal during step 3: single-gpu.py finishes that step, writes its checkpoint, exits 75;
    `--resume auto` (which started the first run fresh) continues to the uninterrupted run's losses, bit for bit."""
    argv = base_args(tiny, tmp_path / "whole", **{"--batch-size": 4, "--grad-accum": 2, "--max-steps": 6})
    single.main(argv)
    out = tmp_path / "run"
    argv = base_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2, "--max-steps": 6}) + ["--resume", "auto"]
    end_step = progress.RunStats.end_step

    def signalled(stats, *args):
        if stats.step == 2:  # in step 3
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
        end_step(stats, *args)

    monkeypatch.setattr(progress.RunStats, "end_step", signalled)
    with pytest.raises(SystemExit) as e:
        single.main(argv)
    assert e.value.code == checkpoints.STOPPED and (out / "checkpoints" / "latest").read_text() == "step-3"
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-2", "step-3"]
    assert json.loads((out / "stopped.json").read_text()) == {"step": 3, "signal": "SIGTERM"}  # what sbatch reads
    monkeypatch.undo()
    single.main(argv)
    assert not (out / "stopped.json").exists()  # the resumed run is no stopped one
    assert results(out)["losses"] == results(tmp_path / "whole")["losses"]


def launched(how, argv, log):
    """The run under a launcher, in a process group of its own (as a SLURM step, a container, a terminal's job):
    (the processes to watch, the pid of the launcher)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    bin_dir, port = Path(sys.executable).parent, str(free_port())
    cmd = (
        [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", port]
        if how == "deepspeed"
        else [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--master_port", port]
    )
    launcher = subprocess.Popen(
        cmd + ["zero-optimization.py", *argv],
        cwd=ROOT,
        env=env,
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return [launcher], launcher


def ranks_of(processes, launcher):
    """The rank processes' pids: the launcher's children running the script, or the tasks themselves."""
    if launcher is None:
        return [p.pid for p in processes]
    deadline = time.time() + 60
    while time.time() < deadline:
        ranks = [
            c
            for c in psutil.Process(launcher.pid).children(recursive=True)
            if "zero-optimization.py" in " ".join(c.cmdline())
            and c.pid != launcher.pid
            and "deepspeed.launcher.launch" not in " ".join(c.cmdline())
        ]
        if len(ranks) == 2:
            env_rank = lambda c: int(c.environ().get("RANK", -1))
            return [c.pid for c in sorted(ranks, key=env_rank)]
        time.sleep(0.1)
    raise AssertionError("the ranks never started")


# How each launcher is stopped, as schedulers do it: one rank alone (on a multi-node job only the nodes that were
# signalled know), the launcher alone (Kubernetes signals a container's first process), every process of the job
# (SLURM signals every process of a step at its time limit or a preemption; a terminal its foreground job).
# (srun's tasks are stopped by a real SLURM in test_slurm.py)
STOPS = [
    ("deepspeed", "rank 1", signal.SIGUSR1),
    ("torchrun", "the launcher", signal.SIGTERM),
    ("torchrun", "the process group", signal.SIGTERM),
    ("deepspeed", "the process group", signal.SIGTERM),
]


def test_a_killed_or_signalled_run_resumes_to_the_uninterrupted_run_under_every_launcher(tiny, tmp_path, uninterrupted):
    """One run through what a cluster does to it. First a rank is killed (SIGKILL): the launcher ends the job at
    once and names that rank. Then, each time resumed with the same command line (`--resume auto`), it is stopped
    four times, once for each launcher and way of signalling: every process exits within 60 s of the signal, after
    the step in flight, its checkpoint published as `latest`. The run then ends with the uninterrupted run's losses
    and weights. The deepspeed launcher and the srun tasks pass on the ranks' exit status 75; torchrun reports it as
    a failure (job/slurm.sbatch decides by its own signal there)."""
    out, log = tmp_path / "stopped", tmp_path / "log"
    argv = long_run(tiny, out, "--resume", "auto")  # nothing to resume yet: a fresh start
    launcher = start(argv, log)
    ended_after = signal_rank_1_after_a_checkpoint(launcher, out, signal.SIGKILL, timeout=120)
    text = log.read_text()
    assert launcher.returncode != 0 and ended_after < 30, (launcher.returncode, ended_after)
    # the launcher names the rank it found ended first, in its once-a-second poll: rank 1, killed (-9), or rank 0,
    # whose collective failed as soon as its peer's connection was gone (one line, exit 1; or gloo's abort, -6), when
    # both ended within the same second
    named = re.search(r"--local_rank=(\d).*exits with return code = (-?\d+)", text)
    assert named and (named.groups() == ("1", "-9") or named.group(1) == "0" and named.group(2) != "0"), text[-2000:]
    assert not (out / "results.json").exists()
    stopped_at = int((out / "checkpoints" / "latest").read_text().split("-")[1])
    log.write_text("")
    for how, to, sig in STOPS:
        before = (out / "checkpoints" / "latest").read_text() if stopped_at else None
        processes, launcher = launched(how, argv, log)
        group = processes[0].pid
        try:
            ranks = ranks_of(processes, launcher)
            deadline = time.time() + 120  # a checkpoint of this launch's own: it is training
            while (
                (out / "checkpoints" / "latest").read_text() if (out / "checkpoints" / "latest").exists() else None
            ) in (before, None):
                assert time.time() < deadline and all(p.poll() is None for p in processes), log.read_text()[-3000:]
                time.sleep(0.05)
            if to == "rank 1" or to == "rank 0":
                os.kill(ranks[int(to[-1])], sig)
            elif to == "the launcher":
                os.kill(launcher.pid, sig)
            else:
                os.killpg(group, sig)
            sent_at = time.time()
            for p in processes:
                p.wait(timeout=90)
            while time.time() < sent_at + 90 and group_alive(group):  # a launcher may leave before its ranks
                time.sleep(0.1)
            ended_after = time.time() - sent_at
        finally:
            for p in processes:
                stop_everything(p)
        text = log.read_text()
        stopped = [line for line in text.splitlines() if line.startswith("stopped by ")]
        assert len(stopped) == 1, text[-3000:]  # one line, from rank 0
        # no traceback of ours; torchrun, signalled itself, leaves with one of its own (SignalException)
        assert 'zero-optimization.py", line' not in text and "finetune/" not in text, text[-3000:]
        assert "Traceback" not in text or (how == "torchrun" and "SignalException" in text), text[-3000:]
        step = int(stopped[0].split(" after step ")[1].split(",")[0])
        assert (out / "checkpoints" / "latest").read_text() == f"step-{step}" and not (out / "results.json").exists()
        assert ended_after < 60 and stopped_at < step < 60, (how, to, ended_after, step)
        codes = [p.returncode for p in processes]
        if to.startswith("rank"):  # the deepspeed launcher alone dies of SIGTERM (on one node)
            assert codes == [checkpoints.STOPPED] * len(processes), (how, to, codes)
        sys.stdout.write(
            f"{how}, {sig.name} to {to}: every process gone {ended_after:.1f} s after it, stopped after step {step}\n"
        )
        log.write_text("")
        stopped_at = step
    check(launch("forked", "zero-optimization.py", argv))  # the last part: its launcher is not what is checked
    # DeepSpeed's optimizer restore differs at the 1e-8 level two steps after a resume (single-gpu.py's is exact)
    assert_close_losses(results(uninterrupted)["losses"], results(out)["losses"], rtol=1e-5)
    assert_same_weights(weights(uninterrupted / "final"), weights(out / "final"), atol=1e-4)  # a wrong resume: ~1e-2
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-50", "step-55", "step-60"]


def wandb_history(out):
    """{step: [the metrics logged at it]} of every W&B run under <out>/wandb, read with wandb's own reader."""
    history = {}
    for folder in sorted((out / "wandb").glob("offline-run-*")):
        if not any(folder.glob("run-*.wandb")):  # a run killed as it opened, before W&B wrote its file: no record
            continue
        records = subprocess.run(
            [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(folder)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for record in map(json.loads, records.splitlines()):
            if record.get("type") == "history":
                history.setdefault(record["history"]["item"]["_step"], []).append(record["history"]["item"])
    return history


def test_wandb_keeps_every_step_through_a_signal_a_sigkill_and_two_resumes(tiny, tmp_path):
    """zero-optimization.py (a world of one: it leaves with os._exit, as every ZeRO rank on a CPU does) with W&B
    offline: SIGUSR1 after a checkpoint stops it (exit 75); resumed, it is SIGKILLed with its W&B service after a
    later checkpoint: wandb's own reader finds every step up to that checkpoint (each checkpoint finishes the W&B run;
    without that, the last ~100 records were lost); resumed again, it finishes. Every step's loss and every eval is
    there as results.json has them; the steps after the killed checkpoint may be there twice, from both tries (W&B
    online drops the second: a resumed run starts after its last step)."""
    out, log = tmp_path / "run", tmp_path / "log"
    argv = base_args(tiny, out, **{"--max-steps": 60, "--eval-every": 10, "--save-every": 10, "--zero-stage": 2})
    argv += ["--deepspeed", "--report-to", "wandb", "--resume", "auto"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    latest = lambda: int((out / "checkpoints" / "latest").read_text().split("-")[1])
    stopped = None
    for how in (signal.SIGUSR1, signal.SIGKILL):
        run = subprocess.Popen(
            [sys.executable, "zero-optimization.py", *argv],
            cwd=ROOT,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(out / "checkpoints" / "latest", run)
            while stopped is not None and latest() == stopped:  # a checkpoint of this try
                assert run.poll() is None, log.read_text()[-3000:]
                time.sleep(0.05)
            if how == signal.SIGUSR1:
                run.send_signal(how)
                assert run.wait(timeout=60) == checkpoints.STOPPED, log.read_text()[-3000:]
            else:
                killed_at = latest()
                stop_everything(run)  # the W&B service first, then the run: nothing is finished
        finally:
            stop_everything(run)
        stopped = latest()
        assert stopped < 60 and not (out / "results.json").exists()
    assert set(range(1, killed_at + 1)) <= set(wandb_history(out))
    check(launch("forked-python", "zero-optimization.py", argv, env={"WANDB_MODE": "offline"}))
    r, history = results(out), wandb_history(out)
    assert sorted(history) == list(range(1, 61))
    assert all(len(items) == 1 for step, items in history.items() if step <= killed_at or step > killed_at + 10)
    for step, items in history.items():
        assert all(item["train/loss"] == pytest.approx(r["losses"][step - 1], rel=1e-6) for item in items), step
    assert [(step, value) for step, value in r["evals"]] == [
        (step, pytest.approx(history[step][0]["eval/loss"], rel=1e-9)) for step in range(10, 61, 10)
    ]


def test_a_stalled_rank_is_named_and_a_frozen_one_too_before_the_collective_times_out(tiny, tmp_path):
    """3 ranks, --dist-timeout 12: after step 3 rank 1 stops in place (FINETUNE_TEST_STALL, tests/hooks) and
    rank 2 freezes (SIGSTOP, as a frozen node: its watchdog cannot report); rank 0 waits for them in the next
    collective. Half of --dist-timeout later every live rank writes its stacks and its flight recorder, and rank 0
    ends the job with one line saying where each rank is and which did not report, before the collective's own
    timeout would have ended it with less to say (the report waits for the others until 80% of --dist-timeout), and
    what the trackers were given is written."""
    out = tmp_path / "stalled"
    launcher = start(
        long_run(tiny, out, "--dist-timeout", "12", "--log-every", "1", "--report-to", "wandb"),
        tmp_path / "log",
        ranks=3,
        FINETUNE_TEST_STALL="1:3,2:3:freeze",
        WANDB_MODE="offline",
        PYTHONPATH=TEST_HOOKS,
    )
    try:
        wait_for(out / "hang" / "summary.txt", launcher)  # rank 0's line; it closes its trackers and leaves
        with contextlib.suppress(psutil.Error, AssertionError):
            psutil.Process(rank_pid(launcher, 0, timeout=1)).wait(timeout=30)
        os.kill(rank_pid(launcher, 2), signal.SIGKILL)  # the frozen rank, killed by the launcher 30 s after its SIGTERM
        launcher.wait(timeout=120)
    finally:
        stop_everything(launcher)
    log = (tmp_path / "log").read_text()
    lines = [line for line in log.splitlines() if line.startswith("error: no progress")]
    assert len(lines) == 1 and "Traceback" not in log and "a collective failed" not in log, log[-3000:]
    # 'error: no progress for 6 s after step 3: rank 1 in beat at sitecustomize.py:NN; rank 0 in all_reduce at
    # progress.py:NN; rank 2 did not report (...); stacks in <out>/hang'
    assert lines[0].startswith("error: no progress for 6 s after step 3: ") and launcher.returncode == hangs.HUNG
    parts = lines[0].split(": ", 2)[2].split("; stacks")[0].split("; ")
    assert parts[-1].startswith("rank 2 did not report"), lines[0]
    where = dict(reversed(part.split(" in ", 1)) for part in parts[:-1])
    assert set(where.values()) == {"rank 0", "rank 1"}, lines[0]
    assert where_of(where, "rank 1").startswith("beat at sitecustomize.py:")  # where the test's hook holds it
    assert where_of(where, "rank 0").startswith("all_reduce at progress.py:")  # the logged losses after step 3
    for rank in (0, 1):
        stacks = (out / "hang" / f"rank-{rank}.txt").read_text()
        assert stacks.startswith(f"rank {rank}: no progress for 6 s after step 3 (which ended at ")
        assert "thread MainThread:" in stacks and "thread hang-watchdog:" in stacks
    assert not (out / "hang" / "rank-2.txt").exists()
    # the flight recorders: on the world group, rank 0 entered one collective more than rank 1 (the losses logged
    # after step 3), which has not completed
    last = {}
    for rank in (0, 1):
        recorded = pickle.loads((out / "hang" / "flight-recorder" / f"rank_{rank}").read_bytes())
        last[rank] = max((e for e in recorded["entries"] if e["pg_id"] == 0), key=lambda e: e["collective_seq_id"])
    assert last[0]["collective_seq_id"] == last[1]["collective_seq_id"] + 1, last
    # rank 0 closed its trackers before it left: W&B, read with its own reader, has the 2 steps it was given
    assert sorted(wandb_history(out)) == [1, 2]  # step 3's losses: in the all-reduce rank 0 waits in
    assert last[0]["profiling_name"] == "gloo:all_reduce" and last[0]["state"] != "completed", last[0]


def where_of(where, rank):
    return next(place for place, ranks in where.items() if ranks == rank)


@pytest.mark.quick
def test_stop_finds_its_world_at_the_first_step_and_a_stopped_run_leaves_the_group(monkeypatch, tmp_path):
    """The HF Trainer makes the process group after Stop() (in TrainingArguments): the ranks must still agree on when
    to stop. And a run stopped by a signal leaves the group as a finished one does (NCCL warns of a leak otherwise)."""
    import torch.distributed as dist

    from finetune import distributed

    stop = training.Stop(tmp_path)  # no process group yet
    votes = []
    with monkeypatch.context() as m:  # two gloo ranks, as the Trainer makes them after
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_world_size", lambda *a: 2)
        m.setattr(dist, "get_backend", lambda *a: "gloo")
        m.setattr(dist, "all_reduce", lambda flag, **kwargs: votes.append(int(flag)))
        assert not stop.due() and votes == [0]
    monkeypatch.setattr(distributed, "skip_teardown", lambda cuda: False)  # a GPU run's exit, with its teardown
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:

        def stopped():
            raise SystemExit(checkpoints.STOPPED)

        with pytest.raises(SystemExit) as e:
            distributed.run_distributed(stopped)
        assert e.value.code == checkpoints.STOPPED and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_port_another_process_holds_is_named_not_blamed_on_the_network(tiny, tmp_path):
    """Two runs on one machine with one port (the launchers' default, 29500): the second's rank 0 cannot listen there.
    One line names the port and the process that holds it, and how to choose another; before, it said the network
    or the interface was wrong (docs/multinode.md). A real process holds the port, listening as a run's rank 0 does."""
    port = free_port()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket, time; s = socket.socket(); s.setsockopt("
            f"socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', {port})); s.listen(); "
            f"print('ready', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        run = launch(
            "forked-python",
            "zero-optimization.py",
            base_args(tiny, tmp_path / "run") + ["--deepspeed"],
            env={"MASTER_PORT": str(port)},
        )
    finally:
        holder.kill()
    assert run.returncode == 1 and "Traceback" not in run.stderr
    lines = [x for x in run.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(
        f"error: port {port} on {os.uname().nodename} is taken by another process (pid "
        f"{holder.pid}: {sys.executable} -c import socket"
    ) and lines[0].endswith(
        "rank 0 cannot open this run's rendezvous there. Give each run on a machine its own port: deepspeed "
        "--master_port N, torchrun --master_port N, MASTER_PORT=N for python (job/slurm.sbatch picks one from the "
        "job's id)"
    ), lines[0]
