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
    and kernels within their budgets; on one rank ZeRO-1/2 reduce nothing (mends.reduce_nothing_alone: the two
    all-reduces left are the norm's and the stop flag's). Before: ZeRO-1/2 8,511 ops, 7 reads, 2 syncs (5,162 ops
    before mends.repoint_only_when_moved, 4,378 before reduce_nothing_alone); ZeRO-3 6,454 ops."""
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


def test_zero3_gathers_and_reduces_a_layer_at_a_time_on_two_ranks(counted):
    """ZeRO-3 on 2 ranks with its transformer layers as leaves and buckets sized to a layer (zero_config.tuned_values):
    at most 3 collectives a step per layer, where a weight matrix a collective and the small parameters gathered one by
    one after every step made 343 for 12 layers (196 all-gathers, 147 reduce-scatters)."""
    zero3 = counted("ZeRO-3", ranks=2)
    gathers, reductions = zero3["collectives"]["_allgather_base"], zero3["collectives"]["_reduce_scatter_base"]
    assert gathers + reductions <= 3 * LAYERS, zero3["collectives"]
    assert zero3["collectives"].get("allreduce", 0) <= 3  # the gradients' norm, the stop flag, the loss scale's check
    assert zero3["syncs"] == 0 and zero3["reads"] <= 3


def tiny_engine(stage, mends):
    """A mended bf16 engine on a 2-layer OPT, after one backward pass (a process group of one is up)."""
    import deepspeed
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16))
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "wall_clock_breakdown": False,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                                   config=config)
    mends.mend(engine)
    ids = torch.arange(8).unsqueeze(0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    return engine, optimizer


def test_zero_steps_leave_weights_in_place_and_copy_gradients_once():
    """After a step the 16-bit weights view their slices of the flat buffer the update was copied into, and the
    re-pointing DeepSpeed does anyway dispatches nothing (mends.repoint_only_when_moved, ZeRO-2: 784 operations
    before for 196 tensors; mends.zero3_step_in_place, ZeRO-3's shards: 588); a buffer that has moved (as
    offload_states moves it) still gets them pointed at it. ZeRO-3's fp32 gradient partition, made at once from
    DeepSpeed's gradient buffer, holds what its flatten-then-convert made (bf16 gradients: exactly). Both engines in
    one process group: DeepSpeed keeps its groups in globals, stale after a group is destroyed and made anew."""
    import os

    import torch
    import torch.distributed as dist

    from finetune import mends
    from helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")

    def stays(weights, flat, repoint):
        on_flat = lambda: all(w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for w in weights)
        assert on_flat()
        counter = host_cost.HostWork()
        with counter.counting():
            repoint()
        assert counter.result()["ops"] == 0
        before = [w.detach().clone() for w in weights]
        flat.data = flat.data.clone()  # moved: the weights view the old storage
        assert not on_flat()
        repoint()
        assert on_flat() and all(torch.equal(w, b) for w, b in zip(weights, before))

    try:
        engine, optimizer = tiny_engine(2, mends)
        engine.step()
        stays(optimizer.bit16_groups[0], optimizer.bit16_groups_flat[0],
              lambda: optimizer._update_model_bit16_weights(0))

        engine, optimizer = tiny_engine(3, mends)  # its forward and backward ran through the mended fetches
        from deepspeed.runtime.zero import partition_parameters
        assert partition_parameters.NoGatherCoalescedHandle.wait.mended
        grads, fp32 = optimizer.averaged_gradients[0], optimizer.fp32_partitioned_groups_flat[0]
        assert grads[0].dtype == torch.bfloat16 and len(grads) == len(optimizer.fp16_partitioned_groups[0])
        expected = torch.cat([g.reshape(-1) for g in grads]).float()
        counter = host_cost.HostWork()
        with counter.counting():
            optimizer._prepare_fp32_grad_for_sub_group(0)
        assert counter.result()["ops"] <= 2  # a view of the buffer, its fp32 copy
        assert torch.equal(fp32.grad, expected)
        fp32.grad, optimizer.averaged_gradients[0] = None, grads  # as before, for the step
        engine.step()
        stays(optimizer.fp16_partitioned_groups[0], optimizer.fp16_partitioned_groups_flat[0],
              lambda: optimizer._unflatten_partitioned_parameters(0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_zero3_on_one_gpu_waits_at_a_fetch_only_behind_a_copy_from_the_host():
    """mends.fetch_waits, fed a GPU's facts: one rank's ZeRO-3 fetch of shards already on the GPU waits for nothing
    (DeepSpeed drained the CUDA stream at every layer's fetch: 16 device syncs a step on the H100 at OPT-125m's
    shape); a shard on the CPU (parameter offload) is still copied over, and waited for; a CPU never waits."""
    import torch

    from finetune import mends

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not mends.fetch_waits([gpu, torch.device("cuda:0")], torch.device("cuda:0"), False)
    assert mends.fetch_waits([gpu, cpu], torch.device("cuda:0"), False)
    assert mends.fetch_waits([cpu], torch.device("cuda:0"), False)
    assert not mends.fetch_waits([cpu], cpu, True)


def test_zero3_keeps_each_modules_parameters_until_a_module_registers_one():
    """mends.keep_parameter_lists: ZeRO-3's iter_params gives a module's parameters (its own, or its tree's) as
    named_parameters() does, then DeepSpeed's external ones; a parameter or a submodule registered anywhere after is
    seen at the next call, and a copy of a module lists its own."""
    import copy

    import deepspeed
    import torch
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    from finetune import mends

    mends.keep_parameter_lists()
    iter_params = partitioned_param_coordinator.iter_params
    assert iter_params.mended and parameter_offload.iter_params is iter_params
    layer = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    listed = lambda module, recurse=False: [id(p) for p in iter_params(module, recurse)]  # noqa: E731
    owned = lambda module, recurse: [id(p) for _, p in module.named_parameters(recurse=recurse)]  # noqa: E731
    for recurse in (False, True):
        assert listed(layer, recurse) == owned(layer, recurse)
    assert listed(layer[0]) == [id(layer[0].weight), id(layer[0].bias)]
    layer[1].extra = torch.nn.Parameter(torch.zeros(3))  # registered after the lists were kept
    layer.append(torch.nn.Linear(3, 1))
    assert listed(layer, True) == owned(layer, True) and len(owned(layer, True)) == 7
    assert listed(layer[1]) == [id(layer[1].weight), id(layer[1].bias), id(layer[1].extra)]
    twin = copy.deepcopy(layer)
    assert listed(twin, True) == owned(twin, True) != owned(layer, True)
    shared = layer[2].weight  # a parameter another module also uses: DeepSpeed's external parameters
    deepspeed.zero.register_external_parameter(layer[0], shared)
    assert listed(layer[0]) == [id(layer[0].weight), id(layer[0].bias), id(shared)]


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
