"""bench/run.py on its tiny CPU set: the table is written, each row measured, the ratio to the seeds' recipe filled;
bench/gpu.py's dry run. A benchmark is never a timed test: no threshold on any figure."""

import re
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, launch, load_script


def forked(cmd, env):
    """bench/run.py's command, its ranks forked from the pre-imported parent (the launcher is not what is checked)."""
    if Path(cmd[0]).name == "deepspeed":  # deepspeed --num_gpus N script flags...
        return launch("forked", cmd[3], cmd[4:], nproc=int(cmd[2]), env=env)
    return launch("forked-python", cmd[1], cmd[2:], env=env)


def test_tiny_benchmark_writes_the_table_and_the_ratios(tmp_path, monkeypatch):
    bench = load_script("bench/run.py")
    monkeypatch.setattr(bench, "execute", forked)
    bench.main(["--set", "tiny", "--out", str(tmp_path)])
    table = (tmp_path / "BENCHMARKS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| demo |")]
    assert len(rows) == 3 and "run_clm recipe" in rows[0] and "seeds' recipe" in rows[1] and "ZeRO-2" in rows[2]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert all(len(c) == 15 for c in cells)
    assert cells[0][7] == "1.00x" and cells[1][8] == "1.0x"  # each peer against itself
    assert re.fullmatch(r"\d+\.\d\dx", cells[2][7]) and re.fullmatch(r"\d+\.\dx", cells[2][8])  # measured here
    assert all(float(c[6].replace(",", "")) > 0 for c in cells)  # useful tokens/s
    assert [c[5] for c in cells] == ["stream", "none", "isolated"]  # packing
    counted, planned = (float(x.split()[0]) for x in cells[2][11].split(" / "))  # model states per rank, planned
    assert cells[2][11].endswith("MiB") and counted > 0 and abs(counted - planned) <= 0.1 * counted
    assert (tmp_path / "throughput.png").stat().st_size > 1000


