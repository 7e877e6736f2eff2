"""The preference losses beside DPO's (--preference-loss robust, ipo, simpo, orpo; --sft-weight), TRL's names: each
against the published formula written out here independently, in float64, on the same log-probabilities; each
through the model (the chunked and the plain loss) against the stock model in float64, loss and gradients; each on
2 ranks under ZeRO-3 as one process; simpo and orpo without a reference pass."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_losses, base_args, check, cpu_process, launch, load_script, results, sequences
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import data, flags, loss, preference
from finetune.internals import demo

single = load_script("single-gpu.py")
KINDS = {  # name: the PairLoss (and flags) each is checked with
    "sigmoid+sft": preference.PairLoss("sigmoid", beta=0.5, sft_weight=0.5),
    "robust": preference.PairLoss("robust", beta=0.5, label_smoothing=0.2),
    "ipo": preference.PairLoss("ipo", beta=0.5),
    "simpo": preference.PairLoss("simpo", beta=2.0, simpo_gamma=0.7),
    "orpo": preference.PairLoss("orpo", beta=0.5, sft_weight=0.25),
}


def published(kind, c, r, c0, r0, nc, nr):
    """The papers' formulas (TRL's forms) for one pair, float64: c, r the chosen and rejected answers' summed
    log-probabilities, c0, r0 the reference's, nc, nr their token counts."""
    p = KINDS[kind]
    if kind.startswith("sigmoid"):
        out = -F.logsigmoid(p.beta * ((c - c0) - (r - r0)))
    elif kind == "robust":
        e, h = p.label_smoothing, p.beta * ((c - c0) - (r - r0))
        out = ((1 - e) * -F.logsigmoid(h) - e * -F.logsigmoid(-h)) / (1 - 2 * e)
    elif kind == "ipo":  # Azar et al. (17), on per-token averages as TRL
        out = ((c - c0) / nc - (r - r0) / nr - 1 / (2 * p.beta)) ** 2
    elif kind == "simpo":  # Meng et al. (6)
        out = -F.logsigmoid(p.beta / nc * c - p.beta / nr * r - p.simpo_gamma)
    else:  # Hong et al.: L_SFT + lambda L_OR, odds(y) = P / (1 - P) with P the mean token probability's log
        odds = lambda mean: mean - torch.log(1 - torch.exp(mean))
        out = -c / nc - p.beta * F.logsigmoid(odds(c / nc) - odds(r / nr))
    return out - p.sft_weight * c / nc


@pytest.mark.quick
@pytest.mark.parametrize("kind", KINDS)
def test_each_loss_is_its_published_formula_on_the_same_log_probabilities(kind):
    """PairLoss.per_pair on random log-probabilities, lengths and references: the formula above, value and
    gradient, to float64's rounding; the rewards TRL reports (beta x (logp - ref), or beta x mean logp without a
    reference)."""
    torch.manual_seed(0)
    logps = -torch.rand(16, 2, dtype=torch.float64) * 40 - 1
    lengths = torch.randint(3, 30, (16, 2)).double()
    reference = logps.detach() + torch.randn(16, 2, dtype=torch.float64)
    ours = logps.clone().requires_grad_()
    KINDS[kind].per_pair(ours, reference, lengths).sum().backward()
    theirs = logps.clone().requires_grad_()
    total = sum(
        published(kind, theirs[i, 0], theirs[i, 1], reference[i, 0], reference[i, 1], lengths[i, 0], lengths[i, 1])
        for i in range(16)
    )
    total.backward()
    assert KINDS[kind].per_pair(logps, reference, lengths).sum().item() == pytest.approx(total.item(), rel=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)
    assert ours.grad.abs().min() > 0  # every answer moves the loss
    expected = KINDS[kind].beta * (logps - reference if kind in ("sigmoid+sft", "robust", "ipo") else logps / lengths)
    torch.testing.assert_close(KINDS[kind].rewards(logps, reference, lengths), expected)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """48 generated pairs and a tiny OPT with a tokenizer of their words (dropout 0.1: preference runs drop it)."""
    root = tmp_path_factory.mktemp("pair-losses")
    demo.make_demo_pairs(root / "pairs.jsonl", n=48, seed=3, style="strings")
    texts = [" ".join(json.loads(line).values()) for line in open(root / "pairs.jsonl")]
    tokenizer = demo.make_demo_tokenizer(texts + ["### User: ### Assistant:"], vocab_size=1000)
    demo.make_demo_lm(root / "model", tokenizer, hidden=32, layers=2, heads=2, positions=128, seed=0)
    return {
        "model": str(root / "model"),
        "data": str(root / "pairs.jsonl"),
        "tokenizer": AutoTokenizer.from_pretrained(root / "model"),
    }


