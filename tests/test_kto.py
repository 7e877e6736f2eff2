"""KTO on unpaired rows (prompt, completion, label): found from the columns, each completion with a mismatched one for
the KL term, the loss the published formula (float64, independently), a run's step the formula on stock
transformers, and ZeRO on 2 ranks the same run as one process (the KL term over the global batch)."""

import json
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dpo_pairs import data_args, dpo_args, single
from helpers import (
    assert_close_losses,
    assert_same_weights,
    check,
    launch,
    results,
    sequences,
    weights,
)
from transformers import AutoModelForCausalLM

from finetune import data, preference, training


def unpaired(pairs_file, path, *, undesirable_every=4, extra=()):
    """Unpaired rows from pairs: every chosen answer desirable, every `undesirable_every`-th rejected one not (more
    desirable than not: the model learns the answers, so the KL term grows past 0), shuffled so that a row's KL
    completion answers another question."""
    rows = []
    for i, line in enumerate(open(pairs_file)):
        pair = json.loads(line)
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        if i % undesirable_every == 0:
            rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    random.Random(0).shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in [*rows, *extra]))
    return path


def kto_args(pairs, rows, out, **overrides):
    return dpo_args(pairs, out, **{"--dataset": rows, "--eval-fraction": 0.2, "--grad-accum": 2, **overrides})


@pytest.fixture(scope="module")
def rows(pairs, tmp_path_factory):
    return str(unpaired(pairs["strings"], tmp_path_factory.mktemp("kto") / "kto.jsonl"))


