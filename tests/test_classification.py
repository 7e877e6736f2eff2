"""sequence_classification.py: string labels, both shipped DeepSpeed configs on 2 processes, the saved model behind
pipeline(), one process without DeepSpeed, and bad input."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, assert_close_losses, check, free_port, launch, load_script, results
from transformers import pipeline

from finetune.internals import demo

classification = load_script("sequence_classification.py")


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    """Generated reviews labelled with strings (1-2 stars 'negative', 4-5 'positive'), and a tiny encoder."""
    root = tmp_path_factory.mktemp("sentiment")
    demo.make_demo_corpus(root / "reviews.csv", n=600, seed=2)
    with open(root / "reviews.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["label"] != "2"]
    with open(root / "sentiment.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "sentiment"])
        writer.writerows([r["text"], "negative" if int(r["label"]) < 2 else "positive"] for r in rows)
    tokenizer = demo.make_demo_wordpiece_tokenizer([r["text"] for r in rows], vocab_size=400)
    demo.make_demo_encoder(root / "encoder", tokenizer, dim=32, layers=2, heads=2, positions=128)
    return root


def argv(root, out, *extra):
    return [
        "--model",
        str(root / "encoder"),
        "--dataset",
        str(root / "sentiment.csv"),
        "--text-column",
        "review",
        "--label-column",
        "sentiment",
        "--max-length",
        "96",
        "--batch-size",
        "16",
        "--lr",
        "2e-3",
        "--epochs",
        "2",
        "--output-dir",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def one_process(sentiment, tmp_path_factory):
    """One process without DeepSpeed; weight decay high enough that where it falls shows in the eval loss."""
    out = tmp_path_factory.mktemp("one") / "run"
    return classification.main(argv(sentiment, out, "--weight-decay", "0.5")), out


def test_one_process_without_deepspeed(one_process):
    r, out = one_process
    assert r["accuracy"] >= 0.9 and r["f1_macro"] >= 0.9 and r["world_size"] == 1
    ran = json.loads((out / "run.json").read_text())["args"]  # what --config replays: this script's flags, resolved
    assert (ran["label_column"], ran["max_length"], ran["weight_decay"], ran["precision"]) == (
        "sentiment",
        96,
        0.5,
        "fp32",
    )
    assert r["labels"] == ["negative", "positive"]
    classify = pipeline("text-classification", model=str(out / "final"))
    answers = classify(
        [
            "The staff were wonderful and made us feel at home. I cannot wait to come back!",
            "The staff ignored us for 40 minutes and never apologized. Never again.",
        ]
    )
    assert [a["label"] for a in answers] == ["positive", "negative"]


def assert_same_training(one, two, resumed_at=None):
    """The Trainer's log every 10 steps (the loss and the gradient norm before clipping) and the final eval loss. The
    first loss logged after a resume averages over the steps since the resume only: left out."""
    assert [h["step"] for h in one["train_log"]] == [h["step"] for h in two["train_log"]]
    window = [h["step"] > resumed_at for h in one["train_log"]].index(True) if resumed_at else None
    for key in ("loss", "grad_norm"):
        values = [
            [h[key] for i, h in enumerate(run["train_log"]) if key != "loss" or i != window] for run in (one, two)
        ]
        assert_close_losses(*values)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def two_ranks(sentiment, tmp_path_factory):
    """Each shipped config on 2 ranks, micro-batch 8: the global batch of the one-process run."""
    runs = {}
    for config in ("ds_config_zero2.json", "ds_config_zero3.json"):
        out = tmp_path_factory.mktemp(config) / "run"
        args = argv(sentiment, out, "--deepspeed", config)
        args[args.index("--batch-size") + 1] = "8"
        # the demo's command, under the deepspeed launcher, for ZeRO-2; ZeRO-3's ranks forked (helpers.launch)
        launcher = "deepspeed" if config == "ds_config_zero2.json" else "forked"
        runs[config] = args, out, check(launch(launcher, "sequence_classification.py", args))
    return runs


def test_two_processes_with_each_shipped_config(two_ranks):
    """ZeRO-2 and ZeRO-3 on 2 ranks train the same (the Trainer samples the batches of 2 processes differently from
    one's, so the comparison is between the two configs)."""
    for _, out, run in two_ranks.values():
        r = results(out)
        assert r["world_size"] == 2 and r["accuracy"] >= 0.9, r
        assert "accuracy" in run.stdout and ("positive (" in run.stdout or "negative (" in run.stdout)
        assert "built successfully" not in run.stdout + run.stderr  # DeepSpeed's op loads, said by every rank
        classify = pipeline("text-classification", model=str(out / "final"))  # gathered from the shards under ZeRO-3
        assert classify("Our server was friendly. I would come back.")[0]["label"] in {"negative", "positive"}
    assert_same_training(*(results(out) for _, out, _ in two_ranks.values()))


def test_a_signal_stops_it_with_a_checkpoint_and_it_resumes_on_the_same_number_of_ranks(two_ranks, tmp_path):
    """ZeRO-3 on 2 ranks, SIGUSR1 to rank 1 in the second epoch: the Trainer saves after the step in flight on every
    rank and the run exits 75. A resume on 1 rank is one line (the Trainer loads DeepSpeed's shards as they are);
    `--resume auto` on 2 finishes the run. (The rest of the second epoch is not the uninterrupted run's: the
    Trainer's own skipping of the batches already seen in an epoch, under 2 processes, gave a gradient norm 7% off at
    the next log; resumes at an epoch's end are exact. The pair's resume is exact anywhere: test_reliability.py.)"""
    args, finished, _ = two_ranks["ds_config_zero3.json"]
    out = tmp_path / "run"
    args = [str(out) if a == str(finished) else a for a in args] + ["--resume", "auto"]  # nothing yet: starts
    uninterrupted = results(finished)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "sequence_classification.py",
            *args,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not list((out / "checkpoints").glob("checkpoint-*/trainer_state.json")):  # the first epoch's
            assert launcher.poll() is None and time.time() < deadline, launcher.stdout.read()[-3000:]
            time.sleep(0.05)
        rank_1 = next(
            c
            for c in psutil.Process(launcher.pid).children(recursive=True)
            if "--local_rank=1" in " ".join(c.cmdline())
        )
        os.kill(rank_1.pid, signal.SIGUSR1)
        log = launcher.communicate(timeout=120)[0]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    stopped = [line for line in log.splitlines() if line.startswith("stopped by ")]
    assert launcher.returncode == 75 and len(stopped) == 1 and "Traceback" not in log, log[-3000:]
    step = int(stopped[0].split(" after step ")[1].split(",")[0])
    last = max((out / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert last.name == f"checkpoint-{step}" and not (out / "results.json").exists()
    epoch = uninterrupted["train_log"][-1]["step"] // 2  # steps in an epoch
    assert epoch < step < 2 * epoch, (step, epoch)  # in the second epoch
    with pytest.raises(SystemExit) as refused:  # what a resume on 1 rank says, before it loads anything
        classification.check_trainer_resume(out / "checkpoints", 1, "ds_config_zero3.json", 0)
    assert f"{last} was written by 2 ranks and this run has 1; resume with 2" in str(refused.value)
    written = (last / "trainer_state.json").stat().st_mtime_ns
    two = check(launch("forked", "sequence_classification.py", args))
    assert (last / "trainer_state.json").stat().st_mtime_ns == written  # a restart would have written it again
    assert f"resuming from {last.name}" in two.stdout
    r = results(out)
    assert r["world_size"] == 2 and r["accuracy"] >= 0.9, r
    assert [h["step"] for h in r["train_log"]] == [h["step"] for h in uninterrupted["train_log"]]
    before = [h for h in uninterrupted["train_log"] if h["step"] <= step]  # logged before the stop, kept
    assert r["train_log"][: len(before)] == before


def test_plain_python_with_deepspeed_is_a_world_of_one(sentiment, tmp_path, one_process):
    """`python3 sequence_classification.py --deepspeed ...` on one GPU: no launcher, so no MPI lookup either. ZeRO-2
    on one rank trains as the run without DeepSpeed: the same eval loss, weight decay kept off biases and norms."""
    run = check(
        launch(
            "forked-python",
            "sequence_classification.py",
            argv(sentiment, tmp_path / "run", "--weight-decay", "0.5", "--deepspeed", "ds_config_zero2.json"),
        )
    )
    r = results(tmp_path / "run")
    assert r["world_size"] == 1 and r["accuracy"] >= 0.9, (r, run.stderr[-2000:])
    assert r["eval_loss"] == pytest.approx(one_process[0]["eval_loss"], rel=1e-5)


@pytest.mark.quick
def test_the_best_epoch_is_the_most_accurate_and_of_those_the_lowest_loss():
    labels = [0, 1, 1, 0]
    confident = classification.classification_metrics([[4, 0], [0, 4], [0, 4], [4, 0]], labels, 2)
    unsure = classification.classification_metrics([[1, 0], [0, 1], [0, 1], [1, 0]], labels, 2)
    wrong_once = classification.classification_metrics([[9, 0], [0, 9], [9, 0], [9, 0]], labels, 2)
    assert confident["accuracy"] == unsure["accuracy"] == 1.0 and wrong_once["accuracy"] == 0.75
    assert confident["accuracy_then_loss"] > unsure["accuracy_then_loss"] > wrong_once["accuracy_then_loss"]
    assert wrong_once["f1_macro"] == pytest.approx((2 * 2 / (2 * 2 + 1) + 2 * 1 / (2 * 1 + 1)) / 2)


@pytest.mark.quick
def test_resume_without_a_checkpoint_is_one_line(sentiment, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # killed before the end of the first epoch
    with pytest.raises(SystemExit, match="run has no checkpoints to resume from"):
        classification.main(argv(sentiment, tmp_path / "run", "--resume"))


@pytest.mark.parametrize(
    "content, flags, message",
    [
        ("review,stars\ngood,1\nbad,0\n", [], "has no column 'sentiment' (it has review, stars); pass --label-column"),
        ("review,sentiment\ngood,positive\nbad,\nok,negative\n", [], "rows without a label"),
        ("review,sentiment\n" + "fine,positive\n" * 10, [], "a single class ('positive')"),
        ("\x00\x01 not a parquet file", ["--dataset-suffix", ".parquet"], "could not read"),
        (
            "review,sentiment\ngood,positive\nbad,negative\n",
            ["--deepspeed", "missing.json"],
            "missing.json does not exist",
        ),
        ("review,sentiment\ngood,positive\nbad,negative\n", ["--lr", "-1"], "--lr must be positive"),
    ],
)
@pytest.mark.quick
def test_bad_input_is_one_line(sentiment, tmp_path, content, flags, message):
    suffix = ".csv"
    if flags[:1] == ["--dataset-suffix"]:
        suffix, flags = flags[1], flags[2:]
    data = tmp_path / f"data{suffix}"
    data.write_text(content)
    args = argv(sentiment, tmp_path / "out", *flags)
    args[args.index("--dataset") + 1] = str(data)
    with pytest.raises(SystemExit) as e:
        classification.main(args)
    assert str(e.value).startswith("error: ") and message in str(e.value) and "\n" not in str(e.value)
