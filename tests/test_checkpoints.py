"""Checkpoints and resume: on another number of ranks, refused when the global batch or the stage changed, after a
kill during a save; what publishing keeps; --final best; a NaN loss stops the run; the catalogue of bad input."""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from helpers import (
    assert_close_losses,
    assert_resumed,
    assert_same_weights,
    base_args,
    check,
    crash_after_first_checkpoint,
    launch,
    load_script,
    long_run,
    results,
    weights,
)
from safetensors.torch import load_file, save_file

from finetune import base, checkpoints, flags, zero

single = load_script("single-gpu.py")


@pytest.mark.parametrize("stage, saved_by, resumed_on", [(2, 2, 1), (3, 1, 2), (0, 2, 1)])
def test_resume_on_another_number_of_ranks_gives_the_uninterrupted_run(tiny, tmp_path, stage, saved_by, resumed_on):
    """The same global batch of 8 sequences (2 per micro-step x 4 // ranks micro-steps x ranks) on 1 or 2 ranks."""
    out, FC1 = tmp_path / "run", "model.decoder.layers.0.fc1.weight"

    def run(ranks, *extra):
        argv = base_args(
            tiny, out, **{"--batch-size": 2, "--grad-accum": 4 // ranks, "--zero-stage": stage, "--weight-decay": 0.1}
        )  # per group: none on biases and norms
        return check(
            launch(
                "forked" if ranks > 1 else "forked-python",
                "zero-optimization.py",
                argv + ["--deepspeed", *extra],
                nproc=ranks,
            )
        )

    run(saved_by)
    full, full_weights = results(out), weights(out / "final")
    crash_after_first_checkpoint(out)  # latest -> step-2, written by `saved_by` ranks
    resumed = run(resumed_on, "--resume")
    assert_resumed(out)
    assert f"step-2 was written by {saved_by} ranks and loaded on {resumed_on}: " in resumed.stdout
    universal = out / "checkpoints" / "step-2" / "universal"
    if stage == 0:  # nothing is sharded: the checkpoint loads as it is
        assert "ZeRO-0 saves the whole optimizer state" in resumed.stdout and not universal.exists()
    else:  # one file per parameter and state, whole, made by DeepSpeed's ds_to_universal
        assert "DeepSpeed resharded ZeRO's optimizer state" in resumed.stdout
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            whole = torch.load(universal / "zero" / FC1 / f"{state}.pt", weights_only=False)
            whole = whole["param"] if isinstance(whole, dict) else whole  # ZeRO-3's are flat
            assert whole.numel() == full_weights[FC1].numel()
    assert json.loads((out / "checkpoints" / "step-4" / "run.json").read_text())["world_size"] == resumed_on
    assert_close_losses(full["losses"], results(out)["losses"], rtol=1e-5)
    assert_same_weights(full_weights, weights(out / "final"), atol=1e-5)


def test_a_resume_that_changes_the_global_batch_or_the_stage_is_one_line(tiny, tmp_path, uninterrupted):
    """The uninterrupted run's checkpoints (ZeRO-2, 2 ranks x micro-batch 2 x 2 micro-steps) resumed on 1 rank with
    another global batch or another stage: refused with one line, before anything is converted or loaded."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted / "checkpoints", out / "checkpoints")
    for changed, stage, message in [
        (
            {"--grad-accum": 2},
            2,
            "trained on global batches of 8 sequences and this run makes 2 x 2 micro-steps x 1 "
            "ranks = 4; pass --grad-accum 4 to make 8",
        ),
        ({"--grad-accum": 4}, 3, "was written with ZeRO stage 2 and this run has stage 3; resume with --zero-stage 2"),
    ]:
        args = load_script("zero-optimization.py").parse_args(
            base_args(tiny, out, **{"--batch-size": 2, **changed}) + ["--resume"]
        )
        with pytest.raises(SystemExit) as refused:
            zero.resume_folder(out, args, {"zero_optimization": {"stage": stage}}, rank=0, world_size=1, say=print)
        assert str(refused.value).startswith("error: --resume: ") and message in str(refused.value)
    assert not list((out / "checkpoints").glob("*/universal"))  # refused before any conversion


class RunsACommand:
    """What a doctored checkpoint holds: unpickling it runs a shell command (it touches a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.quick
def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tiny, tmp_path):
    """single-gpu.py's state.pt doctored so that loading it runs a command: --resume refuses it in one line naming
    the file and what it holds, and the command never runs. (torch.load with weights_only=False ran it.)"""
    out, ran = tmp_path / "run", tmp_path / "ran"
    argv = base_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2})
    single.main(argv)
    crash_after_first_checkpoint(out)  # latest -> step-2
    state = out / "checkpoints" / "step-2" / "state.pt"
    saved = checkpoints.load(state)  # what this project writes loads safely
    saved["stats"]["note"] = RunsACommand(ran)
    torch.save(saved, state)
    with pytest.raises(SystemExit) as refused:
        single.main(argv + ["--resume"])
    assert (
        str(refused.value).startswith(f"error: {state} holds more than a checkpoint does (")
        and "posix.system" in str(refused.value)
        and "loading it could run code, so it is refused" in str(refused.value)
    )
    assert not ran.exists()


