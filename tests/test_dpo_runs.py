"""DPO runs end to end: the first step's loss ln 2 with the formula's gradient, the reference kept with the run and read
on a resume that continues exactly, bf16 with LoRA and the best checkpoint, ZeRO 0-3 (and LoRA under ZeRO-3) on 2
ranks = one process, the preference learning rate. (The formats, packing and the loss: test_preference.py.)"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dpo_pairs import data_args, dpo_args, independent_dpo, single
from helpers import (
    assert_close_losses,
    assert_resumed,
    assert_same_weights,
    check,
    crash_after_first_checkpoint,
    launch,
    results,
    sequences,
    weights,
)
from transformers import AutoModelForCausalLM

from finetune import data, preference, training


@pytest.fixture(scope="module")
def one_process(pairs, tmp_path_factory):
    """single-gpu.py on the pairs, 4 steps of 8 pairs (4 x 2 micro-steps), a checkpoint at step 2, an eval at 2 and
    4; flags -> run folder, each run once."""
    runs = {}

    def run(**flags):
        key = tuple(sorted(flags.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("dpo-one")
            single.main(dpo_args(pairs, out, **{"--grad-accum": 2, "--eval-every": 2, **flags}))
            runs[key] = out
        return runs[key]

    return run


def test_the_first_step_is_ln2_with_the_formulas_gradient_and_the_reference_is_kept(pairs, one_process):
    out = one_process()
    r = results(out)
    assert r["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # the model is its own reference at step 1
    assert r["rewards/chosen"][0] == pytest.approx(0, abs=1e-6)
    assert r["rewards/margins"][0] == pytest.approx(0, abs=1e-6)
    assert r["losses"][-1] < r["losses"][1] and r["rewards/margins"][-1] > 0  # it learns to prefer the chosen
    # the gradient of step 1 against the formula's, with stock transformers in float64 on the loaded model
    config = single.parse_args(dpo_args(pairs, out))
    train = data.prepare(config.data, pairs["tokenizer"], seed=config.train.seed)[0]
    first = training.GlobalBatches(len(train), 8, 42)(0).numpy()
    ids = train.pair_ids(first)
    stock = AutoModelForCausalLM.from_pretrained(pairs["model"], dtype=torch.float64).eval()
    with torch.no_grad():
        reference = torch.stack([torch.stack(_logps(stock, s)) for s in sequences(train)])
    saved = torch.load(out / "reference.pt")
    assert torch.allclose(saved["train"], reference, atol=1e-4, rtol=0)  # what the pass kept, fp32 to float64
    value = independent_dpo(stock, train, ids, reference, 0.5)
    value.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in stock.parameters())).item()
    assert value.item() == pytest.approx(math.log(2), abs=1e-12)
    assert r["grad_norms"][0] == pytest.approx(norm, rel=1e-5)
    assert r["logps/chosen"][0] == pytest.approx(reference[ids, 0].mean().item(), rel=1e-5)
    assert r["evals"][0][0] == 2 and r["best_step"] in (2, 4) and len(r["rewards/accuracies"]) == 4


def _logps(model, seq):
    out = []
    for ids, mask in (seq[:2], seq[2:]):
        logits = model(torch.tensor([ids])).logits[0, :-1]
        out.append((-F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none") * torch.tensor(mask[1:])).sum())
    return out


def test_resume_reads_the_kept_reference_and_continues_exactly(pairs, one_process, tmp_path, capsys):
    whole = one_process()
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    crash_after_first_checkpoint(out)
    kept = (out / "reference.pt").stat().st_mtime_ns
    capsys.readouterr()
    single.main(dpo_args(pairs, out, **{"--grad-accum": 2, "--eval-every": 2, "--resume": None}) + ["--resume"])
    assert "reference log-probabilities" not in capsys.readouterr().out  # read, not computed again
    assert_resumed(out)
    assert (out / "reference.pt").stat().st_mtime_ns == kept
    a, b = results(whole), results(out)
    assert a["losses"] == b["losses"] and a["rewards/margins"] == b["rewards/margins"]
    assert_same_weights(weights(whole / "final"), weights(out / "final"), atol=0)
    crash_after_first_checkpoint(out)
    # the reference is fingerprinted: a resume whose inputs would score it otherwise refuses (the counts agree here)
    with pytest.raises(
        SystemExit,
        match=r"reference.pt was scored with another --precision than this run's: its "
        r"log-probabilities would be wrong",
    ):
        single.main(dpo_args(pairs, out, **{"--grad-accum": 2, "--resume": None, "--precision": "bf16"}) + ["--resume"])
    made_of = json.loads(torch.load(out / "reference.pt")["made_of"])
    key = made_of["pairs"][0].split("/")[0]  # the prepared data's key: its cache folder
    assert (
        made_of
        == {"pairs": [f"{key}/train", f"{key}/eval"], "model": "model", "lora_rank": 0, "base": "", "precision": "fp32"}
        and (Path(data_args(pairs["strings"]).cache_dir) / key).is_dir()
    )
    (out / "reference.pt").unlink()
    with pytest.raises(SystemExit, match="reference.pt is missing"):
        single.main(dpo_args(pairs, out, **{"--grad-accum": 2, "--resume": None}) + ["--resume"])
    # a run started over never takes an earlier run's reference: with one of zeros left there, step 1 is still ln 2
    torch.save(
        {"train": torch.zeros(46, 2, dtype=torch.float64), "eval": torch.zeros(2, 2, dtype=torch.float64)},
        out / "reference.pt",
    )
    single.main(dpo_args(pairs, out, **{"--grad-accum": 2, "--max-steps": 1, "--overwrite": None}) + ["--overwrite"])
    assert results(out)["losses"][0] == pytest.approx(math.log(2), abs=1e-6)


def test_bf16_lora_and_the_best_checkpoint_with_pairs(pairs, tmp_path, capsys):
    """bf16 autocast, LoRA and --final best: the first step is ln 2 to bf16's rounding, final/ is the best step's
    merged model (stock transformers loads it) beside its adapter, and the sample answers a held-out pair's prompt."""
    out = tmp_path / "run"
    single.main(
        dpo_args(
            pairs,
            out,
            **{
                "--precision": "bf16",
                "--lora-rank": 4,
                "--lora-alpha": 8,
                "--lr": 1e-2,
                "--max-steps": 4,
                "--eval-every": 2,
                "--final": "best",
                "--prompt": "x",
            },
        )
    )
    r = results(out)
    assert r["losses"][0] == pytest.approx(math.log(2), abs=2e-3) and r["precision"] == "bf16"
    assert r["final_step"] == r["best_step"] == min(r["evals"], key=lambda e: e[1])[0]
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(out / "final")
    assert "sample: 'Review:" in capsys.readouterr().out and r["sample"] is not None  # a held-out pair's prompt


