"""KTO on unpaired feedback against TRL's KTOTrainer (its defaults, and set for speed), on 2 ranks under ZeRO-2, from
the same SFT model, rows, lr, beta, schedule and epochs. Wall-clock time is the whole launch, as a user waits for it
(start-up, tokenization, the reference pass). The tuned models are judged by bench/dpo.py's score() alone, with stock
transformers: on held-out pairs of a right and a wrong answer to the same question, the share where the right
(desirable) answer's reward, beta (logp - reference logp), is above the wrong one's.

    pip install --no-deps trl==1.16.0 && python3 bench/kto.py     # about 10 minutes on 2 cores: out/bench/kto/KTO.md

The data: bench/dpo.py's questions about generated reviews, each pair split into two rows (the right answer
desirable, the wrong one not), shuffled, so a row's mismatched completion answers another question.
"""

import argparse
import json
import random
import statistics
from pathlib import Path

from dpo import BIN, ROOT, free_port, score, sft_model, timed_runs, wall_cells

from finetune.internals import demo


def unpaired_rows(pairs_file, path):
    rows = []
    for line in open(pairs_file):
        pair = json.loads(line)
        rows += [
            {"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
            {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False},
        ]
    random.Random(0).shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "kto"))
    p.add_argument("--pairs", type=int, default=1500, help="pairs split into rows: twice as many rows")
    p.add_argument("--held-out", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--repeat", type=int, default=3, help="runs of each, in alternating order; the median is kept")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft = sft_model(out)
    demo.make_demo_pairs(out / "pairs.jsonl", n=args.pairs, seed=7, style="messages")
    demo.make_demo_pairs(out / "held-out.jsonl", n=args.held_out, seed=8, style="messages")
    rows = unpaired_rows(out / "pairs.jsonl", out / "rows.jsonl")
    unpaired_rows(out / "held-out.jsonl", out / "held-out-rows.jsonl")
    common = ["--lr", str(args.lr), "--beta", str(args.beta), "--epochs", str(args.epochs), "--warmup-ratio", "0.05"]
    deepspeed = lambda: [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    # the same rows a step: ours packed, about 2.6 rows (each with its mismatched completion, the prompt once) a
    # 128-token block, 2 blocks a rank; TRL's 6 rows a rank, padded per batch
    ours = [*deepspeed(), "zero-optimization.py", "--dataset", str(out / "rows.jsonl"), "--model", str(sft / "final")]
    ours += ["--batch-size", "2", "--block-size", "128", "--zero-stage", "2", "--deepspeed", "--eval-every", "0"]
    ours += ["--save-every", "0", "--prompt", "", "--overwrite", "--log-every", "20", "--output-dir", str(out / "ours")]
    ours += ["--eval-dataset", str(out / "held-out-rows.jsonl"), "--max-eval-samples", "12", *common]
    trl = lambda folder, *more: [
        *deepspeed(),
        "bench/trl_peer.py",
        "--trainer",
        "kto",
        "--model",
        str(sft / "final"),
        "--dataset",
        str(out / "rows.jsonl"),
        "--output-dir",
        str(out / folder),
        "--batch-size",
        "6",
        "--max-length",
        "256",
        *common[:6],
        *more,
    ]
    runs = [
        ("ours (isolated packing)", "ours", ours),
        ("TRL KTOTrainer", "trl", trl("trl")),  # its defaults: gradient checkpointing on, the reference alongside
        ("TRL KTOTrainer, set for speed", "trl-fast", trl("trl-fast", "--fast")),
    ]
    found = timed_runs(runs, args.repeat, out)
    pairs = [json.loads(line) for line in open(out / "held-out.jsonl")]
    models = {name: r["folder"] / "final" for name, r in found.items()} | {"SFT model (the reference)": sft / "final"}
    scores = score(models, sft / "final", pairs, args.beta)
    lines = [
        f"{rows:,} rows ({args.pairs:,} pairs split), {args.epochs:g} epoch, lr {args.lr:g}, beta {args.beta:g}, "
        f"2 CPU ranks, ZeRO-2; held-out: {len(pairs)} pairs",
        "",
        f"| run | held-out reward accuracy | accuracy, TRL's completions | wall clock (s), median of {args.repeat} "
        "[range] | x TRL | x TRL set for speed | reference pass (s) | steps | train tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (_, accuracy, _, tail_accuracy) in scores.items():
        r = found.get(name)
        quality = f"| {name} | {accuracy:.3f} | {tail_accuracy:.3f} |"
        if r is None:
            lines.append(quality + " - | - | - | - | - | - |")
            continue
        res = json.loads((r["folder"] / "results.json").read_text())
        steps = res.get("steps") or len(res.get("losses", []))
        peers = (found["TRL KTOTrainer"]["seconds"], found["TRL KTOTrainer, set for speed"]["seconds"])
        reference = statistics.median(r["reference"]) if r["reference"] else "-"
        lines.append(
            f"{quality} {wall_cells(r['seconds'], *peers)} {reference} | {steps} | "
            f"{res.get('tokens_per_sec') or 0:,.0f} |"
        )
    (out / "KTO.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
