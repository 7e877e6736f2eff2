"""Preference pairs (DPO): the formats found from the columns, a pair packed whole, the truncation rule, bad input; the
loss and its gradient against the DPO formula computed with stock transformers in float64; packed = unpacked; ZeRO
0-3 (and LoRA under ZeRO-3) on 2 ranks = one process; resume exact, from the reference kept with the run."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dpo_pairs import data_args, dpo_args, independent_dpo, single
from helpers import (
    cpu_process,
    load_script,
    sequences,
)
from transformers import AutoConfig, AutoModelForCausalLM

from finetune import blocks, data, loss, preference
from finetune.internals import demo

# ----------------------------------------------------------------------------------------------------
# Formats, packing, truncation, bad input (in process)


@pytest.mark.quick
def test_formats_are_found_from_the_columns_and_each_pair_is_packed_whole(pairs):
    tok = pairs["tokenizer"]
    prepared = {
        style: data.prepare(data_args(pairs[style]), tok, seed=0) for style in ("strings", "messages", "implicit")
    }
    for style, (train, evals) in prepared.items():
        assert train.format == "preference" and train.pairs_total + evals.pairs_total == 48, style
        assert train.predicted.sum() == train.pairs_total and train.cut == 0  # counts are of pairs; none cut
        assert train.predicted.max() >= 2 and len(train) < train.pairs_total  # several pairs a block
        assert sorted(train.pieces.tolist()) == list(range(train.pairs_total))  # every pair once, whole
    prompts = {tuple(tok(json.loads(line)["prompt"])["input_ids"]) for line in open(pairs["strings"])}
    train = prepared["strings"][0]
    held = 0
    for c, cm, r, rm in sequences(train):
        p = cm.index(1)  # the prompt, the same in both; the loss on each answer and its EOS, nowhere else
        assert tuple(c[:p]) in prompts and c[:p] == r[:p] and c[-1] == r[-1] == tok.eos_token_id
        assert cm == [0] * p + [1] * (len(c) - p) and rm == [0] * p + [1] * (len(r) - p)
        held += len(c) + len(r) - (p - 1)
    assert train.lengths.sum() == held  # packed, a pair holds its prompt once (and its last token twice)
    # FlashAttention's layout (one padding-free row, GPU only) puts the same targets in the same answers, each
    # sequence whole in its own segment (the shared prompt copied back), its positions from 0
    config = AutoConfig.from_pretrained(pairs["model"])
    layouts = {}
    for implementation in ("flash_attention_2", "sdpa"):
        config._attn_implementation = implementation
        inputs, targets = train.batch([0, 1, 2], cpu_process(tok.pad_token_id, config))
        labels, index, sequence, count = targets[:4]
        layouts[implementation] = labels.flatten()[index].tolist(), sequence.tolist(), count, inputs
    assert layouts["flash_attention_2"][:3] == layouts["sdpa"][:3] and layouts["sdpa"][2] == train.predicted[:3].sum()
    assert sorted(set(layouts["sdpa"][1])) == list(range(2 * layouts["sdpa"][2]))  # every answer of every pair
    row, bounds = layouts["flash_attention_2"][3]["input_ids"][0], layouts["flash_attention_2"][3]["cu_seq_lens_q"]
    seqs = sequences(train)
    whole = [seqs[i][j] for i in train.pair_ids([0, 1, 2]) for j in (0, 2)]  # chosen, rejected, pair by pair
    assert [row[a:z].tolist() for a, z in zip(bounds, bounds[1:])] == whole
    assert layouts["flash_attention_2"][3]["position_ids"][0].tolist() == [i for x in whole for i in range(len(x))]
    # the conversations with their prompt implicit are the same pairs as with it given
    assert sequences(prepared["implicit"][0]) == sequences(prepared["messages"][0])
    assert sequences(prepared["implicit"][1]) == sequences(prepared["messages"][1])
    c, cm, r, rm = sequences(prepared["messages"][0])[0]
    assert tok.decode([t for t, m in zip(c, cm) if m]).strip() in {
        demo.answer(k, q) + tok.eos_token for k in range(5) for q in range(2)
    }


@pytest.mark.quick
def test_a_pair_longer_than_the_block_loses_the_answers_ends_then_the_prompts_middle(monkeypatch):
    """--block-size bounds each sequence, the prompt and one answer, as TRL's max_length does, packed or not: a longer
    one loses its answer's end, down to a floor; then the prompt's middle, its head (the BOS, a system turn) and its
    end (the question) kept; a pair that does not fit even so is dropped. Packed, the pair's row holds the prompt once
    and its last token twice (up to twice the block); with --packing none each sequence is a row of its own. (Floor
    and head of 2 tokens here: 16 in use.)"""
    monkeypatch.setattr(preference.rows, "ANSWER_FLOOR", 2)
    monkeypatch.setattr(preference.rows, "PROMPT_HEAD", 2)
    seq = lambda prompt, answer: (list(range(prompt)) + [100 + i for i in range(answer)], [0] * prompt + [1] * answer)
    c, r = seq(10, 4), (list(range(10)) + [200, 201], [0] * 10 + [1, 1])
    prompt = list(range(10))
    assert preference.rows.fit(c, r, 14) == (c, r, None)  # each sequence 10 + its answer: 14, 12
    (c4, cm4), (r4, _), how = preference.rows.fit(c, r, 12)
    assert how == "answers" and c4 == prompt + [100, 101] and cm4 == [0] * 10 + [1] * 2 and r4 == r[0]
    (c5, cm5), (r5, _), how = preference.rows.fit(c, r, 8)  # answers at their floor, 6 of the prompt left
    assert how == "prompt" and c5 == [0, 1, 6, 7, 8, 9, 100, 101] and r5 == [0, 1, 6, 7, 8, 9, 200, 201]
    assert cm5 == [0] * 6 + [1] * 2
    assert preference.rows.fit(c, r, 4) == (None, None, "dropped")  # not the head, a last token and a floor
    packed = preference.rows.pair_document(c, r, True)  # 17 tokens: more than a block of 14, within two
    assert packed == (c[0] + [9, 200, 201], [4] * 9 + [0] + [1] * 4 + [2, 1, 1])
    assert preference.rows.pair_document(c, r, False) == (c[0] + r[0], c[1] + [2] + r[1][1:])  # --packing none


@pytest.mark.quick
def test_packed_pairs_are_cut_only_where_trl_would_cut_them(pairs, tmp_path):
    """The issue's case, small: a prompt and two answers longer than the block together, each sequence within it.
    TRL's max_length cuts none of them, and neither does packing now (before: every pair, at its answers' ends);
    packed, each pair's log-probabilities under the model are those of the pairs one sequence a row (the reference
    pass of each layout, 1e-5)."""
    tok = pairs["tokenizer"]
    rows = [
        {"prompt": f"Q{i} " + " ".join(["the"] * 30), "chosen": " was" * (40 + i), "rejected": " good" * (45 - i)}
        for i in range(8)
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [len(tok(r["prompt"] + r["chosen"])["input_ids"]) + 1 for r in rows]
    assert max(lengths) < 96 < min(lengths) + 40  # each sequence within the block, the pair beyond it
    references = {}
    for packing in ("isolated", "none"):
        out = tmp_path / packing
        single.main(
            dpo_args(
                pairs,
                out,
                **{
                    "--dataset": str(path),
                    "--eval-dataset": str(path),
                    "--block-size": 96,
                    "--packing": packing,
                    "--max-steps": 1,
                    "--batch-size": 2,
                },
            )
        )
        references[packing] = torch.load(out / "reference.pt", weights_only=True)
        prepared = data.prepare(data_args(path, block_size=96, packing=packing, eval_dataset=str(path)), tok, seed=0)
        assert prepared[0].cut == 0 and "cut" not in prepared[0].describe(packing)
        if packing == "isolated":  # rows as long as the longest pair, a pair a row here, in both splits
            assert prepared[0].row_tokens == prepared[1].row_tokens == prepared[0].lengths.max() > 96
            assert len(prepared[0]) == 8
    for split in ("train", "eval"):
        torch.testing.assert_close(references["isolated"][split], references["none"][split], rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_long_prompts_keep_their_first_tokens(pairs, tmp_path):
    """The issue's case: 300-token prompts and 300-token answers at --block-size 512: every prompt whole, the answers
    cut (the old rule kept 1 prompt token of each, and the model learned answers to nothing)."""
    tok = pairs["tokenizer"]
    prompts = [f"Q{i} " + " ".join(["the"] * 299) for i in range(8)]
    path = tmp_path / "long.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p, "chosen": " was" * 300, "rejected": " good" * 300}) + "\n" for p in prompts)
    )
    whole = {tuple(tok(p)["input_ids"]) for p in prompts}
    for packing in ("isolated", "none"):
        train = data.prepare(data_args(path, block_size=512, packing=packing, eval_dataset=str(path)), tok, seed=0)[0]
        assert "8 pairs cut to fit a block (8 the answers' ends, 0 the prompt's middle too)" in train.describe(packing)
        found = sequences(train)
        assert len(found) == 8
        for chosen, chosen_flags, rejected, _ in found:
            prompt = tuple(t for t, f in zip(chosen, chosen_flags) if not f)
            assert prompt in whole and rejected[: len(prompt)] == list(prompt)
            assert len(chosen) - len(prompt) >= preference.rows.ANSWER_FLOOR


@pytest.mark.quick
def test_a_shared_prompt_gives_each_sequence_its_own_logits_under_a_sliding_window():
    """Packed, the rejected sequence sees the prompt where the chosen one holds it: through a Mistral whose layers
    attend to their last 3 positions, each sequence's logits are those it has alone (the window counts positions,
    not places in the row, where the chosen answer lies between the prompt and the rejected one)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=3,
        attn_implementation="sdpa",
    )
    model = MistralForCausalLM(config).eval()
    prompt, a, b = [5, 6, 7, 8, 9, 10], [30, 31, 32, 33], [40, 41]
    ids, flags = preference.rows.pair_document((prompt + a, [0] * 6 + [1] * 4), (prompt + b, [0] * 6 + [1] * 2), True)
    split = blocks.Blocks.__new__(blocks.Blocks)  # one block holding the pair, as write_split lays it out
    split.tokens, split.flags = np.array(ids, np.int32), np.array(flags, np.uint8) | [blocks.DOC_START] + [0] * 12
    split.starts, split.lengths, split.predicted, split.pieces = (np.array([x]) for x in (0, len(ids), 1, 0))
    split.first_piece, split.split_rows, split.reference = np.array([0]), False, None
    inputs, _ = split.batch([0], cpu_process(0, config))
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        chosen, rejected = (model(torch.tensor([prompt + x])).logits[0] for x in (a, b))
    torch.testing.assert_close(packed[:10], chosen, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[10:], rejected[5:], rtol=0, atol=1e-5)  # from the prompt's last token on


