"""Each speed mend among DeepSpeed's mends (finetune/internals/mends.py), on a tiny engine in this process: the host
work it saves a step (ops, Python calls, host reads, syncs: bench/host_cost.py's counts) and the numbers it leaves as
they were."""

import pytest
import torch
from mended import counted, engine, host_cost, step, weights, world  # noqa: F401 (fixtures)

from finetune.internals import mend_speedups, mends

# ----------------------------------------------------------------------------------------------------
# The speed mends: what each saves a step

SPEED = [  # (mend, stage, precision, what it saves)
    ("parameter_list_at_stage0", 0, "fp32", "calls"),
    ("nothing_to_reduce_at_stage0", 0, "fp32", "ops"),
    ("no_nvtx_ranges", 3, "fp32", "calls"),
    ("debug_prints_look_first", 3, "fp32", "calls"),
    ("repoint_only_when_moved", 2, "bf16", "ops"),
    ("reduce_nothing_alone", 2, "bf16", "ops"),  # (with contiguous_gradients off, as "auto" has it on one rank)
    ("zero3_step_in_place", 3, "bf16", "ops"),
    ("zero3_keeps_parameter_lists", 3, "fp32", "calls"),
    ("norm_at_once", 2, "fp32", "ops"),
    ("clip_without_a_read", 2, "fp32", "reads"),
]


@pytest.mark.parametrize("mend, stage, precision, saves", SPEED, ids=[s[0] for s in SPEED])
def test_a_speed_mend_saves_host_work_and_changes_no_number(mend, stage, precision, saves):
    """The same steps with every mend that concerns the engine, and without this one: fewer of what it saves, and the
    same weights (each step moves them by about lr = 1e-2; the norm's sum in another order moves the clipping
    coefficient in its last bits, which Adam carries to 1e-5 where a gradient is near zero)."""
    runs = {}
    for without in ((), (mend,)):
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "contiguous_gradients": stage == 3}
        with engine(stage, precision, without=without, zero_optimization=zero) as ds:
            runs[without] = (counted(ds), weights(ds))
    (mended, mended_weights), (own, own_weights) = runs[()], runs[(mend,)]
    assert mended[saves] < own[saves], (mended[saves], own[saves])
    torch.testing.assert_close(mended_weights, own_weights, rtol=0, atol=5e-5)


def test_copies_back_at_once_at_stage0():
    """ZeRO-0 on several ranks copies each reduced gradient back out of the flat buffer: a copy a parameter;
    mended, one foreach copy (the same values). Counted on this one rank's engine, the reduction called directly."""
    import deepspeed.comm as dist

    with engine(0) as ds:
        bucket = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
        ops, results = [], []
        for mended in (False, True):
            if mended:
                mend_speedups.copies_back_at_once_at_stage0(ds, mends.Patches(None))
            values = [b.clone() for b in bucket]
            counter = host_cost.HostWork()
            with counter.counting():
                ds.allreduce_and_copy(values, dist.get_world_group())
            ops.append(counter.result()["kernels"])
            results.append(values)
    assert ops[1] < ops[0] and all(torch.equal(a, b) for a, b in zip(*results))


