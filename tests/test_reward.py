"""Reward models from preference pairs in sequence_classification.py: the Bradley-Terry loss (margin, centering)
against its formula, a trained model's eval loss and accuracy against stock transformers scoring each text alone
(DistilBERT, and decoders: OPT, Llama, GPT-2, Qwen2 with their pad token set), ZeRO-2 and ZeRO-3 on 2 ranks against
one process, the saved model behind pipeline("text-classification")."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import check, launch, load_script, results
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from finetune import reward
from finetune.internals import demo

classification = load_script("sequence_classification.py")


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    """320 generated pairs (prompt, chosen, rejected; and a copy with margins), a tiny encoder with a WordPiece
    tokenizer of their words, and tiny decoders of four families with a byte-level one (GPT-2's without a pad
    token)."""
    root = tmp_path_factory.mktemp("rewards")
    demo.make_demo_pairs(root / "pairs.jsonl", n=320, seed=3)  # 304 to train: 19 global batches of 16
    rows = [json.loads(line) for line in open(root / "pairs.jsonl")]
    (root / "margins.jsonl").write_text(
        "".join(json.dumps({**row, "margin": 0.5 * (i % 3)}) + "\n" for i, row in enumerate(rows))
    )
    texts = [row["prompt"] + row["chosen"] + row["rejected"] for row in rows]
    wordpiece = demo.make_demo_wordpiece_tokenizer(texts, vocab_size=400)
    demo.make_demo_encoder(root / "encoder", wordpiece, dim=32, layers=2, heads=2, positions=128)
    tokenizer = demo.make_demo_tokenizer(texts, vocab_size=400)
    demo.make_demo_lm(root / "opt", tokenizer, hidden=32, layers=2, heads=2, positions=128)
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=400)
    families = {
        "llama": dict(model_type="llama", num_key_value_heads=2, max_position_embeddings=128, **small),
        "qwen2": dict(model_type="qwen2", num_key_value_heads=2, max_position_embeddings=128, **small),
        "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=128, vocab_size=400),
    }
    for name, settings in families.items():
        config = AutoConfig.for_model(**settings, bos_token_id=2, eos_token_id=2)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tokenizer.pad_token = None if name == "gpt2" else "<pad>"  # GPT-2's has none: the script takes the EOS
        tokenizer.save_pretrained(root / name)
    return root


def args(root, out, model="encoder", data="pairs.jsonl", *extra):
    return [
        "--model",
        str(root / model),
        "--dataset",
        str(root / data),
        "--max-length",
        "96",
        "--batch-size",
        "16",
        "--lr",
        "2e-3",
        "--epochs",
        "6",
        "--output-dir",
        str(out),
        *extra,
    ]


def independent(folder, pairs_file, split_of):
    """(mean Bradley-Terry loss, accuracy) of the eval pairs, each text alone through the stock model in float64."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = split_of(pairs_file)
    with torch.no_grad():
        scores = torch.tensor(
            [
                [
                    model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()
                    for text in reward.pair_texts(r, tokenizer)
                ]
                for r in rows
            ],
            dtype=torch.float64,
        )
    margin = torch.tensor([r.get("margin", 0.0) for r in rows], dtype=torch.float64)
    difference = scores[:, 0] - scores[:, 1]
    return -F.logsigmoid(difference - margin).mean().item(), (difference > 0).double().mean().item(), scores


def eval_rows(path):
    from finetune import data

    return list(data.load_splits(str(path), seed=42)[1])


def test_the_bradley_terry_loss_is_trls_formula():
    torch.manual_seed(0)
    chosen, rejected, margin = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), torch.rand(8)
    expected = sum(-torch.log(1 / (1 + torch.exp(-(c - r - m)))) for c, r, m in zip(chosen, rejected, margin)) / 8
    assert reward.bradley_terry(chosen, rejected, margin).item() == pytest.approx(expected.item(), abs=1e-12)
    centered = expected + 0.01 * sum((c + r) ** 2 for c, r in zip(chosen, rejected)) / 8
    assert reward.bradley_terry(chosen, rejected, margin, 0.01).item() == pytest.approx(centered.item(), abs=1e-12)