def test_zero_0_to_3_and_lora_on_2_ranks_train_as_one_process(pairs, one_process, tmp_path):
    """One launch, six runs (tests/zero_runs.py): 2 ranks x micro-batch 2 x 2 micro-steps, the global batch of one
    process's 4 x 2. Folded in: two rows a pair (ZeRO-0), the plain loss (ZeRO-1), an eval after every step (ZeRO-2),
    gradient checkpointing (ZeRO-3), LoRA under ZeRO-3, and unusable rows before, between and after the pairs (ZeRO-2,
    held to the one-process run on the file without them)."""
    lora = {"--lora-rank": 4, "--lora-alpha": 8, "--lr": 1e-2}
    mixed = with_unusable_rows(pairs["strings"], tmp_path / "mixed.jsonl")
    cases = {
        0: {"--packing": "none"},
        1: {"--loss-chunk": 0},
        2: {"--eval-every": 1},
        3: {},
        "lora": lora,
        "mixed": {"--dataset": mixed, "--eval-dataset": mixed},
    }
    argvs = []
    for stage, given in cases.items():
        extra = ["--gradient-checkpointing"] if stage == 3 else []
        argvs.append(
            dpo_args(
                pairs,
                tmp_path / f"zero-{stage}",
                **{
                    "--batch-size": 2,
                    "--grad-accum": 2,
                    "--eval-every": 2,
                    "--zero-stage": {"lora": 3, "mixed": 2}.get(stage, stage),
                    **given,
                },
            )
            + ["--deepspeed", *extra]
        )
    (tmp_path / "runs.json").write_text(json.dumps(argvs))
    check(launch("forked", "tests/zero_runs.py", [str(tmp_path / "runs.json")], timeout=900))
    for stage, given in cases.items():
        same = {k: v for k, v in given.items() if k in ("--packing", "--lora-rank", "--lora-alpha", "--lr")}
        one = one_process(**same) if stage != "mixed" else one_process(**{"--eval-dataset": pairs["strings"]})
        a, b = results(one), results(tmp_path / f"zero-{stage}")
        assert b["world_size"] == 2 and b["global_batch_size"] == 8, stage
        assert_close_losses(a["losses"], b["losses"])
        assert_close_losses(a["grad_norms"], b["grad_norms"])
        assert_close_losses(a["rewards/margins"][1:], b["rewards/margins"][1:], rtol=1e-4)
        assert b["evals"][-1][1] == pytest.approx(a["evals"][-1][1], rel=1e-5)
        assert_same_weights(weights(one / "final"), weights(tmp_path / f"zero-{stage}" / "final"), atol=1e-4)
    # resumed on 2 ranks from the ZeRO-2 run's step 2: rank 0 reads the kept reference and sends it to the other
    whole, out = tmp_path / "zero-2", tmp_path / "resumed"
    shutil.copytree(whole, out)
    crash_after_first_checkpoint(out)
    argv = [a.replace(str(whole), str(out)) for a in argvs[2]] + ["--resume"]
    run = check(launch("forked", "zero-optimization.py", argv))
    assert "reference log-probabilities" not in run.stdout
    assert_resumed(out)
    assert results(out)["losses"] == results(whole)["losses"]
    assert results(out)["rewards/margins"] == results(whole)["rewards/margins"]


