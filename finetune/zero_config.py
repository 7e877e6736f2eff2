"""The DeepSpeed config a run trains with, made from the JSON file (--deepspeed) and the flags, as the HF Trainer
fills "auto": read it, lay the flags that override it over it (--zero-stage, --offload, --sequence-parallel), check
what cannot run, shape it to the model (ZeRO-3's layers as leaves, NVMe swap buffers, the optimizer nothing has to
compile), fill every "auto" from the flags and check the rest against them. zero-optimization.py and
sequence_classification.py take it; what runs with the engine is zero.py's."""
import json
import math
from pathlib import Path

import torch

from . import hardware, quantization
from .base import ROOT, fail
from .internals import mends
from .internals import sequence_parallel as finetune_sp
from .training import ADAM_BETAS, ADAM_EPS, FP16_SCALER

DEFAULT_CONFIG = ROOT / "ds_config_zero3.json"


# ----------------------------------------------------------------------------------------------------
# The DeepSpeed config: "auto" means "from the flags", like the HF Trainer

def deepspeed_config(flags, world_size, total_steps, warmup_steps, model_config):
    """The config deepspeed.initialize takes, in the steps the module's docstring names. `flags`: the run's Config
    (flags.py), its precision and learning rate resolved; `model_config`: the model's (transformers')."""
    path = flags.zero.deepspeed
    config = overridden(read_config(path), flags.zero, flags.sequence_parallel)
    check(config, path, flags, world_size, model_config)
    layer_params = shaped(config, path, flags.model, world_size, model_config)
    fill(config, path, flag_values(config, flags, model_config, world_size=world_size, total_steps=total_steps,
                                   warmup_steps=warmup_steps, layer_params=layer_params))
    mends.before_engine(config, flags.zero.mends)  # what the engine imports and asks as it is built (--mends)
    return config


def overridden(config, zero_flags, sequence_parallel):
    """The file's config under the flags that override it: --zero-stage, --offload (--nvme-path), and
    --sequence-parallel (for zero.Init too, which reads this dict without the process groups)."""
    zero = config.setdefault("zero_optimization", {})
    if zero_flags.zero_stage is not None:
        zero["stage"] = zero_flags.zero_stage
    if sequence_parallel > 1:  # an SP group is one data-parallel replica: DeepSpeed counts the batch per replica
        config["sequence_parallel_size"] = sequence_parallel
    if zero_flags.offload is not None:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": zero_flags.offload}
        if zero_flags.offload == "nvme":
            zero["offload_optimizer"]["nvme_path"] = zero_flags.nvme_path
        if zero.get("stage") == 3:  # stage 3 can offload the parameters too (the file's other offload_param keys kept)
            where = {k: v for k, v in zero["offload_optimizer"].items() if k in ("device", "nvme_path")}
            zero["offload_param"] = {**zero.get("offload_param", {}), **where}
        else:
            zero.pop("offload_param", None)
    return config


def check(config, path, flags, world_size, model_config):
    """One line for what cannot run: sequence parallelism the model or the file cannot take, NVMe offload below stage
    3, 8 bits sharded by ZeRO-3, a 16-bit precision the accelerator lacks."""
    zero, sp = config["zero_optimization"], flags.sequence_parallel
    if sp > 1:
        text = hardware.text_config(model_config)
        finetune_sp.check(sp, world_size, heads=text.num_attention_heads,
                          kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                          implementation=model_config._attn_implementation or "sdpa", model=type(model_config).__name__)
        if zero.get("stage") == 3 and zero.get("reduce_scatter", True) is not True:
            fail(f"{path}: --sequence-parallel needs zero_optimization.reduce_scatter true at stage 3 (without it the "
                 f"engine averages the gradients over another number of ranks bucket by bucket); remove it")
    check_offload(zero)
    quantization.check(flags.model, zero.get("stage"))  # 8 bits cannot be sharded
    from deepspeed.accelerator import get_accelerator
    check_precision(flags.model.precision, get_accelerator())


