"""What the hardware decides: the device, the precision, the matmul mode, and the peak that MFU is measured against.

Each decision is a small function of plain facts (a device name, a compute capability, how many GPUs this process
sees), so a test on a CPU can hand it the facts of an H100 or a V100 (tests/test_hardware.py).
"""
import contextlib
import os
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Facts:
    """What the decisions below need to know about this process's device."""
    kind: str = "cpu"          # "cuda" or "cpu"
    name: str = ""             # torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"
    capability: tuple = ()     # (major, minor): (7, 0) V100, (7, 5) T4, (8, 0) A100, (9, 0) H100
    visible: int = 0           # GPUs this process sees (after CUDA_VISIBLE_DEVICES)


def facts(device):
    if device.type != "cuda":
        return Facts(kind=device.type)
    return Facts("cuda", torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                 torch.cuda.device_count())


def device_index(local_rank, visible):
    """The GPU this rank uses. One process per GPU, numbered by LOCAL_RANK, unless the job gives each process its own
    single GPU (SLURM's --gpus-per-task, a container per rank), which is then GPU 0 for every rank."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise SystemExit(f"error: this process has LOCAL_RANK {local_rank} but sees {visible} GPUs "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most "
                         f"{visible} processes per node, or show each process one GPU")
    return local_rank


def first_device(local_rank=0):
    """This process's device, made the current one before anything else touches CUDA (the process group, the
    model, a library's own torch.cuda.current_device()); otherwise every rank would work on GPU 0."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would guess it, and say so on every import
        return torch.device("cpu")
    device = torch.device("cuda", device_index(local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def choose_precision(requested, facts):
    """--precision: fp32, tf32 (fp32 weights and math, matmuls in TF32), bf16 or fp16 (mixed, with an fp32 master).

    auto: bf16 from compute capability 8.0 (Ampere) on: there bf16 runs on the tensor cores at the fp16 rate and
    needs no loss scaling. Before Ampere (V100 7.0, T4 7.5) bf16 is emulated and slow, so torch's
    is_bf16_supported(), which counts emulation, is the wrong test; those GPUs get fp16 with dynamic loss scaling, the
    tensor-core precision they have (8x fp32 on a V100). A model pretrained in bf16 can overflow in fp16: the run then
    stops at the first non-finite loss, and --precision fp32 is the way out. CPUs get fp32: bf16 is not faster there.
    fp32 is never silently turned into tf32: the losses of fp32 runs agree to fp32 rounding across ranks."""
    ampere = facts.kind == "cuda" and tuple(facts.capability) >= (8, 0)
    if requested == "auto":
        if ampere:
            return "bf16"
        return "fp16" if facts.kind == "cuda" and tuple(facts.capability) >= (7, 0) else "fp32"
    if facts.kind == "cuda" and not ampere and requested in ("bf16", "tf32"):
        raise SystemExit(f"error: --precision {requested} needs compute capability 8.0 (Ampere) or newer, and "
                         f"{facts.name} has {'.'.join(map(str, facts.capability))} (emulated: slow); use --precision "
                         f"fp16 or fp32")
    if facts.kind != "cuda" and requested == "tf32":
        raise SystemExit("error: --precision tf32 is a mode of NVIDIA GPUs from Ampere on; use fp32 here")
    return requested


def set_matmul_precision(precision):
    """TF32 only when asked for (--precision tf32): about 8x the fp32 matmul rate on Ampere and later, with a 10-bit
    mantissa in the products. Everything else is IEEE fp32 where it is fp32 (cuDNN's default is TF32 for
    convolutions). Through torch's older switches: a write with the newer fp32_precision API makes
    torch.get_float32_matmul_precision() raise in torch 2.13, and inductor (--compile) calls it."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = precision == "tf32"


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32 and tf32: no autocast


def pinned_copies(device_type):
    """Whether a batch goes to the device through pinned memory, asynchronously: a copy from pageable memory makes
    the host wait for the device's queue (the previous micro-step's backward) before the loop can go on. On a GPU."""
    return device_type == "cuda"


def autocast(device, precision):
    """Mixed precision for bf16 and fp16 (the weights stay fp32, matmuls run in 16 bits); nothing otherwise."""
    if precision not in AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def attention(facts, precision, flash_installed, model_supports_flash, compatible_flash=None, *, torch_varlen=False):
    """The attention implementation: FlashAttention-2 where it runs (an NVIDIA GPU from Ampere on, 16-bit, the
    flash-attn package installed, a model that supports it): packed documents then go through its varlen kernel
    with no padding and no mask. Without the package, torch's own varlen FlashAttention on the same GPUs where the
    model fits it (`torch_varlen`: varlen.fits, from torch's form of the function and the model's facts), the same
    layout. Otherwise transformers' default (SDPA with a block-diagonal mask; eager for models without SDPA, Gemma 2
    and gpt-oss). A model that names the flash kernels it works with (`_compatible_flash_implementations`) and not
    FlashAttention-2 is not given it: transformers would swap in a hub kernel (gpt-oss: vllm-flash-attn3, for its
    attention sinks, which FlashAttention-2 would drop)."""
    ampere = facts.kind == "cuda" and tuple(facts.capability) >= (8, 0)
    flash_ok = model_supports_flash and (compatible_flash is None or "flash_attention_2" in compatible_flash)
    if ampere and precision in AUTOCAST_DTYPES and flash_installed and flash_ok:
        return "flash_attention_2"
    if ampere and precision in AUTOCAST_DTYPES and torch_varlen:
        return "torch_varlen"
    return None


# Dense peak TFLOPS (no sparsity) from the vendors' data sheets: (16-bit tensor, TF32 tensor, fp32 without tensor
# cores). Matched as whole words in torch.cuda.get_device_name(), most specific first: "A10" is not "A100", "A100"
# is not "RTX A1000", "L40" is not "L40S". A name not listed gets no MFU rather than a wrong one.
PEAK_TFLOPS = [
    (r"H100 NVL", (835, 418, 60)), (r"H100.*PCI", (756, 378, 51)), (r"\bH100\b", (989, 495, 67)),
    (r"H200 NVL", (835, 418, 60)), (r"\bH200\b", (989, 495, 67)), (r"\bGH200\b", (989, 495, 67)),
    (r"H800.*PCI", (756, 378, 51)), (r"\bH800\b", (989, 495, 67)), (r"\bB200\b", (2250, 1125, 75)),
    (r"\bA100\b", (312, 156, 19.5)), (r"\bA800\b", (312, 156, 19.5)),
    (r"\bL40S\b", (362, 183, 91.6)), (r"\bL40\b", (181, 90.5, 90.5)), (r"\bL20\b", (119.5, 59.8, 59.8)),
    (r"\bL4\b", (121, 60, 30.3)), (r"\bA10G\b", (70, 35, 31.2)), (r"\bA10\b", (125, 62.5, 31.2)),
    (r"RTX 6000 Ada", (364, 182, 91.1)), (r"RTX A6000", (155, 77, 38.7)),
    (r"RTX 4090", (165, 82.6, 82.6)), (r"RTX 3090", (71, 35.6, 35.6)),
    (r"\bV100S\b", (130, None, 16.4)), (r"V100.*PCI", (112, None, 14)), (r"\bV100\b", (125, None, 15.7)),
    (r"\bT4\b", (65, None, 8.1)),  # V100 and T4: fp16 (no bf16, no TF32)
]


def peak_tflops(name, precision):
    """(TFLOPS, what it is) for this GPU at this precision, or None for a GPU not in the table (or a CPU)."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            column = {"bf16": 0, "fp16": 0, "tf32": 1, "fp32": 2}[precision]
            if peaks[column] is None:
                return None
            kind = ["dense 16-bit tensor", "dense TF32 tensor", "fp32 (no tensor cores)"][column]
            return peaks[column], f"{name}: {peaks[column]:g} TFLOPS {kind} peak"
    return None