def test_zero3_fetch_alone_without_waiting(monkeypatch):
    """One rank's ZeRO-3 fetch, with a GPU's facts (a device that does not resolve data dependencies itself, as CUDA's
    streams): DeepSpeed's handle drains the stream at every layer's fetch (16 device syncs a step on the H100 at
    OPT-125m's shape); mended, a fetch of shards already on the device waits for nothing (fetch_waits) and leaves the
    parameters as available as DeepSpeed's own does."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as zp

    syncs = []
    stream = type("Stream", (), {"synchronize": lambda self: syncs.append(1)})()
    found = {}
    for without in ((), ("zero3_fetch_alone_without_waiting",)):
        with engine(3, without=without) as ds:
            params = [p for p in ds.module.parameters() if p.ds_status == zp.ZeroParamStatus.NOT_AVAILABLE][:3]
            for p in params:
                p.ds_status = zp.ZeroParamStatus.INFLIGHT  # as the coordinator leaves them before the wait
            handle = zp.NoGatherCoalescedHandle(params)
            syncs.clear()
            with monkeypatch.context() as gpu:  # the wait alone, as on CUDA
                accelerator = type(get_accelerator())
                gpu.setattr(accelerator, "resolves_data_dependency", lambda self: False)
                gpu.setattr(accelerator, "current_stream", lambda self, device_index=None: stream)
                handle.wait()
            found[without] = (len(syncs), {p.ds_status for p in params})
    assert found[()] == (0, {zp.ZeroParamStatus.AVAILABLE})
    assert found[("zero3_fetch_alone_without_waiting",)] == (1, {zp.ZeroParamStatus.AVAILABLE})
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not mend_speedups.fetch_waits([gpu, torch.device("cuda:0")], torch.device("cuda:0"), False)
    assert mend_speedups.fetch_waits([gpu, cpu], torch.device("cuda:0"), False)
    assert not mend_speedups.fetch_waits([cpu], cpu, True)


def test_zero_steps_leave_weights_in_place_and_copy_gradients_once():
    """After a step the 16-bit weights view their slices of the flat buffer the update was copied into, and the
    re-pointing DeepSpeed does anyway dispatches nothing (repoint_only_when_moved, ZeRO-2: 784 operations before for
    OPT-125m's 196 tensors; zero3_step_in_place, ZeRO-3's shards: 588); a buffer that has moved (as offload_states
    moves it) still gets them pointed at it. ZeRO-3's fp32 gradient partition, made at once from DeepSpeed's gradient
    buffer, holds what its flatten-then-convert made (bf16 gradients: exactly)."""

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

    with engine(2, "bf16") as ds:
        step(ds)
        optimizer = ds.optimizer
        stays(
            optimizer.bit16_groups[0], optimizer.bit16_groups_flat[0], lambda: optimizer._update_model_bit16_weights(0)
        )
    with engine(3, "bf16") as ds:
        ids = torch.arange(8).unsqueeze(0)
        ds.backward(ds(input_ids=ids, labels=ids).loss)
        optimizer = ds.optimizer
        grads, fp32 = optimizer.averaged_gradients[0], optimizer.fp32_partitioned_groups_flat[0]
        assert grads[0].dtype == torch.bfloat16 and len(grads) == len(optimizer.fp16_partitioned_groups[0])
        expected = torch.cat([g.reshape(-1) for g in grads]).float()
        counter = host_cost.HostWork()
        with counter.counting():
            optimizer._prepare_fp32_grad_for_sub_group(0)
        assert counter.result()["ops"] <= 2  # a view of the buffer, its fp32 copy
        assert torch.equal(fp32.grad, expected)
        fp32.grad, optimizer.averaged_gradients[0] = None, grads  # as before, for the step
        ds.step()
        stays(
            optimizer.fp16_partitioned_groups[0],
            optimizer.fp16_partitioned_groups_flat[0],
            lambda: optimizer._unflatten_partitioned_parameters(0),
        )


def test_zero3_keeps_each_modules_parameters_until_a_module_registers_one():
    """zero3_keeps_parameter_lists: ZeRO-3's iter_params gives a module's parameters (its own, or its tree's) as
    named_parameters() does, then DeepSpeed's external ones; a parameter or a submodule registered anywhere after is
    seen at the next call, and a copy of a module lists its own. Undone, DeepSpeed's own iter_params is back and
    torch's registration hooks are gone."""
    import copy

    import deepspeed
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    own = partitioned_param_coordinator.iter_params
    hooks = dict(torch.nn.modules.module._global_parameter_registration_hooks)
    with engine(3, only=("zero3_keeps_parameter_lists",)):
        iter_params = partitioned_param_coordinator.iter_params
        assert iter_params is not own and parameter_offload.iter_params is iter_params
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
    assert partitioned_param_coordinator.iter_params is own and parameter_offload.iter_params is own
    assert dict(torch.nn.modules.module._global_parameter_registration_hooks) == hooks


def test_cpu_info_once(monkeypatch):
    """DeepSpeed asks py-cpuinfo about the CPU as it builds CPU Adam (the op's flags, then each optimizer), and
    py-cpuinfo starts a Python process each time (1.2 s of CPU): with offload, mended, the first answer is kept
    for the process until the engine is done. (Counted on py-cpuinfo's function, its answer asked once here.)"""
    import json

    import cpuinfo
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from helpers import ROOT

    config = json.loads((ROOT / "ds_config_zero2.json").read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    own = cpuinfo.get_cpu_info
    answer, asked = getattr(own, "__wrapped__", own)(), []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or answer)  # py-cpuinfo's, counted
    counting, found = cpuinfo.get_cpu_info, []
    for choice in ("none", "all"):
        asked.clear()
        mends.before_engine(config, choice)
        for _ in range(3):
            DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])
        found.append(len(asked))
        held = mends.Mended(choice, mends.WRITTEN_FOR[0])  # as the engine's Mended adopts and undoes it
        held.adopt_pending()
        held.undo()
    assert found[0] >= 3 and found[1] == 1, found
    assert cpuinfo.get_cpu_info is counting  # undone
