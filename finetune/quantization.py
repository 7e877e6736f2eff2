"""QLoRA: the frozen base of a LoRA run held in 4 bits (NF4 with double quantization) or 8 bits (LLM.int8) by
bitsandbytes, the adapters and their optimizer state in full precision (--load-in-4bit, --load-in-8bit). What a run
must do so that the numbers stay right: the checks, the loading config, no CPU repacking, and the export's weights
back in full precision."""
from .base import fail

# NF4 with double quantization as bitsandbytes makes it: a scale per 64 weights, a second-level scale per 256 of those
BLOCK, NESTED_BLOCK = 64, 256


def bits(model):
    """4, 8, or None: how many bits hold the frozen base (`model`: flags.Model, or plan.py's flags)."""
    return 4 if model.load_in_4bit else 8 if model.load_in_8bit else None


def check(model, zero_stage=None, library=True):
    """One line for what cannot run: both widths, a quantized base without adapters to train, 8 bits under ZeRO-3,
    bitsandbytes missing (where the `library` is needed: not by plan.py)."""
    if not bits(model):
        return
    flag = f"--load-in-{bits(model)}bit"
    if model.load_in_4bit and model.load_in_8bit:
        fail("--load-in-4bit and --load-in-8bit both given; choose one (4 bits: QLoRA's NF4, the smaller)")
    if not model.lora_rank:
        fail(f"{flag} quantizes a frozen base, which only LoRA trains over: add --lora-rank (e.g. 16)")
    if bits(model) == 8 and zero_stage == 3:  # Linear8bitLt multiplies by a copy of the weight ZeRO-3 never gathers
        fail("--load-in-8bit cannot be sharded by ZeRO-3 (its int8 weights are read outside the parameter); "
             "use --load-in-4bit, or --zero-stage 2")
    if library:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            fail(f"{flag} needs bitsandbytes: pip install bitsandbytes==0.50.2")


def loading_config(model, compute_dtype):
    """transformers' BitsAndBytesConfig: NF4 with double quantization (QLoRA's), the matmuls in the run's precision,
    the packed bytes stored in that same dtype (bnb_4bit_quant_storage, as PEFT's ZeRO-3 + QLoRA guide has it): a
    bf16 or fp16 engine casts every floating parameter to its dtype, which leaves them as they are then (stored as
    fp32 they would be converted as numbers)."""
    from transformers import BitsAndBytesConfig

    if bits(model) == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=compute_dtype)


def quantized_layers(model):
    """{name: module} of the layers bitsandbytes holds."""
    import bitsandbytes as bnb

    return {n: m for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def keep_trainable(model, flag):
    """After loading: the run fails in one line where bitsandbytes quantized nothing, and no layer repacks itself.
    On CPUs with AVX512-BF16 a Linear4bit rewrites its weight into a packed layout the first time it runs without
    gradients in eval mode (an eval, a sample), after which its matmul has no backward and the adapters' gradients
    are wrong with no error (bitsandbytes nn/modules.py, Linear4bit.forward): that path is turned off."""
    layers = quantized_layers(model)
    if not layers:
        fail(f"{flag}: bitsandbytes quantized no layer of {type(model).__name__} (it replaces torch.nn.Linear "
             f"and Conv1D layers only); train it with LoRA over a 16-bit base instead (drop {flag})")
    for module in layers.values():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        module._load_from_state_dict = _keeping_its_weight(module._load_from_state_dict)


def _keeping_its_weight(load):
    """A quantized layer's state-dict loading (a resume, --final best, DeepSpeed's load_checkpoint) that keeps the
    weight it was loaded with: bitsandbytes does not take its own entries back (weight.absmax, weight.quant_map, ...:
    refused as unexpected), and they are the same ones, quantized from the same files the same way. The rest (a
    bias) loads as it would."""
    def keeping(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for key in [k for k in state_dict if k == f"{prefix}weight" or k.startswith(f"{prefix}weight.")]:
            del state_dict[key]
        load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if f"{prefix}weight" in missing_keys:
            missing_keys.remove(f"{prefix}weight")
    return keeping


def is_quantized(p):
    """A parameter bitsandbytes holds (its bytes are not its values: never cast it)."""
    return type(p).__name__ in ("Params4bit", "Int8Params")


def dequantized(module, data=None):
    """The layer's weight in full precision, on the CPU (where the export is built): `data`, the packed bytes (ZeRO-3's
    gathered copy, already on rank 0's CPU), or the layer's own. Dequantized where the layer's scales are (its GPU in
    a GPU run: bitsandbytes' kernels want both on one device), then copied to the CPU, a layer at a time."""
    import bitsandbytes.functional as F

    weight = module.weight
    data = weight.data if data is None else data
    if hasattr(weight, "quant_state") and weight.quant_state is not None:  # 4 bits
        state = weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            raise RuntimeError("a 4-bit layer was repacked for bitsandbytes' CPU kernel (keep_trainable turns it off)")
        return F.dequantize_4bit(data.to(state.absmax.device), state).to("cpu", state.dtype)
    scales = module.state.SCB if module.state.SCB is not None else weight.SCB  # 8 bits: a scale per output row
    return F.int8_vectorwise_dequant(data.to(scales.device), scales).cpu()


def full_precision_state(model, state, dtype):
    """`state` (a peft model's state dict) with each quantized weight in full precision (`dtype`) and the
    quantization's own entries (absmax, quant_map, ...) left out: what stock transformers loads, and what an adapter
    merges into without rounding its update away (peft's merge into 4 bits quantizes the sum again)."""
    layers = quantized_layers(model)
    quantized = {f"{name}.weight": module for name, module in layers.items()}
    out = {}
    for key, value in state.items():
        if key in quantized:
            out[key] = dequantized(quantized[key], value).to(dtype)
        elif not any(key.startswith(f"{w}.") for w in quantized) and not key.endswith(".SCB"):
            out[key] = value
    return out


def stored_bytes(n, bits_, out_features=0, storage=4):
    """Bytes bitsandbytes keeps for a weight of n values. 4 bits, NF4 + double quantization: two values a byte (in
    elements of `storage` bytes), a uint8 scale per 64 values with its 256-entry fp32 code, an fp32 scale per 256 of
    those and their fp32 offset, NF4's 16 fp32 levels: every tensor its layer's own. 8 bits: a byte each and an fp32
    scale per output row."""
    if bits_ == 8:
        return n + 4 * out_features
    scales = -(-n // BLOCK)
    return -(-n // (2 * storage)) * storage + scales + 4 * 256 + 4 * -(-scales // NESTED_BLOCK) + 4 + 4 * 16
