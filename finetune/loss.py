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

Preference pairs (preference.py) take the same two paths to their loss (PairLoss: DPO's, or another
--preference-loss): each answer's log-probability is the sum over its tokens, and the loss of a pair compares the two
(with the reference's, where the loss has one). LinearPreference makes the chunks'
log-probabilities first, then the pairs' losses and the weight each token's gradient takes from them, then (a second
pass over the chunks, unless the head is frozen) the weighted gradients.
"""
import dataclasses
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
    """The loss from the whole batch's logits; `targets`: blocks.Targets; `pair_loss`: a PairLoss, for preference
    pairs."""
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if targets.sequence is not None:
        return plain_preference_loss(logits, targets, pair_loss)
    return F.cross_entropy(logits.flatten(0, 1), targets.labels.flatten(), reduction="sum")


# Under --compile what follows the backbone runs eagerly where its size is the batch's count of predicted tokens:
# that count changes from batch to batch and the chunks are a Python loop over it, so dynamo would compile the loss
# anew for each count (until its recompile limit, after which the frame runs eagerly anyway). The backbone, shaped
# by the block, compiles once.
@torch.compiler.disable
def plain_preference_loss(logits, targets, pair_loss):
    logits = logits.flatten(0, 1).index_select(0, targets.index)
    labels = targets.labels.flatten().index_select(0, targets.index)
    with torch.no_grad():
        stats = answer_stats(logits.float(), labels) if targets.reference is not None else None
    return preference_loss(-F.cross_entropy(logits, labels, reduction="none"), targets, pair_loss, stats)


@torch.compiler.disable
def chunked_loss(hidden, head, chunk_tokens, targets, pair_loss=None):
    """The loss from the final hidden states and the output head, a chunk of tokens at a time."""
    hidden = hidden.flatten(0, 1).index_select(0, targets.index)  # only the positions that carry loss
    device = hidden.device.type  # the matmuls in the dtype autocast would give them, as the head's own would
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    labels = targets.labels.flatten().index_select(0, targets.index)
    if targets.sequence is not None and targets.reference is None:  # the reference pass: log-probabilities only
        token = token_logps(hidden, head.weight, head.bias, labels, chunk=chunk_tokens, dtype=dtype)
        return preference_loss(token, targets, pair_loss)
    if targets.sequence is not None:
        return LinearPreference.apply(hidden, head.weight, head.bias, labels, targets.sequence, targets.pairs,
                                      targets.reference, pair_loss, chunk_tokens, dtype, torch.is_grad_enabled())
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
    """A batch's summed loss, and for preference pairs the sums of their metrics (scored(): the chosen and rejected
    rewards, the pairs ranked right, the answers' log-probabilities), else None."""
    loss: torch.Tensor
    pair_metrics: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------
# Preference pairs: DPO's loss and the others (--preference-loss)


@dataclasses.dataclass(frozen=True)
class PairLoss:
    """How a pair's two answers are scored (--preference-loss, TRL's names): from their summed log-probabilities
    (c, r), their token counts, and the reference's (c0, r0) where the loss has one; h = beta ((c - c0) - (r - r0)).
    sigmoid: DPO, -log sigmoid(h). robust: DPO for labels flipped with probability `label_smoothing` (Chowdhury et
    al. 2024), (-(1 - e) log sigmoid(h) + e log sigmoid(-h)) / (1 - 2e). ipo: (d - 1 / (2 beta))^2, d the
    difference of the per-token averages of c - c0 and r - r0 (Azar et al. 2023; averaged as TRL does). simpo:
    -log sigmoid(beta (c / |c| - r / |r|) - simpo_gamma), no reference (Meng et al. 2024). orpo: -c / |c| - beta
    log sigmoid(log odds(c / |c|) - log odds(r / |r|)), no reference (Hong et al. 2024). sft_weight adds the chosen
    answer's mean negative log-likelihood, -c / |c|, that many times (TRL's "sft" beside another loss; TRL averages
    it, and ORPO's, over the batch's chosen tokens, here over the pairs' per-answer means)."""
    kind: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0

    @classmethod
    def of(cls, train):
        """From the flags (flags.Train): --preference-loss, --beta, --label-smoothing, --simpo-gamma, --sft-weight."""
        return cls(train.preference_loss, train.beta, train.label_smoothing, train.simpo_gamma, train.sft_weight)

    @property
    def needs_reference(self):
        return self.kind not in ("simpo", "orpo")

    def per_pair(self, logps, reference, lengths):
        """Each pair's loss, differentiable in `logps` ((pairs, 2): chosen, rejected)."""
        mean = logps / lengths
        if self.kind in ("sigmoid", "robust"):
            h = self.beta * ((logps[:, 0] - reference[:, 0]) - (logps[:, 1] - reference[:, 1]))
            e = self.label_smoothing if self.kind == "robust" else 0.0
            loss = (-(1 - e) * F.logsigmoid(h) + e * F.logsigmoid(-h)) / (1 - 2 * e)
        elif self.kind == "ipo":
            d = (logps - reference) / lengths
            loss = (d[:, 0] - d[:, 1] - 1 / (2 * self.beta)) ** 2
        elif self.kind == "simpo":
            loss = -F.logsigmoid(self.beta * (mean[:, 0] - mean[:, 1]) - self.simpo_gamma)
        elif self.kind == "orpo":
            odds = mean - torch.log(-torch.expm1(mean.clamp(max=-1e-6)))  # log(1 - p), finite at p = 1
            loss = -mean[:, 0] - self.beta * F.logsigmoid(odds[:, 0] - odds[:, 1])
        else:
            raise ValueError(f"unknown preference loss {self.kind!r}")
        return loss - self.sft_weight * mean[:, 0] if self.sft_weight else loss

    def rewards(self, logps, reference, lengths):
        """(pairs, 2) implicit rewards, as TRL reports them: beta (logp - reference logp); without a reference
        (simpo, orpo) beta times the answers' mean log-probability."""
        return self.beta * (logps - reference if self.needs_reference else logps / lengths)


def scored(pair_loss, logps, reference, lengths, *, stats, sequence):
    """A PairLoss summed over the pairs, d(loss)/d(logps) ((pairs, 2)), and the metrics' sums (preference.metric_values
    names them): the chosen and rejected rewards, the pairs ranked right, the answers' log-probabilities; from
    `stats` (answer_stats, per predicted token of `sequence`), per answer the mean logits' and the tokens' sums, the
    chosen tokens predicted first, the entropies' sum."""
    with torch.enable_grad():
        leaf = logps.detach().requires_grad_()
        loss = pair_loss.per_pair(leaf, reference, lengths).sum()
        d_logps, = torch.autograd.grad(loss, leaf)
    sums = metrics(pair_loss, logps.detach(), reference, lengths, stats=stats, sequence=sequence)
    return loss.detach(), d_logps, sums


def metrics(pair_loss, logps, reference, lengths, *, stats, sequence):
    chosen, rejected = pair_loss.rewards(logps, reference, lengths).unbind(1)
    first = (sequence % 2 == 0).float()  # a pair's chosen answer is its first sequence
    mean_logit, top1, entropy = stats
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), logps[:, 0].sum(),
                        logps[:, 1].sum(), (mean_logit * first).sum(), (mean_logit * (1 - first)).sum(),
                        first.sum(), (1 - first).sum(), (top1 * first).sum(), entropy.sum()]).detach().float()


