"""The hang report's pieces, in process (internals/hangs.py): the flight recorder's settings and the recorder
dumped, the one line that groups the ranks, micro-steps as progress, --dist-timeout's floor; the whole report on
stalled and frozen ranks: test_reliability.py."""

import pytest
import torch
from helpers import (
    load_script,
)

from finetune import checkpoints, progress
from finetune.internals import hangs


@pytest.mark.quick
def test_the_flight_recorder_is_on_and_dumps_into_the_output_folder(tmp_path):
    """torch's flight recorder, set before the process group exists: its buffer (torch 2.13's own name, not the
    deprecated NCCL one, which every rank would warn about), NCCL's dump on a timeout into the output folder rather
    than /tmp; a value the user set is kept."""
    environ = {"TORCH_FR_BUFFER_SIZE": "100"}
    hangs.flight_recorder_env(tmp_path / "run", environ)
    assert environ == {
        "TORCH_FR_BUFFER_SIZE": "100",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str((tmp_path / "run").resolve() / "nccl_trace_rank_"),
    }
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ


@pytest.mark.quick
def test_the_hang_line_groups_the_ranks_by_where_they_are():
    """The fewest first (the rank that stopped is usually alone), then those that did not report."""
    assert hangs.summary({0: "all_reduce at x.py:1", 1: "beat at y.py:2", 3: "all_reduce at x.py:1"}, 5) == (
        "rank 1 in beat at y.py:2; ranks 0,3 in all_reduce at x.py:1; ranks 2,4 did not report (stopped, or on a "
        "node whose watchdog could not run)"
    )
    assert hangs.spans([0, 1, 2, 4, 5, 7]) == "0-2,4-5,7" and hangs.spans([3]) == "3"


@pytest.mark.quick
def test_micro_steps_are_progress_so_a_long_step_is_not_a_hang(tmp_path, monkeypatch):
    """A step of 10 micro-steps of 200 s each (a large --grad-accum with offload): 2000 s without a finished step,
    past the 900 s bound of the default --dist-timeout (1800 s), yet no micro-step took that long: not a hang. A
    micro-step that does is one. The clock is the test's."""
    from types import SimpleNamespace

    from finetune import loss

    now = [0.0]
    # its thread asleep: the test checks; its clock the test's
    watchdog = hangs.Watchdog(tmp_path, 1800, rank=0, ranks=2, poll=3600, clock=lambda: now[0])
    assert watchdog.seconds == 900  # half of --dist-timeout, however large: the user's bound
    watch = SimpleNamespace(progress=watchdog.progress)  # progress.Watch's, on several ranks
    micro_step = lambda: progress.RunStats.micro_step(
        SimpleNamespace(step_pairs=None, watch=watch), loss.Summed(torch.zeros(()))
    )
    micro_step()  # start-up, the first step: not watched yet
    assert watchdog.last is None
    watchdog.beat(1)
    for _ in range(10):
        now[0] += 200
        assert not watchdog.overdue(watchdog.last)
        micro_step()  # the next micro-step is made, as the scripts' loop says
    watchdog.beat(2)
    now[0] += 901
    assert watchdog.overdue(watchdog.last)  # one micro-step longer than the bound
    watchdog.stop()
    micro_step()  # the evaluation and export after the last step
    assert watchdog.last is None


@pytest.mark.quick
def test_dist_timeout_below_its_minimum_is_one_line():
    """0 would make every collective, the rendezvous included, time out at once (a misleading 'another rank died')."""
    from finetune import distributed

    argv = ["--dist-timeout", "0", "--output-dir", "out/x"]
    for flags in (
        load_script("zero-optimization.py").parse_args(argv).zero,
        load_script("sequence_classification.py").parse_args(argv).zero,
    ):
        with pytest.raises(SystemExit, match=r"^error: --dist-timeout must be at least 10 seconds .*got 0$"):
            distributed.collective_settings(flags.dist_timeout, "out/x")


@pytest.mark.quick
def test_the_flight_recorder_dumped_is_the_one_that_holds_the_training_collectives(tmp_path, monkeypatch):
    """On GPUs NCCL's recorder (torch keeps it apart; the CPU build has none); elsewhere the one every other backend
    shares. Every rank makes the output folder, where NCCL's own dump on a timeout goes, on nodes without a shared disk
    too."""
    import torch.distributed as dist

    assert hangs.recorder("nccl") == "_dump_nccl_trace" and hangs.recorder("gloo") == "_dump_fr_trace"
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: b"nccl", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a: b"gloo")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(dist, "get_backend", lambda *a, backend=backend: backend)
        hangs.dump_flight_recorder(tmp_path / backend / "rank_0")
        assert (tmp_path / backend / "rank_0").read_bytes() == backend.encode()
    checkpoints.prepare_output_dir(tmp_path / "run", overwrite=False, rank=1)
    assert (tmp_path / "run").is_dir()
