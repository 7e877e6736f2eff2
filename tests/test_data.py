"""The shared pieces: packing, the batch order, the loss normalization, the DeepSpeed config filling, loading."""
import argparse
import json

import datasets
import pytest
import torch
from transformers import AutoTokenizer

import data
import training
import zero_utils


@pytest.fixture(scope="module")
def texts(tiny):
    rows = datasets.load_dataset("csv", data_files=tiny["data"])["train"]
    return rows, AutoTokenizer.from_pretrained(tiny["model"])


def stream(rows, tokenizer):
    ids = tokenizer(list(rows["text"]), add_special_tokens=False)["input_ids"]
    return [t for x in ids for t in x + [tokenizer.eos_token_id]], ids


def test_packing_loses_no_token(texts):
    rows, tokenizer = texts
    expected, _ = stream(rows, tokenizer)
    blocks = data.tokenize(rows, tokenizer, "text", 32, packing=True)
    packed = torch.cat([blocks.tokens[s:e] for s, e in zip(blocks.starts, blocks.ends)]).tolist()
    assert packed == expected  # every token, in order, each text followed by EOS
    assert blocks.lengths[:-1].eq(32).all() and 0 < blocks.lengths[-1] <= 32
    assert int(blocks.targets.sum()) == len(expected) - len(blocks)  # each block predicts all but its first token


def test_no_packing_keeps_one_text_per_sequence(texts):
    rows, tokenizer = texts
    _, ids = stream(rows, tokenizer)
    blocks = data.tokenize(rows, tokenizer, "text", 16, packing=False)
    assert len(blocks) == len(rows)
    for i in (0, 7, len(rows) - 1):
        assert blocks.tokens[blocks.starts[i]:blocks.ends[i]].tolist() == (ids[i] + [tokenizer.eos_token_id])[:16]


def test_batch_masks_padding(texts):
    rows, tokenizer = texts
    blocks = data.tokenize(rows, tokenizer, "text", 64, packing=False)
    short, long = int(blocks.lengths.argmin()), int(blocks.lengths.argmax())
    batch = blocks.batch([short, long], pad_id=1, device=torch.device("cpu"))
    n = int(blocks.lengths[short])
    assert batch["input_ids"].shape == (2, int(blocks.lengths[long]))
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    assert (batch["labels"][0, n:] == -100).all() and (batch["labels"][0, :n] == batch["input_ids"][0, :n]).all()


def test_global_batches_do_not_depend_on_the_split():
    order = data.GlobalBatches(num_sequences=100, global_batch=8, seed=3)
    assert order.steps_per_epoch == 12
    first_epoch = torch.cat([order(s) for s in range(12)])
    assert len(set(first_epoch.tolist())) == 96  # no sequence twice in an epoch
    assert not torch.equal(order(12), order(0))  # a new shuffle each epoch
    again = data.GlobalBatches(100, 8, seed=3)
    assert torch.equal(again(5), order(5))
    # 2 ranks x micro-batch 2 x 2 micro-steps cover exactly the global batch, micro-step by micro-step
    batch = order(5)
    for k, micro in enumerate(batch.view(2, -1)):
        shares = [micro.view(2, -1)[rank] for rank in range(2)]
        assert torch.cat(shares).tolist() == batch[4 * k:4 * (k + 1)].tolist()


def test_loss_is_the_token_mean_however_split():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 6, 11), torch.randint(0, 11, (4, 6))
    labels[1, 3:] = -100  # padding
    n = int((labels[:, 1:] != -100).sum())
    whole = training.token_loss_sum(logits, labels) / n
    split = sum(training.token_loss_sum(logits[i:i + 1], labels[i:i + 1]) / n for i in range(4))
    mean = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(whole, split)
    torch.testing.assert_close(whole, mean)


