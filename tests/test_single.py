"""single-gpu.py, in process: the demo, the batch-split invariance, resume, the export, and bad input."""

import gc
import json
import math
import re
import shutil
import weakref

import pytest
import torch
from helpers import (
    assert_close_losses,
    assert_resumed,
    assert_same_weights,
    base_args,
    cpu_process,
    crash_after_first_checkpoint,
    dropout_model,
    independent_loss,
    load_script,
    results,
    weights,
)
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import checkpoints, data, models, training

pytestmark = pytest.mark.quick  # in process: `make test-quick`
single = load_script("single-gpu.py")


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    single.main(["--demo", "--batch-size", "16", "--max-steps", "40", "--output-dir", str(out)])
    r = results(out)
    losses = r["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]  # the loss visibly falls (from ~6.7)
    assert r["eval_loss"] < 0.6 * losses[0] and r["perplexity"] == pytest.approx(2.718281828 ** r["eval_loss"])
    assert r["world_size"] == 1 and r["global_batch_size"] == 16
    assert 0.85 * 40 * 16 * 128 < r["train_tokens"] <= 40 * 16 * 128  # real tokens: whole documents in blocks
    assert r["tokens_per_sec"] > 0 and r["peak_memory_bytes"] > 0
    assert r["trainable_params"] == r["total_params"] > 500_000
    assert (out / "loss.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "step 40/40 | loss" in printed and "sample: 'Review: " in printed and "How many stars" in printed


def test_export_reloads_with_stock_transformers(tmp_path, tiny):
    """final/ is the trained model: reloaded by stock transformers, its loss over the eval documents (each alone, in
    float64) is the eval loss the run reported; and the first step's loss is the initial model's over that batch."""
    out = tmp_path / "run"
    argv = base_args(tiny, out, **{"--prompt": "The food", "--batch-size": 4, "--grad-accum": 2, "--weight-decay": 0.1})
    single.main(argv)
    r = results(out)
    total, count = independent_loss(out / "final", argv, "eval")
    assert total / count == pytest.approx(r["eval_loss"], rel=1e-5)
    config = single.parse_args(argv)
    train = data.prepare(config.data, models.load_tokenizer(config.model.model), seed=config.train.seed)[0]
    first = training.GlobalBatches(len(train), 4 * 2, config.train.seed)(0)  # the first step's 8 sequences
    total, count = independent_loss(tiny["model"], argv, "train", first.tolist())  # before any update
    assert total / count == pytest.approx(r["losses"][0], rel=1e-5)
    final = out / "final"
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.dtype == torch.float32
    generated = model.generate(torch.tensor([[2, 5, 6]]), max_new_tokens=5, do_sample=False, pad_token_id=1)
    assert generated.shape == (1, 8) and isinstance(tokenizer.decode(generated[0]), str)


def test_same_global_batches_whatever_the_split(tmp_path, tiny):
    """8 sequences per step as 8x1 or 2x4 micro-steps: the same losses and weights."""
    single.main(base_args(tiny, tmp_path / "a", **{"--batch-size": 8, "--grad-accum": 1}))
    single.main(base_args(tiny, tmp_path / "b", **{"--batch-size": 2, "--grad-accum": 4}))
    a, b = results(tmp_path / "a"), results(tmp_path / "b")
    assert_close_losses(a["losses"], b["losses"])
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
    assert_same_weights(weights(tmp_path / "a" / "final"), weights(tmp_path / "b" / "final"))


def test_evaluating_changes_nothing_in_the_training(tmp_path, tiny):
    """With dropout on, a run that evaluates after every step (and answers eval prompts for TensorBoard) and one
    that evaluates at the end only: the same losses and gradient norms, bit for bit. Each eval is recorded; a
    checkpoint's run.json carries its step's."""
    model = dropout_model(tiny, tmp_path / "dropout-model")
    runs = {}
    for every in (1, 0):
        out = tmp_path / f"every-{every}"
        single.main(
            base_args(
                tiny,
                out,
                **{
                    "--batch-size": 4,
                    "--grad-accum": 2,
                    "--model": str(model),
                    "--eval-every": every,
                    "--dataset": tiny["chats"],
                    "--block-size": 64,
                },
            )
            + (["--report-to", "tensorboard"] if every else [])
        )
        runs[every] = results(out)
    assert (tmp_path / "every-1" / "tensorboard").is_dir()
    assert runs[1]["losses"] == runs[0]["losses"] and runs[1]["grad_norms"] == runs[0]["grad_norms"]
    assert [s for s, _ in runs[1]["evals"]] == [1, 2, 3, 4] and [s for s, _ in runs[0]["evals"]] == [4]
    assert runs[1]["evals"][-1] == runs[0]["evals"][-1] == [4, runs[0]["eval_loss"]]
    losses = dict(runs[1]["evals"])
    assert len(set(losses.values())) == 4  # the model changed between evals
    assert runs[1]["best_eval_loss"] == min(losses.values()) == losses[runs[1]["best_step"]]
    for step in (2, 4):
        saved = json.loads((tmp_path / "every-1" / "checkpoints" / f"step-{step}" / "run.json").read_text())
        assert saved["eval_loss"] == losses[step]


def test_trackers_get_every_step_and_a_resume_continues_their_curves(tmp_path, tiny, monkeypatch):
    """--report-to tensorboard wandb, a crash after the step-2 checkpoint, a resume: TensorBoard's own reader finds
    each step's loss and gradient norm once, as results.json has them, the evals at their steps with the answers to
    the first eval chats, and the peak memory; W&B (offline) wrote its run, and the resume continued the same run id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    argv = base_args(
        tiny,
        out,
        **{"--batch-size": 4, "--grad-accum": 2, "--eval-every": 2, "--dataset": tiny["chats"], "--block-size": 64},
    )
    argv += ["--report-to", "tensorboard", "wandb"]
    single.main(argv)
    crash_after_first_checkpoint(out)
    single.main(argv + ["--resume"])
    r = results(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]
    for tag, want in (("train/loss", r["losses"]), ("train/grad_norm", r["grad_norms"])):
        assert [s for s, _ in scalars(tag)] == [1, 2, 3, 4], tag  # the steps after the checkpoint logged once
        assert_close_losses(want, [v for _, v in scalars(tag)], rtol=1e-6)  # float32 in the event file
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in r["evals"]] == scalars("eval/loss")
    assert {"train/learning_rate", "train/tokens_per_second", "eval/perplexity"} <= set(events.Tags()["scalars"])
    memory = [v for _, v in scalars("memory/rank_0_peak_gb")]  # each rank's, here the one; the process's peak RSS
    assert len(memory) == 4 and memory[-1] == pytest.approx(r["peak_memory_gb_per_rank"][0], rel=1e-6)
    assert 0.1 < memory[-1] < 24
    samples = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/samples/text_summary")}
    chats = [json.loads(line)["messages"] for line in open(tiny["chats"])]
    turns = {(m[-2]["content"], m[-1]["content"]) for m in chats}  # (question, answer) of each chat's last turn
    assert sorted(samples) == [2, 4] and samples[4].startswith("prompt | expected | answer\n--- | --- | ---\n")
    rows = [line.split(" | ") for line in samples[4].splitlines()[2:]]
    assert len(rows) == 3 and all(len(row) == 3 for row in rows), samples[4]
    assert all((q.replace("<br>", "\n"), a.replace("<br>", "\n")) in turns for q, a, _ in rows)
    tokenizer, model = AutoTokenizer.from_pretrained(out / "final"), AutoModelForCausalLM.from_pretrained(out / "final")
    for question, _, answer in rows:  # the step-4 model's own greedy answers (final/ is that model)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question.replace("<br>", "\n")}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -63:]  # 64 positions
        new = model.generate(ids, max_new_tokens=64 - ids.shape[1], do_sample=False)[0, ids.shape[1] :]
        assert tokenizer.decode(new, skip_special_tokens=True).strip() == answer
    run_id = (out / "wandb-run-id").read_text()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # a W&B run per checkpoint interval (each checkpoint finishes it: tracking.py), steps 1-2 and 3-4, then the
    # resume's 3-4, all one run id (wandb adds -1 to a folder whose second is taken)
    assert len(runs) == 3 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", p.name) for p in runs)
    assert all((p / f"run-{run_id}.wandb").stat().st_size > 0 for p in runs)
    single.main(argv + ["--overwrite"])  # a new run in the same folder: new curves, not the old ones continued
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [s for s, _ in scalars("train/loss")] == [1, 2, 3, 4] and (out / "wandb-run-id").read_text() != run_id


def test_wandb_missing_or_logged_out_is_one_line(monkeypatch, tmp_path):
    """One line from rank 0; the other ranks leave with the same status and say nothing (none goes on into a
    collective the others left). Logged out is asked without a deprecated call of wandb's (it warned beside our
    line)."""
    import sys
    import warnings

    from finetune import tracking

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(SystemExit, match="^error: --report-to wandb: the wandb package is not installed; pip "):
        tracking.check_wandb({})
    with pytest.raises(SystemExit) as quiet:
        tracking.check_wandb({}, say=False)
    assert quiet.value.code == 1
    monkeypatch.undo()
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: logged out
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(
            SystemExit, match="not logged in to W&B; run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline"
        ):
            tracking.check_wandb({})
    assert not [w for w in caught if "deprecated" in str(w.message)], [str(w.message) for w in caught]
    tracking.check_wandb({"WANDB_MODE": "offline"})  # no login needed
    tracking.check_wandb({"WANDB_API_KEY": "x" * 40})


def test_resume_continues_with_identical_losses(tmp_path, tiny, monkeypatch):
    """Bit for bit, with dropout on: the resumed run draws the same dropout masks only if the RNG state came back. And
    nothing of the checkpoint is kept but what the optimizer holds as its state: no second copy of the weights for
    the rest of the run (bytes counted when the loop is done)."""
    model = dropout_model(tiny, tmp_path / "dropout-model")
    out = tmp_path / "run"
    argv = base_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2, "--model": str(model)})
    single.main(argv)
    full = results(out)
    full_weights = weights(out / "final")
    crash_after_first_checkpoint(out)
    with pytest.raises(SystemExit, match="holds an unfinished run; pass --resume"):
        single.main(argv)
    loaded, kept = [], []
    load, held_bytes = checkpoints._TORCH_LOAD, models.held_bytes  # torch.load, as checkpoints.load calls it

    def load_and_watch(*args, **kwargs):
        state = load(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in tree_leaves(state) if isinstance(t, torch.Tensor))
        return state

    def held_after_the_loop(model, optimizer):  # what single-gpu.py calls once the loop is done
        gc.collect()
        live = {
            t.untyped_storage().data_ptr()
            for t in [*model.parameters(), *tree_leaves(optimizer.state)]
            if isinstance(t, torch.Tensor)
        }
        kept.append(
            sum(t.nbytes for t in (r() for r in loaded) if t is not None and t.untyped_storage().data_ptr() not in live)
        )
        return held_bytes(model, optimizer)

    monkeypatch.setattr(checkpoints, "_TORCH_LOAD", load_and_watch)
    monkeypatch.setattr(models, "held_bytes", held_after_the_loop)
    single.main(argv + ["--resume"])
    monkeypatch.undo()
    assert loaded and kept == [0]  # the loaded state kept alive would hold the weights again (on a GPU, its memory)
    assert_resumed(out)
    resumed = results(out)
    assert len(resumed["losses"]) == 4
    assert resumed["losses"] == full["losses"] and resumed["grad_norms"] == full["grad_norms"]
    assert_same_weights(full_weights, weights(out / "final"), atol=0)


def test_the_batches_take_the_layout_of_the_attention_the_model_loaded(tmp_path, tiny, monkeypatch):
    """The AutoConfig names no attention implementation; the model loads with the one the hardware picks
    (FlashAttention-2 on GPUs: varlen rows, not a 4-D mask, or a device-side assert). Here eager attention stands in
    for it (--attention eager): its additive mask is another layout than SDPA's boolean one, and a boolean mask
    added to the scores would attend across documents. The same run either way."""
    argv = base_args(tiny, tmp_path / "sdpa", **{"--batch-size": 4})
    single.main(argv)
    single.main(base_args(tiny, tmp_path / "eager", **{"--batch-size": 4, "--attention": "eager"}))
    assert_close_losses(results(tmp_path / "sdpa")["losses"], results(tmp_path / "eager")["losses"])
    assert results(tmp_path / "eager")["eval_loss"] == pytest.approx(results(tmp_path / "sdpa")["eval_loss"], rel=1e-5)


def test_no_packing_and_bf16(tmp_path, tiny):
    single.main(base_args(tiny, tmp_path / "pad", **{"--batch-size": 4, "--block-size": 64, "--packing": "none"}))
    r = results(tmp_path / "pad")
    assert 4 * 4 * 20 < r["train_tokens"] < 4 * 4 * 64  # real tokens only: the padded positions are not counted
    single.main(base_args(tiny, tmp_path / "bf16", **{"--batch-size": 4, "--precision": "bf16"}))
    r16 = results(tmp_path / "bf16")
    assert r16["precision"] == "bf16" and all(0 < x < 10 for x in r16["losses"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"--dataset": "/nonexistent/data.csv"}, "dataset file /nonexistent/data.csv does not exist"),
        (
            {"--text-column": "review"},
            "has no column 'review' for the text format (it has label, text); name yours with",
        ),
        ({"--log-every": 0}, "--log-every must be positive, got 0"),
        ({"--loss-chunk": -1}, "--loss-chunk must be 0 or more"),
        ({"--lr": 0}, "--lr must be positive, got 0.0"),
        ({"--batch-size": -1}, "--batch-size must be positive"),
        ({"--block-size": 1}, "--block-size must be at least 2"),
        ({"--block-size": 65}, "--block-size 65 is beyond the model's 64 positions"),
        ({"--max-steps": 0, "--epochs": 0}, "set --epochs or --max-steps"),
        ({"--final": "best", "--save-every": 0}, "--final best exports the checkpoint with the lowest eval loss: set"),
        ({"--batch-size": 4000}, "less than one global batch of 4000"),
        (
            {"--attention": "torch_varlen"},
            "--attention torch_varlen: torch's varlen FlashAttention needs torch 2.10 or",
        ),
        (
            {"--attention": "flash_attention_2"},
            "--attention flash_attention_2: the flash-attn package is not installed",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path, tiny, overrides, message):
    with pytest.raises(SystemExit) as e:
        single.main(base_args(tiny, tmp_path / "x", **overrides))
    text = str(e.value)
    assert text.startswith("error: ") and message in text and "\n" not in text


def test_a_finished_run_is_never_overwritten_by_accident(tmp_path, tiny):
    out = tmp_path / "run"
    single.main(base_args(tiny, out))
    before = (out / "results.json").read_text()
    with pytest.raises(SystemExit, match="holds a finished run; pass --overwrite"):
        single.main(base_args(tiny, out, **{"--lr": 5e-3}))
    assert (out / "results.json").read_text() == before
    single.main(base_args(tiny, out, **{"--lr": 5e-3}) + ["--overwrite"])
    assert results(out)["losses"] != __import__("json").loads(before)["losses"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is a file; pass a folder"):
        single.main(base_args(tiny, tmp_path / "file"))
    with pytest.raises(SystemExit, match="no checkpoints to resume from"):
        single.main(base_args(tiny, tmp_path / "new") + ["--resume"])


def test_a_run_that_died_after_its_last_checkpoint_finishes_on_resume(tmp_path, tiny):
    """Killed in the evaluation or the export: the resume runs no step, evaluates, exports, writes the results."""
    out = tmp_path / "run"
    argv = base_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2})
    single.main(argv)
    full, full_weights = results(out), weights(out / "final")  # the uninterrupted run's, before they are deleted
    (out / "results.json").unlink()
    shutil.rmtree(out / "final")
    single.main(argv + ["--resume"])
    resumed = results(out)
    assert resumed["losses"] == full["losses"] and resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    assert resumed["train_tokens"] == full["train_tokens"] and resumed["tokens_per_sec"] > 0
    assert_same_weights(full_weights, weights(out / "final"), atol=0)


def test_fp16_steps_the_schedule_only_when_the_update_happened(tmp_path, tiny, monkeypatch):
    """A loss scale so large that the first gradients overflow: those updates are skipped and, as in DeepSpeed, so
    is the LR schedule; the first real update then gets the first step's learning rate. The scale is read once a
    step."""
    from finetune import training

    monkeypatch.setitem(training.FP16_SCALER, "init_scale", 2.0**20)  # the first gradients overflow fp16
    reads, get_scale = [], torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: reads.append(1) or get_scale(self))
    out = tmp_path / "run"
    single.main(
        base_args(tiny, out, **{"--precision": "fp16", "--max-steps": 6, "--save-every": 6, "--warmup-ratio": 0.0})
    )
    assert len(reads) == 1 + 6 + 1  # one host sync a step (on a GPU), where two were made; the checkpoint's
    state = torch.load(out / "checkpoints" / "step-6" / "state.pt", weights_only=False)
    scale = state["scaler"]["scale"]
    skipped = round(math.log2(2.0**20 / scale))  # each overflow halved the scale once
    assert 1 <= skipped < 6
    assert state["scheduler"]["last_epoch"] == 6 - skipped  # the schedule moved for the real updates only


def test_compile_makes_one_graph_and_then_never_compiles_anew(tiny, tmp_path, monkeypatch, capsys):
    """--compile: batches that vary in width and in their count of tokens that carry loss (a review a row), padded
    to the block size with the loss's sizes dynamic (Blocks.batch's width), compile one graph (dynamo's own count;
    without them, a second for the second batch). After the warm-up (training.CompileWarmup) a batch of another shape
    runs eagerly, never compiled anew, said once; a --compile run trains to the eager run's losses. (dynamo's eager
    backend: what is counted is the graphs; no profile of earlier runs: torch's local PGO off.)"""
    from helpers import data_args
    from torch._dynamo.utils import counters

    from finetune import loss

    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_local_pgo", False)
    tokenizer = models.load_tokenizer(tiny["model"])
    train = data.prepare(data_args(tiny["data"], block_size=64, packing="none"), tokenizer, seed=0)[0]
    order = train.lengths.argsort().tolist()  # the shortest rows first: a width each pair
    rows = [order[2 * i : 2 * i + 2] for i in range(8)]
    assert len({int(train.lengths[r].max()) for r in rows}) > 2  # widths that differ
    said = []
    graphs = {}
    for width in (None, 64):  # without the safety net
        model = loss.CausalLMLoss(AutoModelForCausalLM.from_pretrained(tiny["model"], attn_implementation="sdpa"), 1024)
        model.compile(backend="eager")
        torch._dynamo.reset()
        counters.clear()
        for pair in rows:
            inputs, targets = train.batch(pair, cpu_process(tokenizer.pad_token_id, model.config), width=width)
            model(inputs, targets).loss.backward()
        graphs[width] = counters["stats"]["unique_graphs"]
    assert graphs == {None: 3, 64: 1}  # unpadded: a static graph, a dynamic one, then the dynamic count of pairs
    # the safety net: after 3 steps a batch of a width the graph was not made for runs eagerly, no new graph
    counters.clear()
    torch._dynamo.reset()
    warmup = training.CompileWarmup(True, 64, said.append)
    for step, width in enumerate([64, 64, 64, None]):
        inputs, targets = train.batch(rows[step], cpu_process(tokenizer.pad_token_id, model.config), width=width)
        with warmup.after_warmup(step):
            model(inputs, targets).loss.backward()
    assert inputs["input_ids"].shape[1] < 64 and counters["stats"]["unique_graphs"] == 1
    assert said == [
        "--compile: 1 graph compiled in the first 3 steps; from here a batch of another shape runs "
        "eagerly, never compiled anew"
    ]
    # the scripts: the same losses compiled as eagerly
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager"))
    argv = base_args(
        tiny,
        tmp_path / "eager",
        **{
            "--dataset": tiny["chats"],
            "--block-size": 64,
            "--batch-size": 4,
            "--max-steps": 8,
            "--save-every": 0,
            "--eval-every": 0,
        },
    )
    eager = single.main(argv)
    torch._dynamo.reset()
    counters.clear()
    compiled = single.main([a.replace("eager", "compiled") for a in argv] + ["--compile"])
    assert_close_losses(eager["losses"], compiled["losses"])
    assert capsys.readouterr().out.count("--compile: 1 graph compiled in the first 3 steps") == 1
