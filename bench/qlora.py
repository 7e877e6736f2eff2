"""QLoRA (--load-in-4bit) against LoRA over a 16-bit base and full fine-tuning, with single-gpu.py: the model-state
bytes and peak memory of a rank and tokens/s at OPT-125m's shape, and the held-out loss on real text after the same
steps. The text: The Devil's Dictionary (Ambrose Bierce, 1911, public domain), as Debian's dict-devil ships it.

    apt-get install dict-devil && python3 bench/qlora.py        # about 15 minutes on 2 cores: out/bench/QLORA.md
"""

import argparse
import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DICT = Path("/usr/share/dictd/devil")
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
METHODS = {
    "full fine-tuning": [],
    "LoRA (base in the run's precision)": ["--lora-rank", "16"],
    "QLoRA (4-bit base)": ["--lora-rank", "16", "--load-in-4bit"],
}
# fp32 on the CPU: there (torch 2.13, this machine) a bf16 run's matmuls at this shape fall into torch's reference
# GEMM (cpublas gemm_transb_impl), minutes a step. The bf16 model states are plan.py's (checked against counted bytes
# in the tests).


def entries():
    """The dictionary's entries, one document each (dictd's index gives each entry's offset and length)."""
    text = gzip.open(f"{DICT}.dict.dz").read()
    number = lambda s: sum(B64.index(c) * 64**i for i, c in enumerate(reversed(s)))
    out = []
    for line in Path(f"{DICT}.index").read_text(encoding="latin-1").splitlines():
        word, offset, length = line.split("\t")
        if not word.startswith("00"):
            out.append(text[number(offset) : number(offset) + number(length)].decode("latin-1").strip())
    return out


def corpus(folder):
    """Entries shuffled once: 45% to pretrain a base on, 45% to fine-tune on, 10% held out."""
    docs = entries()
    random.Random(0).shuffle(docs)
    cut, held = int(0.45 * len(docs)), int(0.9 * len(docs))
    parts = {"pretrain": docs[:cut], "tune": docs[cut:held], "held-out": docs[held:]}
    for name, rows in parts.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return parts


def train(model, dataset, out, steps, extra, block=256, batch=8, eval_set=None):
    cmd = [
        sys.executable,
        str(ROOT / "single-gpu.py"),
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--block-size",
        str(block),
        "--batch-size",
        str(batch),
        "--max-steps",
        str(steps),
        "--save-every",
        "0",
        "--eval-every",
        "0",
        "--log-every",
        str(max(1, steps // 5)),
        "--prompt",
        "",
        "--output-dir",
        str(out),
        "--overwrite",
        "--warmup-ratio",
        "0.05",
        *(["--eval-dataset", str(eval_set)] if eval_set else []),
        *extra,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((out / "results.json").read_text())


def planned(model, extra, precision):
    import plan

    argv = [
        "--model",
        str(model),
        "--gpus",
        "1",
        "--gpu-memory",
        "80",
        "--precision",
        precision,
        "--json",
        "--batch-size",
        "4",
        "--block-size",
        "128",
        *extra,
    ]
    out = subprocess.run([sys.executable, str(ROOT / "plan.py"), *argv], capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)["options"][plan.OPTIONS[0]]["held_after_step_bytes_per_rank"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "qlora"))
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--tune-steps", type=int, default=150)
    p.add_argument("--speed-steps", type=int, default=6)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, OPTConfig

    from finetune.internals import demo

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = corpus(out)
    tokenizer = demo.make_demo_tokenizer(parts["pretrain"] + parts["tune"], vocab_size=2048)
    lines = ["# QLoRA vs LoRA vs full fine-tuning (single-gpu.py, CPU)", ""]

    # memory and speed: OPT-125m's shape (random weights), bf16 (autocast; the 16-bit and 4-bit bases compute in it)
    shape = out / "opt-125m-shape"
    if not shape.exists():
        AutoModelForCausalLM.from_config(
            OPTConfig(vocab_size=50272, max_position_embeddings=2048, dropout=0.0, attention_dropout=0.0)
        ).save_pretrained(shape)
        tokenizer.save_pretrained(shape)
    lines += [
        f"## Memory and speed at OPT-125m's shape: 4 x 128 tokens a step, {args.speed_steps} steps",
        "",
        "| method | model states, fp32 (counted) | plan.py, fp32 | plan.py, bf16 | peak resident memory | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, extra in METHODS.items():
        r = train(
            shape,
            out / "tune.jsonl",
            out / f"speed-{len(extra)}",
            args.speed_steps,
            extra + ["--precision", "fp32", "--lr", "1e-4"],
            block=128,
            batch=4,
        )
        lines.append(
            f"| {name} | {r['model_state_bytes_per_rank'][0] / 2**20:.1f} MiB | "
            f"{planned(shape, extra, 'fp32') / 2**20:.1f} MiB | {planned(shape, extra, 'bf16') / 2**20:.1f} "
            f"MiB | {r['peak_memory_bytes'] / 2**20:.0f} MiB | {r['tokens_per_sec']:,.0f} |"
        )

    # quality: a small base pretrained on one part of the book, then each method tunes it on another part
    base = out / "base-model"
    demo.make_demo_lm(base, tokenizer, hidden=256, layers=4, heads=4, positions=256, seed=0)
    pre = train(
        base,
        out / "pretrain.jsonl",
        out / "pretrain",
        args.pretrain_steps,
        ["--lr", "1e-3"],
        eval_set=out / "held-out.jsonl",
    )  # many epochs of a small text: its held-out loss stays high
    lines += [
        "",
        f"## Held-out loss on The Devil's Dictionary: a 4-layer, 256-wide OPT pretrained on 45% of the "
        f"entries ({args.pretrain_steps} steps, held-out loss {pre['eval_loss']:.4f}), then tuned on "
        f"another 45% for {args.tune_steps} steps of 8 x 256 tokens; fp32; 10% held out",
        "",
        "| method | lr | trainable | held-out loss | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for name, extra in METHODS.items():
        lr = "3e-4" if not extra else "2e-3"
        r = train(
            out / "pretrain" / "final",
            out / "tune.jsonl",
            out / f"tune-{len(extra)}",
            args.tune_steps,
            extra + ["--lr", lr, "--precision", "fp32"],
            eval_set=out / "held-out.jsonl",
        )
        lines.append(
            f"| {name} | {lr} | {r['trainable_params'] / 1e6:.2f}M of {r['total_params'] / 1e6:.2f}M | "
            f"{r['eval_loss']:.4f} | {r['tokens_per_sec']:,.0f} |"
        )
    (out.parent / "QLORA.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
