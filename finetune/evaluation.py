"""Evaluation during and after training: the mean loss over an eval split's tokens that carry loss (or, for
preference pairs, the mean DPO loss and the reward accuracy), every rank evaluating its share, without drawing a
random number or changing the training."""
import math

import torch

from . import preference
from .blocks import rank_batches


@torch.no_grad()
def eval_loss_sums(model, blocks, batch_size, process):
    """(summed loss, predicted tokens) over this rank's share of the eval set, as a float64 tensor to all-reduce;
    for preference pairs (summed pair loss, pairs, their metrics' sums: preference/metrics.py). Every rank runs the
    same number of forward passes (ZeRO-3 gathers parameters collectively); a rank with nothing left runs a batch
    whose loss is masked out. `model`: a loss.CausalLMLoss (or the engine that wraps it); `batch_size`: sequences a
    rank and pass; `process`: training.Process."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=process.device)
    pairs = None
    batches = list(rank_batches(len(blocks), batch_size, process.rank, process.world_size))
    kl = preference.kl_point(model, blocks, batches, process)  # KTO's reference point: over the whole eval split
    for mine in batches:
        inputs, targets = blocks.batch(mine if len(mine) else [0], process, carry_loss=len(mine) > 0, kl=kl)
        # eagerly under --compile: in eval mode without gradients dynamo compiles every graph anew, which takes
        # longer than most evals run (docs/zero.md)
        with process.autocast, torch.compiler.set_stance("force_eager"):
            summed = model(inputs=inputs, targets=targets)
        total[0] += summed.loss.double()
        total[1] += targets.counted
        if summed.pair_metrics is not None:
            pairs = summed.pair_metrics + (0 if pairs is None else pairs)
    model.train()
    return total if pairs is None else torch.cat([total, pairs.double()])


def evaluate(model, blocks, batch_size, process):
    """(eval loss, tokens, None): the mean loss over the eval set's tokens that carry loss (the answers, for prompt/
    completion and chats), every rank evaluating its share; for preference pairs (the mean DPO loss, pairs, TRL's
    metrics: preference.metric_values). It draws no random numbers and leaves the model in training mode: a run that
    evaluates trains exactly as one that does not."""
    sums = eval_loss_sums(model, blocks, batch_size, process)
    if process.world_size > 1:
        torch.distributed.all_reduce(sums)
    sums = sums.tolist()
    metrics = preference.metric_values(sums[2:], sums[1]) if len(sums) > 2 else None
    return sums[0] / sums[1] if sums[1] else math.nan, int(sums[1]), metrics


def perplexity(value):
    return math.exp(value) if value < 700 else float("inf")  # exp overflows a float past ~709
