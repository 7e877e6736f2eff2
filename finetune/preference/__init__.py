"""Preference pairs (DPO, Rafailov et al. 2023, and its loss family; docs/preference.md), behind one boundary: what
the rest of the package uses of them is named here, each from the module that holds it:
  rows.py       rows of a better and a worse answer -> one packing unit each (data.py: COLUMNS, documents, counted;
                the samples: examples_prompt); unpaired rows (KTO) -> the same units (unpaired_documents)
  reference.py  the model as loaded scores every pair once (the scripts: reference, resolved); KTO's reference
                point, the KL term, over each global batch (the scripts, evaluation.py: kl_point)
  pair_loss.py  a batch's pairs' loss, from its logits or its hidden states (loss.py: PairLoss.of_logits, of_hidden)
  metrics.py    TRL's metrics, summed with the loss and reported at each log line and eval (progress.py: PairMetrics;
                evaluation.py: metric_values)
blocks.py lays a pair's two sequences out in a batch (one row with the prompt once, or two rows) and gives the loss
each token's answer (Targets.sequence) and the pairs' reference log-probabilities (Targets.reference)."""
from .metrics import METRICS, PairMetrics, metric_values
from .pair_loss import PairLoss
from .reference import kl_point, learning_rate, reference, resolved, without_dropout
from .rows import (
    COLUMNS,
    FORMATS,
    UNPAIRED_COLUMNS,
    counted,
    documents,
    examples_prompt,
    mismatched,
    unpaired_documents,
)

__all__ = ["COLUMNS", "FORMATS", "METRICS", "UNPAIRED_COLUMNS", "PairLoss", "PairMetrics", "counted",
           "documents", "examples_prompt", "kl_point", "learning_rate", "metric_values", "mismatched", "reference",
           "resolved", "unpaired_documents", "without_dropout"]
