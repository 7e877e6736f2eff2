"""--sequence-parallel (Ulysses) in zero-optimization.py on CPU (gloo has the all-to-all): each sequence split over
ranks trains as single-gpu.py on the same batches, documents and sliding windows kept apart, under ZeRO-2 and
ZeRO-3, with LoRA, offload and gradient checkpointing, resumed with another N; and each refusal is one line."""

import types

import numpy as np
import pytest
import torch
from helpers import (
    assert_close_losses,
    assert_resumed,
    assert_same_weights,
    base_args,
    build,
    check,
    cpu_process,
    crash_after_first_checkpoint,
    launch,
    load_script,
    results,
    weights,
)

from finetune import zero_config
from finetune.internals import sequence_parallel as sp

single = load_script("single-gpu.py")
ZERO = "zero-optimization.py"


def chats(tiny, model, out, **more):
    return base_args(
        tiny,
        out,
        **{
            "--model": str(model),
            "--dataset": tiny["chats"],
            "--block-size": 64,
            "--grad-accum": 2,
            "--weight-decay": 0.1,
            "--prompt": "How many stars?",
            **more,
        },
    )


def test_a_sequence_over_2_ranks_trains_as_one_process_and_resumes_with_another_n(tiny, tmp_path):
    """A tiny Mistral (its layers attend to their last 16 tokens, 4 heads share 1 key/value head) on chats packed
    into blocks of 64, the loss on the answers: ZeRO-2 with CPU offload and gradient checkpointing, each sequence
    over 2 ranks, gives one process's losses, gradient norms, eval loss and weights. Resumed from its step-2
    checkpoint without sequence parallelism on 1 rank (DeepSpeed's universal checkpoint), it ends as the
    uninterrupted run."""
    from transformers import AutoTokenizer

    # one key/value head for 4 query heads: Ulysses repeats it for its 2 head shards; the eval then needs the model's
    model = build("mistral", AutoTokenizer.from_pretrained(tiny["model"]), tmp_path / "mistral", num_key_value_heads=1)
    single.main(chats(tiny, model, tmp_path / "one", **{"--batch-size": 4}) + ["--gradient-checkpointing"])
    out = tmp_path / "two"
    argv = chats(tiny, model, out, **{"--batch-size": 4, "--zero-stage": 2, "--offload": "cpu"})
    check(launch("forked", ZERO, argv + ["--sequence-parallel", "2", "--gradient-checkpointing", "--deepspeed"]))
    one, two = results(tmp_path / "one"), results(out)
    assert two["world_size"] == 2 and two["ran"]["optimizer"] == "DeepSpeedCPUAdam on cpu"
    assert_close_losses(one["losses"], two["losses"])
    assert_close_losses(one["grad_norms"], two["grad_norms"])  # the gradients' scale: the engine's divisor undone
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert two["sample"] == one["sample"]  # generated at the end on whole sequences
    whole = weights(out / "final")
    assert_same_weights(weights(tmp_path / "one" / "final"), whole, atol=1e-4)
    crash_after_first_checkpoint(out)
    check(launch("forked-python", ZERO, argv + ["--resume", "--deepspeed"]))  # 1 rank, 1 replica: the same global batch
    assert_resumed(out)
    assert_close_losses(two["losses"], results(out)["losses"])
    assert_same_weights(whole, weights(out / "final"), atol=1e-4)


