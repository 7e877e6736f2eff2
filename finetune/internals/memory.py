"""Count the bytes of model state a rank holds, and what a layer keeps for its backward pass: what plan.py plans,
measured.

Parameters (under ZeRO-3 their shards), gradients, the optimizer's state and every buffer DeepSpeed keeps for them
(flat 16-bit copies, fp32 masters, gradient partitions, reduce buckets, offload staging), each storage counted
once at its full size: a view into a flat buffer adds nothing. Found by walking the objects the engine and the
optimizer hold, not the garbage collector (which misses gradients never read from Python, and sees activations).
"""
import collections
import copy
import dataclasses
import enum
import types

import torch
import transformers

_TENSOR_ATTRIBUTES = ("ds_tensor", "ds_secondary_tensor", "grad_accum", "cpu_data", "SCB")
_SKIP = {"training_dataloader", "training_data", "data_sampler", "lr_scheduler", "timers", "monitor",
         "dp_process_group", "real_dp_process_group", "ds_process_group", "mpu", "_forward_hooks",
         "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_grad_acc_hooks"}
_ATOMS = (str, bytes, int, float, bool, complex, type(None), enum.Enum, type, types.FunctionType, types.MethodType,
          types.BuiltinFunctionType, types.ModuleType, torch.dtype, torch.device)
_WALK_MODULES = ("deepspeed", "torch.optim", "collections", "bitsandbytes")


def held_bytes(model, optimizer):
    """Bytes of tensor storage reachable from the model and its optimizer (a DeepSpeed engine and its optimizer,
    or a module and a torch optimizer), each storage once."""
    storages, seen = {}, set()
    stack = [optimizer, getattr(model, "optimizer", None), getattr(model, "basic_optimizer", None),
             getattr(model, "module", model)]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.untyped_storage().nbytes():
                storage = obj.untyped_storage()
                storages[(obj.device, storage.data_ptr())] = storage.nbytes()
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack += [getattr(obj, a) for a in _TENSOR_ATTRIBUTES if isinstance(getattr(obj, a, None), torch.Tensor)]
            stack.append(getattr(obj, "nvme_swapper", None))  # NVMe offload: its pinned swap buffers
            stack.append(getattr(obj, "quant_state", None))  # a 4-bit weight's scales
        elif isinstance(obj, torch.nn.Module):
            stack += [*obj._parameters.values(), *obj._buffers.values(), *obj._modules.values()]
            stack.append(vars(obj).get("state"))  # an 8-bit layer's int8 weights and scales
        elif isinstance(obj, dict):
            stack += [v for k, v in obj.items() if k not in _SKIP]
            stack += [k for k in obj if isinstance(k, torch.Tensor)]  # torch optimizers key their state by tensor
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack += list(obj)
        elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith(_WALK_MODULES):
            stack += [v for k, v in vars(obj).items() if k not in _SKIP] if hasattr(obj, "__dict__") else []
    return sum(storages.values())


_COUNTED = {}  # layer_bytes': (config, precision, autocast) -> (bytes a token, a token per token attended)
LENGTHS = (32, 64, 128)  # the sequences count_layer runs


def layer_bytes(config, precision, autocast=False, tiled=False):
    """What one transformer layer keeps for its backward pass, counted, not assumed (Llama's gated MLP keeps four
    tensors of its width where OPT's keeps two; under autocast the norms keep fp32 copies; eager attention keeps its
    T x T probabilities): (a, q), a sequence of T tokens keeping a·T + q·T² bytes. Counted on the model's layers at
    1/k and 2/k of every width and of the heads' size (as many heads: what grows with the widths is 1/k of the
    model's, what a head keeps per token, its softmax's statistics, and the T x T terms are the model's), k a power
    of 2 that leaves the heads at least 8 wide. None where the model cannot be built so. tiled: with --tiled-mlp
    (the MLP keeps its input only)."""
    key = (config.to_json_string(), precision, autocast, tiled)
    if key not in _COUNTED:
        try:
            text = config.get_text_config()
            k = 1
            head = text.head_dim if getattr(text, "head_dim", None) else text.hidden_size // text.num_attention_heads
            while head // (2 * k) >= 8 and all(w % (4 * k) == 0 for w in widths(text).values()):  # rotary: even
                k *= 2
            small, q = count_layer(config, precision, autocast, k, tiled)
            if k > 1:  # a token's bytes there: wide / k + fixed; at twice the widths: 2·wide / k + fixed
                wider = count_layer(config, precision, autocast, k // 2, tiled)[0]
                small = k * (wider - small) + 2 * small - wider  # wide + fixed
            _COUNTED[key] = small, q
        except Exception:  # a model this count cannot build (a vision tower, a custom layer): the rule of 34
            _COUNTED[key] = None
    return _COUNTED[key]


def widths(text):
    """The config's widths that scale together (the heads' size included), by name."""
    head = {"head_dim": text.head_dim or text.hidden_size // text.num_attention_heads} \
        if hasattr(text, "head_dim") else {}
    names = ("hidden_size", "intermediate_size", "ffn_dim", "word_embed_proj_dim", "moe_intermediate_size",
             "shared_expert_intermediate_size")
    return {**head, **{n: getattr(text, n) for n in names if isinstance(getattr(text, n, None), int)}}


def count_layer(config, precision, autocast, k, tiled=False):
    """(bytes a token, bytes a token per token attended) that one layer of the model at 1/k of its widths keeps for
    backward: run forward on the CPU in training mode (dropout's masks included) under torch's saved-tensor hooks,
    2 layers and 1 at 3 lengths; the differences are one layer's share, free of the embedding, the head and the
    weights' 16-bit copies."""
    text = copy.deepcopy(config.get_text_config())
    for name, width in widths(text).items():
        setattr(text, name, width // k)
    text.vocab_size, text.pad_token_id = 256, None
    weights = torch.float32 if autocast or precision in ("fp32", "tf32") else \
        torch.float16 if precision == "fp16" else torch.bfloat16
    saved, types = {}, getattr(text, "layer_types", None)
    for layers in (1, 2):
        text.num_hidden_layers = layers
        if types:
            text.layer_types = types[:layers]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(text, dtype=weights).train()  # the scripts' attention
        if tiled:
            from .. import long_sequences

            long_sequences.tile_mlps(model, text, max(LENGTHS))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for length in LENGTHS:
            kept = {}

            def keep(t, params=params, kept=kept):  # (this length's)
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    kept[storage.data_ptr()] = max(kept.get(storage.data_ptr(), 0), storage.nbytes())
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
                    torch.autocast("cpu", torch.float16 if precision == "fp16" else torch.bfloat16, enabled=autocast):
                model(input_ids=torch.randint(0, 256, (1, length)))
            saved[layers, length] = sum(kept.values())
    # one layer at T tokens: c + a·T + q·T² (c: its weights' 16-bit copies); two differences give a and q
    layer = [saved[2, t] - saved[1, t] for t in LENGTHS]
    (t1, t2, t3), (d1, d2) = LENGTHS, (layer[1] - layer[0], layer[2] - layer[1])
    q = (d2 / (t3 - t2) - d1 / (t2 - t1)) / (t3 - t1)
    return d1 / (t2 - t1) - q * (t1 + t2), q
