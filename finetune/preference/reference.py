"""The reference: the model as loaded scores every pair once, before the first step; a resume reads what was kept.
KTO's reference point (the KL term) for each step. The data's loss and learning rate's defaults."""
import json
import time
from pathlib import Path

import torch

from ..base import fail
from ..blocks import rank_batches
from .pair_loss import PairLoss


def reference(model, splits, config, out, process):
    """Before the first step: the log-probabilities of every pair's two answers under the model as loaded (with LoRA:
    the base), each rank its share, summed over the ranks, kept in <output-dir>/reference.pt; a resume reads that
    file (rank 0 reads it, the others get it from rank 0), so the reference never moves and is never recomputed.
    They go with the splits' batches to the loss, with --beta. No second copy of the model at any time. `config`:
    the run's Config (flags.py); `process`: training.Process."""
    train = splits[0]
    if train.pieces is None:  # not pairs, nor unpaired rows
        return splits
    if config.sequence_parallel > 1:
        fail("preference pairs (DPO) are not split over ranks: drop --sequence-parallel (or shorten the pairs)")
    rank, world_size = process.rank, process.world_size
    without_dropout(model)
    if not PairLoss.of(config.train).needs_reference:  # simpo, orpo: no reference model, nothing to score or keep
        return [split.with_reference(torch.zeros(split.pairs_total, 2)) for split in splits]
    path, tensors, made_of = out / "reference.pt", None, fingerprint(splits, config.model)
    if config.run.resume and rank == 0:  # a run that starts (an earlier run's file included) scores them anew
        if not path.exists():
            fail(f"{path} is missing, so the resumed run has no reference; start again with --overwrite")
        saved = torch.load(path, weights_only=True)
        tensors = [saved[name] for name in ("train", "eval")]
        if any(len(t) != n for t, n in zip(tensors, (train.pairs_total, splits[1].pairs_total))):
            fail(f"{path} holds the reference of other data; start the run again with --overwrite")
        was = json.loads(saved.get("made_of", "{}"))  # (a file written before it was kept: the counts only)
        changed = [key for key in made_of if key in was and was[key] != made_of[key]]
        if changed:
            fail(f"{path} was scored with another {', '.join(REFERENCE_INPUTS[k] for k in changed)} than this run's: "
                 f"its log-probabilities would be wrong. Resume with the run's own flags, or start again with "
                 f"--overwrite")
    has = torch.tensor([int(tensors is not None)], device=process.device)
    if world_size > 1:
        torch.distributed.broadcast(has, 0)
    if has.item():
        tensors = tensors or [torch.zeros(s.pairs_total, 2, dtype=torch.float64) for s in splits]
        if world_size > 1:
            for t in tensors:
                moved = t.to(process.device)
                torch.distributed.broadcast(moved, 0)
                t.copy_(moved.cpu())
    else:
        started = time.perf_counter()
        tensors = [_scores(model, s, config.train.batch_size, process) for s in splits]
        if rank == 0:
            tmp = path.with_name(".tmp-reference.pt")
            torch.save({"train": tensors[0], "eval": tensors[1], "made_of": json.dumps(made_of)}, tmp)
            tmp.replace(path)
        units = "pairs" if train.desirable is None else "completions and their mismatched ones"  # (KTO)
        process.say(f"reference log-probabilities of {len(tensors[0]) + len(tensors[1]):,} {units} computed once in "
            f"{time.perf_counter() - started:.1f} s, kept in {path}")
    return [split.with_reference(scores.float()) for split, scores in zip(splits, tensors)]


REFERENCE_INPUTS = {"pairs": "dataset, rows or cut (--dataset, --eval-dataset, --block-size, --packing, ...)",
                    "model": "--model", "lora_rank": "--lora-rank", "base": "quantized base",
                    "precision": "--precision"}


def fingerprint(splits, model):
    """What the reference's log-probabilities depend on, kept beside them: the prepared pairs (their cache key: the
    dataset, its rows, the block size and packing that cut them), the model (its folder's name), the adapters'
    base (LoRA scores the base; 4 or 8 bits round it) and the precision it ran in. `model`: flags.Model."""
    return {"pairs": [s.source for s in splits], "model": Path(str(model.model)).name, "lora_rank": model.lora_rank,
            "base": f"{model.bits}bit" if model.bits else "", "precision": model.precision}


