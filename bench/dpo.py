"""Preference tuning (DPO) against TRL's DPOTrainer (its defaults, and set for speed), on 2 ranks, from the same SFT
model, pairs, lr, beta, schedule and epochs; and DPO's tokens/s against SFT's on the same data. Wall-clock time is
the whole launch, as a user waits for it (start-up, tokenization, the reference pass). The tuned models are scored
by score() alone: the DPO loss and the reward accuracy of held-out pairs against the same reference (the SFT model),
pair by pair with stock transformers, over the tokens the chat template marks as the assistant's.

    pip install --no-deps trl==1.16.0 && python3 bench/dpo.py     # about 11 minutes on 2 cores: out/bench/dpo/DPO.md

The data: the demo's questions about generated reviews; a pair prefers the right answer (star count, or whether the
reviewer returns) over a wrong one. The SFT model: `single-gpu.py --demo`'s (from scratch, on the demo's chats).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from finetune.internals import demo  # noqa: E402

BIN = Path(sys.executable).parent
ENV = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "HF_HUB_OFFLINE": "1"}


def launch(cmd, out):
    """Seconds of the whole command; its output kept in out/log.txt."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (out / "log.txt").write_text(run.stdout + run.stderr)
    if run.returncode:
        raise SystemExit(f"failed ({run.returncode}): {' '.join(map(str, cmd))}\n{run.stderr[-3000:]}")
    return seconds, run.stdout


def timed_runs(runs, repeat, out):
    """Each (name, folder, command) launched `repeat` times, in alternating order (one run moves 10-20% on a shared
    machine): {name: {"folder", "seconds": [...], "reference": [the reference pass's seconds, where it says them]}}."""
    found = {}
    for turn in range(repeat):
        for name, folder, cmd in runs if turn % 2 == 0 else runs[::-1]:
            seconds, stdout = launch(cmd, out / folder)
            row = found.setdefault(name, {"folder": out / folder, "seconds": [], "reference": []})
            row["seconds"].append(seconds)
            reference = re.search(r"computed once in ([\d.]+) s", stdout)
            row["reference"] += [float(reference.group(1))] if reference else []
    return found


def wall_cells(seconds, *peers):
    """A run's table cells: its median seconds [range], then its median over each peer's (lists of seconds)."""
    median = statistics.median(seconds)
    ratios = " | ".join(f"{median / statistics.median(peer):.2f}x" for peer in peers)
    return f"{median:.0f} [{min(seconds):.0f}-{max(seconds):.0f}] | {ratios} |"