def test_a_zero_shard_that_would_run_code_is_refused_on_every_rank(tiny, tmp_path, uninterrupted):
    """The same in a shard DeepSpeed loads (its checkpoint engine asks torch.load for weights_only=False): the
    uninterrupted run's newest checkpoint (ZeRO-2, 2 ranks), its model states doctored, resumed on 2 ranks."""
    out, ran = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(uninterrupted / "checkpoints", out / "checkpoints")
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    shard = latest / "mp_rank_00_model_states.pt"
    saved = checkpoints.load(shard)
    saved["client_state_note"] = RunsACommand(ran)
    torch.save(saved, shard)
    resumed = launch("forked", "zero-optimization.py", long_run(tiny, out, "--resume"))
    assert resumed.returncode != 0 and f"error: {shard} holds more than a checkpoint does (" in resumed.stderr
    assert "Traceback" not in resumed.stderr and not ran.exists()


def test_a_damaged_newest_checkpoint_is_named_with_the_whole_one_before_it(tiny, tmp_path, uninterrupted):
    """The uninterrupted run's checkpoints (ZeRO-2, 2 ranks; step-60 the newest): a shard cut short, a rank's
    optimizer shard gone, its random state gone: --resume names the file in one line and the newest whole checkpoint
    before it, never a traceback nor a silent start over. single-gpu.py's state.pt cut short: the same, end to end."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted / "checkpoints", out / "checkpoints")
    newest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    args = load_script("zero-optimization.py").parse_args(long_run(tiny, out, "--resume"))
    cut = newest / "mp_rank_00_model_states.pt"
    for damage, problem in [
        (
            lambda: cut.write_bytes(cut.read_bytes()[:1000]),
            "mp_rank_00_model_states.pt is cut short (1,000 bytes: not a whole archive)",
        ),
        (
            lambda: next(newest.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")).unlink(),
            "the optim states of rank 1 are missing",
        ),
        (lambda: (newest / "rng-1.pt").unlink(), "rng-1.pt is missing"),
    ]:
        damage()
        with pytest.raises(SystemExit) as refused:
            zero.resume_folder(out, args, {"zero_optimization": {"stage": 2}}, rank=0, world_size=2, say=print)
        assert str(refused.value) == (
            f"error: --resume: {newest} is damaged: {problem}. step-55 is whole: point "
            f"{out / 'checkpoints' / 'latest'} at it (echo step-55 > "
            f"{out / 'checkpoints' / 'latest'}) and rerun with --resume"
        )
    one = tmp_path / "one"
    argv = base_args(tiny, one, **{"--batch-size": 4, "--grad-accum": 2})
    single.main(argv)
    crash_after_first_checkpoint(one)  # latest -> step-2, the only one
    state = one / "checkpoints" / "step-2" / "state.pt"
    state.write_bytes(state.read_bytes()[:5000])
    with pytest.raises(
        SystemExit,
        match=r"^error: --resume: .*step-2 is damaged: state.pt is cut short \(5,000 "
        r"bytes: not a whole archive\)\. No earlier checkpoint is whole: start over "
        r"with --overwrite$",
    ):
        single.main(argv + ["--resume"])


@pytest.fixture
def small_disk(tmp_path):
    """mount(name, size): a real small disk, a tmpfs of `size` mounted on tmp_path/name (root only: CI is root)."""
    import subprocess

    if os.geteuid() != 0:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("mounting a tmpfs needs root")
    mounted = []

    def mount(name, size):
        folder = tmp_path / name
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_is_one_line_the_newest_checkpoint_stays_and_resume_continues(tiny, tmp_path, small_disk):
    """A real disk that fills: a 300 kB tmpfs, too small for the first checkpoint (state.pt is 0.5 MB): the write
    fails, one line, the partial folder removed. A 900 kB one holds the first and not the second: the line comes
    before the second is written (its size known from the first's), `latest` still names the first; on a larger
    disk --resume then continues to the uninterrupted run's losses. (Before: two tracebacks from torch.save.)"""
    argv = lambda out: base_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2})
    single.main(argv(tmp_path / "whole"))
    whole = results(tmp_path / "whole")
    tiny_disk = small_disk("tiny", "300k")
    with pytest.raises(SystemExit) as full:
        single.main(argv(tiny_disk / "run"))
    assert str(full.value).startswith(
        f"error: the disk of {tiny_disk / 'run' / 'checkpoints'} filled while checkpoint step-2 was written ("
    ) and "no checkpoint is complete" in str(full.value)
    assert not list((tiny_disk / "run" / "checkpoints").iterdir())  # the partial folder removed
    small = small_disk("small", "900k")
    with pytest.raises(SystemExit) as refused:
        single.main(argv(small / "run"))
    message = str(refused.value)
    assert (
        message.startswith("error: checkpoint step-4 needs about 0.5 MB (as step-2 did) and ")
        and "nothing written; step-2, the newest complete checkpoint, is untouched" in message
    )
    assert (small / "run" / "checkpoints" / "latest").read_text() == "step-2"
    assert sorted(p.name for p in (small / "run" / "checkpoints").iterdir()) == ["latest", "step-2"]
    shutil.copytree(small / "run", tmp_path / "moved")  # a larger disk
    single.main(argv(tmp_path / "moved") + ["--resume"])
    assert_close_losses(whole["losses"], results(tmp_path / "moved")["losses"], rtol=1e-6)


