"""The training loss: summed next-token cross-entropy over the tokens that carry loss, computed in chunks of tokens
from the model's final hidden states, so the logits of all tokens (tokens x vocabulary: 1.6 GB in fp32 for OPT at
16 x 512 tokens, far more at Llama-3's 128k vocabulary) and their gradient never exist at once.

How: attach() gives the model a forward that, when called with `loss_targets`, runs the backbone, keeps the
hidden states of the positions that carry loss, and runs the output head and the cross-entropy on one chunk at a
time under activation checkpointing (each chunk's logits are recomputed in the backward pass). It is the model's
own forward, so a DeepSpeed engine calls it: under ZeRO-3 the head's weight is gathered by the head's own hooks,
and the engine's bookkeeping (gradient accumulation) runs. Every rank runs the same number of chunks, since each
ZeRO-3 gather is a collective. --loss-chunk 0 is the plain path: all logits at once, as transformers does.
"""
import math
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# models whose logits are more than head(hidden): softcapped or scaled. They take the plain path.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def attach(model, chunk_tokens, max_tokens):
    """Give the causal LM (the transformers model, inside any peft wrapper) the forward described above.
    `max_tokens`: the most tokens a micro-batch can hold on a rank (batch size x block size), which fixes the number
    of chunks for every rank and step."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if any(getattr(inner.config, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING):
        chunk_tokens = 0
    original = inner.forward

    def forward(self, *args, loss_targets=None, **kwargs):
        if loss_targets is None:  # generate(), or any other caller: the model as it was
            return original(*args, **kwargs)
        labels, index = loss_targets
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in ("labels", "return_dict")}
        if not chunk_tokens:
            logits = original(*args, **kwargs).logits
            logits = logits if logits.dtype == torch.float32 else logits.float()
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        hidden = self.base_model(*args, **kwargs)[0]
        hidden = hidden.flatten(0, 1).index_select(0, index)  # only the positions that carry loss
        targets = labels.flatten().index_select(0, index)
        head = self.get_output_embeddings()
        chunks = math.ceil(max_tokens / chunk_tokens)
        size = max(1, math.ceil(len(index) / chunks))
        total = hidden.new_zeros((), dtype=torch.float32)
        for c in range(chunks):  # the same count on every rank, some chunks maybe empty
            part = slice(c * size, (c + 1) * size)
            total = total + checkpoint(_chunk_loss, head, hidden[part], targets[part], use_reentrant=False)
        return total

    inner.forward = types.MethodType(forward, inner)  # on the instance: the state dict keeps its names
    return model


def _chunk_loss(head, hidden, targets):
    # the cross-entropy inside the checkpointed function: its input, the chunk's logits, is then recomputed too
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def token_loss_sum(model, inputs, labels):
    """The summed loss of a batch: `labels` is (shifted labels with -100, flat index of the positions that carry
    loss), as data.Blocks.batch makes them. The scripts divide it by the global batch's count of such tokens, so
    every token weighs the same however the batch is split over micro-steps and ranks."""
    return model(**inputs, loss_targets=labels)
