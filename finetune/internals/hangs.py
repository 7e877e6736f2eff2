"""A hang names itself: when a rank makes no progress (no micro-step begins, no step ends) for half of --dist-timeout,
every rank writes the Python stacks of all its threads to <output-dir>/hang/rank-N.txt, and rank 0 ends the job with
one line that says where each rank is, before the hung collective's own timeout, e.g.

    error: no progress for 900 s after step 1200: rank 3 in read_batch at data.py:402; ranks 0-2,4-7 in
    all_reduce at zero-optimization.py:175; stacks in out/hang

The ranks meet in the rendezvous store (rank 0's TCP store, which answers while the collectives hang), not in a
collective. torch's flight recorder (every rank's last collectives, with their sequence numbers: the rank behind the
others is the one that stopped) is dumped beside the stacks (hang/flight-recorder/rank_N, read with
`python -m torch.distributed.flight_recorder.fr_trace <output-dir>/hang/flight-recorder`): on GPUs NCCL's recorder,
which holds the training's collectives (the gloo one holds the stop votes only); NCCL's watchdog also dumps it when a
collective times out (<output-dir>/nccl_trace_rank_N)."""
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # this project's code: the scripts and the package
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives each rank keeps in its flight recorder (a few hundred KB)
HUNG = 3  # the exit status of a run ended by a hang report
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all",
               "all_to_all_single", "send", "recv", "reduce", "gather", "scatter", "monitored_barrier"}


MIN_DIST_TIMEOUT = 10  # seconds: below it a report could not come before the collective's own timeout
SESSIONS_GRACE = 5  # seconds this host's own launcher session gets to close after the report (end_launcher_sessions)
REPORT_BY = 0.8  # rank 0 says its line by this share of --dist-timeout after the last progress, waiting for reports


def threshold(dist_timeout):
    """Seconds without progress before the report: half of --dist-timeout, so that it comes before the hung
    collective would fail with less to say. Progress is a micro-step begun or a step ended: a step of many
    micro-steps (a large --grad-accum, offload, long blocks) may take as long as it needs; the bound is on one
    micro-step, and --dist-timeout sets it."""
    return dist_timeout / 2


def flight_recorder_env(out, environ=None):
    """torch's flight recorder, set before the process group is made (torch reads it then). torch 2.13 keeps one for
    the gloo and NCCL groups alike (FlightRecorder.hpp: TORCH_FR_BUFFER_SIZE, 2000 entries unless set; the older
    TORCH_NCCL_TRACE_BUFFER_SIZE still works, with a deprecation warning from every rank). Where NCCL's watchdog
    dumps it when a collective times out: TORCH_FR_DUMP_TEMP_FILE, the global rank appended: the output folder
    rather than /tmp, under torch's own name (nccl_trace_rank_N), so that it exists before any dump. A value the user
    set wins."""
    environ = os.environ if environ is None else environ
    wanted = {"TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_DUMP_TEMP_FILE": str(Path(out).resolve() / "nccl_trace_rank_")}
    for key, value in wanted.items():
        environ.setdefault(key, value)
    return wanted