@pytest.mark.quick
@pytest.mark.parametrize(
    "rows, flags, message",
    [
        ([{"prompt": "a", "chosen": "", "rejected": " b"}], {}, "trained on: 7 skipped (the chosen answer is empty)"),
        ([{"prompt": "a", "chosen": " b", "rejected": " b"}], {}, "7 skipped (chosen and rejected are the same"),
        (
            [
                {
                    "prompt": [{"role": "user", "content": "a"}],
                    "chosen": [{"role": "assistant", "content": "b"}],
                    "rejected": [{"role": "user", "content": "c"}],
                }
            ],
            {},
            "the last turn of rejected is the user's",
        ),
        ([{"chosen": "The answer is 4", "rejected": 5}], {}, "not both strings or both lists"),
        (
            [{"prompt": "a long prompt here", "chosen": " b", "rejected": " c"}],
            {"block_size": 3},
            "7 dropped (longer than --block-size 3 with 16 prompt tokens and 16 of each answer)",
        ),
        ([{"prompt": "a", "chosen": " b", "rejected": " c"}], {"packing": "stream"}, "drop --packing stream"),
        ([{"prompt": "a", "chosen": " b"}], {}, "'rejected'"),  # a column missing
    ],
)
def test_a_file_with_no_usable_pair_is_one_line_and_nothing_is_prepared(pairs, tmp_path, rows, flags, message):
    """A bad pair is skipped and counted (next test); a file where no pair can be trained on is one line."""
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    cache = Path(data_args(path).cache_dir)
    before = set(cache.iterdir()) if cache.exists() else set()
    with pytest.raises(SystemExit, match=re.escape(message)):
        data.prepare(data_args(path, **flags), pairs["tokenizer"], seed=0)
    assert {p for p in cache.iterdir() if not p.name.endswith(".failed")} <= before


