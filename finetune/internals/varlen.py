"""Packed documents through torch's own varlen FlashAttention (torch.nn.attention.varlen, from torch 2.10): the
documents' boundaries as cumulative lengths, no mask, no padding, nothing to build. Without the flash-attn package,
SDPA takes packed documents as a block-diagonal mask, which rules out its flash kernel (the memory-efficient one
computes every tile and reads the mask). The batch layout is FlashAttention's (blocks.attention_layout "varlen": one
row of the real tokens, a pair's rejected answer given its prompt back), so transformers' flash kwargs
(cu_seq_lens_q/k, max_length_q/k) reach this function through the model's attention interface.

Two forms of torch's function exist: 2.10/2.11 take `is_causal` and nothing else (no scale, one head count, no
window); 2.12 on take `window_size` (causal is (-1, 0)), `scale` and `enable_gqa`. hardware.attention decides from
the form and the model's facts (fits) whether it runs; on a CPU it never does (the kernel is CUDA's), and the tests
feed the plumbing a reference kernel of the same signature."""
import inspect

import torch

NAME = "torch_varlen"  # the attention implementation's name in transformers' AttentionInterface


def form(kernel):
    """Which of torch's varlen signatures `kernel` has: "window" (2.12 on), "is_causal" (2.10/2.11), or None."""
    if kernel is None:
        return None
    parameters = inspect.signature(kernel).parameters
    return "window" if "window_size" in parameters else "is_causal" if "is_causal" in parameters else None


def torch_kernel():
    """torch's varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def fits(kernel_form, *, head_dim, window, softcap, dropout, interface, sinks, uneven_heads):
    """Whether a model's attention can run on torch's varlen kernel of this form: it calls transformers' attention
    interface (`_supports_attention_backend`), has no attention sinks nor logit softcapping nor attention dropout
    (the kernel has none), one head size for queries, keys and values (not MLA's), heads of at most 256 and a
    multiple of 8 (FlashAttention's), and a sliding window only where the form takes one. Grouped key/value heads
    run on either (repeated for the 2.10/2.11 form)."""
    if kernel_form not in ("window", "is_causal") or not interface or sinks or softcap or dropout or uneven_heads:
        return False
    return head_dim <= 256 and head_dim % 8 == 0 and (not window or kernel_form == "window")


def model_facts(config, architecture):
    """fits()'s facts of a model, from its config and its class (a model without attention heads fits nothing)."""
    from ..hardware import text_config

    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return dict(head_dim=0, window=False, softcap=False, dropout=0.0, interface=False, sinks=False,
                    uneven_heads=False)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    # layers with a window: every layer where the config class declares no layer types (Mistral's model windows
    # every layer whatever a checkpoint lists), else those its types name (blocks.document_masks decides alike)
    declared = any("layer_types" in inspect.get_annotations(k) for k in type(text).__mro__)
    types = getattr(text, "layer_types", None) if declared else None
    windowed = getattr(text, "sliding_window", None) is not None
    return dict(head_dim=head_dim, window=windowed and (not types or "sliding_attention" in types),
                softcap=bool(getattr(text, "attn_logit_softcapping", None)),
                dropout=float(getattr(text, "attention_dropout", None) or getattr(text, "attn_pdrop", None) or 0.0),
                interface=bool(getattr(architecture, "_supports_attention_backend", False)),
                sinks=getattr(architecture, "_compatible_flash_implementations", None) is not None,
                uneven_heads=getattr(text, "kv_lora_rank", None) is not None
                or getattr(text, "v_head_dim", None) not in (None, head_dim))


def attention(kernel):
    """transformers' attention function over `kernel` (torch's varlen_attn, or a reference of its signature): the
    batch's documents from its cumulative lengths. A call without them (generation at the end, a caller's own
    batch) is SDPA's, causal."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel_form = form(kernel)

    def varlen_attention(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, sliding_window=None,
                         **kwargs):  # (transformers' attention interface: it passes the rest by name)
        if kwargs.get("cu_seq_lens_q") is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if dropout:
            raise ValueError(f"{NAME} attention has no dropout ({dropout}); use --attention sdpa")
        # (1, heads, tokens, head size) -> (tokens, heads, head size): one row of documents end to end, in the 16 bits
        # autocast computes in (rotary embeddings over fp32 hidden states leave queries and keys in fp32; the
        # kernel, a custom op, has no autocast rule), as transformers' flash path casts them
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        q, k, v = (x.transpose(1, 2).flatten(0, 1).to(dtype).contiguous() for x in (query, key, value))
        bounds = (kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"])
        head_dim = q.shape[-1]
        if kernel_form == "window":
            window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
            out = kernel(q, k, v, *bounds, scale=scaling, window_size=window, enable_gqa=k.shape[1] != q.shape[1])
        else:  # 2.10/2.11: the default scale only, one head count
            if scaling is not None and scaling != head_dim ** -0.5:
                q = q * (scaling * head_dim ** 0.5)
            if k.shape[1] != q.shape[1]:
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
            out = kernel(q, k, v, *bounds, is_causal=True)
        return out.unsqueeze(0), None

    return varlen_attention


def register(kernel=None, name=NAME):
    """Register the attention over `kernel` (default: torch's) with transformers under `name`; returns the name. No
    mask function is registered: transformers then builds no mask for it (the documents' bounds are the batch's)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention(kernel or torch_kernel()))
    return name


def documents_apart(q, k, v, cu, *, scale=None, left=-1, gqa=False):
    """The reference the kernels are held to (tests/test_varlen.py, bench/attention.py): SDPA on each document
    [cu[i], cu[i+1]) of (tokens, heads, head size) apart, causal, within `left` tokens back where left >= 0."""
    outs = []
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        at = torch.arange(b - a, device=q.device)
        mask = (at[:, None] >= at[None, :]) & ((at[:, None] - at[None, :] <= left) if left >= 0 else True)
        qi, ki, vi = (x[a:b].transpose(0, 1) for x in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                                     enable_gqa=gqa).transpose(0, 1))
    return torch.cat(outs)