def test_a_probe_that_fails_is_a_row_and_the_set_goes_on(tmp_path, monkeypatch):
    bench = load_script("bench/run.py")
    monkeypatch.setattr(bench, "execute", forked)
    monkeypatch.setitem(
        bench.SETS,
        "probe",
        {
            "demo": (
                2,
                128,
                1,
                [
                    bench.run("too big", batch=100000, probe=True),  # fails: less data than one global batch
                    bench.run("fits", batch=4, probe=True),
                ],
            )
        },
    )
    rows = bench.main(["--set", "probe", "--out", str(tmp_path)])
    assert [row["run"].split(":")[0] for row in rows] == ["too big", "fits"]  # no peer for a set of probes
    assert "did not run (error: " in rows[0]["run"] and "less than one global batch" in rows[0]["run"]
    assert rows[1]["result"]["tokens_per_sec"] > 0
    table = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| demo | too big: did not run (error: " in table and "| demo | fits | 1 |" in table


@pytest.mark.quick
def test_the_gpu_smoke_test_says_so_without_a_gpu():
    run = subprocess.run(["bash", "bench/gpu_check.sh", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip().startswith("error: no CUDA GPU here")


def test_the_gpu_benchmarks_dry_run_has_its_columns_its_ratios_and_its_deadlines(tmp_path):
    """bash bench/gpu.sh --dry: the GPU benchmark's parts on the CPU (the demo model), each its own process: the
    table's columns, a ratio to single-gpu.py's and to the Trainer's, a part over its deadline stopped and named (the
    rest go on), a part the budget cannot hold skipped without starting it."""
    gpu = load_script("bench/gpu.py")
    runs = ["single-gpu.py", "HF Trainer, run_clm, ZeRO-2"]
    rows = gpu.main(["--dry", "--runs", "attention", *runs, "--out", str(tmp_path)])
    assert "| SDPA, the documents' mask |" in (tmp_path / "ATTENTION.md").read_text()  # attention alone, run first
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["tok_s"] > 0 for r in rows)
    assert rows[0]["planned"] > 0 and rows[0]["peak"] > 0 and rows[0]["launches"] == 0  # no kernels on a CPU
    table = (tmp_path / "GPU.md").read_text().splitlines()
    assert table[2].split(" | ")[2:13] == [
        "tok/s",
        "x single-gpu.py",
        "x Trainer",
        "MFU",
        "peak GiB",
        "planned GiB",
        "host GiB",
        "planned host GiB",
        "launches/step",
        "syncs/step",
        "last loss",
    ]
    single, trainer = ([c.strip() for c in line.strip("|").split("|")] for line in table[4:6])
    assert single[3] == "1.00x" and trainer[4] == "1.00x"  # each against itself
    assert single[4] == f"{rows[0]['tok_s'] / rows[1]['tok_s']:.2f}x"
    # PROFILE.md: each run's step by kind (internals/step_time.py); on a CPU the ops' own times and the rest idle
    from finetune.internals.step_time import KINDS

    profile = (tmp_path / "PROFILE.md").read_text().splitlines()
    assert profile[2] == "| shape | run | step ms | " + " | ".join(KINDS) + " | idle |" and len(profile) == 6
    for r in rows:
        step = r["kinds"]
        assert sum(step[k]["ms"] for k in KINDS) + step["idle_ms"] == pytest.approx(step["step_ms"])
        assert min(step[k]["ms"] for k in ("matmuls", "attention", "head, loss and embedding", "optimizer")) > 0
    stopped = gpu.main(["--dry", "--runs", "ZeRO-3", "--deadline", "1", "--out", str(tmp_path / "late")])
    assert stopped[0]["status"] == "over its 1 s deadline" and "tok_s" not in stopped[0]
    skipped = gpu.main(["--dry", "--runs", "ZeRO-2", "--budget", "5", "--out", str(tmp_path / "none")])
    assert skipped[0]["status"] == "skipped: no time left in the budget"
    assert not (tmp_path / "none" / "runs").exists()


def test_the_attention_benchmark_holds_each_kernel_to_the_documents_run_apart(tmp_path):
    """bench/attention.py --dry (bench/gpu.py runs it first): each way of keeping packed documents apart gives each
    document run alone (SDPA with the block-diagonal mask; the varlen function as the model calls it, over a CPU
    kernel of torch's signature); SDPA causal keeps none apart, timed beside them; flash-attn, absent, is a row."""
    from test_varlen import window_form

    attention = load_script("bench/attention.py")
    rows = {
        r["attention"]: r
        for r in attention.main(["--dry", "--repeats", "2", "--out", str(tmp_path)], torch_kernel=window_form)
    }
    masked, through, causal = rows[attention.MASKED], rows[attention.VARLEN], rows[attention.CAUSAL]
    assert masked["documents"] > 2 and masked["difference"] < 1e-5 and through["difference"] < 1e-5
    assert causal["difference"] is None and causal["x_causal"] == 1 and masked["ms"] > 0 and through["ms"] > 0
    assert rows[attention.FLASH]["status"] == "not installed"
    table = (tmp_path / "ATTENTION.md").read_text().splitlines()
    assert len(table) == 4 + 4 and "| tiny, GQA | 2 x 128 |" in table[4] and table[4].endswith("| ok |")


@pytest.mark.quick
def test_a_profile_cut_short_by_the_runs_end_is_written_and_stopped(tmp_path):
    """TRAIN_PROFILE over steps 5-8 of a run of 6: the run's end stops the profiler and writes its counts per step
    profiled (2 here); left running, it crashed the interpreter's exit (a segmentation fault after results.json)."""
    import json

    import torch

    from finetune import progress

    for last, written in ((6, True), (4, False)):  # 4: it started at the end of step 4 and saw no step
        folder = tmp_path / str(last)
        profiler = progress.Profiler(folder, rank=0)
        for step in range(1, last + 1):
            torch.ones(4).add_(1)
            profiler.step_done(step)
        assert profiler.active is not None
        profiler.close(last)
        assert profiler.active is None and torch.autograd.profiler._is_profiler_enabled is False
        assert (folder / "profile-rank0.json").exists() == written
    assert json.loads((tmp_path / "6" / "profile-rank0.json").read_text())["aten::add_"] == 1.0