def values(p):
    """How many numbers a parameter holds: whole under ZeRO-3 (ds_numel); a 4-bit one packs several into each of
    its elements (its quant_state keeps the shape)."""
    state = getattr(p, "quant_state", None)
    return state.shape.numel() if state is not None else getattr(p, "ds_numel", p.numel())


def matmul_params(model, trainable_only=False, all_experts=False):
    """N in 6N: the parameters that take part in matrix products for every token (only those that train, with
    `trainable_only`). Position embeddings and an input embedding are only looked up; an embedding tied to the output
    head is counted once, as the head (torchtitan's count). Whole under ZeRO-3 too (ds_numel)."""
    numel = values
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    seen, total = set(), 0
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    head_weight = head.weight if head is not None else None
    inputs = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    lookups = {id(p) for p in (inputs.parameters() if inputs is not None else [])} - {id(head_weight)}
    experts, active = experts_per_token(inner.config) if hasattr(inner, "config") and not all_experts else (None, None)
    for name, p in inner.named_parameters(remove_duplicate=True):
        if id(p) in seen or id(p) in lookups or "position" in name or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        shape = getattr(p, "ds_shape", p.shape)
        # a mixture of experts' fused weights (experts x in x out): a token goes through `active` of them
        total += numel(p) * active // experts if experts and len(shape) == 3 and shape[0] == experts else numel(p)
    return total


def text_config(config):
    """The settings of a model's language layers: a multimodal model (Gemma 3 from 4B up) keeps them in its text
    config; a text model's config is its own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def experts_implementation(precision, experts):
    """The experts' kernel of a mixture of experts: under autocast (single-gpu.py's bf16 and fp16 over fp32 weights)
    one that computes them in 16 bits, as autocast does a Linear. transformers' grouped_mm is not autocast-enabled: it
    casts the tokens to the fp32 experts' weights, and torch's _grouped_mm, whose fast path on a GPU takes bf16 only,
    falls back to an fp32 loop over the experts with a host sync per layer (GroupedMMUtils.h). None: transformers'
    default (fp32 runs; the ZeRO engine's 16-bit weights, under no autocast, take it unchanged)."""
    return "grouped_mm_autocast" if experts and precision in AUTOCAST_DTYPES else None


def experts_per_token(config):
    """(experts, experts a token is routed to) of a mixture-of-experts model, or (None, None)."""
    text = text_config(config)
    experts = next((getattr(text, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(text, n, None)), None)
    return (experts, getattr(text, "num_experts_per_tok", None) or 1) if experts else (None, None)


def flops_per_token(config, num_params, attended, trainable=None):
    """6N + 12·L·H·Q·T (the PaLM appendix, as nanoGPT and torchtitan count it): N parameters in matmuls (a mixture of
    experts: those a token goes through), L layers, H·Q the queries' width (heads x head size: the hidden size for
    most models), T the tokens a token attends to: the block length when texts are packed into one stream, the
    document's own length when documents are isolated or padded (`attended`, the mean over the tokens).
    6N is 2N forward, 2N for the gradients of the activations and 2N for those of the weights: with frozen weights
    (LoRA) only the `trainable` of the N have the last, so 4N + 2·trainable."""
    weights = num_params if trainable is None else trainable
    config = text_config(config)
    width = config.num_attention_heads * getattr(config, "head_dim", None) if getattr(config, "head_dim", None) \
        else config.hidden_size  # the queries' width: Gemma 2's and gpt-oss's differ from the hidden size
    return 4 * num_params + 2 * weights + 12 * config.num_hidden_layers * width * attended
