"""The fixes among DeepSpeed's mends: where DeepSpeed 0.19.8 computes something other than single-gpu.py does, or
loads what it should not. Each function mends the one engine it is given (mends.py holds the registry: which engines
each concerns, the versions it was written for, its upstream report, the probe that finds its defect in another
DeepSpeed); docs/deepspeed-upstream.md says what DeepSpeed would need to change for each to go."""
import torch

from .. import checkpoints


def loss_scaler(optimizer):
    """What holds fp16's cur_scale, looked up at each use: ZeRO-0's optimizers keep it in loss_scale_config, ZeRO's
    in loss_scaler, which loading a ZeRO checkpoint replaces."""
    return optimizer.loss_scale_config if hasattr(optimizer, "loss_scale_config") else optimizer.loss_scaler


def adam_starts_at_the_first_step(engine, patches):
    """ZeRO-0 in fp16 or bf16 (fp16/unfused_optimizer.py: torch's AdamW is not DeepSpeed's FusedAdam): its constructor
    takes an optimizer step on zero gradients (initialize_optimizer_states), so Adam's step count starts at 1 (the
    first update 25% short) and weight decay shrinks the fp32 masters once. Undone: Adam's state emptied, the masters
    copied back from the weights they were made from."""
    optimizer = engine.optimizer
    optimizer.optimizer.state.clear()
    for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
        for master, weight in zip(masters, weights):
            master.data.copy_(weight.data)


def fp16_loss_scaled_at_stage0(engine, patches):
    """ZeRO-0 in fp16: engine.backward scales the loss only for ZeRO's optimizers, yet the step divides the gradients
    by the loss scale, so every update is 2^16 times too small and training stalls (DeepSpeed PR #8393, open). The
    loss is scaled here, by the scale the step will divide by."""
    backward, optimizer = engine.backward, engine.optimizer
    engine.backward = lambda loss, **kwargs: backward(loss * loss_scaler(optimizer).cur_scale, **kwargs)


def fp16_grows_after_the_update(engine, patches):
    """fp16 at every stage: a clean step that ends a window (loss_scale_window) grows the scale before it unscales
    the gradients with it, halving that update (and the logged norm). torch's GradScaler grows after the update: so
    does this (the growth is held back until the step returns), and the config's loss_scale_window is one less than
    its growth_interval (DeepSpeed counts one more clean step: zero_config.flag_values)."""
    optimizer = engine.optimizer
    update, step, grown = optimizer._update_scale, optimizer.step, []

    def update_after_the_step(overflow=False):
        scale = loss_scaler(optimizer).cur_scale
        update(overflow)
        if not overflow and loss_scaler(optimizer).cur_scale != scale:  # grown: the gradients still carry `scale`
            grown.append(loss_scaler(optimizer).cur_scale)
            loss_scaler(optimizer).cur_scale = scale

    def step_then_grow(*args, **kwargs):
        done = step(*args, **kwargs)
        if grown:
            loss_scaler(optimizer).cur_scale = grown.pop()
        return done

    optimizer._update_scale, optimizer.step = update_after_the_step, step_then_grow


def fp16_norm_unscaled_at_stage0(engine, patches):
    """ZeRO-0 in fp16 with torch's optimizer (FP16_UnfusedOptimizer) keeps the norm of the scaled gradients as the
    step's gradient norm: the logged norm is 2^16 times too large (DeepSpeed's FusedAdam path divides it itself).
    Divided here by the scale the gradients carried (an overflow's infinite norm stays infinite)."""
    optimizer = engine.optimizer
    step = optimizer.step

    def step_with_the_unscaled_norm(*args, **kwargs):
        scale = loss_scaler(optimizer).cur_scale  # before the step: the scale of this step's gradients
        done = step(*args, **kwargs)
        optimizer._global_grad_norm = optimizer._global_grad_norm / scale
        return done

    optimizer.step = step_with_the_unscaled_norm


def clip_keeps_the_norm_at_stage0(engine, patches):
    """ZeRO-0 in fp32 (and in bf16 under torch_autocast) clips with runtime/utils.py's clip_grad_norm_ and drops the
    norm it returns, so the engine reports none (get_global_grad_norm: None). Clipped as single-gpu.py does (torch's
    clip_grad_norm_ over all gradients at once: the same norm and coefficient, one foreach norm rather than one a
    parameter) and the norm kept where the engine reads it after each step (optimizer._global_grad_norm). With
    sequence parallelism (an mpu) DeepSpeed's own clip, which knows its groups, still keeps its norm."""
    from deepspeed.runtime.utils import clip_grad_norm_

    optimizer, parameters = engine.optimizer, list(engine.module.parameters())

    def clip_and_keep():
        with_grads = [p for p in parameters if p.grad is not None]
        optimizer._global_grad_norm = torch.nn.utils.clip_grad_norm_(with_grads, engine.gradient_clipping()) \
            if engine.mpu is None else clip_grad_norm_(with_grads, engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_and_keep


def checkpoints_load_no_code(engine, patches):
    """DeepSpeed's checkpoint engine loads every file with torch.load(weights_only=False): a checkpoint folder copied
    from elsewhere could run a command as it loads. load_checkpoint reads them as checkpoints.load does (tensors,
    numbers, strings, DeepSpeed's few types), or refuses the file in one line."""
    load_checkpoint = engine.load_checkpoint

    def load_checkpoint_safely(*args, **kwargs):
        with checkpoints.loading_safely():
            return load_checkpoint(*args, **kwargs)

    engine.load_checkpoint = load_checkpoint_safely


def universal_load_keeps_steps_and_groups(engine, patches):
    """DeepSpeed's universal load (a checkpoint another number of ranks wrote) sets the optimizer's state directly
    from files loaded onto the CPU: each parameter's AdamW `step` stays on the CPU where a fused AdamW on a GPU
    reads it on the device (an illegal memory access at the first step), and under ZeRO-3 every parameter shares one
    `step` tensor (AdamW would advance it once per parameter) and every parameter group takes the first group's
    settings (weight decay on biases and norms: stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3).
    After such a load: each `step` its own tensor where torch reads it, each group's weight decay as it was (the
    groups differ in nothing else: training.param_groups)."""
    load_checkpoint = engine.load_checkpoint

    def load_checkpoint_then_repair(*args, **kwargs):
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer inside ZeRO's
        decays = [group.get("weight_decay") for group in inner.param_groups]
        loaded = load_checkpoint(*args, **kwargs)
        if engine.load_universal_checkpoint():
            place_optimizer_steps(inner)
            for group, decay in zip(inner.param_groups, decays):
                group["weight_decay"] = decay
        return loaded

    engine.load_checkpoint = load_checkpoint_then_repair


def place_optimizer_steps(optimizer):
    """Each parameter's AdamW `step` where torch reads it: a fused (or capturable) AdamW on the parameter's device, in
    float32, another one on the CPU (as torch's own load_state_dict places it), and one tensor per parameter."""
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for param, state in optimizer.state.items():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(param.device if on_device else "cpu", torch.float32, copy=True)