@pytest.fixture(scope="module")
def one_process(pairs, rows, tmp_path_factory):
    """single-gpu.py on the rows, 4 steps of 8 (4 x 2 micro-steps), a checkpoint every step, an eval at 2 and 4."""
    runs = {}

    def run(**flags):
        key = tuple(sorted(flags.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("kto-one")
            single.main(
                kto_args(pairs, rows, out, **{"--save-every": 1, "--keep-checkpoints": 0, "--eval-every": 2, **flags})
            )
            runs[key] = out
        return runs[key]

    return run


def test_mismatched_completions_come_from_other_rows():
    assert preference.mismatched(["p", "q", "r"], ["a", "b", "c"]) == ["c", "a", "b"]
    # never its own completion, nor an empty one, nor one of a row with its own prompt
    assert preference.mismatched(["p", "q", "r", "s"], ["a", "", "a", "b"]) == ["b", None, "b", "a"]
    assert preference.mismatched(["p", "p", "q", "q"], ["a", "b", "c", "d"]) == ["d", "d", "b", "b"]
    assert preference.mismatched(["p", "q"], ["a", "a"]) == [None, None]


def test_unpaired_rows_are_found_and_each_unit_holds_a_completion_and_another_rows(pairs, tmp_path):
    bad = [{"prompt": "Q?", "completion": " A.", "label": "yes"}, {"prompt": "Q?", "completion": "", "label": True}]
    path = unpaired(pairs["strings"], tmp_path / "rows.jsonl", extra=bad)
    lines = [json.loads(line) for line in open(path)]
    train, evals = data.prepare(data_args(path, eval_fraction=0.2), pairs["tokenizer"], seed=0)
    assert train.format == "unpaired" and train.desirable is not None
    assert train.pairs_total + evals.pairs_total == len(lines) - 2
    assert int(train.desirable.sum()) + int(evals.desirable.sum()) == sum(row["label"] is True for row in lines) - 1
    assert sum(int(n) for n in re.findall(r"(\d+) skipped", train.pairs_said + " " + evals.pairs_said)) == 2
    tokenized = lambda text: tuple(pairs["tokenizer"](text, add_special_tokens=False)["input_ids"])
    answers = {tokenized(row["completion"]) for row in lines}
    for split in (train, evals):
        for c, mask, kl, _ in sequences(split):
            prompt = mask.index(1)
            assert c[:prompt] == kl[:prompt]  # the same prompt, then another row's completion (and the EOS)
            assert tuple(kl[prompt:-1]) in answers and kl[prompt:-1] != c[prompt:-1]


def test_kto_loss_is_the_published_formula_in_float64():
    """PairLoss("kto").per_pair on random log-probabilities against eq. 7 of Ethayarajh et al. (2024) written out in
    float64, the KL term the clamped mean of the KL completions' log-ratios: values and gradients."""
    torch.manual_seed(0)
    n, beta, wd, wu = 12, 0.3, 1.0, 1.33
    logps, reference = -20 * torch.rand(n, 2, dtype=torch.float64), -20 * torch.rand(n, 2, dtype=torch.float64)
    desirable = torch.rand(n) < 0.6
    kto = preference.PairLoss("kto", beta=beta, desirable_weight=wd, undesirable_weight=wu)
    for shift in (0.0, 5.0):  # a KL term clamped to 0, and one above it
        kl = ((logps[:, 1] + shift) - reference[:, 1]).mean().clamp(min=0)
        ours = logps.clone().requires_grad_()
        kto.per_pair(ours, reference, torch.ones(n, 2), desirable=desirable, kl=kl).mean().backward()
        expected, grads = 0.0, torch.zeros(n, 2, dtype=torch.float64)
        for i in range(n):
            ratio = logps[i, 0].item() - reference[i, 0].item()
            s = 1 / (1 + torch.exp(torch.tensor(-beta * (ratio - kl.item()), dtype=torch.float64)).item())
            if desirable[i]:
                expected += wd * (1 - s) / n
                grads[i, 0] = -wd * beta * s * (1 - s) / n
            else:
                expected += wu * s / n  # 1 - sigmoid(beta (kl - ratio)) = sigmoid(beta (ratio - kl))
                grads[i, 0] = wu * beta * s * (1 - s) / n
        value = kto.per_pair(logps, reference, torch.ones(n, 2), desirable=desirable, kl=kl).mean().item()
        assert value == pytest.approx(expected, abs=1e-12)
        torch.testing.assert_close(ours.grad, grads, atol=1e-12, rtol=0)  # the KL completions: no gradient


def _logp(model, ids, mask):
    logits = model(torch.tensor([ids])).logits[0, :-1]
    carries = torch.tensor(mask[1:]) > 0
    return -F.cross_entropy(logits[carries], torch.tensor(ids[1:])[carries], reduction="sum")


def test_a_step_is_the_formula_on_stock_transformers_with_the_global_batchs_kl(pairs, rows, one_process):
    """Step 2 (after one update, so the KL term is no longer 0): its loss, KL term and gradient norm against KTO
    computed in float64 on stock transformers from the step-1 checkpoint, each sequence alone."""
    out = one_process()
    r = results(out)
    assert r["losses"][0] == pytest.approx(0.5, abs=1e-6)  # the model is its own reference: 1 - sigmoid(0)
    assert r["kl"][0] == pytest.approx(0, abs=1e-6) and r["kl"][1] > 0.01
    assert "rewards/accuracies" not in r and len(r["rewards/margins"]) == 4 and r["rewards/margins"][-1] > 0
    config = single.parse_args(kto_args(pairs, rows, out))
    train = data.prepare(config.data, pairs["tokenizer"], seed=config.train.seed)[0]
    ids = train.pair_ids(training.GlobalBatches(len(train), 8, 42)(1).numpy())
    stock = AutoModelForCausalLM.from_pretrained(pairs["model"], dtype=torch.float64)
    stock.load_state_dict(
        {k: v.double() for k, v in torch.load(out / "checkpoints" / "step-1" / "state.pt")["model"].items()}
    )
    stock.eval()
    seqs, reference = sequences(train), torch.load(out / "reference.pt")["train"].double()
    logps = torch.stack([torch.stack([_logp(stock, *seqs[i][:2]), _logp(stock, *seqs[i][2:])]) for i in ids])
    kl = (logps[:, 1] - reference[ids, 1]).mean().clamp(min=0).detach()
    z = 0.5 * (logps[:, 0] - reference[ids, 0] - kl)
    desirable = torch.from_numpy(train.desirable[ids])
    loss = torch.where(desirable, 1 - torch.sigmoid(z), 1 - torch.sigmoid(-z)).mean()
    loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in stock.parameters())).item()
    assert r["kl"][1] == pytest.approx(kl.item(), rel=1e-5)
    assert r["losses"][1] == pytest.approx(loss.item(), rel=1e-5)
    assert r["grad_norms"][1] == pytest.approx(norm, rel=1e-5)


