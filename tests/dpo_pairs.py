"""What the DPO tests share beside the `pairs` fixture (conftest.py: generated pairs in each format, a tiny OPT): the
flags of a run on them, the data's piece, the DPO formula on stock transformers in float64 (tests/test_preference.py,
tests/test_dpo_runs.py)."""

import torch
import torch.nn.functional as F
from helpers import (
    base_args,
    load_script,
    sequences,
)

from finetune import flags

single = load_script("single-gpu.py")
BLOCK = 128


def dpo_args(pairs, out, **overrides):
    return base_args(
        {"model": pairs["model"], "data": pairs["strings"]},
        out,
        **{"--block-size": BLOCK, "--batch-size": 4, "--lr": 3e-3, "--beta": 0.5, "--warmup-ratio": 0, **overrides},
    )


def data_args(path, **kw):
    return flags.defaults(**{"dataset": str(path), "seed": 0, "block_size": BLOCK, "max_eval_samples": 0, **kw}).data


def independent_dpo(model, split, pair_ids, reference, beta):
    """mean over the pairs of -log sigmoid(beta ((c - c_ref) - (r - r_ref))), each sequence alone through the
    model given (stock transformers), its answer's log-probability summed in float64."""
    seqs, total = sequences(split), 0
    for i in pair_ids:
        logps = []
        for ids, mask in (seqs[i][:2], seqs[i][2:]):
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            carries = torch.tensor(mask[1:]) > 0
            logps.append(-F.cross_entropy(logits[carries], torch.tensor(ids[1:])[carries], reduction="sum"))
        ref = reference[i].double()
        total = total - F.logsigmoid(beta * ((logps[0] - ref[0]) - (logps[1] - ref[1])))
    return total / len(pair_ids)
