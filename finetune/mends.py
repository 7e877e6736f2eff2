"""What DeepSpeed 0.19.8 gets wrong, or makes slow, where single-gpu.py is right, mended after deepspeed.initialize
(mend) and after a universal checkpoint's load (place_optimizer_steps). Each mend reaches into DeepSpeed's private
attributes: check_version refuses another DeepSpeed in one line before the engine is built, rather than mend the
wrong thing silently. What each costs or saves, counted: bench/host_cost.py, docs/gpu.md."""
import itertools
import math

import torch

from . import checkpoints
from .base import fail

MENDED_VERSION = "0.19.8"  # the DeepSpeed whose private attributes these mends were written against


def check_version(version):
    """The mends reach into DeepSpeed's private attributes: on another version they could mend the wrong thing
    silently. One line instead, before the engine is built (zero_config.deepspeed_config asks)."""
    if version != MENDED_VERSION:
        fail(f"finetune/mends.py mends DeepSpeed {MENDED_VERSION} and this is DeepSpeed {version}: install "
             f"deepspeed=={MENDED_VERSION} (requirements.txt), or read finetune/mends.py against the new version's "
             f"source and update MENDED_VERSION")


def mend(engine):
    """Mend, after deepspeed.initialize, what DeepSpeed 0.19.8 gets wrong or makes slow where single-gpu.py is right:
    - ZeRO-0 in fp32 (and in bf16 under torch_autocast) clips with runtime/utils.py's clip_grad_norm_, a norm and a
      multiplication per parameter, and drops the norm it returns (and computes none without clipping): clip as
      single-gpu.py does (torch's, over all gradients at once: the same norm and coefficient), and keep the norm for
      results.json. With sequence parallelism (an mpu) DeepSpeed's own, which knows its groups.
    - ZeRO-0 on one rank all-reduces the gradients with itself: all of them flattened into one buffer, then each
      copied back (two copies of every gradient a step). There is no other rank: no reduction. On more ranks the
      copies back are one foreach copy, not a copy per parameter.
    - ZeRO-0 in fp16 or bf16 (fp16/unfused_optimizer.py: torch's AdamW is not DeepSpeed's FusedAdam): its constructor
      takes an optimizer step on zero gradients (initialize_optimizer_states), so Adam's step count starts at 1 (the
      first update 25% short) and weight decay shrinks the fp32 masters once. Undo it.
    - ZeRO-0 in fp16: engine.backward scales the loss only for ZeRO's optimizers, yet the step divides the gradients
      by the loss scale, so every update is 2^16 times too small and training stalls (DeepSpeed PR #8393, open).
      Scale it here; keep the norm unscaled.
    - Loading a checkpoint runs whatever its pickles hold (DeepSpeed's checkpoint engine loads with
      weights_only=False): load_checkpoint reads them as checkpoints.load does, or refuses the file in one line.
    - fp16 at every stage: a clean step that ends a window grows the scale before it unscales the gradients with it,
      halving that update (and ZeRO-3's logged norm). torch's GradScaler grows after the update: so does this, and
      the config's loss_scale_window is one less than its growth_interval (DeepSpeed counts one more clean step).
    - ZeRO-1/2 point every parameter anew at its slice of the flat 16-bit buffer after each step (4 operations a
      parameter), where they already are: repoint_only_when_moved.
    - ZeRO-1/2 on one rank all-reduce the gradients with themselves: reduce_nothing_alone.
    - ZeRO-0 walks the module tree for its parameters at every step, to clip and to drop the gradients: a list, once.
    - ZeRO-3's step copies the gradients twice and points the shards anew where they already are:
      zero3_step_in_place.
    - ZeRO-3 on one GPU drains the CUDA stream at every layer's fetch: fetch_alone_without_waiting.
    - ZeRO-3 walks a layer's module tree for its parameters at every fetch and release: keep_parameter_lists.
    - NVTX ranges around DeepSpeed's functions, and ZeRO-3's debug messages: quiet_instrumentation."""
    import deepspeed.comm as dist
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.utils import clip_grad_norm_

    optimizer = engine.optimizer
    stage0 = not isinstance(optimizer, ZeROOptimizer)
    if isinstance(optimizer, FP16_UnfusedOptimizer):  # ZeRO-0 in fp16 or bf16
        optimizer.optimizer.state.clear()  # Adam's state begins at the first real step
        for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            for master, weight in zip(masters, weights):
                master.data.copy_(weight.data)  # as before that zero-gradient step's weight decay
    # the module's parameters, once: engine.py walks the module tree for them at every step (1,900 Python calls for
    # OPT-125m's 196 tensors), to clip and then to set each gradient to None
    module_parameters = list(engine.module.parameters()) if stage0 else []
    if stage0 and not engine.fp16_enabled() and not engine.bfloat16_enabled():  # engine.zero_grad's callers
        def zero_grad():
            for param in module_parameters:
                param.grad = None

        engine.zero_grad = zero_grad
    if engine.fp16_enabled():
        # what holds cur_scale, looked up at each use: loading a ZeRO checkpoint replaces the loss_scaler object
        scaler = lambda: optimizer.loss_scale_config if stage0 else optimizer.loss_scaler
        update, step, backward, grown = optimizer._update_scale, optimizer.step, engine.backward, []

        def update_after_the_step(overflow=False):
            scale = scaler().cur_scale
            update(overflow)
            if not overflow and scaler().cur_scale != scale:  # grown: this step's gradients still carry `scale`
                grown.append(scaler().cur_scale)
                scaler().cur_scale = scale

        def step_then_grow(*args, **kwargs):
            done = step(*args, **kwargs)
            if isinstance(optimizer, FP16_UnfusedOptimizer):  # (DeepSpeed's FusedAdam path unscales it itself)
                optimizer._global_grad_norm = optimizer._global_grad_norm / scaler().cur_scale
            if grown:
                scaler().cur_scale = grown.pop()
            return done

        optimizer._update_scale, optimizer.step = update_after_the_step, step_then_grow
        if stage0:
            engine.backward = lambda loss, **kwargs: backward(loss * scaler().cur_scale, **kwargs)
    elif stage0 and not engine.bfloat16_enabled():
        def clip_and_keep():  # the engine reads optimizer._global_grad_norm after each step (engine.py)
            parameters = [p for p in module_parameters if p.grad is not None]
            optimizer._global_grad_norm = torch.nn.utils.clip_grad_norm_(parameters, engine.gradient_clipping()) \
                if engine.mpu is None else clip_grad_norm_(parameters, engine.gradient_clipping(), mpu=engine.mpu)

        engine.clip_fp32_gradients = clip_and_keep
    if stage0 and engine.dp_world_size == 1 and engine.mpu is None:
        engine.enable_backward_allreduce = False  # engine._backward_epilogue: no allreduce_gradients()
    elif stage0:
        def allreduce_and_copy(small_bucket, dp_group, dp_world_size=None):  # engine.py's, the copies at once
            reduced = engine.allreduce_bucket(small_bucket, dp_group, dp_world_size)
            torch._foreach_copy_(small_bucket, engine.unflatten(reduced, small_bucket))

        engine.allreduce_and_copy = allreduce_and_copy
    quiet_instrumentation()
    load_checkpoint = engine.load_checkpoint

    def load_checkpoint_safely(*args, **kwargs):  # DeepSpeed's checkpoint engine loads with weights_only=False
        with checkpoints.loading_safely():
            return load_checkpoint(*args, **kwargs)

    engine.load_checkpoint = load_checkpoint_safely
    if hasattr(optimizer, "_update_model_bit16_weights"):  # ZeRO-1/2's (not ZeRO-3's, nor BF16_Optimizer's)
        repoint_only_when_moved(optimizer)
    if hasattr(optimizer, "_unflatten_partitioned_parameters"):  # ZeRO-3's
        zero3_step_in_place(optimizer)
        fetch_alone_without_waiting()
        keep_parameter_lists()
    if not stage0 and engine.mpu is None and not engine.has_moe_layers:
        if not engine.zero_optimization_partition_weights() and optimizer.dp_process_group is not None \
                and dist.get_world_size(group=optimizer.dp_process_group) == 1:  # ZeRO-1/2 on one rank (ZeRO-3's
            reduce_nothing_alone(optimizer)  # allreduce_and_copy is another function, with other arguments)
        norm_at_once(optimizer)
        if not engine.zero_optimization_partition_weights() and not optimizer.cpu_offload:
            clip_without_a_read(optimizer)


MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def muon_only_when_named(optimizer_type):
    """DeepSpeed imports its Muon optimizer wherever it asks whether the optimizer is Muon: the engine's check of a
    ZeRO optimizer, the bf16 and ZeRO-3 optimizers' set-up, ZeRO-1/2's first gradient reduction and a padded
    partition's copy. The import wraps Muon's kernels in torch.compile, which loads the compiler: 0.8 s of every
    rank's start on a CPU, for a run that names another optimizer (the files name AdamW). There, stand-ins answer
    DeepSpeed the same way: nothing is an instance of their MuonWithAuxAdam, and their muon_update, reached only by
    a Muon parameter group, says so if it ever were. A config whose optimizer is Muon gets DeepSpeed's own."""
    import sys
    import types

    stand_ins = [sys.modules.get(name) for name in MUON_MODULES]
    if optimizer_type.lower() == "muon":
        for name, module in zip(MUON_MODULES, stand_ins):
            if getattr(module, "stand_in", False):
                del sys.modules[name]
        return
    if any(module is not None for module in stand_ins):  # imported already, or stood in for: nothing to save
        return

    def muon_update(*args, **kwargs):
        raise RuntimeError("a Muon update in a run whose config names another optimizer (mends.muon_only_when_named)")

    optimizer, original = types.ModuleType(MUON_MODULES[0]), types.ModuleType(MUON_MODULES[1])
    optimizer.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})  # (never instantiated: no optimizer named it)
    original.muon_update = muon_update
    optimizer.stand_in = original.stand_in = True
    sys.modules.update(zip(MUON_MODULES, (optimizer, original)))