def shaped(config, path, model, world_size, model_config):
    """What the config takes from the model and the machine: NVMe swap buffers that hold its largest shard, ZeRO-3's
    transformer layers as leaves and torch's linear layers, the optimizer nothing has to compile, ZeRO-0's bf16 as
    torch's autocast (autocast_at_stage0). `model`: flags.Model. The largest layer's parameters (ZeRO-3's buckets),
    or None."""
    zero = config["zero_optimization"]
    if zero.get("offload_param", {}).get("device") == "nvme":
        size_swap_buffers(config, path, largest_parameter(model_config), world_size,
                          4 if model.precision in ("fp32", "tf32") else 2)
    layer_params = None  # ZeRO-3: its transformer layers gathered and reduced whole (zero3_layers)
    if zero.get("stage") == 3:
        classes, layer_params = zero3_layers(meta_model(model_config), whole_layers=not model.lora_rank)
        zero.setdefault("leaf_module", {"classes": classes})  # the file's own list wins
        # torch's linear, not DeepSpeed's autograd Function for it: the same tensors saved for backward, but torch binds
        # that Function's arguments through inspect.signature at every call (6,500 Python calls a step at OPT-125m's
        # 72 linear layers) and it launches 144 more kernels a step. The file's own choice wins
        zero.setdefault("memory_efficient_linear", False)
    choose_optimizer(config, torch.cuda.is_available())
    autocast_at_stage0(config, model.precision, zero.get("stage", 0), path)
    return layer_params


def flag_values(config, flags, model_config, *, world_size, total_steps, warmup_steps, layer_params):
    """(key in the JSON, the value the flags give it, the flag an error names) for every key "auto" may stand for."""
    train, precision, sp = flags.train, flags.model.precision, flags.sequence_parallel
    zero = config["zero_optimization"]
    engine_bf16 = precision == "bf16" and not (config.get("torch_autocast") or {}).get("enabled")
    return [
        ("train_micro_batch_size_per_gpu", train.batch_size, "--batch-size"),
        ("gradient_accumulation_steps", train.grad_accum, "--grad-accum"),
        ("train_batch_size", train.batch_size * train.grad_accum * world_size // sp,
         f"--batch-size x --grad-accum x {world_size // sp} {'ranks' if sp == 1 else 'replicas'}"),
        ("gradient_clipping", train.max_grad_norm, "--max-grad-norm"),
        ("optimizer.params.lr", train.lr, "--lr"),
        ("optimizer.params.betas", list(ADAM_BETAS), "ADAM_BETAS"),
        ("optimizer.params.eps", ADAM_EPS, "ADAM_EPS"),
        ("optimizer.params.weight_decay", train.weight_decay, "--weight-decay"),
        ("scheduler.params.warmup_min_lr", 0.0, "--lr"),
        ("scheduler.params.warmup_max_lr", train.lr, "--lr"),
        ("scheduler.params.warmup_num_steps", warmup_steps, "--warmup-ratio"),
        ("scheduler.params.total_num_steps", total_steps, "--epochs/--max-steps"),
        ("bf16.enabled", engine_bf16, "--precision"),
        ("fp16.enabled", precision == "fp16", "--precision"),
        # the loss scale of single-gpu.py's GradScaler (training.FP16_SCALER), so the pair skips the same steps
        ("fp16.initial_scale_power", int(math.log2(FP16_SCALER["init_scale"])), "training.FP16_SCALER"),
        ("fp16.loss_scale_window", FP16_SCALER["growth_interval"] - 1,
         "training.FP16_SCALER's growth_interval - 1 (DeepSpeed grows the scale one clean step later than torch)"),
        ("fp16.hysteresis", 1, "torch's GradScaler (no hysteresis)"),
    ] + [(f"zero_optimization.{key}", value, None)
         for key, value in tuned_values(zero.get("stage", 0), model_config.hidden_size, torch.cuda.is_available(),
                                        world_size, layer_params).items()]


