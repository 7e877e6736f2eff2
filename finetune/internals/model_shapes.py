"""What a model holds, counted on the meta device (nothing allocated, whatever its size): its parameters (with LoRA's
adapters, with a quantized base as bitsandbytes stores it), its largest layer, the scales of a 4- or 8-bit base, the
parameters a token goes through in a mixture of experts. plan.py plans from these; a published model's config
offline for the OPT family, Llama-3.2-1B and Llama-3.1-8B."""
import math
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, OPTConfig

from .. import models, quantization
from ..hardware import experts_per_token
from ..zero_config import zero3_layers

# Published OPT shapes (hidden, layers, heads, FFN), so the planner works offline for these ids.
OPT_SHAPES = {"opt-125m": (768, 12, 12, 3072), "opt-350m": (1024, 24, 16, 4096), "opt-1.3b": (2048, 24, 32, 8192),
              "opt-2.7b": (2560, 32, 32, 10240), "opt-6.7b": (4096, 32, 32, 16384), "opt-13b": (5120, 40, 40, 20480),
              "opt-30b": (7168, 48, 56, 28672), "opt-66b": (9216, 64, 72, 36864)}

def llama_3_2_1b():
    """Llama-3.2-1B's published config (its values), so that its shape is planned and benchmarked offline."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                     "low_freq_factor": 1.0, "original_max_position_embeddings": 8192})


def llama_3_1_8b():
    """Llama-3.1-8B's published config (its values), planned and benchmarked offline."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                     "low_freq_factor": 1.0, "original_max_position_embeddings": 8192})


PUBLISHED = {"meta-llama/Llama-3.2-1B": llama_3_2_1b, "meta-llama/Llama-3.1-8B": llama_3_1_8b}


def load_config(name):
    """The model's config: the published OPT shapes and Llama's (PUBLISHED) offline, else a local folder or the
    hub."""
    if name in PUBLISHED:
        return PUBLISHED[name]()
    shape = OPT_SHAPES.get(name.split("/")[-1]) if name.startswith("facebook/") else None
    if shape:
        hidden, layers, heads, ffn = shape
        return OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
                         word_embed_proj_dim=512 if name.endswith("350m") else hidden, max_position_embeddings=2048)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        sys.exit(f"error: cannot load a config for {name!r} (not a local folder, and the hub did not answer); "
                 f"pass a local model folder, or one of: {', '.join('facebook/' + k for k in OPT_SHAPES)}, "
                 f"{', '.join(PUBLISHED)}")


_BUILT = {}  # meta_model's: (config, LoRA rank, targets) -> (model, quantized weights)


def meta_model(config, lora_rank=0, lora_targets="all-linear"):
    """(the model built on the meta device, nothing allocated, with the adapters peft would add for LoRA; the weights
    bitsandbytes would quantize), built once for each shape: plan() asks up to four times, and a 70B model takes
    seconds to build."""
    key = (config.to_json_string(), lora_rank, lora_targets)
    if key not in _BUILT:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
            quantized = [m.weight for m in quantized_layers(model)]  # before the adapters wrap the layers
            if lora_rank:  # the adapters the scripts add (finetune/models.py: the experts' too, in a mixture of them)
                from peft import LoraConfig, get_peft_model
                targets, experts = models.lora_targets(model, lora_targets)
                model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=targets,
                                                         target_parameters=experts, task_type="CAUSAL_LM"))
        _BUILT[key] = model, quantized
    return _BUILT[key]


def parameters(config, lora_rank=0, lora_targets="all-linear", bits=None, precision="bf16"):
    """(numel, trainable) of every parameter tensor (tied ones once); with LoRA, the adapters (trainable) and the base
    (frozen). With `bits` (--load-in-4bit/8bit) a weight bitsandbytes holds counts as what is stored: its packed
    bytes in elements of the run's precision (4 bits: the scripts store them in that dtype, bnb_4bit_quant_storage;
    8 bits: int8 bytes in such units)."""
    model, quantized = meta_model(config, lora_rank, lora_targets)
    quantized = {id(w) for w in quantized} if bits else set()
    b = 4 if precision in ("fp32", "tf32") else 2
    held = lambda p: p.numel() if id(p) not in quantized else math.ceil(p.numel() / (2 * b)) if bits == 4 \
        else p.numel() / b
    return list({id(p): (held(p), p.requires_grad) for p in model.parameters()}.values())


def optimizer_groups(config, lora_rank=0, lora_targets="all-linear"):
    """The sizes of the trainable tensors in the optimizer's groups, in their order (training.param_groups: the
    matrices, then the biases and norms), as ZeRO-1/2 flattens and partitions each group."""
    model = meta_model(config, lora_rank, lora_targets)[0]
    trainable = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    return [[p.numel() for p in trainable if p.dim() >= 2], [p.numel() for p in trainable if p.dim() < 2]]


def layer_params(config, lora_rank=0, lora_targets="all-linear"):
    """The parameters of the model's largest transformer layer (ZeRO-3's leaf, its buckets' size), or None (LoRA: its
    layers are not leaves, zero_config.zero3_layers)."""
    return zero3_layers(meta_model(config, lora_rank, lora_targets)[0], whole_layers=not lora_rank)[1]


def quantized_layers(model):
    """The layers from_pretrained gives bitsandbytes (transformers' own choice, quantizers/: every nn.Linear and
    Conv1D but the output head, what it ties, and the model's fp32 modules)."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
    return [m for name, m in model.named_modules()
            if (type(m) is torch.nn.Linear or isinstance(m, Conv1D)) and should_convert_module(name, skip)]


def quantization_constants(config, bits, lora_rank=0, lora_targets="all-linear"):
    """(bytes every rank holds whole beside a quantized base: the scales; ZeRO-3 partitions the packed weights, not
    these, the largest quantized weight's values: the one dequantized copy a forward makes at a time)."""
    sizes = [(w.numel(), w.shape[0]) for w in meta_model(config, lora_rank, lora_targets)[1]]
    packed = lambda n: n if bits == 8 else math.ceil(n / 2)  # counted as parameters (parameters())
    return sum(quantization.stored_bytes(n, bits, out, storage=1) - packed(n) for n, out in sizes), \
        max((n for n, _ in sizes), default=0)


def count_params(config):
    """(all parameters, tied ones once; the largest number held directly by one module)."""
    params = parameters(config)
    return sum(n for n, _ in params), max(n for n, _ in params)


def active_parameters(config):
    """Parameters a token goes through: in a mixture of experts, the fused experts' weights (experts x in x out) count
    for the experts_per_tok of them; None for a model without experts."""
    experts, k = experts_per_token(config)
    if not experts:
        return None
    unique = {id(p): p for p in meta_model(config)[0].parameters()}.values()
    return sum(p.numel() * k // experts if p.dim() == 3 and p.shape[0] == experts else p.numel() for p in unique)
