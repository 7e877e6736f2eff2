"""Reward models from preference pairs in sequence_classification.py: the Bradley-Terry loss (margin, centering)
against its formula, a trained model's eval loss and accuracy against stock transformers scoring each text alone
(DistilBERT, and decoders: OPT, Llama, GPT-2, Qwen2 with their pad token set), ZeRO-2 and ZeRO-3 on 2 ranks against
one process, the saved model behind pipeline("text-classification")."""

import json

import datasets
import pytest
import torch
import torch.nn.functional as F
from helpers import check, launch, load_script, results
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BloomConfig, pipeline

from finetune import reward
from finetune.internals import demo

classification = load_script("sequence_classification.py")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=400)


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

    families = {
        "llama": dict(model_type="llama", num_key_value_heads=2, max_position_embeddings=128, **SMALL),
        "qwen2": dict(model_type="qwen2", num_key_value_heads=2, max_position_embeddings=128, **SMALL),
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


@pytest.mark.parametrize(
    "family, attention",
    [("opt", "sdpa"), ("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("qwen2", "sdpa"), ("mistral", "sdpa")]
    + [("qwen3", "sdpa"), ("gemma", "sdpa"), ("gemma2", "eager"), ("phi3", "sdpa")],
)
def test_a_pair_in_one_row_scores_each_text_as_alone(rewards, tmp_path, family, attention):
    """The one-row layout (a decoder's default): each pair's shared tokens once, then the rest of each text. Through
    RewardTrainer.compute_loss, each text's reward is the stock model's on that text alone in float64 (1e-5; fp32
    rounding), for pairs of different lengths (padding), answers of which one starts the other, the eager
    attention's additive mask and Mistral's sliding window (8 tokens: shorter than the texts)."""
    from transformers import AutoConfig, TrainingArguments

    folder = rewards / family
    if family not in ("opt", "llama", "gpt2", "qwen2"):  # Mistral's sliding window shorter than every text: the mask
        # must window each text as alone; Gemma 2's too, on every other layer, with its scores' softcapping
        window = {"sliding_window": 8} if family in ("mistral", "gemma2") else {}
        config = AutoConfig.for_model(
            family,
            num_key_value_heads=2,
            max_position_embeddings=128,
            head_dim=16,
            bos_token_id=2,
            eos_token_id=2,
            pad_token_id=0,
            num_labels=1,
            **window,
            **SMALL,
        )
        folder = tmp_path / family
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(rewards / "llama").save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, attn_implementation=attention)
    model.config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(1)
    torch.nn.init.normal_(model.score.weight)  # (a fresh head: rewards apart enough to tell a wrong token)
    rows = [json.loads(line) for line in open(rewards / "pairs.jsonl")][:6]
    rows[1] = {**rows[1], "rejected": rows[1]["chosen"] + " and more"}  # the chosen answer starts the rejected one
    rows[2] = {**rows[2], "chosen": rows[2]["chosen"] + " " + rows[2]["chosen"]}  # longer: the others padded
    pairs, _ = reward.tokenized_pairs(datasets.Dataset.from_list(rows), tokenizer, 96, "pairs")
    layout = reward.one_row_layout(model, "one-row")
    assert layout == ("additive" if attention == "eager" else "bool")
    collator = reward.OneRowCollator(tokenizer.pad_token_id, model.config, layout)
    trainer = reward.RewardTrainer(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to=[]),
        data_collator=collator,
        center=0.0,
    )
    batch = collator([pairs[i] for i in range(len(pairs))])
    longest = max(
        len(p["chosen_ids"]) + len(p["rejected_ids"]) - reward.shared_prefix(p["chosen_ids"], p["rejected_ids"])
        for p in pairs
    )
    assert batch["input_ids"].shape == (6, longest)  # each row: the shared tokens once
    with torch.no_grad():
        _, scored = trainer.compute_loss(model.eval(), batch, return_outputs=True)
    alone = model.double()
    with torch.no_grad():
        expected = [
            [alone(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in (p["chosen_ids"], p["rejected_ids"])]
            for p in pairs
        ]
    assert scored.flatten().tolist() == pytest.approx(sum(expected, []), abs=1e-5)
    assert len({round(x, 3) for x in sum(expected, [])}) >= 8  # rewards apart: a wrong token shows
    assert family in reward.ONE_ROW_MODELS


def test_an_encoder_alibi_flashattention_or_pair_layout_apart_pads_each_text_alone(rewards):
    encoder = AutoModelForSequenceClassification.from_pretrained(rewards / "encoder", num_labels=1)
    decoder = AutoModelForSequenceClassification.from_pretrained(rewards / "llama", num_labels=1)
    assert reward.one_row_layout(encoder, "one-row") is None and reward.one_row_layout(decoder, "apart") is None
    assert reward.one_row_layout(decoder, "one-row", replicas=2) is None  # the Trainer's DataParallel
    for implementation in ("flash_attention_2", "flex_attention"):  # (facts of a GPU run: no 4-D mask, or added)
        decoder.config._attn_implementation = implementation
        assert reward.one_row_layout(decoder, "one-row") is None
    bloom = AutoModelForSequenceClassification.from_config(
        BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=400, num_labels=1)
    )
    assert isinstance(bloom.score, torch.nn.Linear) and reward.one_row_layout(bloom, "one-row") is None  # ALiBi
    assert reward.shared_prefix([1, 2, 3], [1, 2, 3]) == 2 and reward.shared_prefix([1, 2], [1, 2, 5, 6]) == 1
    assert reward.shared_prefix([1, 2, 3], [1, 4, 3]) == 1 and reward.shared_prefix([7], [8, 9]) == 0


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


def test_a_decoder_in_one_row_under_zero_3_on_2_ranks_starts_as_one_process(rewards, tmp_path):
    """The one-row layout's hook on the head under ZeRO-3 (the head's weight gathered for each forward): OPT with
    margins and centering on 2 ranks, micro-batch 8, against one process at 16: the first 10 steps' mean loss
    (1e-5), and the model gathered from the shards scores the eval pairs as stock transformers do alone."""
    extra = ["--epochs", "1", "--center-rewards-coefficient", "0.01"]
    one = classification.main(args(rewards, tmp_path / "one", "opt", "margins.jsonl", *extra))
    argv = args(rewards, tmp_path / "zero3", "opt", "margins.jsonl", *extra, "--deepspeed", "ds_config_zero3.json")
    argv[argv.index("--batch-size") + 1] = "8"
    check(launch("forked", "sequence_classification.py", argv))
    two = results(tmp_path / "zero3")
    assert two["train_log"][0]["loss"] == pytest.approx(one["train_log"][0]["loss"], rel=1e-5)
    loss, _, scores = independent(tmp_path / "zero3" / "final", rewards / "margins.jsonl", eval_rows)
    centered = loss + 0.01 * ((scores[:, 0] + scores[:, 1]) ** 2).mean().item()
    assert two["eval_loss"] == pytest.approx(centered, rel=1e-5) and two["world_size"] == 2


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
