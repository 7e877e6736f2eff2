"""A hang names itself: when a rank finishes no step for a while (half of --dist-timeout, at most 10 minutes), every
rank writes the Python stacks of all its threads to <output-dir>/hang/rank-N.txt, and rank 0 ends the job with one
line that says where each rank is, e.g.

    error: no step finished for 300 s after step 1200: rank 3 in read_batch at data.py:402; ranks 0-2,4-7 in
    all_reduce at zero-optimization.py:175; stacks in out/hang

The ranks meet in the rendezvous store (rank 0's TCP store, which answers while the collectives hang), not in a
collective. torch's flight recorder (every rank's last collectives, with their sequence numbers: the rank behind the
others is the one that stopped) is dumped beside the stacks (hang/flight-recorder/rank_N, read with
`python -m torch.distributed.flight_recorder.fr_trace <output-dir>/hang/flight-recorder`); on GPUs NCCL's watchdog
also dumps it when a collective times out (<output-dir>/nccl_trace_rank_N)."""
import os
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # this project's code: the scripts and the package
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives each rank keeps in its flight recorder (a few hundred KB)
HUNG = 3  # the exit status of a run ended by a hang report
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all",
               "all_to_all_single", "send", "recv", "reduce", "gather", "scatter", "monitored_barrier"}


def threshold(dist_timeout):
    """Seconds without a finished step before the report: half of --dist-timeout (the collective would fail there
    with less to say), at most 10 minutes (steps of large models with offload take a minute or two)."""
    return min(600.0, dist_timeout / 2)


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


reported = threading.Event()  # this rank has written its hang report: a signal now ends it at once (Stop)


class Watchdog:
    """A thread of each rank that watches the steps finish (beat()). Off during pauses (evaluation, checkpoints:
    their collectives are bounded by --dist-timeout) and before the first step ends (start-up, compilation)."""

    def __init__(self, out, seconds, rank, ranks, store=None, poll=1.0):
        self.out, self.seconds, self.rank, self.ranks, self.store = Path(out), seconds, rank, ranks, store
        self.step, self.last, self.last_wall, self.paused, self.poll = 0, None, None, False, poll
        self.main = threading.main_thread()
        threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def beat(self, step):
        """A step finished."""
        self.step, self.last, self.last_wall = step, time.monotonic(), time.time()
        stall = os.environ.get("FINETUNE_TEST_STALL")  # tests only: "rank:step" stops that rank after that step
        if stall == f"{self.rank}:{step}":
            time.sleep(3600)

    def stop(self):
        """No steps left to watch (the evaluation and export after the last one are bounded by --dist-timeout)."""
        self.last = None

    def pause(self, paused):
        self.paused = paused
        if not paused and self.last is not None:
            self.last = time.monotonic()

    def _watch(self):
        while True:
            time.sleep(self.poll)
            last = self.last  # once: stop() may clear it meanwhile
            if last is not None and not self.paused and time.monotonic() - last > self.seconds:
                self.report()
                return

    def report(self):
        """This rank's stacks to hang/rank-N.txt and its whereabouts to the store; rank 0 then gathers them, says
        the one line, and ends the job (the launcher stops the other ranks)."""
        reported.set()
        folder = self.out / "hang"
        folder.mkdir(parents=True, exist_ok=True)
        where = whereabouts(sys._current_frames().get(self.main.ident))
        (folder / f"rank-{self.rank}.txt").write_text(
            f"rank {self.rank}: no step finished for {self.seconds:.0f} s after step {self.step} (which ended at "
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
        deadline = time.monotonic() + min(30.0, self.seconds)  # the other ranks' watchdogs fire about as late
        while len(places) < self.ranks and time.monotonic() < deadline:
            for r in range(1, self.ranks):
                if r not in places and self.store.check([f"hang/rank-{r}"]):
                    places[r] = self.store.get(f"hang/rank-{r}").decode()
            time.sleep(0.2)
        line = (f"error: no step finished for {self.seconds:.0f} s after step {self.step}: "
                f"{summary(places, self.ranks)}; stacks in {folder}")
        (folder / "summary.txt").write_text(line + "\n")
        print(line, file=sys.stderr, flush=True)
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


def dump_flight_recorder(path):
    """This rank's flight recorder (its last collectives, in the format torch's fr_trace reads), if it is on."""
    try:
        import torch._C._distributed_c10d as c10d

        trace = c10d._dump_fr_trace(True, True, False)
    except Exception:  # noqa: BLE001 (an older torch, or the recorder off)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(trace)
