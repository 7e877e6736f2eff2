"""bench/gpu.py's prepared GPU calls beyond the engine's table, dry on the CPU: Llama-3.1-8B's shape (QLoRA, LoRA,
full fine-tuning under ZeRO-3 + CPU offload) on a narrowed config, and one long sequence with and without
--offload-activations --tiled-mlp; each run's memory beside plan.py's. A benchmark is never a timed test."""

import math

import pytest
from helpers import load_script


def test_the_8b_runs_dry_on_a_narrowed_config_with_the_plans_gpu_and_host_peaks(tmp_path):
    """bash bench/gpu.sh --shapes llama-3.1-8b (LoRA, QLoRA, full fine-tuning under ZeRO-3 + CPU offload, as users
    run them) dry: the same commands on Llama-3.1-8B's config narrowed (its vocabulary, 2 layers of 128), each run's
    peak and host memory beside plan.py's. 4 steps: fewer than the profiler's window, whose profiler is closed at the
    run's end (it crashed the interpreter's exit before)."""
    gpu = load_script("bench/gpu.py")
    runs = ["QLoRA 16, 4-bit base", "full, ZeRO-3 + CPU offload"]  # (LoRA: QLoRA's run without --load-in-4bit)
    rows = gpu.main(["--dry", "--shapes", "llama-3.1-8b-narrowed", "--runs", *runs, "--out", str(tmp_path)])
    assert [(r["run"], r["status"]) for r in rows] == [(run, "ok") for run in runs], rows
    for r in rows:
        assert r["tok_s"] > 0 and r["host"] > 0 and r["planned"] > 0 and math.isfinite(r["loss"])
    qlora, full = rows
    assert full["planned_host"] > 0 and not qlora["planned_host"]  # the optimizer's state there; QLoRA loads on GPU
    model = tmp_path / "models" / "llama-3.1-8b-narrowed"
    assert qlora["planned"] < gpu.planned_peak(model, "ZeRO-0", qlora["shape"], "LoRA 16", True)[0]  # 4-bit base
    header = (tmp_path / "GPU.md").read_text().splitlines()[2].split(" | ")
    assert header[6:10] == ["peak GiB", "planned GiB", "host GiB", "planned host GiB"]
    assert not (tmp_path / "runs" / "llama-3.1-8b-narrowed-QLoRA_16__4_bit_base" / "profile").exists()  # no step
    assert gpu.parts(["llama-3.1-8b"]) == [("llama-3.1-8b", r) for r in gpu.SCALE_UP]  # QLoRA and LoRA first


def test_the_long_sequence_runs_dry(tmp_path):
    """bash bench/gpu.sh --shapes long-1b long-8b (one sequence of 8k-64k tokens, checkpointing alone against
    --offload-activations --tiled-mlp) dry: the demo model at 1/64 of the blocks, the plan's peak and host memory
    beside each, the same loss both ways."""
    gpu = load_script("bench/gpu.py")
    runs = ["8k, checkpointed", "8k, offloaded + tiled"]
    rows = gpu.main(["--dry", "--shapes", "long-demo", "--runs", *runs, "--out", str(tmp_path)])
    assert [(r["run"], r["status"]) for r in rows] == [(run, "ok") for run in runs]
    plain, both = rows
    assert plain["loss"] == pytest.approx(both["loss"], rel=1e-5) and both["tok_s"] > 0
    assert both["planned"] <= plain["planned"] and both["planned_host"] > plain["planned_host"]
    assert gpu.sizes("long-1b", "QLoRA, 64k, offloaded + tiled", False) == (1, 65536)


def test_a_8b_plan_that_needs_more_host_memory_than_there_is_skips_the_run():
    """Full fine-tuning of Llama-3.1-8B with its fp32 Adam state on the host: plan.py's 150 GiB of CPU memory; the
    GPU machine has 128 GiB, so the part is skipped with the reason rather than run out of memory."""
    gpu = load_script("bench/gpu.py")
    planned, host = gpu.planned_peak(
        "meta-llama/Llama-3.1-8B", "ZeRO-3 + CPU offload", "llama-3.1-8b", "full, ZeRO-3 + CPU offload", False
    )
    assert 140 * 2**30 < host < 160 * 2**30 and planned < 10 * 2**30


def test_the_1b_run_at_the_plans_largest_micro_batch_takes_what_fits_the_card(monkeypatch):
    """single-gpu.py at Llama-3.2-1B's shape with the micro-batch plan.py fits on the card (MFU grows with it): on an
    H100's 80 GiB nine tenths of plan.py's largest for ZeRO-0 at 512 tokens (its peaks were 2-7% under the measured),
    whose one more sequence would pass the 90% plan.py allows; on an H200's 141 GiB more, held at 4x the shape's 16."""
    gpu = load_script("bench/gpu.py")
    name, model = "single-gpu.py, the plan's largest micro-batch", "meta-llama/Llama-3.2-1B"
    monkeypatch.setattr(gpu, "card_memory", lambda: 80.0)
    batch, block = gpu.sizes("llama-3.2-1b", name, False, model)
    largest = gpu.planned(model, "ZeRO-0", name, False, batch=16, block=512)["largest_batch"]
    assert block == 512 and batch == int(0.9 * largest) > 16
    assert gpu.planned_peak(model, "ZeRO-0", "llama-3.2-1b", name, False)[0] <= 0.9 * 80 * 2**30
    assert (
        gpu.planned(model, "ZeRO-0", name, False, batch=largest + 1, block=512)["peak_bytes_per_gpu"] > 0.9 * 80 * 2**30
    )
    monkeypatch.setattr(gpu, "card_memory", lambda: 141.0)
    assert gpu.sizes("llama-3.2-1b", name, False, model) == (64, 512)
