"""The tests' fixtures: a tiny OPT model and a generated corpus, made once per session, the long run a stopped one
must end as, and the checks every test gets (launcher variables restored, no shared-memory buffer left); the
session's environment and the helpers the tests share: helpers.py."""

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from helpers import check, launch, long_run  # first: the session's environment (helpers.py)

from finetune.internals import demo

# `make test` runs two files at a time (pytest-xdist, --dist loadfile: a file's module fixtures are made once), each
# worker taking the next file in this order when its own is done: the longest first, so that both end together.
# Seconds alone on 2 cores, roughly: 170, 150, 150, 100, 70, 60, 55, 50, 45, 40, 35, 30, 25, 20, 15, 15; the rest in
# process, a few seconds each.
LONGEST_FIRST = [
    "test_reliability.py",
    "test_slurm.py",
    "test_zero.py",
    "test_job.py",
    "test_classification.py",
    "test_plan.py",
    "test_bench.py",
    "test_lora.py",
    "test_qlora.py",
    "test_models.py",
    "test_basics.py",
    "test_sequence_parallel.py",
    "test_checkpoints.py",
    "test_host_cost.py",
    "test_dpo_runs.py",
    "test_mend_speedups.py",
    "test_mends.py",
    "test_preference.py",
    "test_single.py",
]


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file keeps its own order


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "quick: the in-process tier, `make test-quick`: formats, masks, packing, the "
        "loss, the planner, GPU decisions fed a GPU's facts, bad input, configs",
    )


def made_once(tmp_path_factory, name, make):
    """The session's folder `name`, its contents made by make(folder) once for all of `make test`'s workers: the
    first to ask makes them, the others wait for it and share them."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, which holds each worker's own
    folder = base / name
    with FileLock(str(base / f"{name}.lock")):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed left
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A 2-layer, 32-wide OPT (dropout 0), 240 generated reviews (text) and 240 chats about reviews (messages)."""
    root = made_once(tmp_path_factory, "tiny", make_tiny)
    return {
        "data": str(root / "reviews.csv"),
        "chats": str(root / "chats.jsonl"),
        "model": str(root / "model"),
        "root": root,
    }


def make_tiny(root):
    demo.make_demo_corpus(root / "reviews.csv", n=240, seed=1)
    demo.make_demo_chats(root / "chats.jsonl", n=240, seed=1)
    import csv

    with open(root / "reviews.csv") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    with open(root / "chats.jsonl") as f:
        texts += [" ".join(m["content"] for m in json.loads(line)["messages"]) for line in f]
    tokenizer = demo.make_demo_tokenizer(texts + ["### User: ### Assistant:"], vocab_size=300)
    demo.make_demo_lm(root / "model", tokenizer, hidden=32, layers=2, heads=2, positions=64, seed=0)


@pytest.fixture(scope="session")
def uninterrupted(tiny, tmp_path_factory):
    """The long run, whole: what a stopped and resumed run must end as, and checkpoints to resume from (read only)."""
    folder = made_once(
        tmp_path_factory, "whole", lambda f: check(launch("forked", "zero-optimization.py", long_run(tiny, f / "run")))
    )
    return folder / "run"


@pytest.fixture(autouse=True)
def launcher_variables_restored():
    """A script run in process as a world of one sets RANK, MASTER_PORT, ... in this process: not for the next test."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in names}
    handlers = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGUSR1)}  # checkpoints.Stop sets them
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def no_shm_buffers_left():
    """What a test's runs leave in /dev/shm (DeepSpeed's CPU all-reduce buffers, 66 MB a rank; a run that ends well
    removes its own, a killed one cannot): removed after each test, or a session would fill the machine's memory."""
    start = time.time()
    yield
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        with contextlib.suppress(FileNotFoundError):  # the other worker's test may remove it first
            if leftover.stat().st_mtime >= start - 1 and str(leftover) not in held_open():
                leftover.unlink()


def held_open():
    """The files some process has open: a rank keeps its DeepSpeed buffers open while it runs, and `make test`'s
    other worker runs tests beside this one."""
    held = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            held.add(os.readlink(fd))
    return held


@pytest.fixture(scope="module")
def pairs(tiny, tmp_path_factory):
    """48 generated pairs in each format, and a tiny OPT (dropout 0.1: DPO turns it off) with a tokenizer of their
    words: a pair is 46-64 tokens, two or three a block."""
    import dpo_pairs
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pairs")
    files = {}
    for style in ("strings", "messages", "implicit"):
        files[style] = root / f"{style}.jsonl"
        demo.make_demo_pairs(files[style], n=48, seed=3, style=style)
    texts = [" ".join(json.loads(line).values()) for line in open(files["strings"])]
    tokenizer = demo.make_demo_tokenizer(texts + ["### User: ### Assistant:"], vocab_size=1000)
    demo.make_demo_lm(root / "model", tokenizer, hidden=32, layers=2, heads=2, positions=dpo_pairs.BLOCK, seed=0)
    config = json.loads((root / "model" / "config.json").read_text())
    (root / "model" / "config.json").write_text(json.dumps({**config, "dropout": 0.1, "attention_dropout": 0.1}))
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    return {"model": str(root / "model"), "tokenizer": tokenizer, **{k: str(v) for k, v in files.items()}}