@pytest.mark.quick
@pytest.mark.parametrize("kind", KINDS)
def test_each_loss_through_the_model_is_the_formula_on_the_stock_models_answers(pairs, kind):
    """The summed loss over a split and its gradient through the model, chunked and plain, against the formula on
    each answer's log-probability from the stock model in float64, each sequence alone; TRL's metrics' rewards."""
    split, _ = data.prepare(
        flags.defaults(dataset=pairs["data"], block_size=128, max_eval_samples=0).data, pairs["tokenizer"], seed=0
    )
    torch.manual_seed(0)
    split = split.with_reference(-60 - 20 * torch.rand(split.pairs_total, 2))
    stock = AutoModelForCausalLM.from_pretrained(pairs["model"], dtype=torch.float64)
    preference.without_dropout(stock)
    expected = 0
    for pair, (c, cm, r, rm) in enumerate(sequences(split)):  # each pair's answers whole, each alone
        logp = []
        for ids, carries in ((c, cm), (r, rm)):
            logits = stock(torch.tensor([ids])).logits[0, :-1]
            keep = torch.tensor(carries[1:]) > 0
            logp += [-F.cross_entropy(logits[keep], torch.tensor(ids[1:])[keep], reduction="sum"), keep.sum()]
        ref = split.reference[pair].double()
        expected = expected + published(kind, logp[0], logp[2], ref[0], ref[1], logp[1].double(), logp[3].double())
    expected.backward()
    for chunk in (16, 0):
        model = loss.CausalLMLoss(
            AutoModelForCausalLM.from_pretrained(pairs["model"], attn_implementation="sdpa"), chunk, KINDS[kind]
        )
        preference.without_dropout(model)
        inputs, targets = split.batch(np.arange(len(split)), cpu_process(0, model.config))
        summed = model(inputs, targets)
        summed.loss.backward()
        assert summed.loss.item() == pytest.approx(expected.item(), rel=1e-5), chunk
        ours = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        theirs = torch.cat([q.grad.flatten() for q in stock.parameters()])  # (a key bias's is 0 but for rounding)
        assert (ours - theirs).norm() <= 1e-5 * theirs.norm(), chunk
        assert summed.pair_metrics[7] == sum(sum(x[1][1:]) for x in sequences(split))  # the chosen answers' tokens


def test_each_loss_on_2_ranks_under_zero3_trains_as_one_process(pairs, tmp_path):
    """One launch, a run of each loss (tests/zero_runs.py), 2 ranks x micro-batch 2 x 2 micro-steps against one
    process's 4 x 2: the losses, the gradients' norms and the rewards' margins to 1e-5; simpo and orpo score no
    reference (no reference.pt, no line about it)."""
    args = lambda kind, out, **more: base_args(
        {"model": pairs["model"], "data": pairs["data"]},
        out,
        **{
            "--block-size": 128,
            "--lr": 3e-3,
            "--warmup-ratio": 0,
            "--grad-accum": 2,
            "--save-every": 0,
            "--preference-loss": KINDS[kind].kind,
            "--beta": KINDS[kind].beta,
            "--sft-weight": KINDS[kind].sft_weight,
            "--label-smoothing": KINDS[kind].label_smoothing,
            "--simpo-gamma": KINDS[kind].simpo_gamma,
            **more,
        },
    )
    argvs = [
        args(kind, tmp_path / f"two-{kind}", **{"--batch-size": 2, "--zero-stage": 3}) + ["--deepspeed"]
        for kind in KINDS
    ]
    (tmp_path / "runs.json").write_text(json.dumps(argvs))
    run = check(launch("forked", "tests/zero_runs.py", [str(tmp_path / "runs.json")], timeout=900))
    assert run.stdout.count("reference log-probabilities") == 3  # sigmoid, robust, ipo; not simpo nor orpo
    for kind in KINDS:
        single.main(args(kind, tmp_path / f"one-{kind}", **{"--batch-size": 4}))
        one, two = results(tmp_path / f"one-{kind}"), results(tmp_path / f"two-{kind}")
        assert two["world_size"] == 2 and len(one["losses"]) == 4, kind
        assert_close_losses(one["losses"], two["losses"])
        assert_close_losses(one["grad_norms"], two["grad_norms"])
        assert_close_losses(one["rewards/margins"][1:], two["rewards/margins"][1:], rtol=1e-4)
        assert (tmp_path / f"one-{kind}" / "reference.pt").exists() == KINDS[kind].needs_reference
