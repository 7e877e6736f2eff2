"""The speed mends among DeepSpeed's mends: where DeepSpeed 0.19.8 does more host work a step than the same step needs
(per-parameter loops, device syncs, reductions with itself, a module tree walked at every fetch), each function does
the same work with less, for the engine it is given, or for the process through `patches` (mends.py holds the
registry and undoes what is process-wide). What each saves, counted: tests/test_mends.py, bench/host_cost.py."""
import itertools
import math
import operator

import torch


def parameter_list_at_stage0(engine, patches):
    """ZeRO-0 walks the module tree for its parameters at every step to set each gradient to None (engine.zero_grad:
    1,900 Python calls a step for OPT-125m's 196 tensors): a list, made once."""
    parameters = list(engine.module.parameters())

    def zero_grad():
        for param in parameters:
            param.grad = None

    engine.zero_grad = zero_grad


def nothing_to_reduce_at_stage0(engine, patches):
    """ZeRO-0 on one rank all-reduces the gradients with itself: all of them flattened into one buffer, then each
    copied back (two copies of every gradient a step). There is no other rank: no reduction
    (engine._backward_epilogue calls allreduce_gradients only where this is on)."""
    engine.enable_backward_allreduce = False


def copies_back_at_once_at_stage0(engine, patches):
    """ZeRO-0 on several ranks copies each reduced gradient back out of the flat buffer one at a time
    (engine.allreduce_and_copy: a copy a parameter): one foreach copy of them all."""
    def allreduce_and_copy(small_bucket, dp_group, dp_world_size=None):  # engine.py's signature
        reduced = engine.allreduce_bucket(small_bucket, dp_group, dp_world_size)
        torch._foreach_copy_(small_bucket, engine.unflatten(reduced, small_bucket))

    engine.allreduce_and_copy = allreduce_and_copy


def no_nvtx_ranges(engine, patches):
    """DeepSpeed wraps its engine's and ZeRO-3's per-module functions (fetch, release, reduce: 1,534 calls a step for
    OPT-125m) in an NVTX range for the profiler's timeline: 6 Python calls each around the work, and on a GPU a push
    and a pop into CUDA's NVTX library, whether a profiler listens or not. Off, as DeepSpeed turns it off under
    torch.compile (engine.py); to see the ranges in an Nsight Systems timeline, run with --mends fixes."""
    import deepspeed.utils.nvtx

    patches.replace(deepspeed.utils.nvtx, "enable_nvtx", lambda own: False)


def debug_prints_look_first(engine, patches):
    """ZeRO-3 prints its debug messages through functions that ask the process group for the rank before they look
    whether there is anything to print (12,000 calls a step, for messages never printed): they look first. stage3.py
    has its own; the others took partition_parameters' by `import *`."""
    from deepspeed.runtime.zero import parameter_offload, partition_parameters, partitioned_param_coordinator, stage3

    def looking_first(print_rank_0):
        def print_rank_0_when_asked(message, debug=False, force=False):
            if debug or force:
                print_rank_0(message, debug, force)
        return print_rank_0_when_asked

    for module in (partition_parameters, partitioned_param_coordinator, parameter_offload, stage3):
        patches.replace(module, "print_rank_0", looking_first)


def repoint_only_when_moved(engine, patches):
    """ZeRO-1/2's step ends by setting each parameter's data to its slice of the group's flat 16-bit buffer
    (stage_1_and_2.py, _update_model_bit16_weights, "TODO: we probably don't need this? just to be safe"): a narrow, a
    view and two data swaps a parameter, 784 operations a step for OPT-125m's 196 tensors. The all-gather before it
    wrote into that buffer in place, so each parameter still views its slice. Here the slices are compared by address
    and shape on the host (no tensor operation); only a group where one has moved (a loaded checkpoint, say) is
    pointed anew, by DeepSpeed's own code."""
    optimizer = engine.optimizer
    original = optimizer._update_model_bit16_weights

    def update_model_bit16_weights(group_index):
        flat = optimizer.bit16_groups_flat[group_index]
        start, size = flat.data_ptr(), flat.element_size()
        for param, meta, offset in zip(optimizer.round_robin_bit16_groups[group_index],
                                       optimizer.round_robin_bit16_meta[group_index],
                                       optimizer.round_robin_bit16_offsets[group_index]):
            if param.data_ptr() != start + offset * size or param.shape != meta.shape:
                return original(group_index)

    optimizer._update_model_bit16_weights = update_model_bit16_weights


