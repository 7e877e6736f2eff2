"""Reward models: sequence_classification.py on a preference file against TRL's RewardTrainer (its defaults, and set
for speed), on 2 ranks under ZeRO-2, from the same SFT model (a new one-output head), pairs, lr, schedule and epochs.
Wall-clock time is the whole launch, as a user waits for it. The models are judged with stock transformers alone:
on held-out pairs, the share whose chosen answer the model scores higher.

    pip install --no-deps trl==1.16.0 && python3 bench/reward.py    # about 8 minutes: out/bench/reward/REWARD.md

The data: bench/dpo.py's questions about generated reviews (messages), the right answer chosen over a wrong one.
Ours holds 5% of the file out for its per-epoch eval; TRL trains on the same 95%.
"""

import argparse
import json
from pathlib import Path

import torch
from dpo import BIN, ROOT, free_port, sft_model, timed_runs, wall_cells

from finetune import data, reward
from finetune.internals import demo


@torch.no_grad()
def accuracy(folder, pairs):
    """The share of pairs whose chosen text the model at `folder` scores higher, each text alone, in float64."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = tokenizer.chat_template or data.DEFAULT_CHAT_TEMPLATE
    score = lambda text: model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
    right = [score(chosen) > score(rejected) for chosen, rejected in (reward.pair_texts(p, tokenizer) for p in pairs)]
    return sum(right) / len(right)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "reward"))
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--held-out", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--repeat", type=int, default=3, help="runs of each, in alternating order; the median is kept")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft = sft_model(out)
    demo.make_demo_pairs(out / "pairs.jsonl", n=args.pairs, seed=7, style="messages")
    demo.make_demo_pairs(out / "held-out.jsonl", n=args.held_out, seed=8, style="messages")
    ours_train = data.load_splits(str(out / "pairs.jsonl"), seed=42)[0]  # what ours trains on: TRL the same rows
    (out / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ours_train))
    deepspeed = lambda: [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    common = ["--model", str(sft / "final"), "--lr", str(args.lr), "--epochs", str(args.epochs)]
    ours = [*deepspeed(), "sequence_classification.py", "--dataset", str(out / "pairs.jsonl"), *common]
    ours += ["--deepspeed", "ds_config_zero2.json", "--batch-size", "6", "--max-length", "256", "--weight-decay", "0"]
    ours += ["--warmup-ratio", "0.05", "--overwrite", "--output-dir", str(out / "ours")]
    trl = lambda folder: [
        *deepspeed(),
        "bench/trl_peer.py",
        "--trainer",
        "reward",
        *common,
        "--batch-size",
        "6",
        "--dataset",
        str(out / "train.jsonl"),
        "--max-length",
        "256",
        "--output-dir",
        str(out / folder),
    ]
    runs = [
        ("ours (sequence_classification.py)", "ours", ours),
        ("TRL RewardTrainer", "trl", trl("trl")),  # its defaults: gradient checkpointing on
        ("TRL RewardTrainer, set for speed", "trl-fast", [*trl("trl-fast"), "--fast"]),
    ]
    found = timed_runs(runs, args.repeat, out)
    held_out = [json.loads(line) for line in open(out / "held-out.jsonl")]
    lines = [
        f"{len(ours_train):,} pairs, {args.epochs:g} epoch, lr {args.lr:g}, 6 pairs a rank a step, 2 CPU ranks, "
        f"ZeRO-2; held-out: {len(held_out)} pairs",
        "",
        f"| run | held-out accuracy | wall clock (s), median of {args.repeat} [range] | x TRL | x TRL set for speed |",
        "|---|---|---|---|---|",
    ]
    peers = (found["TRL RewardTrainer"]["seconds"], found["TRL RewardTrainer, set for speed"]["seconds"])
    for name, r in found.items():
        lines.append(f"| {name} | {accuracy(r['folder'] / 'final', held_out):.3f} | {wall_cells(r['seconds'], *peers)}")
    (out / "REWARD.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
