"""The training loss, a module the scripts see and call: CausalLMLoss(model)(inputs, targets) is the summed
next-token cross-entropy over the tokens that carry loss (preference pairs: their summed preference loss), computed a
chunk of tokens at a time from the model's final hidden states, so that the logits of all tokens (tokens x
vocabulary: 1.6 GB in fp32 for OPT at 16 x 512 tokens, far more at Llama-3's 128k vocabulary) and their gradient
never exist at once.

How: the backbone runs, the hidden states of the positions that carry loss are kept, and they go with the output
head's weight to LinearCrossEntropy: for each chunk it makes the chunk's logits, the loss, and at once their gradient
(the softmax minus the one-hot target, written over the logits), and from it the gradients of the hidden states and
of the head's weight. So nothing is recomputed in the backward pass and no separate softmax backward runs (the
approach of Liger-Kernel's fused linear cross-entropy, written here in plain PyTorch). CausalLMLoss is the module a
DeepSpeed engine wraps, so under ZeRO-3 reading the head's weight inside its forward gathers it (and its gradient goes
back whole to ZeRO's reduction), and the engine's bookkeeping (gradient accumulation) runs. --loss-chunk 0 is the
plain path: all logits at once, as transformers computes them.

Preference pairs take the same two paths to their loss: a batch of pairs is handed over to its PairLoss
(preference/pair_loss.py: DPO's, or another --preference-loss), which sums each answer's log-probabilities over its
tokens and compares the two (with the reference's, where the loss has one).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import hardware

# models whose logits are more than head(hidden): softcapped or scaled. They take the plain path.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def postprocessed_logits(config):
    """The name of the setting that makes this model's logits more than head(hidden), or None."""
    text = hardware.text_config(config)  # a multimodal model keeps it there
    return next((name for name in LOGIT_POSTPROCESSING if getattr(text, name, None) not in (None, 1, 1.0)), None)


class CausalLMLoss(torch.nn.Module):
    """The causal LM with its loss, the module the scripts train and DeepSpeed wraps: forward(inputs, targets) is a
    batch's summed loss (a Summed; `inputs`, `targets` as blocks.Blocks.batch makes them). The scripts divide it by
    the global batch's count of tokens that carry loss (preference pairs: of pairs), so every token weighs the same
    however the batch is split over micro-steps and ranks. For preference pairs whose reference is not scored yet
    (targets.reference None: preference.reference) it is their (pairs, 2) log-probabilities.

    It holds the model's own submodules under the model's names, not under a prefix of its own: its state dict,
    DeepSpeed's checkpoints (and zero_to_fp32's weights) name every weight as the model does, and checkpoints written
    before it existed load. The model itself (generate, save_pretrained, peft's adapters): `causal_lm`. Called by
    keyword, model(inputs=..., targets=...): ZeRO-3 takes a module's positional inputs through autograd functions of
    its own (5 operations and 190 Python calls a step at OPT-125m's shape)."""

    def __init__(self, causal_lm, chunk_tokens, pair_loss=None):
        super().__init__()
        self.__dict__["causal_lm"] = causal_lm  # not a submodule of ours: its submodules are, under its names
        self._parameters, self._buffers, self._modules = causal_lm._parameters, causal_lm._buffers, causal_lm._modules
        # (the transformers model: under peft's wrapper where there are adapters)
        self.__dict__["lm"] = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
        self.chunk_tokens = 0 if postprocessed_logits(self.lm.config) else chunk_tokens
        self.pair_loss = pair_loss
        head = self.lm.get_output_embeddings()
        if self.chunk_tokens and hasattr(head.weight, "ds_id"):
            # ZeRO-3 gathers a module's weights around its own forward; the loss reads the head's weight outside the
            # head's: name the head's parameters as this module's own, so they are gathered around this forward
            # (parameter_offload.py)
            import deepspeed
            for p in (head.weight, head.bias):
                if p is not None:
                    deepspeed.zero.register_external_parameter(self, p)

    @property
    def config(self):
        return self.lm.config

    def train(self, mode=True):
        self.causal_lm.training = self.lm.training = mode  # (the submodules are ours: super() sets theirs)
        return super().train(mode)

    def forward(self, inputs, targets):
        inputs = {k: v for k, v in inputs.items() if v is not None}
        if self.chunk_tokens:
            hidden = self.lm.base_model(**inputs)[0]
            out = chunked_loss(hidden, self.lm.get_output_embeddings(), self.chunk_tokens, targets, self.pair_loss)
        else:
            out = plain_loss(self.lm(**inputs).logits, targets, self.pair_loss)
        if targets.sequence is not None and targets.reference is None:
            return out  # the reference pass (preference.reference): the pairs' log-probabilities
        return Summed(*out) if isinstance(out, tuple) else Summed(out)