def quiet_instrumentation():
    """DeepSpeed wraps its engine's and ZeRO-3's per-module functions (fetch, release, reduce: 1,534 calls a step for
    OPT-125m) in an NVTX range for the profiler's timeline: 6 Python calls each around the work, and on a GPU a push
    and a pop into CUDA's NVTX library, whether a profiler listens or not. Off, as DeepSpeed turns it off under
    torch.compile (engine.py); to see the ranges in an Nsight Systems timeline, set
    deepspeed.utils.nvtx.enable_nvtx = True after mends.mend. ZeRO-3 prints its debug messages through functions
    that ask the process group for the rank before they look whether there is anything to print (12,000 calls a
    step, for messages never printed): they look first."""
    import deepspeed.utils.nvtx
    from deepspeed.runtime.zero import parameter_offload, partition_parameters, partitioned_param_coordinator, stage3

    deepspeed.utils.nvtx.enable_nvtx = False
    # stage3.py has its own; the others took partition_parameters' by `import *`
    for module in (partition_parameters, partitioned_param_coordinator, parameter_offload, stage3):
        print_rank_0 = module.print_rank_0
        if not getattr(print_rank_0, "mended", False):
            module.print_rank_0 = print_when_asked(print_rank_0)


def print_when_asked(print_rank_0):
    def print_rank_0_when_asked(message, debug=False, force=False):
        if debug or force:
            print_rank_0(message, debug, force)

    print_rank_0_when_asked.mended = True
    return print_rank_0_when_asked


def repoint_only_when_moved(optimizer):
    """ZeRO-1/2's step ends by setting each parameter's data to its slice of the group's flat 16-bit buffer
    (stage_1_and_2.py, _update_model_bit16_weights, "TODO: we probably don't need this? just to be safe"): a narrow, a
    view and two data swaps a parameter, 784 operations a step for OPT-125m's 196 tensors. The all-gather before it
    wrote into that buffer in place, so each parameter still views its slice. Here the slices are compared by address
    and shape on the host (no tensor operation); only a group where one has moved (a loaded checkpoint, say) is
    pointed anew, by DeepSpeed's own code."""
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


def reduce_nothing_alone(optimizer):
    """ZeRO-1/2 on one rank (zero_config.tuned_values leaves contiguous_gradients off there) reduce the gradients
    with themselves: each bucket flattened into a new buffer, divided by 1, all-reduced in a group of one, and every
    gradient copied back out of it (stage_1_and_2.py, allreduce_and_copy: 4 operations a parameter, 784 a step for
    OPT-125m's 196 tensors). Each gradient already is what that gives (DeepSpeed's pass through a narrower
    communication_data_type would only round it), so nothing is done; where the reduced gradients also feed the
    separate fp32 partition buffer (an output_bucket), DeepSpeed's own code runs."""
    import deepspeed.comm as dist

    original = optimizer.allreduce_and_copy

    def allreduce_and_copy(small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None):
        if any(output is not None for output in output_bucket or ()) or (
                process_group is not None and dist.get_world_size(group=process_group) != 1):
            return original(small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                            process_group=process_group, output_bucket=output_bucket)

    optimizer.allreduce_and_copy = allreduce_and_copy


def zero3_step_in_place(optimizer):
    """ZeRO-3's step, per parameter group: the gradient partitions flattened into a new buffer and that converted to
    fp32 (stage3.py, _prepare_fp32_grad_for_sub_group: a view and a copy a parameter, then a second copy of them
    all), and after the update each 16-bit shard pointed anew at its slice of the flat buffer the update was just
    copied into (_unflatten_partitioned_parameters: 3 operations a parameter). The partitions already lie one after
    the other in DeepSpeed's gradient buffer, and the shards already view their slices: the same fp32 copy is made
    from that buffer at once, and the shards are left where they are; both compared by address on the host, DeepSpeed's
    own code where they do not lie so."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
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


def fetch_alone_without_waiting():
    """ZeRO-3 on one rank (a partition of one) gathers nothing: a fetch points each parameter at its shard on the
    device (partition_parameters.py, NoGatherHandle and NoGatherCoalescedHandle: the shard's .to(device), no copy
    where it is there already), and then waits for the whole current CUDA stream to drain
    (current_stream().synchronize()) before the layer may run: a device sync for every layer forward and backward
    (the H100 profiled 16 a step at OPT-125m's shape, 21 at Llama-3.2-1B's), with the GPU idle until the host has
    launched the next layer. Only a copy from the host (parameters offloaded to the CPU) needs that wait: it stays
    where a shard is elsewhere (fetch_waits decides)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as zp

    def waiting_only_behind_a_copy(original, params, complete):  # the handle's wait; its private attributes' names
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

        wait.mended = True
        return wait

    for handle, params in ((zp.NoGatherHandle, "_NoGatherHandle__param"),
                           (zp.NoGatherCoalescedHandle, "_NoGatherCoalescedHandle__params")):
        if not getattr(handle.wait, "mended", False):
            handle.wait = waiting_only_behind_a_copy(handle.wait, params, f"_{handle.__name__}__complete")


