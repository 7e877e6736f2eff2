"""Sequence parallelism (--sequence-parallel N in zero-optimization.py): each sequence split over N ranks, DeepSpeed's
Ulysses attention (deepspeed.runtime.sequence_parallel.ulysses_sp, the ALST work) between them. Every rank holds
the activations of its N-th of the tokens; around attention, an all-to-all turns the sequence shards into head shards
(every rank: the whole sequence, heads/N of the heads), and another turns them back. ZeRO still shards the model
states over all the ranks.

What DeepSpeed's wrapper lacks, written here:
- the documents' isolation: it drops the attention mask, so SDPA would let packed documents attend to each other.
  The host knows where each document of the whole row begins (shard()): with SDPA each shard carries every token's
  document, and the attention here builds the documents' causal mask (with the layer's sliding window) once per
  forward, in the query's dtype, one tensor for every layer and its backward; FlashAttention gets the row's
  boundaries (cu_seq_lens, as without SP), so that no layer derives them on the device.
- the batches: our blocks are shifted and masked on the host; a row is padded to a multiple of N (pads: position 0,
  no loss, a segment of their own), and each rank takes its slice of tokens and of targets, so no label crosses a
  shard.
- SP only for the training batches: evaluation and generation see whole sequences on every rank, with the mask as
  the batch gives it (the wrapper would otherwise take every forward, and a decoding step of one token cannot be
  split).
- the loss is the shards' summed token loss over the global batch's count of predicted tokens, so the gradient is
  the single process's however unevenly the answers fall on the shards; zero.gradient_divisor undoes the engine's
  averaging, which under SP divides by the data-parallel replicas at ZeRO 0-2 and by all ranks at ZeRO-3.
"""
import math

import numpy as np
import torch

from .. import hardware
from ..base import fail

SHARDED = "sequence_sharded"  # the batch key that marks a training batch cut into sequence shards
DOCUMENTS, PLAIN = "sp_documents", "sp_one_document_a_row"  # SDPA: each token's document in the whole rows; no mask


def setup(size, model, world_size, batch_rows):
    """The process groups and the attention for --sequence-parallel `size`; the mpu that deepspeed.initialize takes
    (None without SP). `batch_rows`: rows of a training micro-batch (1 when FlashAttention lays documents end to
    end)."""
    if size == 1:
        return None
    config = model.config
    text = hardware.text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    implementation = config._attn_implementation or "sdpa"
    check(size, world_size, heads=heads, kv_heads=kv_heads, implementation=implementation, model=type(config).__name__,
          layer_types=getattr(text, "layer_types", None))
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parallel_state_sp.initialize_sequence_parallel(size)
    core = ALL_ATTENTION_FUNCTIONS[implementation]
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    masks = {}  # this forward's documents' masks (documents_attention), released at its end
    ulysses = UlyssesSPAttentionHF(
        attn=documents_attention(core, masks) if implementation == "sdpa" else core, batch_size=batch_rows,
        attn_head_count=heads, attn_head_size=head_size, kv_head_count=kv_heads,
        num_hidden_layers=text.num_hidden_layers, process_group=parallel_state_sp.get_sequence_parallel_group(),
        seq_length_is_variable=True)

    exchanged = {"yes": False}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.pop(SHARDED, False):  # a training batch: its shards meet in the all-to-all
            exchanged["yes"] = True
            groups = getattr(module, "num_key_value_groups", None)
            try:
                return ulysses(module, query, key, value, None, *args, **kwargs)
            finally:  # Ulysses sets it for its head shards when it repeats key/value heads; whole sequences need it
                if groups is not None:
                    module.num_key_value_groups = groups
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = attention
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__  # under LoRA too
    model.register_forward_hook(  # the backward keeps what it needs of the mask
        lambda module, args, kwargs, output: masks.clear() or intercepted(exchanged["yes"], kwargs, name),
        with_kwargs=True)
    return Groups()


def intercepted(exchanged, kwargs, model):
    """After a sharded batch's forward: its attention went through the Ulysses exchange. A model whose attention
    bypasses transformers' attention functions (code of its own) would attend within each shard only: a wrong
    model, trained without a word."""
    if kwargs.get(SHARDED) and not exchanged:
        fail(f"--sequence-parallel: {model}'s attention does not go through transformers' attention functions, so "
             f"DeepSpeed's Ulysses cannot take it over; train it without --sequence-parallel")


class Groups:
    """DeepSpeed's groups for Ulysses (parallel_state_sp, what the engine takes as its mpu), saying that no tensor is
    split over ranks. DeepSpeed 0.19.8 takes a model-parallel size from an mpu that lacks one from its sequence-
    parallel size (utils/bwc.py falls back to get_model_parallel_world_size, an alias there): its checkpoints then
    record a tensor-parallel degree of N, which ds_to_universal cannot convert ("model-state file count 1 does not
    match ... tp_degree=2"), and its ZeRO-1/2 universal load calls get_tensor_model_parallel_world_size, which
    parallel_state_sp lacks. With this, a checkpoint written under sequence parallelism resumes on any number of
    ranks, with or without it."""

    def __getattr__(self, name):
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        return getattr(parallel_state_sp, name)

    @staticmethod
    def get_tensor_model_parallel_world_size():
        return 1

    @staticmethod
    def get_tensor_model_parallel_rank():
        return 0