class Watchdog:
    """A thread of each rank that watches the steps finish (beat()) and the micro-steps begin (progress()). Off during
    pauses (evaluation, checkpoints: their collectives are bounded by --dist-timeout) and before the first step ends
    (start-up, compilation). `reported` is set once this rank has written its report: a signal then ends the process
    at once (training.Stop), as it has no step to finish. `clock`: time.monotonic (a test drives its own)."""

    def __init__(self, out, dist_timeout, rank, ranks, *, store=None, before_exit=None, poll=1.0, clock=time.monotonic):
        self.out, self.rank, self.ranks, self.store, self.poll = Path(out), rank, ranks, store, poll
        self.before_exit = before_exit  # what rank 0 writes before it ends the job (the trackers' records)
        self.dist_timeout, self.seconds, self.clock = dist_timeout, threshold(dist_timeout), clock
        self.step, self.last, self.last_wall, self.paused = 0, None, None, False
        self.reported = threading.Event()
        self.main = threading.main_thread()
        threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def progress(self):
        """A micro-step is made (progress.RunStats.micro_step): the rank is alive and working."""
        if self.last is not None:  # armed (after the first step) and not stopped
            self.last = self.clock()

    def beat(self, step):
        """A step finished."""
        self.step, self.last, self.last_wall = step, self.clock(), time.time()

    def stop(self):
        """No steps left to watch (the evaluation and export after the last one are bounded by --dist-timeout)."""
        self.last = None

    def pause(self, paused):
        self.paused = paused
        if not paused and self.last is not None:
            self.last = self.clock()

    def overdue(self, last):
        return last is not None and not self.paused and self.clock() - last > self.seconds

    def _watch(self):
        while True:
            time.sleep(self.poll)
            last = self.last  # once: stop() may clear it meanwhile
            if self.overdue(last):
                self.report(last)
                return

    def report(self, last):
        """This rank's stacks to hang/rank-N.txt and its whereabouts to the store; rank 0 then gathers them, says
        the one line, and ends the job (the launcher stops the other ranks). `last`: the monotonic time of its last
        progress; the collective it hangs in began after it, and times out --dist-timeout after that."""
        self.reported.set()
        folder = self.out / "hang"
        folder.mkdir(parents=True, exist_ok=True)
        where = whereabouts(sys._current_frames().get(self.main.ident))
        (folder / f"rank-{self.rank}.txt").write_text(
            f"rank {self.rank}: no progress for {self.seconds:.0f} s after step {self.step} (which ended at "
            f"{time.strftime('%H:%M:%S', time.localtime(self.last_wall))}); main thread in {where}\n\n{all_stacks()}")
        dump_flight_recorder(folder / "flight-recorder" / f"rank_{self.rank}")
        if self.store is not None:
            try:
                self.store.set(f"hang/rank-{self.rank}", where)
            except Exception:  # noqa: BLE001 (rank 0's store is gone: its own report will not come either)
                pass
        if self.rank != 0:
            return
        places = {0: where}
        # the other ranks' watchdogs fire about as late; a frozen rank's never does: the line must come first
        deadline = min(self.clock() + 30.0, last + REPORT_BY * self.dist_timeout)
        while len(places) < self.ranks and self.clock() < deadline:
            for r in range(1, self.ranks):
                if r not in places and self.store.check([f"hang/rank-{r}"]):
                    places[r] = self.store.get(f"hang/rank-{r}").decode()
            time.sleep(0.2)
        line = (f"error: no progress for {self.seconds:.0f} s after step {self.step}: "
                f"{summary(places, self.ranks)}; stacks in {folder}")
        (folder / "summary.txt").write_text(line + "\n")
        print(line, file=sys.stderr, flush=True)
        # what the trackers were given is written before the exit below skips every exit handler; bounded, the
        # main thread being stuck is why we are here
        closing = threading.Thread(target=self.before_exit or (lambda: None), daemon=True)
        closing.start()
        closing.join(timeout=20)
        end_launcher_sessions(os.environ.get("MASTER_PORT"))
        sys.stdout.flush()
        os._exit(HUNG)


def whereabouts(frame):
    """Where a thread is, in one phrase: the collective it waits in (or the innermost function), and the innermost
    line of this project's code that led there, e.g. 'all_reduce at zero-optimization.py:175'."""
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)  # outermost first
    ours = [f for f in stack if Path(f.filename).resolve().is_relative_to(ROOT) and "site-packages" not in f.filename]
    waiting = next((f.name for f in reversed(stack) if f.name in COLLECTIVES and "site-packages" in f.filename),
                   stack[-1].name)
    if not ours:
        return waiting
    here = ours[-1]
    return f"{waiting} at {Path(here.filename).name}:{here.lineno}"


