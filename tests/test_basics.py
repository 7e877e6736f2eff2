"""Every lesson in basics/ on CPU with 2 processes and 3 (an odd world, which splits unevenly): exit code, and the
values it prints. Forked with torchrun's variables (helpers.launch), but under torchrun itself, as the README runs
them, the first lesson and the one whose subject is a rank that never joins (torchrun is tested for real in
test_reliability.py too)."""

import re

import pytest
from helpers import launch

UNDER_TORCHRUN = {("p2p", 2), ("timeout", 2)}
LESSONS = [
    "p2p",
    "collectives",
    "ring_allreduce",
    "data_parallel",
    "zero",
    "tensor_parallel",
    "pipeline_parallel",
    "timeout",
]


def checks(stdout, rank):
    lines = re.findall(rf"^\[rank {rank}\] check (.*): (ok|FAILED)$", stdout, re.M)
    assert all(status == "ok" for _, status in lines), lines
    return [name for name, _ in lines]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson(lesson, n):
    run = launch(
        "torchrun" if (lesson, n) in UNDER_TORCHRUN else "forked", f"basics/{lesson}.py", [], nproc=n, timeout=300
    )
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    per_rank = [checks(out, r) for r in range(n)]
    if lesson == "p2p":
        assert f"blocking ring sum is {n * (n - 1) // 2}" in per_rank[0]
        assert all(f"non-blocking ring sum is {n * (n - 1) // 2} on every rank" in c for c in per_rank)
    elif lesson == "collectives":
        for r in range(n):
            assert f"all_reduce(sum) gives {n * (n - 1) // 2} -> {n * (n - 1) // 2}" in per_rank[r]
            assert f"scatter from rank 0 gives {10 * r} -> {10 * r}" in per_rank[r]
            assert f"reduce_scatter gives {n * (n + 1) // 2} -> {n * (n + 1) // 2}" in per_rank[r]
            assert len(per_rank[r]) == 8 + 2 * (r == 0) + (r % 2 == 0)  # rank 0: reduce, gather; evens: the group
    elif lesson == "ring_allreduce":
        assert all("ring on 4M numbers equals dist.all_reduce" in c for c in per_rank)
        assert len(re.findall(r"16 MB: ring from scratch [\d.]+ ms, dist.all_reduce [\d.]+ ms", out)) == n
    elif lesson == "data_parallel":
        assert all(len(c) == 2 for c in per_rank)
    elif lesson == "zero":
        psi = 12 * 24 + 24 + 24 * 12 + 12  # the toy MLP's parameters
        for stage, held in ((1, 8 * psi + 8 * psi // n), (2, 4 * psi + 12 * psi // n), (3, 16 * psi // n)):
            assert len(re.findall(rf"ZeRO-{stage}: holds .* = {held} bytes", out)) == n, (stage, held)
        assert all(len(c) == 6 for c in per_rank)
    elif lesson == "tensor_parallel":
        assert all(len(c) == 3 for c in per_rank)
    elif lesson == "pipeline_parallel":
        assert "pipeline loss equals the unsplit model's" in per_rank[n - 1]
        assert all(f"stage {r} gradients equal the unsplit model's layer {r}" in per_rank[r] for r in range(n))
        assert out.count("forward micro-batch") == 4 * n and out.count("backward micro-batch") == 4 * n
    elif lesson == "timeout":
        waits = [float(w) for w in re.findall(r"all_reduce gave up after ([\d.]+) s: rank \d never joined", out)]
        assert len(waits) == n - 1 and all(2.5 < w < 6 for w in waits)  # the lesson's 3 s (+3)


@pytest.mark.parametrize("lesson", LESSONS)
def test_one_process_is_told_to_start_more(lesson):
    run = launch("forked", f"basics/{lesson}.py", [], nproc=1)
    assert run.returncode == 0 and "this lesson needs at least 2 processes" in run.stdout