def test_pairs_take_a_dpo_learning_rate_unless_one_is_given(pairs, tmp_path, capsys):
    """--lr's default is the data's (TRL's DPO default for pairs, 5e-6 with LoRA); the start line says which."""
    cases = [
        (None, "preference", 0),
        (None, "preference", 16),
        (None, "messages", 0),
        (None, "text", 16),
        (3e-4, "preference", 0),
    ]
    assert [preference.learning_rate(*case) for case in cases] == [1e-6, 5e-6, 5e-5, 5e-5, 3e-4]
    single.main(dpo_args(pairs, tmp_path / "run", **{"--lr": None, "--max-steps": 1, "--save-every": 0}))
    assert " | lr 1e-06 | fp32 | cpu" in capsys.readouterr().out


UNUSABLE = [
    {"prompt": "a", "chosen": "", "rejected": " b"},  # an empty answer
    {"prompt": "a", "chosen": " b", "rejected": " b"},  # nothing to prefer
    {"chosen": "The answer is 4", "rejected": "The answer is 4 or 5"},  # an implicit prompt leaves one answer empty
]


def with_unusable_rows(path, out):
    """The pairs of `path` with an unusable row before them, one between them and one after: skipped, and the rest
    trains as the file without them."""
    rows = [json.loads(line) for line in open(path)]
    rows = UNUSABLE[:1] + rows[:10] + UNUSABLE[1:2] + rows[10:] + UNUSABLE[2:]
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


@pytest.mark.parametrize("packing", ["isolated", "none"])
def test_unusable_rows_before_kept_pairs_train_as_the_file_without_them(pairs, tmp_path, capsys, packing):
    """Unusable rows before, between and after the pairs, in the training and the eval file, packed and a pair a row:
    skipped and counted at start, and the reference pass, the training and the evaluation are those of the file
    without them: the same reference log-probabilities, losses and eval (before: the reference pass ended in an
    IndexError, a pair's index counting the rows skipped before it)."""
    mixed = with_unusable_rows(pairs["strings"], tmp_path / "mixed.jsonl")
    runs = {}
    for name, path in (("clean", pairs["strings"]), ("mixed", mixed)):
        out = tmp_path / name
        flags = {"--dataset": path, "--eval-dataset": path, "--packing": packing, "--max-steps": 3}
        single.main(dpo_args(pairs, out, **flags))
        runs[name] = results(out), torch.load(out / "reference.pt", weights_only=True)
    said = capsys.readouterr().out
    assert "; 3 skipped (2: the chosen answer is empty; 1: chosen and rejected are the same" in said
    (clean, clean_reference), (mixed_run, mixed_reference) = runs["clean"], runs["mixed"]
    assert torch.equal(clean_reference["train"], mixed_reference["train"]) and len(clean_reference["train"]) == 48
    assert torch.equal(clean_reference["eval"], mixed_reference["eval"])
    assert mixed_run["losses"] == clean["losses"] and mixed_run["evals"] == clean["evals"]
    assert mixed_run["rewards/accuracies"] == clean["rewards/accuracies"]