def fill(config, path, values):
    """Every "auto" filled from `values`; a value the file sets otherwise than a flag, an "auto" no flag fills, and a
    zero_optimization section DeepSpeed would refuse: one line each."""
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        config.setdefault(key, "auto")  # the loop needs these three to be what the flags say
    mismatches = []
    for dotted, value, flag in values:
        *parents, key = dotted.split(".")
        node = config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if not isinstance(node, dict) or key not in node:
            continue
        if node[key] == "auto":
            node[key] = value
        elif flag is not None and node[key] != value:
            mismatches.append(f"{dotted}={node[key]} vs {flag} = {value}")
    if mismatches:
        fail(f"{path} disagrees with the flags: {'; '.join(mismatches)}. Set those keys to \"auto\" or change the "
             f"flags")
    leftover = [k for k, v in _walk(config) if v == "auto"]
    if leftover:
        fail(f"{path}: no flag fills {', '.join(leftover)}; give them values")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError
    try:  # typos here would otherwise surface as a traceback inside deepspeed.initialize
        DeepSpeedZeroConfig(**config["zero_optimization"])
    except ValidationError as e:
        error = e.errors()[0]
        fail(f"{path}: zero_optimization.{'.'.join(map(str, error['loc']))}: {error['msg']}; fix or remove it")


def read_config(path):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        fail(f"DeepSpeed config {path} does not exist; pass --deepspeed with a JSON file")
    except json.JSONDecodeError as e:
        fail(f"DeepSpeed config {path} is not valid JSON ({e}); fix the file")


LARGEST_BUCKET = int(5e8)  # elements: DeepSpeed's own default bucket (1 GB in 16 bits), the most "auto" gives one


def tuned_values(stage, hidden_size, cuda, world_size, layer_params=None):
    """The zero_optimization values that no flag sets, for "auto". ZeRO-1/2's reduce buckets: hidden^2 elements, but
    at least 2.5e7 (fewer, larger collectives). ZeRO-3 with its transformer layers as leaves (layer_params: the
    largest layer's parameters, zero3_layers): a layer's parameters gathered in one collective, the next layer's
    prefetched while this one computes, a layer's gradients reduced in one, and no parameter kept whole outside
    its layer (persistent parameters cost a collective each after every step, stage3.py's _post_step); without
    leaves, the HF Trainer's rule from the hidden size (a weight matrix a collective). overlap_comm (which holds the
    buckets twice) pays on GPUs only, where it runs the reductions on a side CUDA stream, and only where there is a
    reduction to overlap: on one GPU it would only wait for the side stream after every backward. ZeRO-1/2's
    contiguous_gradients copies each gradient into a reduce bucket and again into the rank's gradient partition as
    autograd makes it (11 operations a parameter): on one rank there is nothing to reduce (mends: reduce_nothing_alone),
    so the gradients stay where autograd put them, as in single-gpu.py (its memory behaviour too)."""
    square = hidden_size * hidden_size
    bucket = square if stage == 3 else max(square, int(2.5e7))
    values = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket, "overlap_comm": cuda and world_size > 1,
              "contiguous_gradients": stage == 3 or world_size > 1,
              "stage3_prefetch_bucket_size": int(0.9 * square), "stage3_param_persistence_threshold": 10 * hidden_size}
    if stage == 3 and layer_params:
        values.update(reduce_bucket_size=min(max(square, layer_params), LARGEST_BUCKET),
                      stage3_prefetch_bucket_size=min(layer_params, LARGEST_BUCKET),
                      stage3_param_persistence_threshold=0)
    return values