def sft_model(out):
    """The starting point, made once: the demo's supervised fine-tuning (`single-gpu.py --demo`), in out/sft/final."""
    sft = out / "sft"
    if not (sft / "final" / "config.json").exists():
        cmd = [sys.executable, "single-gpu.py", "--demo", "--batch-size", "16", "--output-dir", str(sft)]
        launch([*cmd, "--overwrite", "--prompt", ""], sft)
    return sft


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logps(model, tokenizer, prompt, answer):
    """log p(answer | prompt), summed over (the tokens of the answer the chat template marks as generated: its text
    and EOS, what the model says; every token after the prompt and the assistant's header: TRL's completion, which
    also holds what the template adds after the EOS)."""
    head = len(
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    whole = tokenizer.apply_chat_template(
        prompt + answer, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = torch.tensor([list(whole["input_ids"])]), torch.tensor(list(whole["assistant_masks"]))
    token = -F.cross_entropy(model(ids).logits[0, :-1].double(), ids[0, 1:], reduction="none")
    return torch.stack([(token * mask[1:]).sum(), token[head - 1 :].sum()])


@torch.no_grad()
def score(models, reference, pairs, beta):
    """{name: (mean DPO loss, reward accuracy) over the generated tokens, then over TRL's completions} on the held-out
    pairs, each model against the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    ref = load(reference)
    base = [
        (logps(ref, tokenizer, p["prompt"], p["chosen"]), logps(ref, tokenizer, p["prompt"], p["rejected"]))
        for p in pairs
    ]
    out = {}
    for name, path in models.items():
        model = load(path)
        margins = torch.stack(
            [
                beta
                * (
                    (logps(model, tokenizer, p["prompt"], p["chosen"]) - rc)
                    - (logps(model, tokenizer, p["prompt"], p["rejected"]) - rr)
                )
                for p, (rc, rr) in zip(pairs, base)
            ]
        )
        out[name] = [x for m in margins.T for x in (F.softplus(-m).mean().item(), (m > 0).double().mean().item())]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "dpo"))
    p.add_argument("--pairs", type=int, default=3000)
    p.add_argument("--held-out", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each, in alternating order; the table's time is "
        "their median (one run moves 10-20%% on a shared machine)",
    )
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft = sft_model(out)
    demo.make_demo_pairs(out / "pairs.jsonl", n=args.pairs, seed=7, style="messages")
    demo.make_demo_pairs(out / "held-out.jsonl", n=args.held_out, seed=8, style="messages")
    chosen = [json.loads(line) for line in open(out / "pairs.jsonl")]
    (out / "chosen.jsonl").write_text(
        "".join(json.dumps({"messages": r["prompt"] + r["chosen"]}) + "\n" for r in chosen)
    )
    common = ["--lr", str(args.lr), "--beta", str(args.beta), "--epochs", str(args.epochs), "--warmup-ratio", "0.05"]
    # the same pairs a step: ours, isolated packing, 2.9 pairs a 128-token block (a pair of 61-78 tokens holds its
    # prompt once: 36-47), 2 blocks a rank (11.7 pairs a step, measured); TRL and ours unpacked, 6 pairs a rank (12)
    ours = [
        "--model",
        str(sft / "final"),
        "--batch-size",
        "2",
        "--zero-stage",
        "2",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--prompt",
        "",
        "--overwrite",
        "--log-every",
        "20",
        "--deepspeed",
    ]
    # TRL's run evaluates nothing; ours evaluates at least at the end: on one step's worth of the held-out pairs
    held_out = ["--eval-dataset", str(out / "held-out.jsonl"), "--max-eval-samples", "12"]
    deepspeed = lambda: [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    trl = lambda folder, *more: [
        *deepspeed(),
        "bench/trl_peer.py",
        "--trainer",
        "dpo",
        "--model",
        str(sft / "final"),
        "--dataset",
        str(out / "pairs.jsonl"),
        "--output-dir",
        str(out / folder),
        "--batch-size",
        "6",
        "--max-length",
        "256",
        *common[:6],
        *more,
    ]
    runs = [  # (name, folder, command)
        (
            "ours (isolated packing)",
            "ours",
            [
                *deepspeed(),
                "zero-optimization.py",
                "--dataset",
                str(out / "pairs.jsonl"),
                "--output-dir",
                str(out / "ours"),
                *ours,
                *held_out,
                *common,
                "--block-size",
                "128",
            ],
        ),
        (
            "ours (--packing none)",
            "ours-none",
            [
                *deepspeed(),
                "zero-optimization.py",
                "--dataset",
                str(out / "pairs.jsonl"),
                "--output-dir",
                str(out / "ours-none"),
                *ours,
                *held_out,
                *common,
                "--packing",
                "none",
                "--batch-size",
                "6",
                "--block-size",
                "256",
            ],
        ),
        ("TRL DPOTrainer", "trl", trl("trl")),  # its defaults: gradient checkpointing on, the reference alongside
        ("TRL DPOTrainer, set for speed", "trl-fast", trl("trl-fast", "--fast")),
    ]
    rows = timed_runs(runs, args.repeat, out)
    # SFT on the same data (prompt + chosen answer), for tokens/s
    sft_cmd = [
        *deepspeed(),
        "zero-optimization.py",
        "--dataset",
        str(out / "chosen.jsonl"),
        "--output-dir",
        str(out / "sft-same"),
        *ours,
        "--block-size",
        "256",
        "--lr",
        str(args.lr),
        "--epochs",
        str(args.epochs),
    ]
    sft_seconds, _ = launch(sft_cmd, out / "sft-same")
    pairs = [json.loads(line) for line in open(out / "held-out.jsonl")]
    scores = score(
        {name: r["folder"] / "final" for name, r in rows.items()} | {"SFT model (the reference)": sft / "final"},
        sft / "final",
        pairs,
        args.beta,
    )
    lines = [
        "| run | held-out DPO loss | reward accuracy | DPO loss, TRL's completions | accuracy, TRL's completions |"
        f" wall clock (s), median of {args.repeat} [range] | x TRL | x TRL set for speed | reference pass (s) |"
        " train tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (dpo_loss, accuracy, tail_loss, tail_accuracy) in scores.items():
        r = rows.get(name)
        quality = f"| {name} | {dpo_loss:.4f} | {accuracy:.3f} | {tail_loss:.4f} | {tail_accuracy:.3f} |"
        if r is None:
            lines.append(quality + " - | - | - | - | - |")
            continue
        res = json.loads((r["folder"] / "results.json").read_text()) if "TRL" not in name else {}
        peers = (rows["TRL DPOTrainer"]["seconds"], rows["TRL DPOTrainer, set for speed"]["seconds"])
        reference = statistics.median(r["reference"]) if r["reference"] else "-"
        lines.append(
            f"{quality} {wall_cells(r['seconds'], *peers)} {reference} | {res.get('tokens_per_sec') or 0:,.0f} |"
        )
    sft_same = json.loads((out / "sft-same" / "results.json").read_text())
    lines.append(
        f"\nSFT on the same data (prompt + chosen answer, same flags): {sft_same['tokens_per_sec']:,.0f} "
        f"tok/s, {sft_seconds:.0f} s wall clock."
    )
    (out / "DPO.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