def keep_parameter_lists():
    """ZeRO-3 asks a module for its parameters at every fetch and release (partitioned_param_coordinator.py,
    iter_params: named_parameters() walks a transformer layer's module tree, about 25 Python calls each time, 10,000 a
    step for OPT-125m's 12 layers). The lists are kept on each module instead (a deep copy of a module copies its
    list with its parameters), made anew after any module anywhere registers a parameter or a submodule (torch's
    global registration hooks); the parameters registered with DeepSpeed as external to a module are read at each
    call, as there."""
    import operator

    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    if getattr(partitioned_param_coordinator.iter_params, "mended", False):
        return
    registrations = [0]  # how many registrations torch has seen: a list kept before the last one is stale

    def registered(module, name, value):  # (returns None: the parameter or module registered as it is)
        registrations[0] += 1

    torch.nn.modules.module.register_module_parameter_registration_hook(registered)
    torch.nn.modules.module.register_module_module_registration_hook(registered)

    def iter_params(module, recurse=False):
        kept = module.__dict__.get("_finetune_parameters")
        if kept is None or kept[0] != registrations[0]:
            kept = module.__dict__["_finetune_parameters"] = (registrations[0], {})
        params = kept[1].get(recurse)
        if params is None:
            params = kept[1][recurse] = tuple(p for _, p in module.named_parameters(recurse=recurse))
        external = module.__dict__.get("ds_external_parameters")
        return params if external is None else itertools.chain(params, map(operator.itemgetter(1), external()))

    iter_params.mended = True
    partitioned_param_coordinator.iter_params = parameter_offload.iter_params = iter_params


def fetch_waits(shard_devices, device, resolves_data_dependency):
    """Whether a one-rank ZeRO-3 fetch must wait for the device: only where a shard lies elsewhere (the CPU, under
    parameter offload) and its copy to the device may still be running (a device that does not resolve data
    dependencies: CUDA's streams; DeepSpeed's CPU accelerator does)."""
    return not resolves_data_dependency and any(d != device for d in shard_devices)


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


def norm_at_once(optimizer):
    """ZeRO 1-3 take the gradients' norm (for clipping, and reported) one parameter at a time: each gradient copied to
    fp64, its norm, a pow, then a stack and a sum (stage_1_and_2.py and stage3.py, get_grad_norm_direct): 4 operations
    a parameter, 800 a step for OPT-125m's 196 tensors, and an fp64 copy of the largest gradient. Here: one foreach
    norm over all of a rank's gradients, accumulated in fp32 as single-gpu.py's clip_grad_norm_ does, the squares
    summed over the ranks (the same all-reduce), an invalid norm still DeepSpeed's -1. Not with CPU offload (its norm
    is taken in the backward pass, on the CPU) nor the infinity norm."""
    import deepspeed.comm as dist

    original = optimizer.get_grad_norm_direct
    offloaded = getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "cpu_offload", False)
    if offloaded:
        return

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


def clip_without_a_read(optimizer):
    """ZeRO-1/2 clip the gradients after asking whether the norm is valid with a bool on the host
    (stage_1_and_2.py, unscale_and_clip_grads: a device sync, once per parameter group and step, whether or not the
    step would clip). The same coefficient on the device: an invalid norm (inf, NaN, DeepSpeed's -1) clips to zero, as
    there."""
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


def place_optimizer_steps(optimizer):
    """Each parameter's AdamW `step` where torch reads it: a fused (or capturable) AdamW on the parameter's device, in
    float32, another one on the CPU (as torch's own load_state_dict places it). DeepSpeed's universal load sets the
    state directly, from files loaded onto the CPU (ds_to_universal; base_optimizer.py for ZeRO-1/2, stage3.py), so
    the fused AdamW on a GPU would read a CPU `step` at the first step (an illegal memory access). And one tensor per
    parameter: ZeRO-3's load gives them all the same one, which AdamW would then advance once per group and step."""
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for param, state in optimizer.state.items():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(param.device if on_device else "cpu", torch.float32, copy=True)