def reduce_nothing_alone(engine, patches):
    """ZeRO-1/2 on one rank (zero_config.tuned_values leaves contiguous_gradients off there) reduce the gradients
    with themselves: each bucket flattened into a new buffer, divided by 1, all-reduced in a group of one, and every
    gradient copied back out of it (stage_1_and_2.py, allreduce_and_copy: 4 operations a parameter, 784 a step for
    OPT-125m's 196 tensors). Each gradient already is what that gives (DeepSpeed's pass through a narrower
    communication_data_type would only round it), so nothing is done; where the reduced gradients also feed the
    separate fp32 partition buffer (an output_bucket), DeepSpeed's own code runs."""
    import deepspeed.comm as dist

    optimizer = engine.optimizer
    original = optimizer.allreduce_and_copy

    def allreduce_and_copy(small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None):  # (stage_1_and_2.py's signature)
        if any(output is not None for output in output_bucket or ()) or (
                process_group is not None and dist.get_world_size(group=process_group) != 1):
            return original(small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                            process_group=process_group, output_bucket=output_bucket)

    optimizer.allreduce_and_copy = allreduce_and_copy


def zero3_step_in_place(engine, patches):
    """ZeRO-3's step, per parameter group: the gradient partitions flattened into a new buffer and that converted to
    fp32 (stage3.py, _prepare_fp32_grad_for_sub_group: a view and a copy a parameter, then a second copy of them
    all), and after the update each 16-bit shard pointed anew at its slice of the flat buffer the update was just
    copied into (_unflatten_partitioned_parameters: 3 operations a parameter). The partitions already lie one after
    the other in DeepSpeed's gradient buffer, and the shards already view their slices: the same fp32 copy is made
    from that buffer at once, and the shards are left where they are; both compared by address on the host,
    DeepSpeed's own code where they do not lie so."""
    from deepspeed.accelerator import get_accelerator

    optimizer, accelerator = engine.optimizer, get_accelerator()
    prepare, unflatten = optimizer._prepare_fp32_grad_for_sub_group, optimizer._unflatten_partitioned_parameters

    def prepare_fp32_grad_for_sub_group(sub_group_id):
        grads, fp32 = optimizer.averaged_gradients[sub_group_id], optimizer.fp32_partitioned_groups_flat[sub_group_id]
        if span(grads) != fp32.numel():
            return prepare(sub_group_id)
        together = grads[0].as_strided((fp32.numel(),), (1,))  # from the first one's place in the gradient buffer
        fp32.grad = together.to(fp32.dtype, copy=True)  # the flattened copy's values, in one copy
        if not accelerator.is_synchronized_device() and accelerator.on_accelerator(together):
            together.record_stream(accelerator.current_stream())  # as DeepSpeed records each of them (one storage)
        optimizer.averaged_gradients[sub_group_id] = None

    def unflatten_partitioned_parameters(sub_group_id):
        shards = optimizer.fp16_partitioned_groups[sub_group_id]
        flat = optimizer.fp16_partitioned_groups_flat[sub_group_id]
        if span(shards) != flat.numel() or shards[0].data_ptr() != flat.data_ptr() or shards[0].dtype != flat.dtype:
            return unflatten(sub_group_id)

    optimizer._prepare_fp32_grad_for_sub_group = prepare_fp32_grad_for_sub_group
    optimizer._unflatten_partitioned_parameters = unflatten_partitioned_parameters


def span(tensors):
    """How many elements `tensors` fill one after the other from the first one's address, all contiguous, in one
    dtype and one storage, with nothing between them; None where they do not. Read from their addresses on the host
    (a storage's range holds no other storage: the first and the last one's tell)."""
    if not tensors or tensors[0] is None:
        return None
    first, end = tensors[0], tensors[0].data_ptr()
    for t in tensors:  # (a loop, not a generator: no Python call a tensor)
        if t is None or t.data_ptr() != end or not t.is_contiguous() or t.dtype != first.dtype:
            return None
        end += t.numel() * t.element_size()
    if tensors[-1].untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return None
    return (end - first.data_ptr()) // first.element_size()