@pytest.mark.quick
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    argv = base_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2})
    single.main(argv)
    whole = results(out)
    crash_after_first_checkpoint(out)  # latest -> step-2
    partial = out / "checkpoints" / ".tmp-step-4"  # what a kill in the middle of the step-4 save leaves
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"PK\x03\x04 half a file")
    single.main(argv + ["--resume"])
    assert_close_losses(whole["losses"], results(out)["losses"], rtol=1e-6)
    assert not partial.exists() and (out / "checkpoints" / "latest").read_text() == "step-4"


@pytest.mark.quick
def test_publish_keeps_the_newest_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f".tmp-step-{step}").mkdir()
        (tmp_path / f".tmp-step-{step}" / "state.pt").write_text(str(step))
        checkpoints.publish(tmp_path, f"step-{step}", keep=2)
        assert (tmp_path / "latest").read_text() == f"step-{step}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-6", "step-8"]


@pytest.mark.quick
def test_publish_never_deletes_the_best_checkpoint(tmp_path):
    """--keep-checkpoints 1 with the lowest eval loss at step 4: step 4 stays beside the newest, whatever its age."""
    for step, loss in ((2, 3.0), (4, 1.5), (6, 2.0), (8, None), (10, 2.5)):
        (tmp_path / f".tmp-step-{step}").mkdir()
        base.write_json(tmp_path / f".tmp-step-{step}" / "run.json", {"step": step, "eval_loss": loss})
        checkpoints.publish(tmp_path, f"step-{step}", keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-10", "step-4"]
    assert checkpoints.best(tmp_path).name == "step-4"


@pytest.mark.quick
def test_publish_drops_a_later_checkpoint_that_was_never_published(tmp_path):
    """A kill between the rename and `latest` leaves step-6 unpublished; the run resumes from step 4 and a signal
    stops it at step 5: step 5 is `latest`, and stays, where step 6 would have outranked it for --keep-checkpoints."""
    (tmp_path / ".tmp-step-4").mkdir()
    checkpoints.publish(tmp_path, "step-4", keep=1)
    (tmp_path / "step-6").mkdir()  # renamed from .tmp-step-6, then killed before `latest` moved to it
    (tmp_path / ".tmp-step-5").mkdir()
    checkpoints.publish(tmp_path, "step-5", keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-5"]
    assert (tmp_path / "latest").read_text() == "step-5"


@pytest.mark.quick
def test_final_best_is_the_checkpoint_publish_kept(tmp_path):
    """--final best takes the best checkpoint that exists: here one written on a signal at step 3 (no --save-every
    step) with the lowest eval loss; --keep-checkpoints 1 kept it and deleted step 4, the best of the saved steps."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    model, weights_at = torch.nn.Linear(2, 2), {}
    for step, loss in ((2, 0.5), (3, 0.2), (4, 0.3), (6, 0.4)):
        weights_at[step] = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        folder = tmp_path / "checkpoints" / f".tmp-step-{step}"
        folder.mkdir(parents=True)
        torch.save({"model": weights_at[step]}, folder / "state.pt")
        base.write_json(folder / "run.json", {"step": step, "eval_loss": loss, "world_size": 1})
        checkpoints.publish(tmp_path / "checkpoints", f"step-{step}", keep=1)
    model.load_state_dict(weights_at[6])
    stats = SimpleNamespace(step=6, evals=[[2, 0.5], [3, 0.2], [4, 0.3], [6, 0.4]], rank=0, ranks=1, final_step=None)
    said = []
    checkpoints.load_best(model, tmp_path, stats, "best", SimpleNamespace(world_size=1, say=said.append))
    assert stats.final_step == 3 and torch.equal(model.weight, weights_at[3]["weight"]), said
    stats.evals[-1][1] = 0.2  # the last step as good: the model in memory, no load
    checkpoints.load_best(model, tmp_path, stats, "best", SimpleNamespace(world_size=1, say=said.append))
    assert stats.final_step == 3  # the earliest of equals


@pytest.mark.quick
def test_a_nan_loss_stops_the_run_at_its_step(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny["model"], model)
    state = load_file(str(model / "model.safetensors"))
    key = next(k for k in state if "final_layer_norm.weight" in k)
    state[key][0] = float("nan")
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"error: the loss is nan at step 1: training diverged"):
        single.main(base_args(tiny, out, **{"--model": str(model)}))
    assert not (out / "results.json").exists() and not (out / "checkpoints" / "latest").exists()


def test_zero_stops_on_nan_too(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny["model"], model)
    state = load_file(str(model / "model.safetensors"))
    state[next(iter(state))].fill_(float("inf"))
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    run = launch(
        "forked-python",
        "zero-optimization.py",
        base_args(tiny, tmp_path / "run", **{"--model": str(model), "--zero-stage": 1}),
    )
    assert run.returncode != 0 and "error: the loss is nan at step 1" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def no_weights(tiny, tmp_path):
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny["model"], folder)
    (folder / "model.safetensors").unlink()
    return str(folder)


def ds_file(tmp_path, zero):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


# The catalogue of bad input beyond what test_single, test_data, test_classification and test_job check.
BAD = [
    ("model folder without weights", lambda t, p: {"--model": no_weights(t, p)}, "a model folder needs config.json"),
    (
        "unknown hub id while offline",
        lambda t, p: {"--model": "no-such-org/no-such-model"},
        "cannot load 'no-such-org/no-such-model': it is not a local folder",
    ),
    (
        "DeepSpeed JSON with a typo",
        lambda t, p: {"--deepspeed_config": ds_file(p, {"stage": 2, "overlap_com": True})},
        "zero_optimization.overlap_com: Extra inputs are not permitted",
    ),
    (
        "DeepSpeed JSON with stage 7",
        lambda t, p: {"--deepspeed_config": ds_file(p, {"stage": 7})},
        "zero_optimization.stage: Input should be 0, 1, 2, 3",
    ),
    ("checkpoint pointer to a missing folder", "pointer", "which is missing; point it at a step-N folder"),
    (
        "LoRA on the output head under the chunked loss",
        lambda t, p: {"--lora-rank": 4, "--lora-targets": "q_proj,lm_head"},
        "--lora-targets q_proj,lm_head puts an adapter on the output head, which the chunked loss reads as its base "
        "weight (loss.py): the adapter would never train. Leave the head out of --lora-targets, or pass --loss-chunk 0",
    ),
]


def finished_run(out):
    """A folder as a finished run leaves it (its files' contents stand for theirs), and how to see it is untouched."""
    for name, text in (
        ("results.json", "{}"),
        ("loss.png", "png"),
        ("reference.pt", "pairs"),
        ("checkpoints/latest", "step-4"),
        ("checkpoints/step-4/run.json", "{}"),
        ("final/model.safetensors", "weights"),
        ("tensorboard/events", "curves"),
    ):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return lambda: {str(f.relative_to(out)): f.read_text() for f in sorted(out.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("name, make, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_catalogue(tiny, tmp_path, name, make, message):
    """Each refusal is one line, and with --overwrite over a finished run it leaves that run as it was: every check
    that can refuse a run (the model, the adapters, the DeepSpeed config, ...) comes before --overwrite removes it."""
    out, kept = tmp_path / "out", None
    if make == "pointer":
        (out / "checkpoints").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text("step-9")
        argv = base_args(tiny, out) + ["--resume"]
    else:
        kept = finished_run(out)
        before = kept()
        argv = base_args(tiny, out, **make(tiny, tmp_path)) + ["--overwrite"]
    if "--deepspeed_config" in " ".join(argv):  # the DeepSpeed config is read by zero-optimization.py
        run = launch("forked-python", "zero-optimization.py", argv)
        text = run.stderr.strip().splitlines()[-1]
        assert run.returncode != 0 and "Traceback" not in run.stderr
    else:
        with pytest.raises(SystemExit) as e:
            single.main(argv)
        text = str(e.value)
    assert text.startswith("error: ") and message in text, text
    assert kept is None or kept() == before


@pytest.mark.quick
def test_a_run_killed_in_its_first_save_starts_over_under_resume_auto(tmp_path):
    """A half-written first checkpoint is nothing to resume: --resume auto (resolved to no resume) starts afresh,
    where it used to stop every requeue with "holds an unfinished run"; plain --resume says there is nothing."""
    (tmp_path / "checkpoints" / ".tmp-step-500").mkdir(parents=True)
    run = flags.defaults(output_dir=str(tmp_path)).run
    checkpoints.prepare_output_dir(checkpoints.output_dir(run), overwrite=False, rank=0)
    assert not (tmp_path / "checkpoints" / ".tmp-step-500").exists()
    with pytest.raises(SystemExit, match="has no checkpoints to resume from"):
        checkpoints.output_dir(dataclasses.replace(run, resume="newest"))


def test_a_record_from_before_a_metric_was_kept_restores_without_it():
    """A checkpoint written before TRL's token metrics were kept (six pair metrics a step): restored, every metric
    has one value a step, None where it was not kept, and the next step's values append to each."""
    from finetune import preference, progress

    old = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    record = progress.Record.restored({"step": 2, "losses": [0.7, 0.6], "pair_metrics": {k: [1.0, 2.0] for k in old}})
    assert set(record.pair_metrics) == set(preference.METRICS) and record.pair_metrics["rewards/chosen"] == [1.0, 2.0]
    assert record.pair_metrics["entropy"] == [None, None] and record.pair_metrics["logits/chosen"] == [None, None]
