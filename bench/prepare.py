"""Data preparation at scale: generated corpora of 10k, 100k and 1M reviews, prepared (tokenized in --num-proc
processes, packed, written) by one process, and by 2 ranks of a node (local rank 0 prepares, the other waits, then
both memory-map the files and read batches as training does). Each rank's time and peak resident memory.

    python3 bench/prepare.py --docs 10000 100000 1000000      # writes out/bench/PREPARE.md
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def corpus(path, n):
    """n generated reviews (demo.py's), one per row of a .csv file with a `text` column."""
    import csv

    from finetune.internals import demo

    if path.exists():
        return path
    rng = random.Random(n)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        for _ in range(n):
            writer.writerow([demo._review(rng, rng.randrange(5))])
    return path


def worker(dataset, local_rank):
    """One rank: prepare (or wait for) the data, then read 50 batches of 8 blocks as training would."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from finetune import data, flags, training
    from finetune.internals import demo

    tokenizer = AutoTokenizer.from_pretrained(demo.assets()["lm"])
    settings = flags.defaults(dataset=str(dataset), seed=0, block_size=256, max_eval_samples=0).data
    start = time.perf_counter()
    train, _ = data.prepare(settings, tokenizer, seed=0, local_rank=local_rank)
    prepared = time.perf_counter() - start
    order = np.random.default_rng(local_rank).permutation(len(train))
    process = training.Process(
        device=torch.device("cpu"),
        rank=0,
        world_size=1,
        autocast=None,
        pad_id=tokenizer.pad_token_id,
        model_config=None,
    )
    for k in range(50):
        train.batch(order[8 * k : 8 * (k + 1)], process)
    with open("/proc/self/status") as f:  # now: the process's own memory, and the file pages it maps (shared)
        now = {
            k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")
        }
    print(
        json.dumps(
            {
                "rank": local_rank,
                "seconds": prepared,
                "blocks": len(train),
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                **now,
            }
        )
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--out", default=str(ROOT / "out" / "bench"))
    p.add_argument("--worker", nargs=2, metavar=("DATASET", "LOCAL_RANK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(Path(args.worker[0]), int(args.worker[1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.docs:
        dataset = corpus(out / f"reviews-{n}.csv", n)
        for ranks in (1, 2):
            cache = out / "prepare-cache" / f"{n}-{ranks}"  # a fresh cache: the preparation really runs
            subprocess.run(["rm", "-rf", str(cache)], check=True)
            # and a fresh cache of the datasets library too, whose Arrow copy of the file would serve the next run
            env = {
                **os.environ,
                "DATA_CACHE": str(cache),
                "HF_DATASETS_CACHE": str(cache / "hf"),
                "HF_HUB_OFFLINE": "1",
            }
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", str(dataset), str(r)],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(ranks)
            ]
            for proc in procs:
                line = proc.communicate()[0].strip().splitlines()[-1]
                rows.append({"docs": n, "ranks": ranks, **json.loads(line)})
    lines = [
        "| documents | ranks | rank | preparation (s) | blocks of 256 | peak resident memory (MiB) | at the end: "
        "own (anonymous) / mapped file pages (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['docs']:,} | {r['ranks']} | {r['rank']} | {r['seconds']:.1f} | {r['blocks']:,} | "
        f"{r['peak_rss'] / 2**20:,.0f} | {r['RssAnon'] / 2**20:,.0f} / {r['RssFile'] / 2**20:,.0f} |"
        for r in rows
    ]
    (out / "PREPARE.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