@pytest.mark.quick
def test_bad_pairs_are_skipped_and_counted_and_the_rest_train(pairs, tmp_path):
    """Public preference sets hold rows with an empty answer, two the same, or one a prefix of the other (an implicit
    prompt then leaves one answer empty): skipped and said at start, the others prepared (before: the whole run
    stopped on the first)."""
    good = [json.loads(line) for line in open(pairs["strings"])][:8]
    bad = [
        {"prompt": "a", "chosen": "", "rejected": " b"},
        {"prompt": "a", "chosen": " b", "rejected": " b"},
        {"chosen": "The answer is 4", "rejected": "The answer is 4 or 5"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    train = data.prepare(data_args(path, eval_dataset=str(pairs["strings"])), pairs["tokenizer"], seed=0)[0]
    assert train.pairs_total == 8
    assert "; 3 skipped (2: the chosen answer is empty; 1: chosen and rejected are the same" in train.describe(
        "isolated"
    )


@pytest.mark.quick
def test_sequence_parallelism_is_refused_with_pairs(pairs, tmp_path):
    splits = data.prepare(data_args(pairs["strings"]), pairs["tokenizer"], seed=0)
    config = load_script("zero-optimization.py").parse_args(["--sequence-parallel", "2"])
    with pytest.raises(SystemExit, match="drop --sequence-parallel"):
        preference.reference(None, splits, config, tmp_path, None)
    assert not (tmp_path / "reference.pt").exists()


# ----------------------------------------------------------------------------------------------------
# The loss: against the formula, packed = unpacked, chunked = plain


@pytest.mark.quick
def test_the_loss_and_its_gradient_are_the_formulas_packed_or_not_chunked_or_not(pairs):
    """A reference other than the model's, so that every pair's loss and gradient is its own: the summed loss over a
    split and its gradients through the model (chunked and plain loss; isolated packing and two rows a pair) equal
    the formula's, computed pair by pair in float64 with the stock model; the metrics too."""
    tok = pairs["tokenizer"]
    results_by = {}
    for packing in ("isolated", "none"):
        train, _ = data.prepare(data_args(pairs["strings"], packing=packing), tok, seed=0)
        torch.manual_seed(0)
        train = train.with_reference(-60 - 20 * torch.rand(train.pairs_total, 2))
        for chunk in (16, 0):
            model = loss.CausalLMLoss(
                AutoModelForCausalLM.from_pretrained(pairs["model"], attn_implementation="sdpa"),
                chunk,
                preference.PairLoss(beta=0.5),
            )
            preference.without_dropout(model)
            blocks_all = np.arange(len(train))
            inputs, targets = train.batch(blocks_all, cpu_process(tok.pad_token_id, model.config))
            summed = model(inputs, targets)
            value = summed.loss / train.pairs_total
            value.backward()
            metrics = preference.metric_values(summed.pair_metrics.tolist(), train.pairs_total)
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            results_by[packing, chunk] = value.item(), grads, metrics
        ids = train.pair_ids(np.arange(len(train)))
    stock = AutoModelForCausalLM.from_pretrained(pairs["model"], dtype=torch.float64).eval()
    expected = independent_dpo(stock, train, ids, train.reference, 0.5)
    expected.backward()
    assert expected.item() > 0.8  # far from ln 2: the reference is not the model's
    for key, (value, grads, _) in results_by.items():
        assert value == pytest.approx(expected.item(), rel=1e-5), key
        for k, p in stock.named_parameters():
            err = (grads[k].double() - p.grad).abs().max()  # (the keys' bias: no gradient, but rounding)
            assert err <= 1e-4 * p.grad.abs().max() + 1e-8, (key, k, err.item())
    # TRL's metrics: per pair the rewards, margin, ranked right, logps; per token mean logit, top-1 share, entropy
    logp, answers = [], [[], []]
    with torch.no_grad():
        for s, j in ((s, j) for s in sequences(train) for j in (0, 1)):  # each pair's chosen, then its rejected
            ids, carries = torch.tensor(s[2 * j][1:]), torch.tensor(s[1 + 2 * j][1:]) > 0
            logits = stock(torch.tensor([s[2 * j]])).logits[0, :-1][carries]
            logp.append(-F.cross_entropy(logits, ids[carries], reduction="sum").item())
            answers[j].append(
                torch.stack(
                    [
                        logits.mean(-1),
                        (logits.argmax(-1) == ids[carries]).double(),
                        torch.distributions.Categorical(logits=logits).entropy(),
                    ]
                )
            )
    logp = torch.tensor(logp, dtype=torch.float64).view(-1, 2)
    rewards = 0.5 * (logp - train.reference.double())
    chosen, rejected = (torch.cat(a, 1) for a in answers)
    expected = [
        rewards[:, 0].mean(),
        rewards[:, 1].mean(),
        (rewards[:, 0] > rewards[:, 1]).double().mean(),
        (rewards[:, 0] - rewards[:, 1]).mean(),
        logp[:, 0].mean(),
        logp[:, 1].mean(),
        chosen[0].mean(),
        rejected[0].mean(),
        chosen[1].mean(),
        torch.cat([chosen[2], rejected[2]]).mean(),
    ]
    assert rejected[0].mean() != chosen[0].mean() and chosen[2].mean() > 1  # numbers that can be wrong
    for key, (_, _, metrics) in results_by.items():
        assert list(metrics) == list(preference.METRICS)
        assert list(metrics.values()) == pytest.approx([float(x) for x in expected], rel=1e-5, abs=1e-6), key


# ----------------------------------------------------------------------------------------------------
# Runs: the first step, ZeRO on 2 ranks, resume
