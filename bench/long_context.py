"""Memory of long blocks under sequence parallelism: rank 0's peak for each --sequence-parallel N, a tiny Llama-shaped
model (or the shape you give) on the demo reviews cut into blocks of --block tokens (stream packing: one document a
row). Each run is zero-optimization.py under ZeRO-3 on N ranks, a few steps; the activations' share is the peak less
that of the same run at a short block. On a CPU the peak is the process's resident memory (docs/long-context.md).

    python3 bench/long_context.py --block 16384 --sp 1 2 4
    python3 bench/long_context.py --hidden 768 --layers 12 --heads 12 --block 4096 --sp 1 2   # the OPT-125m shape
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from finetune.internals import demo  # noqa: E402


def build(folder, hidden, layers, heads, positions):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    texts = [line for line in (folder / "reviews.csv").read_text().splitlines()[1:]]
    tokenizer = demo.make_demo_tokenizer(texts, vocab_size=2000)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=int(8 / 3 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


def run(folder, block, size, steps):
    out = folder / f"run-{block}-{size}"
    argv = [
        "zero-optimization.py",
        "--model",
        str(folder / "model"),
        "--dataset",
        str(folder / "reviews.csv"),
        "--block-size",
        str(block),
        "--packing",
        "stream",
        "--batch-size",
        "1",
        "--max-steps",
        str(steps),
        "--zero-stage",
        "3",
        "--sequence-parallel",
        str(size),
        "--eval-every",
        "0",
        "--max-eval-samples",
        "8",
        "--prompt",
        "",
        "--save-every",
        "0",
        "--log-every",
        "1",
        "--output-dir",
        str(out),
        "--overwrite",
        "--deepspeed",
    ]
    launcher = (
        [sys.executable]
        if size == 1
        else [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(size)]
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // size))}
    done = subprocess.run(launcher + argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads((out / "results.json").read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=16384)
    p.add_argument("--short", type=int, default=512, help="the block whose peak is the baseline")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="long-context-"))
    demo.make_demo_corpus(folder / "reviews.csv", n=8000, seed=0)
    build(folder, args.hidden, args.layers, args.heads, max(args.block, 4096))
    print(f"| N | block | rank 0's peak, GiB | at block {args.short}, GiB | activations, GiB | tokens/s |")
    print("|---|---|---|---|---|---|")
    for size in args.sp:
        long, short = run(folder, args.block, size, args.steps), run(folder, args.short, size, args.steps)
        if "error" in long or "error" in short:
            print(f"| {size} | {args.block} | {long.get('error') or short.get('error')} | | | |")
            continue
        peak, base = long["peak_memory_gb_per_rank"][0], short["peak_memory_gb_per_rank"][0]
        print(
            f"| {size} | {args.block:,} | {peak:.2f} | {base:.2f} | {peak - base:.2f} | "
            f"{long['tokens_per_sec']:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
