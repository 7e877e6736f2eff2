"""The loss of a batch's preference pairs (DPO's, or another --preference-loss: PairLoss), from each answer's summed
log-probability: from the whole batch's logits (of_logits, --loss-chunk 0) or a chunk of the final hidden states at a
time (of_hidden: LinearPreference makes the chunks' log-probabilities first, then the pairs' losses and the weight each
token's gradient takes from them, then, a second pass over the chunks unless the head is frozen, the weighted
gradients). Without a reference yet (the reference pass) each gives the (pairs, 2) log-probabilities. What loss.py's
CausalLMLoss hands a batch of pairs over to."""
import dataclasses

import torch
import torch.nn.functional as F


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
    it, and ORPO's, over the batch's chosen tokens, here over the pairs' per-answer means).
    kto (unpaired rows: a pair's answers are a completion and its KL completion; Ethayarajh et al. 2024, eq. 7, as
    TRL's KTOTrainer): with z = beta (c - c0 - kl), a desirable completion's loss desirable_weight (1 - sigmoid(z)),
    an undesirable one's undesirable_weight (1 - sigmoid(-z)); kl, the reference point, the mean of r - r0 over the
    step's whole global batch, at least 0, held constant (kl_point; reference_point)."""
    kind: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @classmethod
    def of(cls, train):
        """From the flags (flags.Train): --preference-loss, --beta, --label-smoothing, --simpo-gamma, --sft-weight,
        --desirable-weight, --undesirable-weight."""
        return cls(train.preference_loss, train.beta, train.label_smoothing, train.simpo_gamma, train.sft_weight,
                   train.desirable_weight, train.undesirable_weight)

    @property
    def needs_reference(self):
        return self.kind not in ("simpo", "orpo")

    def per_pair(self, logps, reference, lengths, *, desirable=None, kl=None):
        """Each pair's loss, differentiable in `logps` ((pairs, 2): chosen, rejected; kto: the completion, the KL
        completion, which is not differentiated: its log-probabilities make only the reference point, kl)."""
        mean = logps / lengths
        if self.kind == "kto":
            z = self.beta * (logps[:, 0] - reference[:, 0] - kl)
            return torch.where(desirable, self.desirable_weight * (1 - torch.sigmoid(z)),
                               self.undesirable_weight * (1 - torch.sigmoid(-z)))
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

    def of_logits(self, logits, targets):
        """The batch's (summed loss, metrics' sums) from all its fp32 logits; `targets`: blocks.Targets."""
        return plain_preference_loss(logits, targets, self)

    def of_hidden(self, hidden, head, labels, targets, *, chunk, dtype):
        """The same from the hidden states of the positions that carry loss and the output head, a chunk at a time."""
        if targets.reference is None:  # the reference pass (and KTO's KL pass): log-probabilities only
            token = token_logps(hidden, head.weight, head.bias, labels, chunk=chunk, dtype=dtype)
            return preference_loss(token, targets, self)
        return LinearPreference.apply(hidden, head.weight, head.bias, labels, targets, self, chunk, dtype,
                                      torch.is_grad_enabled())

    def rewards(self, logps, reference, lengths):
        """(pairs, 2) implicit rewards, as TRL reports them: beta (logp - reference logp); without a reference
        (simpo, orpo) beta times the answers' mean log-probability."""
        return self.beta * (logps - reference if self.needs_reference else logps / lengths)


def reference_point(logps, targets):
    """KTO's kl for this batch (None for pairs): the step's, made before it (preference.kl_point), or, where the step
    is one micro-batch a rank (then no pass before it), made here from this batch's KL completions on every rank: the
    mean of their log-ratio to the reference, summed over the ranks (an all-reduce of two numbers), at least 0. Every
    rank runs the same micro-steps, so every rank takes part."""
    if targets.desirable is None or targets.kl is not None:
        return targets.kl
    sums = torch.stack([(logps[:, 1].detach().double() - targets.reference[:, 1].double()).sum(),
                        torch.full((), len(logps), dtype=torch.float64, device=logps.device)])  # (no copy)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()


def scored(pair_loss, logps, targets, lengths, *, stats):
    """A PairLoss summed over the pairs, d(loss)/d(logps) ((pairs, 2)), and the metrics' sums (metrics)."""
    kl = reference_point(logps, targets)
    with torch.enable_grad():
        leaf = logps.detach().requires_grad_()
        loss = pair_loss.per_pair(leaf, targets.reference, lengths, desirable=targets.desirable, kl=kl).sum()
        d_logps, = torch.autograd.grad(loss, leaf)
    sums = metrics(pair_loss, logps.detach(), targets, lengths, stats=stats, kl=kl)
    return loss.detach(), d_logps, sums


def metrics(pair_loss, logps, targets, lengths, *, stats, kl=None):
    """The metrics' sums (metrics.metric_values names them): the chosen and rejected rewards, the pairs ranked right,
    the answers' log-probabilities; from `stats` (answer_stats, per predicted token), per answer the mean logits' and
    the tokens' sums, the chosen tokens predicted first, the entropies' sum; KTO's reference point and units (0 for
    pairs). KTO: "chosen" the desirable completions, "rejected" the undesirable ones, "ranked right" the desirable
    ones' count (TRL's KTO metrics; the KL completions count in none of them)."""
    chosen, rejected = pair_loss.rewards(logps, targets.reference, lengths).unbind(1)
    sequence, pairs = targets.sequence, len(logps)
    first = (sequence % 2 == 0).float()  # a pair's chosen answer is its first sequence
    mean_logit, top1, entropy = stats
    if targets.desirable is None:
        return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), logps[:, 0].sum(),
                            logps[:, 1].sum(), (mean_logit * first).sum(), (mean_logit * (1 - first)).sum(),
                            first.sum(), (1 - first).sum(), (top1 * first).sum(), entropy.sum(),
                            *chosen.new_zeros(2)]).detach().float()
    good = targets.desirable.float()
    good_token = first * good[sequence // 2]
    bad, bad_token = 1 - good, first - good_token
    return torch.stack([(chosen * good).sum(), (chosen * bad).sum(), good.sum(), (logps[:, 0] * good).sum(),
                        (logps[:, 0] * bad).sum(), (mean_logit * good_token).sum(), (mean_logit * bad_token).sum(),
                        good_token.sum(), bad_token.sum(), (top1 * good_token).sum(), (entropy * first).sum(),
                        kl * pairs, chosen.new_tensor(pairs)]).detach().float()


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
    kl = reference_point(logps.view(-1, 2), targets)
    loss = pair_loss.per_pair(logps.view(-1, 2), targets.reference, lengths, desirable=targets.desirable,
                              kl=kl).sum()
    return loss, metrics(pair_loss, logps.view(-1, 2), targets, lengths, stats=stats, kl=kl)


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
    def forward(ctx, hidden, weight, bias, labels, given, pair_loss, chunk, dtype, with_grads):
        """`labels`: the positions' targets; `given`: the batch's blocks.Targets (answers, pairs, references)."""
        need_hidden, need_weight, need_bias = (with_grads and needed for needed in ctx.needs_input_grad[:3])
        targets, sequence, pairs = labels, given.sequence, given.pairs
        token, stats = token_logps(hidden, weight, bias, targets, chunk=chunk, dtype=dtype, with_stats=True)
        logps = torch.zeros(2 * pairs, dtype=torch.float32, device=hidden.device).index_add_(0, sequence, token)
        loss, d_logps, sums = scored(pair_loss, logps.view(-1, 2), given, answer_lengths(sequence, pairs),
                                     stats=stats)
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
        return (scale(grad_hidden, ctx.hidden_dtype), scale(grad_weight), scale(grad_bias), *[None] * 6)


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