def answer_stats(logits, labels):
    """Per predicted token, from its fp32 logits: the mean logit, whether the label is the most likely token (1.0),
    the entropy of its distribution (TRL's logits/*, mean_token_accuracy and entropy). The softmax a few rows at a
    time: no second (tokens x vocabulary) tensor."""
    entropy = torch.empty(len(labels), dtype=torch.float32, device=logits.device)
    for start in range(0, len(labels), 128):
        rows = logits[start:start + 128]
        entropy[start:start + 128] = rows.logsumexp(-1) - (rows.softmax(-1) * rows).sum(-1)
    return torch.stack([logits.mean(-1), (logits.argmax(-1) == labels).float(), entropy])


def preference_loss(token, targets, pair_loss, stats=None):
    """From each predicted token's log-probability: each answer's sum; then (the loss, metrics) or, without a
    reference yet, the (pairs, 2) sums themselves."""
    logps = torch.zeros(2 * targets.pairs, dtype=torch.float32, device=token.device).index_add(0, targets.sequence,
                                                                                                token.float())
    if targets.reference is None:
        return logps.view(-1, 2)
    lengths = answer_lengths(targets.sequence, targets.pairs)
    loss = pair_loss.per_pair(logps.view(-1, 2), targets.reference, lengths).sum()
    return loss, metrics(pair_loss, logps.view(-1, 2), targets.reference, lengths, stats=stats,
                         sequence=targets.sequence)