def test_zero_3_on_2_ranks_trains_as_one_process_with_the_global_batchs_kl(pairs, rows, one_process, tmp_path):
    """One launch, four runs: 2 ranks x micro-batch 2 x 2 micro-steps, the global batch of one process's 4 x 2:
    ZeRO-3 with gradient checkpointing, ZeRO-2 with a unit's two sequences in two rows, LoRA under ZeRO-3 (its
    reference the base); and ZeRO-2 at one micro-step a step (4 a rank; one process: 8), whose kl the loss makes
    from its own forward, summed over the ranks, with no pass before the step. The KL term is the global batch's:
    each rank's own would differ."""
    lora = {"--lora-rank": 4, "--lora-alpha": 8, "--lr": 1e-2}
    once = {"--grad-accum": 1}
    cases = {  # name: (stage, the 2-rank run's flags, the one-process run's)
        "zero-3": (3, {}, {}),
        "rows": (2, {"--packing": "none"}, {"--packing": "none"}),
        "lora": (3, lora, lora),
        "one-micro-step": (2, {**once, "--batch-size": 4}, {**once, "--batch-size": 8}),
    }
    argvs = [
        kto_args(
            pairs,
            rows,
            tmp_path / name,
            **{"--batch-size": 2, "--save-every": 1, "--eval-every": 2, "--zero-stage": stage, **given},
        )
        + ["--deepspeed", *(["--gradient-checkpointing"] if name == "zero-3" else [])]
        for name, (stage, given, _) in cases.items()
    ]
    (tmp_path / "runs.json").write_text(json.dumps(argvs))
    check(launch("forked", "tests/zero_runs.py", [str(tmp_path / "runs.json")], timeout=900))
    for name, (_, _, alone) in cases.items():
        one = one_process(**alone)
        a, b = results(one), results(tmp_path / name)
        assert b["world_size"] == 2 and b["global_batch_size"] == 8, name
        assert_close_losses(a["losses"], b["losses"])
        assert_close_losses(a["grad_norms"], b["grad_norms"])
        torch.testing.assert_close(torch.tensor(a["kl"]), torch.tensor(b["kl"]), atol=1e-5, rtol=1e-5)
        assert max(b["kl"]) > 0.01, name  # the KL term took part
        assert b["evals"][-1][1] == pytest.approx(a["evals"][-1][1], rel=1e-5)
        assert_same_weights(weights(one / "final"), weights(tmp_path / name / "final"), atol=1e-4)
    # the kl made in the loss (one micro-step a step) is the one the pass before the step makes (two)
    single_step, two_steps = results(one_process(**once, **{"--batch-size": 8})), results(one_process())
    assert_close_losses(single_step["losses"], two_steps["losses"])
    torch.testing.assert_close(torch.tensor(single_step["kl"]), torch.tensor(two_steps["kl"]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"--preference-loss": "ipo"},
            "unpaired rows (prompt, completion, label) train with KTO: drop --preference-loss",
        ),
        ({"--sft-weight": 0.5}, "unpaired rows (KTO) have none: drop it"),
        ({"--desirable-weight": 0}, "--desirable-weight and --undesirable-weight must be positive"),
    ],
)
def test_flags_kto_cannot_take_are_one_line(pairs, rows, tmp_path, flags, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        single.main(kto_args(pairs, rows, tmp_path / "out", **flags))
    assert not (tmp_path / "out").exists()


def test_kto_on_pairs_is_one_line(pairs, tmp_path):
    with pytest.raises(SystemExit, match="--preference-loss kto takes unpaired rows"):
        single.main(dpo_args(pairs, tmp_path / "out", **{"--preference-loss": "kto"}))


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"prompt": "a", "completion": " b", "label": "yes"}, {"prompt": "c", "completion": " d", "label": 2}],
            "label is not true or false",
        ),
        (
            [{"prompt": "a", "completion": " b", "label": True}, {"prompt": "a", "completion": " b", "label": False}],
            "no other row's completion to estimate the KL term from",
        ),
    ],
)
def test_a_file_with_no_usable_row_is_one_line_and_nothing_is_prepared(pairs, tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    cache = Path(data_args(path).cache_dir)
    before = set(cache.iterdir()) if cache.exists() else set()
    with pytest.raises(SystemExit, match=re.escape(message)):
        data.prepare(data_args(path), pairs["tokenizer"], seed=0)
    assert {p for p in cache.iterdir() if not p.name.endswith(".failed")} <= before
