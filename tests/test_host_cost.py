"""The host's work per steady step (bench/host_cost.py), held as counts: a change that adds a host read, a device sync,
a per-parameter loop or a collective per layer to the training step fails here, with the count. The counts are exact
on any machine (the ops a GPU would launch, the values it would wait for), so the budgets are too; the speed they
buy is measured on a GPU (bench/gpu.sh), never timed here. Ranks forked from the pre-imported parent."""

import pytest
from helpers import launch, load_script

host_cost = load_script("bench/host_cost.py")
LAYERS = 12  # host_cost.assets' model: OPT-125m's 196 tensors
# ops a step as a multiple of single-gpu.py's (bf16, one process): what this code reaches, a little above it. The goals
# (docs/gpu.md): 1.2x at ZeRO-0, 1.5x at ZeRO-1/2, 2x at ZeRO-3; what is left above them is DeepSpeed's own per-
# parameter bookkeeping (views a parameter: no kernel each), so the kernels' budgets are the tighter ones
OPS = {"ZeRO-0": 1.01, "ZeRO-1": 1.05, "ZeRO-2": 1.05, "ZeRO-3": 2.0}
KERNELS = {"ZeRO-0": 1.01, "ZeRO-1": 0.7, "ZeRO-2": 0.7, "ZeRO-3": 1.1}
# Python calls a step, the same way: the host's interpreter work launches do not count (DeepSpeed's hooks per parameter
# and per module; ZeRO-3's fetch and release). Before: single-gpu.py 4,494, ZeRO-0 6,638, ZeRO-1/2 5,709 / 8,810 (one
# rank, bf16), ZeRO-3 97,111
CALLS = {"ZeRO-0": 1.15, "ZeRO-1": 2.5, "ZeRO-2": 3.8, "ZeRO-3": 21}


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """count(run, precision, ranks): bench/host_cost.py's counts of one steady step, each run once."""
    files = host_cost.assets(tmp_path_factory.mktemp("host-cost"))
    forked = lambda script, argv, ranks: launch("forked" if ranks > 1 else "forked-python", script, argv, nproc=ranks)
    runs = {}

    def count(name, precision="bf16", ranks=1):
        if (name, precision, ranks) not in runs:
            runs[name, precision, ranks] = host_cost.count_run(name, precision, files, ranks, launch=forked)
        return runs[name, precision, ranks]

    return count


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero0_does_what_single_gpu_py_does(counted, precision):
    """ZeRO-0 on one GPU is single-gpu.py under the engine: in bf16 torch's autocast over fp32 weights and torch's
    fused AdamW (not DeepSpeed's unfused 16-bit optimizer: 3.5x the ops and a host read per parameter), clipped at
    once, no all-reduce with itself, no throughput timer's syncs. Before: 7,630 ops and 203 reads (bf16), 3,709 ops
    (fp32), 2 syncs."""
    single, zero0 = counted("single-gpu.py", precision), counted("ZeRO-0", precision)
    assert single["syncs"] == zero0["syncs"] == 0
    assert zero0["reads"] == single["reads"] == 1  # the stop flag's, a CPU tensor (read twice before the hold left)
    assert zero0["collectives"] == {} and single["collectives"] == {}
    assert zero0["ops"] <= OPS["ZeRO-0"] * single["ops"], (zero0["ops"], single["ops"])
    assert zero0["kernels"] <= KERNELS["ZeRO-0"] * single["kernels"], (zero0["kernels"], single["kernels"])
    assert zero0["calls"] <= CALLS["ZeRO-0"] * single["calls"], (zero0["calls"], single["calls"])
    assert single["calls"] < 2600, single["calls"]  # clipped over the optimizer's lists, not model.parameters()


@pytest.mark.parametrize("stage", ["ZeRO-1", "ZeRO-2", "ZeRO-3"])
def test_every_stage_reads_at_most_one_value_more_and_never_synchronizes(counted, stage):
    """bf16, what GPUs run. At most one value read a step beyond single-gpu.py's (ZeRO-3 asks whether the gradients'
    norm is finite before it steps); no synchronize() (the throughput timer is off in the shipped configs); the ops
    and kernels within their budgets; on one rank ZeRO-1/2 reduce nothing (mend reduce_nothing_alone: the two
    all-reduces left are the norm's and the stop flag's). Before: ZeRO-1/2 8,511 ops, 7 reads, 2 syncs (5,162 ops
    before mend repoint_only_when_moved, 4,378 before reduce_nothing_alone); ZeRO-3 6,454 ops."""
    single, zero = counted("single-gpu.py"), counted(stage)
    assert zero["syncs"] == 0
    assert zero["reads"] <= single["reads"] + 1, zero["read_lines"]
    assert zero["ops"] <= OPS[stage] * single["ops"], (zero["ops"], single["ops"])
    assert zero["kernels"] <= KERNELS[stage] * single["kernels"], (zero["kernels"], single["kernels"])
    assert zero["calls"] <= CALLS[stage] * single["calls"], (zero["calls"], single["calls"])
    if stage != "ZeRO-3":
        assert zero["collectives"] == {"allreduce": 2}, zero["collectives"]