def without_dropout(model):
    """DPO trains without dropout (as TRL does by default): the first step's loss is then ln 2 exactly, and the
    model's log-probabilities are the ones the reference was scored with. Dropout layers, and the rates the models
    keep as numbers (OPT's attention_dropout, GPT-2's attn_pdrop, ...), all to 0; a mixture of experts' router noise
    too (Mixtral's jitter_noise: it scales the hidden states at random in training mode)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop") or name == "layerdrop"
                                             or "jitter" in name):
                setattr(module, name, 0.0)


@torch.no_grad()
def _scores(model, blocks, batch_size, process):
    """Each pair's (chosen, rejected) log-probabilities, float64, on every rank. Every rank runs the same number of
    forward passes (ZeRO-3 gathers parameters collectively); a rank with nothing left runs a masked batch."""
    model.eval()
    scores = torch.zeros(blocks.pairs_total, 2, dtype=torch.float64, device=process.device)
    for mine in rank_batches(len(blocks), batch_size, process.rank, process.world_size):
        inputs, targets = blocks.batch(mine if len(mine) else [0], process)
        # eagerly under --compile: one pass, in shapes and a grad mode the training never runs, compiled for each
        # batch shape would take longer than it runs (200 pairs on a CPU: 40 s against 0.2 s)
        with process.autocast, torch.compiler.set_stance("force_eager"):
            logps = model(inputs=inputs, targets=targets)  # (targets.reference None: the log-probabilities)
        if len(mine):
            scores[torch.from_numpy(blocks.pair_ids(mine)).to(process.device)] = logps.view(-1, 2).double()
    model.train()
    if process.world_size > 1:
        torch.distributed.all_reduce(scores)
    return scores.cpu()


@torch.no_grad()
def kl_point(model, blocks, micro_batches, process):
    """KTO's reference point for a step (a float32 device scalar; None for any other data): the mean over the units
    of `micro_batches` on every rank (the global batch; an eval split) of each KL completion's log-ratio to the
    reference, r - r0, at least 0, as TRL's KTOTrainer estimates it from its batch. A pass without gradients
    before the step's first micro-step (the scripts call it for unpaired rows), so the loss of every micro-step on
    every rank takes the same value: one process and any number of ranks train alike. No host read: the value stays
    on the device. Where the step is one micro-batch a rank, no pass: None, and the loss makes the same value from
    that micro-batch's own forward (pair_loss.reference_point)."""
    if blocks.desirable is None or len(micro_batches) == 1:
        return None
    sums = torch.zeros(2, dtype=torch.float64, device=process.device)
    for micro in micro_batches:
        inputs, targets = blocks.batch(micro if len(micro) else [0], process, carry_loss=len(micro) > 0)
        # eagerly under --compile, as the reference pass: a forward without gradients, not a graph training runs
        with process.autocast, torch.compiler.set_stance("force_eager"):
            logps = model(inputs=inputs, targets=targets._replace(reference=None))  # (units, 2): the log-probabilities
        sums[0] += (logps[:, 1].double() - targets.reference[:, 1].double()).sum()
        sums[1] += targets.pairs
    if process.world_size > 1:
        torch.distributed.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()


def resolved(config, data_format):
    """The run's Config for its data: --lr's default (learning_rate), and for unpaired rows the KTO loss (one line
    for a pair loss or --sft-weight given with them, or KTO with pairs). `config`: flags.Config."""
    train, loss = config.train, config.train.preference_loss
    if data_format == "unpaired":
        if loss not in ("sigmoid", "kto"):  # (sigmoid: the flag's default)
            fail(f"unpaired rows (prompt, completion, label) train with KTO: drop --preference-loss {loss}")
        if train.sft_weight:
            fail("--sft-weight adds the chosen answer's likelihood of preference pairs, and unpaired rows (KTO) have "
                 "none: drop it")
        loss = "kto"
    elif data_format == "preference" and loss == "kto":
        fail("--preference-loss kto takes unpaired rows (prompt, completion, label), and these are pairs: drop it "
             "for DPO, or give each answer a row of its own")
    return config.resolved(lr=learning_rate(train.lr, data_format, config.model.lora_rank), preference_loss=loss)


LEARNING_RATES = {"text": 5e-5, "preference": 1e-6, "preference+lora": 5e-6}  # --lr's defaults (learning_rate)


def learning_rate(lr, data_format, lora_rank):
    """--lr, or its default for the data: 5e-5 for supervised fine-tuning; for preference pairs (DPO) TRL's DPOConfig
    default, 1e-6 (full fine-tuning DPO runs from 5e-7 to 5e-6: 5e-5 would move a model 50 times too far for a
    user who only changed the data's format), and 5e-6 with LoRA, whose scaled low-rank updates take a larger
    rate (docs/preference.md); the same for unpaired rows (KTO: TRL's KTOConfig default is DPO's)."""
    if lr is not None:
        return lr
    if data_format in ("preference", "unpaired"):
        return LEARNING_RATES["preference+lora" if lora_rank else "preference"]
    return LEARNING_RATES["text"]