def autocast_at_stage0(config, precision, stage, path):
    """Whether the engine trains in bf16 as single-gpu.py does: torch's autocast over fp32 weights, with the optimizer
    the config names (torch's fused AdamW). At ZeRO-0 DeepSpeed's own bf16 (bf16.enabled) takes its unfused 16-bit
    optimizer instead (fp16/unfused_optimizer.py): per parameter an overflow check that reads a value on the host (a
    device sync each: 196 a step for OPT-125m), a norm, an fp32 gradient copy and a copy back, 3.5x single-gpu.py's
    operations a step; and it rounds the weights to bf16, where autocast keeps them fp32 (the same memory: 2-byte
    weights beside 4-byte masters against 4-byte weights). So at ZeRO-0, --precision bf16 sets torch_autocast where the
    file leaves both "auto" (or lacks them), and the script's own forward runs under it too; ZeRO-1/2/3 shard the
    16-bit copies, which autocast would make 32-bit: they keep DeepSpeed's bf16. A file's explicit choice is kept."""
    section = config.get("torch_autocast")
    engine_bf16 = config.get("bf16", {}).get("enabled", "auto")
    if section is None and precision == "bf16" and stage == 0 and engine_bf16 == "auto":
        config["torch_autocast"] = section = {"enabled": True, "dtype": "bfloat16"}
    enabled = bool(section and section.get("enabled"))
    if enabled and str(section.get("dtype")).removeprefix("torch.") not in ({"bf16", "bfloat16"} if precision == "bf16"
                                                                          else {"fp16", "float16", "half"}):
        fail(f"{path}: torch_autocast autocasts to {section.get('dtype')} but --precision is {precision}; remove the "
             f"torch_autocast section or change --precision")
    return enabled


_META_MODELS = {}  # meta_model's, by config: the config asks for it twice (leaves, NVMe buffers), a 70B takes seconds


def meta_model(model_config):
    """The model's structure without its storage (the meta device): built in a moment, whatever its size."""
    from transformers import AutoModelForCausalLM
    key = model_config.to_json_string()
    if key not in _META_MODELS:
        with torch.device("meta"):
            _META_MODELS[key] = AutoModelForCausalLM.from_config(model_config)
    return _META_MODELS[key]


def largest_parameter(model_config):
    """The elements of the model's largest parameter (at most models: the embedding), counted on the meta device."""
    return max(p.numel() for p in meta_model(model_config).parameters())


def zero3_layers(model, whole_layers=True):
    """(the classes ZeRO-3 takes as leaves, the parameters of the largest module of them, or None). ZeRO-3 gathers a
    leaf module's parameters in one collective when it enters it, and releases them when it leaves, rather than a
    collective for each of its linear layers and norms through a hook on each (zero_optimization.leaf_module): the
    model's transformer layers (transformers' _no_split_modules: what must stay on one device), and a mixture of
    experts' blocks (moe_blocks). Counted (bench/host_cost.py, OPT's shape, 2 ranks): 343 collectives a step for 12
    layers, 30 with its layers as leaves and the buckets sized to a layer. Not the layers under LoRA (whole_layers
    False): the first layer's input, the frozen embedding's output, needs no gradient, so torch fires the layer's
    backward hook as soon as its output's gradient is there, and DeepSpeed 0.19.8 releases the layer's parameters
    before the adapters' gradients are accumulated into them (a size mismatch in AccumulateGrad)."""
    layers = set(getattr(model, "_no_split_modules", None) or []) if whole_layers else set()
    sizes = {}
    for module in model.modules():
        if type(module).__name__ in layers:
            sizes[type(module).__name__] = max(sizes.get(type(module).__name__, 0),
                                               sum(p.numel() for p in module.parameters()))
    classes = list(sizes) + [name for name in (moe_blocks(model) if hardware.experts_per_token(model.config)[0]
                                               else []) if name not in sizes]
    return classes, max(sizes.values(), default=None)


def moe_blocks(model):
    """The classes of a mixture of experts' blocks (the router and the experts), by their structure: a module with a
    child that holds the experts' fused weights (experts x in x out). ZeRO-3 gathers a leaf module's parameters at
    once when it enters it, rather than through a hook for each of its children
    (zero_optimization.leaf_module). DeepSpeed 0.19.8 names Mixtral's, Qwen2-MoE's and Qwen3-MoE's blocks by default;
    this finds the others' (OLMoE, gpt-oss, ...) too. A model whose experts are separate modules needs its block
    named in the config file's "leaf_module" (it wins over this): then ranks that route to different experts would
    run different submodules, which ZeRO-3's prefetching cannot follow (it hangs or fetches them one by one)."""
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    experts = hardware.experts_per_token(model.config)[0]
    found = []
    for module in model.modules():
        fused = any(len(p.shape) == 3 and p.shape[0] == experts for child in module.children()
                    for p in child.parameters(recurse=False))
        if fused and type(module).__name__ not in found:
            found.append(type(module).__name__)
    return list(DEFAULT_LEAF_MODULE_CLASSES) + found