@pytest.fixture(scope="module")
def one_process(rewards, tmp_path_factory):
    out = tmp_path_factory.mktemp("reward-one") / "run"
    return classification.main(args(rewards, out)), out


def test_a_reward_model_learns_the_pairs_and_its_eval_is_stock_transformers(rewards, one_process):
    r, out = one_process
    assert r["labels"] == ["reward"] and r["world_size"] == 1 and r["accuracy"] >= 0.8
    loss, accuracy, scores = independent(out / "final", rewards / "pairs.jsonl", eval_rows)
    assert r["eval_loss"] == pytest.approx(loss, rel=1e-5) and r["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    score = pipeline("text-classification", model=str(out / "final"))  # a reward: sigmoid of the score by default
    texts = reward.pair_texts(eval_rows(rewards / "pairs.jsonl")[0], AutoTokenizer.from_pretrained(out / "final"))
    raw = score(list(texts), function_to_apply="none")
    assert [a["score"] for a in raw] == pytest.approx(scores[0].tolist(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("family", ["opt", "llama", "gpt2", "qwen2"])
def test_decoders_score_their_last_token_with_margins_and_centering(rewards, tmp_path, family):
    out = tmp_path / "run"
    extra = ["--epochs", "1", "--center-rewards-coefficient", "0.01"]
    r = classification.main(args(rewards, out, family, "margins.jsonl", *extra))
    loss, accuracy, scores = independent(out / "final", rewards / "margins.jsonl", eval_rows)
    centered = loss + 0.01 * ((scores[:, 0] + scores[:, 1]) ** 2).mean().item()
    assert r["eval_loss"] == pytest.approx(centered, rel=1e-5) and r["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert AutoModelForSequenceClassification.from_pretrained(out / "final").config.pad_token_id is not None


def test_zero_2_and_3_on_2_ranks_learn_the_pairs_and_save_whole_models(rewards, one_process, tmp_path):
    """ZeRO-2 and ZeRO-3 on 2 ranks, micro-batch 8: the global batch of the one-process run, the same batches (the
    Trainer's seeded sampler, 19 whole global batches an epoch): each learns the pairs, and its model, gathered
    from the shards, scores them as stock transformers do. Their training follows one process's only through the
    first steps (docs/classification.md)."""
    one, _ = one_process
    runs = {}
    for config in ("ds_config_zero2.json", "ds_config_zero3.json"):
        argv = args(rewards, tmp_path / config, "encoder", "pairs.jsonl", "--deepspeed", config)
        argv[argv.index("--batch-size") + 1] = "8"
        check(launch("forked", "sequence_classification.py", argv))
        runs[config] = two = results(tmp_path / config)
        assert two["world_size"] == 2 and two["labels"] == ["reward"] and two["accuracy"] >= 0.8
        loss, accuracy, _ = independent(tmp_path / config / "final", rewards / "pairs.jsonl", eval_rows)
        assert two["eval_loss"] == pytest.approx(loss, rel=1e-5) and two["accuracy"] == accuracy  # gathered whole
    zero2, zero3 = runs.values()  # the first 10 steps: one process
    assert zero2["train_log"][0]["loss"] == pytest.approx(one["train_log"][0]["loss"], rel=1e-5)
    assert zero3["train_log"][0]["loss"] == pytest.approx(one["train_log"][0]["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "rows, flags, message",
    [
        ([{"chosen": "a b", "rejected": 5}], [], "rejected must be text or a list of messages in every row"),
        ([{"chosen": "good " * 40, "rejected": "bad " * 40}], ["--max-length", "8"], "longer than --max-length 8"),
    ],
)
def test_a_preference_file_it_cannot_train_is_one_line(rewards, tmp_path, rows, flags, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 40))
    with pytest.raises(SystemExit, match=message):
        classification.main(args(rewards, tmp_path / "out", "encoder", "pairs.jsonl", "--dataset", str(path), *flags))
    assert not (tmp_path / "out").exists()
