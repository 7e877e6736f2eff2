"""Preference pairs longer than the block: does the model still learn what the prompt asks? Pairs whose preference
is read from the prompt's first word only (the chosen answer starts with the colour the prompt names first, the
rejected one with the other, then the same filler), a 12-word prompt and two 421-word answers, at --block-size 512:
every pair must be cut. DPO on a tiny OPT, 2 epochs; the held-out reward accuracy and the start line's count of pairs
cut. (With answers that fit, --answer-words 100, the same model reaches 1.000.)

    python3 bench/long_pairs.py                  # this checkout (about 2 minutes on 2 CPU cores)
    python3 bench/long_pairs.py --root ../old    # another checkout's scripts on the same pairs (before and after)
"""

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from finetune.internals import demo  # noqa: E402

COLOURS = ("red", "blue")
FILLER = "the cat sat on the mat and the dog ran to the park"


def pairs(path, n, seed, answer_words=420, prompt_words=10):
    """n pairs: the prompt names a colour first, then filler; the chosen answer names that colour, the rejected the
    other, each followed by the same filler (so only the prompt's first word tells them apart)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            first = rng.choice(COLOURS)
            other = COLOURS[1 - COLOURS.index(first)]
            prompt = f"{first} " + " ".join(rng.choice(FILLER.split()) for _ in range(prompt_words)) + " answer:"
            tail = " " + " ".join(rng.choice(FILLER.split()) for _ in range(answer_words))
            f.write(json.dumps({"prompt": prompt, "chosen": f" {first}" + tail, "rejected": f" {other}" + tail}) + "\n")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(ROOT), help="the checkout whose single-gpu.py trains")
    p.add_argument("--out", default=str(ROOT / "out" / "long-pairs"))
    p.add_argument("--answer-words", type=int, default=420, help="filler words after each answer's colour")
    p.add_argument("--prompt-words", type=int, default=10, help="filler words after the prompt's colour")
    p.add_argument("--packing", default="isolated", help="the scripts' --packing: isolated (pairs packed) or none")
    p.add_argument("--lr", default="3e-3")
    p.add_argument("--epochs", default="2")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = f"{args.prompt_words}-{args.answer_words}"
    train = pairs(out / f"train-{shape}.jsonl", 400, 1, args.answer_words, args.prompt_words)
    held = pairs(out / f"held-{shape}.jsonl", 100, 2, args.answer_words, args.prompt_words)
    if not (out / "model" / "config.json").exists():
        texts = [" ".join(json.loads(line).values()) for line in open(train)]
        tokenizer = demo.make_demo_tokenizer(texts, vocab_size=300)
        demo.make_demo_lm(out / "model", tokenizer, hidden=64, layers=2, heads=4, positions=512, seed=0)
    run = out / f"run-{Path(args.root).resolve().name}-{shape}-{args.packing}"
    done = subprocess.run(
        [
            sys.executable,
            "single-gpu.py",
            f"--model={out / 'model'}",
            f"--dataset={train}",
            f"--eval-dataset={held}",
            "--max-eval-samples=0",
            "--block-size=512",
            f"--packing={args.packing}",
            "--batch-size=8",
            f"--epochs={args.epochs}",
            f"--lr={args.lr}",
            "--log-every=50",
            "--save-every=0",
            "--prompt=",
            f"--output-dir={run}",
            "--overwrite",
        ],
        cwd=args.root,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"error: the run failed:\n{done.stderr[-2000:]}")
    start = next(line for line in done.stdout.splitlines() if "pairs in" in line)
    accuracy = re.findall(r"reward accuracy ([0-9.]+)", done.stdout)[-1]
    print(f"{args.root} (--packing {args.packing}): held-out reward accuracy {accuracy}\n  {start}")


if __name__ == "__main__":
    main()