def swap_buffer_elements(largest, world_size, bytes_per_element, intra_op_parallelism=1):
    """ZeRO-3 + NVMe swaps each rank's shard of a parameter (ceil(numel / ranks) elements) through one of
    offload_param.buffer_count pinned buffers of buffer_size elements each, and refuses a larger shard
    (runtime/swap_tensor/partitioned_param_swapper.py: "More elements N than buffer size"). DeepSpeed's default, 1e8
    elements, is smaller than OPT-1.3B's or Llama-2-7B's embedding. The size that fits the largest shard, rounded up to
    the I/O alignment DeepSpeed pads each buffer to (1024 bytes per intra-op thread), so none is wasted."""
    align = 1024 * intra_op_parallelism // bytes_per_element
    return math.ceil(math.ceil(largest / world_size) / align) * align


def size_swap_buffers(config, path, largest, world_size, bytes_per_element):
    """offload_param.buffer_size from the model ("auto" or absent); a size set in the file that is too small is an
    error here rather than an assertion while the model loads."""
    section = config["zero_optimization"]["offload_param"]
    needed = swap_buffer_elements(largest, world_size, bytes_per_element,
                                  config.get("aio", {}).get("intra_op_parallelism", 1))
    given = section.get("buffer_size", "auto")
    if given == "auto":
        section["buffer_size"] = needed
    elif given < math.ceil(largest / world_size):
        fail(f"{path}: zero_optimization.offload_param.buffer_size={given} is smaller than this model's largest "
             f"parameter shard ({math.ceil(largest / world_size)} elements); set it to \"auto\" or at least {needed}")


def choose_optimizer(config, cuda):
    """Fill the optimizer's "torch_adam" and "fused" when "auto": torch's fused AdamW (on GPUs and CPUs), which nothing
    has to compile, unless the optimizer state is offloaded. Without "torch_adam", DeepSpeed builds its FusedAdam with
    nvcc on the first run (a minute; and every run fails on a machine whose torch came from PyPI without the CUDA
    toolkit). With offload, the step runs on the CPU in DeepSpeedCPUAdam, which DeepSpeed compiles with the system's
    C++ compiler on first use (job/preflight.py --offload checks for what it needs)."""
    params = config.get("optimizer", {}).get("params", {})
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if params.get("torch_adam") == "auto":
        params["torch_adam"] = not offload
    if params.get("fused") == "auto":  # one kernel over all parameters: no temporaries the size of the model
        if params.get("torch_adam"):
            params["fused"] = True
        else:
            params.pop("fused")  # DeepSpeedCPUAdam takes no such argument
    return config


def check_offload(zero):
    """DeepSpeed offloads the optimizer state to NVMe only at stage 3; below it, "device": "nvme" silently becomes CPU
    memory and nvme_path is ignored."""
    if zero.get("offload_optimizer", {}).get("device") == "nvme" and zero.get("stage", 0) != 3:
        fail(f"--offload nvme needs ZeRO stage 3 (at stage {zero.get('stage', 0)} DeepSpeed would quietly use CPU "
             f"memory instead); pass --zero-stage 3, or --offload cpu")


def check_precision(precision, accelerator):
    """deepspeed.initialize refuses a 16-bit type its accelerator says it lacks with a traceback: fp16 on a CPU
    without oneDNN's fp16 kernels (this machine), on a Pascal GPU (compute capability 6, unless
    DS_ALLOW_DEPRECATED_FP16=1), bf16 on GPUs before Ampere."""
    supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}.get(precision)
    if supported is not None and not supported():
        other = "bf16" if precision == "fp16" and accelerator.is_bf16_supported() else "fp32"
        fail(f"--precision {precision}: DeepSpeed does not train in {precision} on this "
             f"{accelerator.device_name()} device; pass --precision {other}")


def _walk(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _walk(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