def test_zero2_on_two_ranks_reduces_in_buckets_within_its_budget(counted):
    """ZeRO-2 where users run it, on 2 ranks or more (contiguous_gradients on): the gradients reduced in one bucket
    (4 all-reduces a step with the norm's and the stop flag's), the updated halves gathered (2), no sync, at most one
    more host read than single-gpu.py, and its ops (1.73x: the per-parameter copies into the bucket and the
    partition) and Python calls (5.1x: DeepSpeed's hooks) held where they are."""
    single, zero2 = counted("single-gpu.py"), counted("ZeRO-2", ranks=2)
    assert zero2["collectives"] == {"allreduce": 4, "_allgather_base": 2}, zero2["collectives"]
    assert zero2["syncs"] == 0 and zero2["reads"] <= single["reads"] + 1
    assert zero2["ops"] <= 1.8 * single["ops"], (zero2["ops"], single["ops"])
    assert zero2["calls"] <= 5.3 * single["calls"], (zero2["calls"], single["calls"])


def test_the_trainers_engine_is_mended_as_ours(counted):
    """sequence_classification.py's engine, which the HF Trainer builds, gets zero-optimization.py's mends (--mends,
    applied once it exists): ZeRO-2 on one rank at about half the ops and kernels of DeepSpeed's own code (nothing
    reduced alone, the norm at once, the weights not pointed anew), one all-reduce and one host read fewer; as few ops
    as our own loop's step. The Trainer's NaN filter of the logged loss is off: one more read fewer (its two checks).
    Measured: 2,164 ops, 606 kernels, 3 reads against 4,531, 1,195 and 5 (bf16; 5 and 7 reads with the NaN check)."""
    mended, own, ours = counted("Trainer ZeRO-2"), counted("Trainer ZeRO-2, --mends none"), counted("ZeRO-2")
    assert mended["ops"] <= 0.5 * own["ops"] and mended["kernels"] <= 0.55 * own["kernels"], (mended, own)
    assert mended["ops"] <= ours["ops"], (mended["ops"], ours["ops"])
    assert mended["collectives"] == {"allreduce": 2} and own["collectives"] == {"allreduce": 3}
    assert mended["syncs"] == own["syncs"] == 0
    # left: the Trainer's grad norm (accelerate), the attention mask's padding check (transformers), the stop flag
    assert mended["reads"] == own["reads"] - 2 == 3, mended["read_lines"]


def test_a_step_runs_through_a_few_modules_a_reader_can_follow(counted):
    """A steady step of single-gpu.py runs the code of 4 of the project's modules (the batches, the loss, the loop's
    helpers, its progress), one of zero-optimization.py 6 (and DeepSpeed's speed mends, and the hang watchdog of
    several ranks). Before: 8 (blocks, checkpoints, flags, hangs, hardware, loss, progress, training) and 10 (and
    mends, zero)."""
    loop = ["blocks.py", "loss.py", "progress.py", "training.py"]
    assert counted("single-gpu.py")["modules"] == loop
    for stage in ("ZeRO-2", "ZeRO-3"):
        assert counted(stage, ranks=2)["modules"] == sorted(
            loop + ["internals/hangs.py", "internals/mend_speedups.py"]
        ), stage


def test_zero3_gathers_and_reduces_a_layer_at_a_time_on_two_ranks(counted):
    """ZeRO-3 on 2 ranks with its transformer layers as leaves and buckets sized to a layer (zero_config.tuned_values):
    at most 3 collectives a step per layer, where a weight matrix a collective and the small parameters gathered one by
    one after every step made 343 for 12 layers (196 all-gathers, 147 reduce-scatters)."""
    zero3 = counted("ZeRO-3", ranks=2)
    gathers, reductions = zero3["collectives"]["_allgather_base"], zero3["collectives"]["_reduce_scatter_base"]
    assert gathers + reductions <= 3 * LAYERS, zero3["collectives"]
    assert zero3["collectives"].get("allreduce", 0) <= 3  # the gradients' norm, the stop flag, the loss scale's check
    assert zero3["syncs"] == 0 and zero3["reads"] <= 3


def test_the_count_sees_a_host_read_a_sync_and_a_collective():
    """The counter itself, on ops whose costs are known: a value read, a .tolist(), a synchronize(), an all-reduce
    in a world of one, and views (no kernel)."""
    import os

    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        counter = host_cost.HostWork()
        with counter.counting():
            x = torch.ones(4)
            y = x.view(2, 2).t()  # two views: ops, not kernels
            float(y.sum())
            x.tolist()
            get_accelerator().synchronize()
            dist.all_reduce(x)
        counted = counter.result()
    finally:
        dist.destroy_process_group()
    assert counted["reads"] == 2 and counted["syncs"] == 1 and counted["collectives"] == {"allreduce": 1}
    assert counted["kernels"] == 2  # ones, sum: not the views, the read, the collective
    assert counted["ops"] == counted["kernels"] + 2 + 1 + 1