def zero3_fetch_alone_without_waiting(engine, patches):
    """ZeRO-3 on one rank (a partition of one) gathers nothing: a fetch points each parameter at its shard on the
    device (partition_parameters.py, NoGatherHandle and NoGatherCoalescedHandle: the shard's .to(device), no copy
    where it is there already), and then waits for the whole current CUDA stream to drain
    (current_stream().synchronize()) before the layer may run: a device sync for every layer forward and backward
    (the H100 profiled 16 a step at OPT-125m's shape, 21 at Llama-3.2-1B's), with the GPU idle until the host has
    launched the next layer. Only a copy from the host (parameters offloaded to the CPU) needs that wait: it stays
    where a shard is elsewhere (fetch_waits decides)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as zp

    def waiting_only_behind_a_copy(params, complete):  # the handle's private attributes, by their mangled names
        def wrap(original):
            def wait(self, **kwargs):
                fetched = getattr(self, params)
                fetched = fetched if isinstance(fetched, list) else [fetched]
                accelerator = get_accelerator()
                if getattr(self, complete) or fetch_waits([p.ds_tensor.device for p in fetched],
                                                          torch.device(accelerator.current_device_name()),
                                                          accelerator.resolves_data_dependency()) \
                        or any(p.ds_status != zp.ZeroParamStatus.INFLIGHT for p in fetched):
                    return original(self, **kwargs)
                for param in fetched:
                    param.ds_status = zp.ZeroParamStatus.AVAILABLE
                setattr(self, complete, True)
            return wait
        return wrap

    for handle, params in ((zp.NoGatherHandle, "_NoGatherHandle__param"),
                           (zp.NoGatherCoalescedHandle, "_NoGatherCoalescedHandle__params")):
        patches.replace(handle, "wait", waiting_only_behind_a_copy(params, f"_{handle.__name__}__complete"))


def fetch_waits(shard_devices, device, resolves_data_dependency):
    """Whether a one-rank ZeRO-3 fetch must wait for the device: only where a shard lies elsewhere (the CPU, under
    parameter offload) and its copy to the device may still be running (a device that does not resolve data
    dependencies: CUDA's streams; DeepSpeed's CPU accelerator does)."""
    return not resolves_data_dependency and any(d != device for d in shard_devices)


def zero3_keeps_parameter_lists(engine, patches):
    """ZeRO-3 asks a module for its parameters at every fetch and release (partitioned_param_coordinator.py,
    iter_params: named_parameters() walks a transformer layer's module tree, about 25 Python calls each time, 10,000 a
    step for OPT-125m's 12 layers). The lists are kept on each module instead (a deep copy of a module copies its
    list with its parameters), made anew after any module anywhere registers a parameter or a submodule (torch's
    global registration hooks, removed with the mend); the parameters registered with DeepSpeed as external to a
    module are read at each call, as there."""
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    registrations = [0]  # how many registrations torch has seen: a list kept before the last one is stale

    def registered(module, name, value):  # (returns None: the parameter or module registered as it is)
        registrations[0] += 1

    def iter_params(module, recurse=False):
        kept = module.__dict__.get("_finetune_parameters")
        if kept is None or kept[0] != registrations[0]:
            kept = module.__dict__["_finetune_parameters"] = (registrations[0], {})
        params = kept[1].get(recurse)
        if params is None:
            params = kept[1][recurse] = tuple(p for _, p in module.named_parameters(recurse=recurse))
        external = module.__dict__.get("ds_external_parameters")
        return params if external is None else itertools.chain(params, map(operator.itemgetter(1), external()))

    def install():
        hooks = [torch.nn.modules.module.register_module_parameter_registration_hook(registered),
                 torch.nn.modules.module.register_module_module_registration_hook(registered)]
        return lambda: [hook.remove() for hook in hooks]

    patches.install("torch's registration hooks for zero3_keeps_parameter_lists", install)
    for module in (partitioned_param_coordinator, parameter_offload):  # (once: a second engine's make nothing anew)
        patches.replace(module, "iter_params", lambda own: iter_params)


def norm_at_once(engine, patches):
    """ZeRO 1-3 take the gradients' norm (for clipping, and reported) one parameter at a time: each gradient copied to
    fp64, its norm, a pow, then a stack and a sum (stage_1_and_2.py and stage3.py, get_grad_norm_direct): 4 operations
    a parameter, 800 a step for OPT-125m's 196 tensors, and an fp64 copy of the largest gradient. Here: one foreach
    norm over all of a rank's gradients, accumulated in fp32 as single-gpu.py's clip_grad_norm_ does, the squares
    summed over the ranks (the same all-reduce), an invalid norm still DeepSpeed's -1. Not with CPU offload (its norm
    is taken in the backward pass, on the CPU) nor the infinity norm."""
    import deepspeed.comm as dist

    optimizer = engine.optimizer
    original = optimizer.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if norm_type != 2:
            return original(gradients, params, norm_type)
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]  # ZeRO-1/2's alignment padding
        group = optimizer._get_param_partition_group(params[0]) if hasattr(optimizer, "_get_param_partition_group") \
            else optimizer.dp_process_group
        squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum() if grads \
            else torch.zeros((), dtype=torch.float32, device=optimizer.device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
        norm = squares.sqrt()
        return torch.where(norm.isfinite(), norm, torch.full_like(norm, -1.0))

    optimizer.get_grad_norm_direct = get_grad_norm_direct


def clip_without_a_read(engine, patches):
    """ZeRO-1/2 clip the gradients after asking whether the norm is valid with a bool on the host
    (stage_1_and_2.py, unscale_and_clip_grads: a device sync, once per parameter group and step, whether or not the
    step would clip). The same coefficient on the device: an invalid norm (inf, NaN, DeepSpeed's -1) clips to zero, as
    there."""
    optimizer = engine.optimizer

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
            return
        combined_scale = optimizer.loss_scale
        if optimizer.clip_grad > 0.0:
            norm = torch.as_tensor(total_norm, dtype=torch.float32, device=grad_groups_flat[0].device)
            norm = torch.where(norm.isfinite() & (norm >= 0), norm, torch.full_like(norm, math.inf))
            combined_scale = torch.clamp((norm / optimizer.loss_scale + 1e-6) / optimizer.clip_grad, min=1.0) \
                * optimizer.loss_scale
        for grad in grad_groups_flat:
            for piece in grad if isinstance(grad, list) else [grad]:
                piece.data.mul_(1.0 / combined_scale)

    optimizer.unscale_and_clip_grads = unscale_and_clip_grads


MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")
MUON_KEY = "DeepSpeed's Muon modules in sys.modules"  # (Patches' key: a Muon run takes the stand-ins out)


def muon_only_when_named(config, patches):
    """DeepSpeed imports its Muon optimizer wherever it asks whether the optimizer is Muon: the engine's check of a
    ZeRO optimizer, the bf16 and ZeRO-3 optimizers' set-up, ZeRO-1/2's first gradient reduction and a padded
    partition's copy. The import wraps Muon's kernels in torch.compile, which loads the compiler: 0.8 s of every
    rank's start on a CPU, for a run that names another optimizer (the files name AdamW). There, stand-ins answer
    DeepSpeed the same way: nothing is an instance of their MuonWithAuxAdam, and their muon_update, reached only by
    a Muon parameter group, says so if it ever were. `config`: the DeepSpeed config (mends.py applies this only where
    its optimizer is not Muon and DeepSpeed's Muon is not imported yet)."""
    import sys
    import types

    def muon_update(*args, **kwargs):
        raise RuntimeError("a Muon update in a run whose config names another optimizer (mends: muon_only_when_named)")

    def install():
        optimizer, original = types.ModuleType(MUON_MODULES[0]), types.ModuleType(MUON_MODULES[1])
        optimizer.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})  # (never instantiated: no optimizer named it)
        original.muon_update = muon_update
        sys.modules.update(zip(MUON_MODULES, (optimizer, original)))

        def remove():
            for name, module in zip(MUON_MODULES, (optimizer, original)):
                if sys.modules.get(name) is module:
                    del sys.modules[name]
        return remove

    patches.install(MUON_KEY, install)


def muon_in_use(config):
    """Whether the stand-ins would change nothing or get in the way: a config that names Muon, or DeepSpeed's own
    Muon modules imported already (their import cost is paid)."""
    import sys

    named = str(config.get("optimizer", {}).get("type", "")).lower() == "muon"
    return named or any(getattr(sys.modules.get(name), "__file__", None) for name in MUON_MODULES)


def cpu_info_once(config, patches):
    """DeepSpeed asks py-cpuinfo about the CPU three times as it builds the optimizer of an offloaded run (twice for
    CPU Adam's compiler flags, once in the optimizer), on every rank, and py-cpuinfo starts a Python process each time
    (1.2 s of CPU here). The answer does not change while a process runs: each asks once."""
    import functools

    import cpuinfo

    patches.replace(cpuinfo, "get_cpu_info", functools.cache)