def answer_lengths(sequence, pairs):
    """(pairs, 2) tokens that carry loss in each answer (at least 1)."""
    ones = torch.ones(len(sequence), dtype=torch.float32, device=sequence.device)
    return torch.zeros(2 * pairs, dtype=torch.float32, device=sequence.device).index_add_(0, sequence, ones).view(
        -1, 2).clamp_(min=1)


def _logits(h, w, b):
    return (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()


@torch.no_grad()
def token_logps(hidden, weight, bias, targets, *, chunk, dtype, with_stats=False):
    """log p(target) of each position, a chunk at a time (float32); with_stats: and answer_stats of each."""
    with torch.autocast(hidden.device.type, enabled=False):
        h_all, w, b = hidden.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None
        out = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        stats = torch.empty(3, len(targets), dtype=torch.float32, device=hidden.device) if with_stats else None
        for start in range(0, len(targets), chunk):
            logits = _logits(h_all[start:start + chunk], w, b)
            y = targets[start:start + chunk]
            if with_stats:
                stats[:, start:start + chunk] = answer_stats(logits, y)
            out[start:start + chunk] = logits.gather(1, y[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
    return (out, stats) if with_stats else out


class LinearPreference(torch.autograd.Function):
    """A PairLoss over the pairs of a batch, from the final hidden states, chunk by chunk: the log-probabilities first
    (token_logps), then the gradients with each token's weight, d(loss)/d(its answer's logp): a second pass over the
    chunks where the head is trained, else the hidden states' gradient made in the first pass and scaled."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sequence, pairs, reference, pair_loss, chunk, dtype, with_grads):
        need_hidden, need_weight, need_bias = (with_grads and needed for needed in ctx.needs_input_grad[:3])
        token, stats = token_logps(hidden, weight, bias, targets, chunk=chunk, dtype=dtype, with_stats=True)
        logps = torch.zeros(2 * pairs, dtype=torch.float32, device=hidden.device).index_add_(0, sequence, token)
        loss, d_logps, sums = scored(pair_loss, logps.view(-1, 2), reference, answer_lengths(sequence, pairs),
                                     stats=stats, sequence=sequence)
        # d(loss)/d(logits) of a token = -d(loss)/d(its logp) x (softmax - one-hot)
        weights = -d_logps.flatten().index_select(0, sequence)
        grad_hidden = grad_weight = grad_bias = None
        if need_hidden or need_weight or need_bias:
            with torch.autocast(hidden.device.type, enabled=False):
                h_all, w = hidden.to(dtype), weight.to(dtype)
                b = bias.to(dtype) if bias is not None else None
                grad_hidden = torch.empty_like(h_all) if need_hidden else None
                grad_weight = torch.zeros_like(weight) if need_weight else None
                grad_bias = torch.zeros_like(bias) if need_bias else None
                for start in range(0, len(targets), chunk):
                    h, y = h_all[start:start + chunk], targets[start:start + chunk]
                    logits = _logits(h, w, b)
                    logits = logits.sub_(logits.max(dim=-1, keepdim=True).values).exp_()
                    logits.div_(logits.sum(dim=-1, keepdim=True))
                    logits[torch.arange(len(y), device=y.device), y] -= 1
                    g = logits.mul_(weights[start:start + chunk, None]).to(dtype)
                    if grad_hidden is not None:
                        grad_hidden[start:start + chunk] = g @ w
                    if grad_weight is not None and grad_weight.dtype == dtype:
                        grad_weight.addmm_(g.t(), h)
                    elif grad_weight is not None:
                        grad_weight += g.t() @ h
                    if grad_bias is not None:
                        grad_bias += g.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_out, _):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = lambda g, dtype=None: None if g is None else g.mul_(grad_out).to(dtype or g.dtype)
        return (scale(grad_hidden, ctx.hidden_dtype), scale(grad_weight), scale(grad_bias), *[None] * 8)