def test_2_replicas_of_2_ranks_with_zero3_and_lora_train_as_one_process(tiny, tmp_path):
    """4 ranks: 2 data-parallel replicas, each sequence over the 2 ranks of its replica, ZeRO-3 sharding over all 4
    (whose reduce-scatter averages over all ranks, where ZeRO-2 averages over the replicas), LoRA on the tiny OPT:
    one process's losses, gradient norms, adapters and merged weights."""
    lora = {"--lora-rank": 4, "--model": tiny["model"]}
    single.main(chats(tiny, tiny["model"], tmp_path / "one", **{"--batch-size": 4, **lora}))
    argv = chats(tiny, tiny["model"], tmp_path / "four", **{"--batch-size": 2, "--zero-stage": 3, **lora})
    check(launch("forked", ZERO, argv + ["--sequence-parallel", "2", "--deepspeed"], nproc=4))
    one, four = results(tmp_path / "one"), results(tmp_path / "four")
    assert four["world_size"] == 4 and four["global_batch_size"] == 8 and four["ran"]["zero_stage"] == 3
    assert_close_losses(one["losses"], four["losses"])
    assert_close_losses(one["grad_norms"], four["grad_norms"])
    assert four["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert_same_weights(weights(tmp_path / "one" / "final"), weights(tmp_path / "four" / "final"), atol=1e-4)


@pytest.mark.quick
def test_the_shards_of_a_batch_are_its_tokens_and_targets_cut_at_one_place():
    """Rows of 5 tokens over 2 ranks: padded to 6 (a pad at position 0, no loss), 3 tokens each; the targets were
    shifted on the whole row, so together the shards predict the row's tokens, each once."""
    ids = np.array([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    positions = np.array([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    labels = np.array([[11, 12, -100, 14, -100], [-100, 22, 23, 24, -100]])
    host = types.SimpleNamespace(ids=ids, positions=positions, labels=labels)  # (Blocks.rows gives these)
    shards = [sp.shard(host, rank, 2, cpu_process(0, None)) for rank in (0, 1)]
    assert [s[0]["input_ids"].tolist() for s in shards] == [[[10, 11, 12], [20, 21, 22]], [[13, 14, 0], [23, 24, 0]]]
    assert [s[0]["position_ids"].tolist() for s in shards] == [[[0, 1, 2], [0, 1, 2]], [[0, 1, 0], [3, 4, 0]]]
    assert [s[1][0].tolist() for s in shards] == [
        [[11, 12, -100], [-100, 22, 23]],
        [[14, -100, -100], [24, -100, -100]],
    ]
    assert [s[1][1].tolist() for s in shards] == [[0, 1, 4, 5], [0, 3]]  # where the loss is, in each shard
    assert all(s[0][sp.SHARDED] for s in shards) and "attention_mask" not in shards[0][0]
    # each token's document in the whole padded rows, what every rank's attention sees after the all-to-all
    assert all(s[0][sp.DOCUMENTS].tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 2]] for s in shards)
    assert not any(s[0][sp.PLAIN] for s in shards)


@pytest.mark.quick
def test_the_documents_mask_is_built_once_per_forward_from_the_hosts_documents():
    """After the all-to-all, attention sees the whole row: each document attends causally to itself only, within the
    layer's window. The mask is the same for every layer: built once per forward, in the query's dtype (one tensor
    for every layer's backward), from the documents the host found (no host sync)."""
    seen, masks = [], {}
    attention = sp.documents_attention(lambda module, q, k, v, mask, *a, **kw: seen.append((mask, kw)), masks)
    query = torch.zeros(1, 1, 7, 2, dtype=torch.bfloat16)

    one = torch.tensor([[1, 1, 1, 1], [2, 2, 2, 2]])  # a document a row (a stream cut into blocks): no mask to build
    attention(torch.nn.Module(), query, None, None, None, **{sp.DOCUMENTS: one, sp.PLAIN: True})
    assert seen[-1][0] is None and seen[-1][1]["is_causal"] is True

    documents = torch.tensor([[1, 1, 1, 1, 2, 2, 3]])  # positions 0 1 2 3 0 1 0
    for _ in range(4):  # the layers
        attention(
            torch.nn.Module(), query, None, None, None, sliding_window=2, **{sp.DOCUMENTS: documents, sp.PLAIN: False}
        )
    mask = seen[-1][0]
    assert all(m is mask for m, _ in seen[-4:]) and mask.dtype == torch.bfloat16  # one mask for the 4 layers
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]
    assert set(mask[0, 0].flatten().tolist()) == {0.0, float("-inf")}
    attention(
        torch.nn.Module(),
        query,
        None,
        None,
        None,
        sliding_window=2,
        **{sp.DOCUMENTS: documents.clone(), sp.PLAIN: False},
    )
    assert seen[-1][0] is not mask  # the next forward's documents: its own mask


@pytest.mark.parametrize(
    "size, world, heads, kv, attention, message",
    [
        (2, 3, 4, 4, "sdpa", "--sequence-parallel 2 does not divide the 3 ranks; use a divisor of 3"),
        (4, 4, 6, 6, "sdpa", "the model's 6 attention heads do not split over 4 ranks; use a divisor of 6"),
        (2, 2, 4, 3, "sdpa", "the model's 3 key/value heads do not split over 2 ranks (nor 2 over them)"),
        (2, 2, 4, 2, "eager", "runs eager attention, which DeepSpeed's Ulysses cannot take over"),
    ],
)
@pytest.mark.quick
def test_what_cannot_be_split_is_one_line(size, world, heads, kv, attention, message):
    with pytest.raises(SystemExit) as e:
        sp.check(size, world, heads=heads, kv_heads=kv, implementation=attention, model="Gemma2Config")
    assert str(e.value).startswith("error: ") and message in str(e.value)


@pytest.mark.quick
def test_a_model_whose_layers_mix_tokens_outside_attention_is_one_line():
    """Recurrent or convolution layers (Qwen3-Next's linear attention, LFM2's convolutions), or Llama 4's chunks,
    would see each rank's slice alone: refused. Sliding and MoE layers are attention's or mix nothing."""
    sp.check(
        2,
        2,
        heads=4,
        kv_heads=2,
        implementation="sdpa",
        model="Gemma3TextConfig",
        layer_types=["sliding_attention", "full_attention", "moe"],
    )
    with pytest.raises(
        SystemExit, match="Qwen3NextConfig has conv, linear_attention layers, which mix tokens outside attention"
    ):
        sp.check(
            2,
            2,
            heads=4,
            kv_heads=2,
            implementation="sdpa",
            model="Qwen3NextConfig",
            layer_types=["linear_attention", "full_attention", "conv"],
        )


@pytest.mark.quick
def test_a_model_whose_attention_bypasses_transformers_is_one_line():
    """Attention code of a model's own never reaches the exchange: each shard would attend to itself only."""
    sp.intercepted(True, {sp.SHARDED: True}, "M")  # went through it
    sp.intercepted(False, {}, "M")  # an eval batch, whole sequences: nothing to exchange
    with pytest.raises(SystemExit, match="M's attention does not go through transformers' attention functions"):
        sp.intercepted(False, {sp.SHARDED: True}, "M")


def test_zero3_under_sequence_parallelism_keeps_its_reduce_scatter(tiny, tmp_path):
    """ZeRO-3 averages gradients over every rank in its reduce-scatter; without it, over the replicas in some buckets
    and every rank in others: refused in one line rather than trained with a gradient off by N in places."""
    import json

    from transformers import AutoConfig

    config = json.loads(open(zero_config.DEFAULT_CONFIG).read())
    config["zero_optimization"]["reduce_scatter"] = False
    (tmp_path / "ds.json").write_text(json.dumps(config))
    args = load_script(ZERO).parse_args(
        base_args(tiny, tmp_path / "run") + ["--deepspeed", str(tmp_path / "ds.json"), "--sequence-parallel", "2"]
    )
    with pytest.raises(SystemExit, match="needs zero_optimization.reduce_scatter true at stage 3"):
        zero_config.deepspeed_config(args, 2, 4, 1, AutoConfig.from_pretrained(tiny["model"]))


@pytest.mark.quick
def test_with_flash_attention_the_documents_laid_end_to_end_are_cut_into_the_shards(tiny):
    """FlashAttention (what a GPU runs): the micro-batch's documents are one row, without padding; under sequence
    parallelism that row is cut into the shards, and each carries the whole row's boundaries (cu_seq_lens, padded
    to a multiple of the ranks: each pad a document of its own), which FlashAttention takes after the all-to-all
    rather than derive them from the gathered positions in every layer (transformers' flash utils)."""
    from types import SimpleNamespace

    from finetune import data, models

    config = single.parse_args(chats(tiny, tiny["model"], "/tmp/unused", **{"--batch-size": 4}))
    train = data.prepare(config.data, models.load_tokenizer(config.model.model), seed=config.train.seed)[0]
    flash = SimpleNamespace(_attn_implementation="flash_attention_2")
    rows = [0, 1, 2, 3]
    whole, (targets, *_) = train.batch(rows, cpu_process(0, flash))
    assert "cu_seq_lens_q" in whole and whole["input_ids"].shape[0] == 1
    shards = [train.batch(rows, cpu_process(0, flash), sequence_shard=(rank, 2)) for rank in (0, 1)]
    joined = torch.cat([s[0]["input_ids"] for s in shards], dim=1)
    width = whole["input_ids"].shape[1]
    cu = whole["cu_seq_lens_q"].tolist() + list(range(width + 1, joined.shape[1] + 1))  # then the pads, one each
    for shard, _ in shards:
        assert shard["input_ids"].shape[0] == 1 and shard["cu_seq_lens_q"].tolist() == cu
        assert shard["max_length_q"] == shard["max_length_k"] == whole["max_length_q"]
    assert torch.equal(joined[:, :width], whole["input_ids"]) and (joined[:, width:] == 0).all()
    assert torch.equal(torch.cat([s[1][0] for s in shards], dim=1)[:, :width], targets)