# layer types that mix tokens in attention alone (or not at all): a recurrent, convolution or chunked layer would see
# only its shard
ATTENTION_ONLY = {"full_attention", "sliding_attention", "moe", "dense", "sparse"}


def check(size, world_size, *, heads, kv_heads, implementation, model, layer_types=None):
    """What sequence parallelism cannot split: one line each."""
    if size < 1:
        fail(f"--sequence-parallel must be 1 or more, got {size}")
    if world_size % size:
        fail(f"--sequence-parallel {size} does not divide the {world_size} ranks; use a divisor of {world_size}")
    if heads % size:
        fail(f"--sequence-parallel {size}: the model's {heads} attention heads do not split over {size} ranks; use a "
             f"divisor of {heads}")
    if kv_heads % size and size % kv_heads:
        fail(f"--sequence-parallel {size}: the model's {kv_heads} key/value heads do not split over {size} ranks (nor "
             f"{size} over them); use a divisor or a multiple of {kv_heads}")
    others = sorted(set(layer_types or ()) - ATTENTION_ONLY)
    if others:
        fail(f"--sequence-parallel: {model} has {', '.join(others)} layers, which mix tokens outside attention (each "
             f"rank would see its slice only); train it without --sequence-parallel")
    if implementation not in ("sdpa", "flash_attention_2", "flash_attention_3", "torch_varlen"):
        fail(f"--sequence-parallel: {model} runs {implementation} attention, which DeepSpeed's Ulysses cannot take "
             f"over (it needs SDPA or FlashAttention); train it without --sequence-parallel")


def documents_attention(sdpa, masks):
    """SDPA over the whole sequence (after the all-to-all) with the documents' causal mask, from each token's document
    (shard(): DOCUMENTS), with the layer's sliding window if it has one. The mask is the same for every layer: built
    once per forward and window into `masks` (which the model's forward hook empties), additive in the query's dtype
    (SDPA would turn a boolean mask into such a tensor in every layer, and keep each for the backward). No host sync."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        documents, plain = kwargs.pop(DOCUMENTS), kwargs.pop(PLAIN)
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)  # models pass it, or keep it
        if not window and plain:  # one document a row (a stream of text cut into blocks): no mask to build
            return sdpa(module, query, key, value, None, *args, is_causal=True, **kwargs)
        if masks.get("documents") is not documents:  # a new forward's
            masks.clear()
            masks["documents"] = documents
        if (window, query.dtype) not in masks:
            i = torch.arange(documents.shape[-1], device=documents.device)
            allowed = (documents[:, :, None] == documents[:, None, :]) & (i[:, None] >= i[None, :])
            if window:
                allowed &= i[:, None] - i[None, :] < window
            masks[window, query.dtype] = torch.zeros(allowed.shape, dtype=query.dtype, device=allowed.device
                                                     ).masked_fill_(~allowed, float("-inf"))[:, None]
        return sdpa(module, query, key, value, masks[window, query.dtype], *args, **kwargs)
    return attention


def shard(host, rank, size, process, layout="bool"):
    """This rank's shard of a training batch (`host`: Blocks.rows' token ids, positions and shifted targets):
    the rows padded to a multiple of `size` tokens (a pad: position 0, no loss, a segment of its own), then cut into
    `size` slices; the rank of an SP group takes its slice. The targets were shifted on the whole row, so the shards
    together predict exactly the row's tokens. With them, where the documents of the whole rows begin, which every
    rank's attention sees after the all-to-all: FlashAttention's boundaries (`layout` varlen: one row), or SDPA's
    tokens' documents. Returns the model's inputs and the loss targets, as Blocks.batch."""
    ids, positions, labels, width = host.ids, host.positions, host.labels, host.ids.shape[1]
    padded = math.ceil(width / size) * size
    pad = lambda x, value: np.pad(x, ((0, 0), (0, padded - width)), constant_values=value)  # noqa: E731
    ids, positions, labels = pad(ids, 0), pad(positions, 0), pad(labels, -100)
    starts = positions == 0
    if layout == "varlen":
        bounds = np.append(np.flatnonzero(starts[0]), padded).astype(np.int32)
        cu, longest = process.to_device(bounds), int(np.diff(bounds).max())
        whole = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    else:
        whole = {DOCUMENTS: process.to_device(np.cumsum(starts, axis=1)),
                 PLAIN: bool(starts.sum() == starts.shape[0] and starts[:, 0].all())}
    piece = slice(rank * (padded // size), (rank + 1) * (padded // size))
    ids, positions, labels = ids[:, piece], positions[:, piece], labels[:, piece]
    index = process.to_device(np.flatnonzero(labels != -100))
    ids, positions, labels = process.to_device(np.stack([ids, positions, labels]))
    return {"input_ids": ids, "position_ids": positions, "use_cache": False, SHARDED: True, **whole}, (labels, index)