def ds_args(**kw):
    base = dict(batch_size=4, grad_accum=2, max_grad_norm=1.0, lr=2e-4, weight_decay=0.01, precision="fp32",
                zero_stage=None, offload=None, nvme_path="/nvme")
    return argparse.Namespace(**{**base, **kw})


def test_deepspeed_config_fills_auto_from_flags():
    config, has_scheduler = zero_utils.deepspeed_config(training.HERE / "ds_config_zero3.json", ds_args(), 2, 100, 5, 64)
    assert not has_scheduler
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 2, 16)
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    assert config["gradient_clipping"] == 1.0
    assert config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_deepspeed_config_overrides_and_offload():
    config, _ = zero_utils.deepspeed_config(training.HERE / "ds_config_zero3.json", ds_args(offload="cpu"), 1, 10, 1, 8)
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    config, _ = zero_utils.deepspeed_config(training.HERE / "ds_config_zero3.json",
                                        ds_args(zero_stage=2, offload="cpu"), 1, 10, 1, 8)
    assert config["zero_optimization"]["stage"] == 2 and "offload_param" not in config["zero_optimization"]


def test_deepspeed_config_scheduler_block_is_filled(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}))
    config, has_scheduler = zero_utils.deepspeed_config(path, ds_args(), 1, 100, 5, 8)
    assert has_scheduler and config["scheduler"]["params"] == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 2e-4, "warmup_num_steps": 5, "total_num_steps": 100}


@pytest.mark.parametrize("content, message", [
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu=8 vs --batch-size = 4"),
    ({"train_batch_size": 12}, "train_batch_size=12 vs --batch-size x --grad-accum x 2 ranks = 16"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, "optimizer.params.lr=0.1 vs --lr = 0.0002"),
    ({"bf16": {"enabled": True}}, "bf16.enabled=True vs --precision = False"),
    ({"optimizer": {"type": "AdamW", "params": {"foo": "auto"}}}, "no flag fills optimizer.params.foo"),
])
def test_deepspeed_config_errors_name_both_sides(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SystemExit, match="error: ") as e:
        zero_utils.deepspeed_config(path, ds_args(), 2, 100, 5, 8)
    assert message in str(e.value)


def test_deepspeed_config_bad_files(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        zero_utils.deepspeed_config(tmp_path / "nope.json", ds_args(), 1, 1, 1, 8)
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(SystemExit, match="not valid JSON"):
        zero_utils.deepspeed_config(tmp_path / "bad.json", ds_args(), 1, 1, 1, 8)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".json", ".parquet", ".txt"])
def test_local_formats_and_carved_eval_split(tmp_path, suffix):
    rows = datasets.Dataset.from_dict({"text": [f"review number {i}" for i in range(40)],
                                       "label": [i % 5 for i in range(40)]})
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        rows.to_csv(path)
    elif suffix == ".parquet":
        rows.to_parquet(path)
    elif suffix == ".txt":
        path.write_text("\n".join(list(rows["text"])) + "\n")
    else:
        rows.to_json(path, lines=suffix == ".jsonl")
    train, evaluation = data.load_splits(str(path), "text", seed=0)
    assert len(train) + len(evaluation) == 40 and len(evaluation) == 2
    assert sorted(list(train["text"]) + list(evaluation["text"])) == sorted(rows["text"])


def test_loading_errors(tmp_path, tiny):
    with pytest.raises(SystemExit, match="does not exist"):
        data.load_splits(str(tmp_path / "missing.csv"), "text", 0)
    with pytest.raises(SystemExit, match="has no column 'body' \\(it has label, text\\); pass --text-column"):
        data.load_splits(tiny["data"], "body", 0)
    (tmp_path / "empty.csv").write_text("text\n")
    with pytest.raises(SystemExit, match="could not read .*empty.csv .*is it a non-empty .csv file"):
        data.load_splits(str(tmp_path / "empty.csv"), "text", 0)
    with pytest.raises(SystemExit, match="could not load dataset 'no-such/dataset'"):
        data.load_splits("no-such/dataset", "text", 0)
