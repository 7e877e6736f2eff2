"""TRL's metrics of preference pairs (rewards/chosen, rewards/accuracies, logps/*, logits/*, ...): their sums made
with each batch's loss (pair_loss.metrics), added up over a step and kept until the next log line (PairMetrics),
then averaged over the global batch's pairs or answer tokens (metric_values), as TRL's DPOTrainer logs them (KTO's:
as its KTOTrainer does, with "kl" and without "rewards/accuracies")."""
import math

import torch

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "mean_token_accuracy", "entropy")  # as TRL's DPO
ALL_METRICS = (*METRICS, "kl")  # and KTO's: "kl", no "rewards/accuracies"
SUMS = len(ALL_METRICS) + 2  # pair_loss.metrics' sums a batch


def metric_values(sums, pairs):
    """The metrics from pair_loss.metrics' sums over some pairs (a list): per pair the rewards, the share ranked
    right, their margin and the answers' log-probabilities; per answer token the mean logit (chosen, rejected), per
    chosen token the share predicted as the most likely token, per answer token the entropy: as TRL's DPOTrainer logs
    them. Unpaired rows (KTO): the rewards and log-probabilities per desirable or undesirable completion, the tokens'
    of the completions, and the KL term (its mean over the steps' units), as TRL's KTOTrainer logs them."""
    chosen, rejected, right, logp_chosen, logp_rejected, logit_chosen, logit_rejected, n_chosen, n_rejected, top1, \
        entropy, kl, units = sums
    per = lambda value, count: value / count if count else math.nan
    good, bad = (right, pairs - right) if units else (pairs, pairs)
    values = dict(zip(ALL_METRICS, [per(chosen, good), per(rejected, bad), per(right, pairs),
                                per(chosen, good) - per(rejected, bad) if units else per(chosen - rejected, pairs),
                                per(logp_chosen, good),
                                per(logp_rejected, bad), per(logit_chosen, n_chosen), per(logit_rejected, n_rejected),
                                per(top1, n_chosen), per(entropy, n_chosen + n_rejected), per(kl, units)]))
    del values["rewards/accuracies" if units else "kl"]
    return values


class PairMetrics:
    """A run's pair metrics between log lines (progress.RunStats holds one): each micro-batch's sums added up over the
    step (add), the step's kept with the global batch's count of pairs (end_step), and all of them handed over as one
    tensor for the log line's all-reduce (take) and read back per step (per_step)."""

    def __init__(self):
        self.step_sums, self.pending = None, []

    def add(self, sums):
        if sums is not None:
            self.step_sums = sums if self.step_sums is None else sums + self.step_sums

    def end_step(self, pairs):
        """`pairs`: the global batch's pairs (every rank adds them: per_step divides by the ranks)."""
        sums, self.step_sums = self.step_sums, None
        if sums is not None:
            self.pending.append(torch.cat([sums, sums.new_tensor([pairs])]))

    def take(self, like):
        """The pending steps' sums, flat, on `like`'s device (empty without pairs), no longer pending."""
        taken = torch.stack(self.pending).flatten().to(like.device) if self.pending else like[:0]
        self.pending = []
        return taken

    def per_step(self, reduced, ranks):
        """{metric: value} of each step taken, from its sums all-reduced over `ranks` ranks."""
        steps = reduced.view(-1, SUMS + 1).tolist() if len(reduced) else []
        return [metric_values(sums, count / ranks) for *sums, count in steps]