def summary(places, ranks):
    """'rank 3 in read_batch at data.py:402; ranks 0-2,4-7 in all_reduce at ...; rank 5 did not report'."""
    groups = {}
    for rank in range(ranks):
        groups.setdefault(places.get(rank), []).append(rank)
    parts = [f"{'rank' if len(rs) == 1 else 'ranks'} {spans(rs)} in {where}"
             for where, rs in sorted(((w, rs) for w, rs in groups.items() if w is not None), key=lambda g: len(g[1]))]
    if None in groups:
        missing = groups[None]
        parts.append(f"{'rank' if len(missing) == 1 else 'ranks'} {spans(missing)} did not report (stopped, or on a "
                     f"node whose watchdog could not run)")
    return "; ".join(parts)


def spans(ranks):
    """[0, 1, 2, 4, 5, 7] -> '0-2,4-5,7'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def all_stacks():
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())


def recorder(backend):
    """Which of torch's flight recorders holds the training's collectives: torch keeps NCCL's (CUDA events) apart
    from the one of every other backend (FlightRecorderCuda.cpp: _dump_nccl_trace; FlightRecorder.cpp:
    _dump_fr_trace, which on a GPU run holds only the gloo group of the stop votes)."""
    return "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace"


def dump_flight_recorder(path):
    """This rank's flight recorder (its last collectives, in the format torch's fr_trace reads), if it is on."""
    try:
        import torch._C._distributed_c10d as c10d
        import torch.distributed as dist

        dump = getattr(c10d, recorder(dist.get_backend() if dist.is_initialized() else None))
        trace = dump(True, True, False)
    except Exception:  # noqa: BLE001 (an older torch, a CPU build without NCCL, or the recorder off)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(trace)


def end_launcher_sessions(master_port, grace=SESSIONS_GRACE):
    """After rank 0's report, the launcher ends too. DeepSpeed's multi-node launcher runs pdsh, which runs an ssh to
    each host and waits for all of them: the ssh to a lost host never notices (SSH sends no keep-alive unless the
    user's config asks for one: ServerAliveInterval is 0 by default), so the launch, and a SLURM job around it, would
    run on until its time limit. A helper apart from this process (which exits now) gives this host's own session
    `grace` seconds to close as its ranks exit, then ends the ssh clients of this job's pdsh that remain on this host:
    pdsh then exits non-zero, and the launcher with it. Nothing happens where no pdsh of this job runs here (torchrun,
    srun, one host, or rank 0 not on the launching host)."""
    if master_port:
        subprocess.Popen([sys.executable, "-m", "finetune.internals.hangs", str(master_port), str(grace)], cwd=ROOT,
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)


def launcher_sessions(master_port, proc=Path("/proc")):
    """{pid of this job's pdsh: [pids of its ssh clients]} on this host. This job's pdsh: its command line holds the
    remote launch (deepspeed.launcher.launch) with this run's --master_port, as job/slurm.sbatch finds its ranks."""
    procs = {}
    for entry in proc.glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        procs[int(entry.name)] = ([c.decode(errors="replace") for c in command if c], parent)
    port = f"--master_port={master_port}"
    jobs = [pid for pid, (command, _) in procs.items() if command and Path(command[0]).name == "pdsh"
            and "deepspeed.launcher.launch" in command and port in command]
    return {job: [pid for pid, (command, parent) in procs.items() if parent == job and command
                  and Path(command[0]).name == "ssh"] for job in jobs}


def end_sessions(master_port, grace):
    """The helper's work (end_launcher_sessions): give this job's pdsh `grace` seconds to end by itself, then end
    what remains of its ssh clients, with SIGTERM, and 5 s later with SIGKILL; leave as soon as pdsh is gone."""
    def wait(seconds):
        until = time.monotonic() + seconds
        while time.monotonic() < until and launcher_sessions(master_port):
            time.sleep(0.1)

    wait(grace)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        remaining = [pid for clients in launcher_sessions(master_port).values() for pid in clients]
        if not remaining:
            return
        for pid in remaining:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        wait(5)


if __name__ == "__main__":  # end_launcher_sessions' helper: python -m finetune.internals.hangs PORT GRACE
    end_sessions(sys.argv[1], float(sys.argv[2]))