def causal_lm(model):
    """The transformers model (under peft's wrapper where there are adapters) inside a DeepSpeed engine (.module)
    and a CausalLMLoss (.causal_lm): what generates, saves and says what it is."""
    model = getattr(model, "module", model)
    return getattr(model, "causal_lm", model)


def plain_loss(logits, targets, pair_loss=None):
    """The loss from the whole batch's logits; `targets`: blocks.Targets; `pair_loss`: preference.PairLoss, for
    preference pairs."""
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if targets.sequence is not None:
        return pair_loss.of_logits(logits, targets)
    return F.cross_entropy(logits.flatten(0, 1), targets.labels.flatten(), reduction="sum")


# Under --compile what follows the backbone runs eagerly where its size is the batch's count of predicted tokens:
# that count changes from batch to batch and the chunks are a Python loop over it, so dynamo would compile the loss
# anew for each count (until its recompile limit, after which the frame runs eagerly anyway). The backbone, shaped
# by the block, compiles once.
@torch.compiler.disable
def chunked_loss(hidden, head, chunk_tokens, targets, pair_loss=None):
    """The loss from the final hidden states and the output head, a chunk of tokens at a time."""
    hidden = hidden.flatten(0, 1).index_select(0, targets.index)  # only the positions that carry loss
    device = hidden.device.type  # the matmuls in the dtype autocast would give them, as the head's own would
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    labels = targets.labels.flatten().index_select(0, targets.index)
    if targets.sequence is not None:  # preference pairs: their loss (preference/pair_loss.py)
        return pair_loss.of_hidden(hidden, head, labels, targets, chunk=chunk_tokens, dtype=dtype)
    return LinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk_tokens, dtype,
                                    torch.is_grad_enabled())


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, targets), chunk by chunk; the gradients are made
    in the same pass and kept for the backward (the size of the hidden states and of the weight)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, dtype, with_grads):
        # only the gradients autograd will ask for: a frozen head (LoRA) needs none, and its weight's gradient would
        # be a third of the loss's matmuls and a vocabulary x hidden buffer
        need_hidden, need_weight, need_bias = (with_grads and needed for needed in ctx.needs_input_grad[:3])
        with_grads = need_hidden or need_weight or need_bias
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(h_all) if need_hidden else None
            grad_weight = torch.zeros_like(weight) if need_weight else None
            grad_bias = torch.zeros_like(bias) if need_bias else None
            for start in range(0, len(targets), chunk):
                h, y = h_all[start:start + chunk], targets[start:start + chunk]
                logits = (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()
                target = logits.gather(1, y[:, None]).squeeze(1)
                peak = logits.max(dim=-1, keepdim=True).values
                sums = logits.sub_(peak).exp_().sum(dim=-1)  # in place: no second (tokens x vocabulary) tensor
                total += (sums.log() + peak.squeeze(1) - target).sum()  # log-sum-exp minus the target's logit
                if with_grads:  # d(loss)/d(logits) = softmax - one-hot, over the logits' own memory
                    logits.div_(sums[:, None])
                    logits[torch.arange(len(y), device=y.device), y] -= 1
                    g = logits.to(dtype)
                    if grad_hidden is not None:
                        grad_hidden[start:start + chunk] = g @ w
                    if grad_weight is not None and grad_weight.dtype == dtype:
                        grad_weight.addmm_(g.t(), h)
                    elif grad_weight is not None:  # autocast over fp32 weights: the product in 16 bits, the sum in fp32
                        grad_weight += g.t() @ h
                    if grad_bias is not None:
                        grad_bias += g.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.hidden_dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # in place: a scaled copy of the head's gradient would be a second (vocabulary x hidden) tensor. A second
        # backward through the same graph (retain_graph) is refused by autograd: the saved tensors have changed.
        scale = lambda g, dtype=None: None if g is None else g.mul_(grad_out).to(dtype or g.dtype)
        return (scale(grad_hidden, ctx.hidden_dtype), scale(grad_weight), scale(grad_bias), None, None, None, None)


class Summed(NamedTuple):
    """A batch's summed loss, and for preference pairs the sums of their metrics (preference/metrics.py), else
    None."""
    loss: torch.Tensor
    pair_metrics: torch.Tensor | None = None
