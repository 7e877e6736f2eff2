"""The data layer: formats found from the columns, loss masks, packing that isolates documents, batches, the
prepared-once cache, loading. In process, on tiny models."""

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from helpers import cpu_process, data_args, documents_of
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
)

from finetune import blocks, data, evaluation, loss, models, training

pytestmark = pytest.mark.quick  # in process: `make test-quick`


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny["model"])


def documents(split):
    return [d for i in range(len(split)) for d in documents_of(split, i)]


def test_best_fit_decreasing_keeps_documents_whole():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(1, 40, 300), [64, 100, 33]])  # block 32: three longer documents
    doc, start, n, block = blocks.best_fit_decreasing(lengths, 32)
    fill = np.bincount(block, weights=n)
    assert fill.max() <= 32 and n.sum() == lengths.sum()
    for d in range(len(lengths)):
        pieces = sorted(zip(start[doc == d], n[doc == d]))
        if lengths[d] <= 32:  # never split
            assert len(pieces) == 1 and pieces[0] == (0, lengths[d])
        else:  # consecutive pieces of a block each, then the rest
            assert [p[0] for p in pieces] == list(range(0, lengths[d], 32)) and sum(p[1] for p in pieces) == lengths[d]
    # best fit decreasing on these lengths needs close to the minimum number of blocks
    assert len(fill) <= np.ceil(lengths.sum() / 32) * 1.05 + 1


@pytest.mark.parametrize("packing", ["isolated", "stream", "none"])
def test_every_token_in_its_place(tiny, tokenizer, packing, tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "CHUNK", 7)  # prepared in tmp_path, written 7 pieces at a time
    train, _ = data.prepare(data_args(tiny["data"], packing=packing, cache_dir=str(tmp_path)), tokenizer, seed=0)
    rows = data.load_splits(tiny["data"], seed=0)[0]  # the same training split
    docs = [x + [tokenizer.eos_token_id] for x in tokenizer(list(rows["text"]))["input_ids"]]
    if packing == "stream":  # every token, in order, cut every 32 tokens; a segment per block
        stream = np.concatenate([train.tokens[s : s + n] for s, n in zip(train.starts, train.lengths)])
        assert stream.tolist() == [t for d in docs for t in d] and (train.lengths[:-1] == 32).all()
        assert all(train.flags[s] == blocks.DOC_START for s in train.starts)
    elif packing == "isolated":  # each document whole, or cut into pieces of 32, each piece a segment
        pieces = [tuple(d[i : i + 32]) for d in docs for i in range(0, len(d), 32)]
        assert sorted(map(tuple, documents(train))) == sorted(pieces) and (train.lengths <= 32).all()
    else:  # one document per row, cut at 32
        assert [tuple(d) for d in documents(train)] == [tuple(d[:32]) for d in docs]
    # the predicted tokens: every token but the first of each segment
    assert train.predicted.sum() == train.lengths.sum() - len(documents(train))


def test_isolated_packing_keeps_each_document_whole_in_one_block(tiny, tokenizer):
    train, evals = data.prepare(data_args(tiny["data"], block_size=160), tokenizer, seed=0)
    rows = datasets.load_dataset("csv", data_files=tiny["data"])["train"]
    docs = [x + [tokenizer.eos_token_id] for x in tokenizer(list(rows["text"]))["input_ids"]]
    packed = set(map(tuple, documents(train) + documents(evals)))
    fits = [tuple(d) for d in docs if len(d) <= 160]
    assert len(fits) > 0.9 * len(docs) and all(d in packed for d in fits)  # a document that fits is never cut


def tiny_models(vocab):
    kw = dict(vocab_size=vocab, hidden_size=32, num_attention_heads=4)
    yield (
        "opt",
        OPTConfig(
            **kw,
            num_hidden_layers=2,
            ffn_dim=64,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
        ),
    )
    yield (
        "gpt2",
        GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    )
    yield (
        "llama",
        LlamaConfig(
            **kw,
            num_hidden_layers=2,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    )
    # sliding windows shorter than the documents: every layer (Mistral), or local and global layers (Gemma 2)
    yield (
        "mistral",
        MistralConfig(
            **kw,
            num_hidden_layers=2,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=256,
            sliding_window=8,
        ),
    )
    yield (
        "gemma2",
        Gemma2Config(
            **kw,
            num_hidden_layers=2,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            sliding_window=8,
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    )


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_document_in_a_packed_block_sees_only_itself(tiny, tokenizer, attention):
    """Its logits equal those of the document run alone, for OPT, GPT-2, Llama, and Mistral and Gemma 2 with sliding
    windows shorter than the documents (random weights)."""
    train, _ = data.prepare(data_args(tiny["chats"], block_size=128), tokenizer, seed=0)
    segments = [len(documents_of(train, i)) for i in range(len(train))]
    rows = [i for i, n in enumerate(segments) if n >= 2][:3]  # blocks of 2 documents or more
    assert len(rows) == 3
    torch.manual_seed(0)
    for name, config in tiny_models(len(tokenizer)):
        if name == "gemma2" and attention == "sdpa":  # transformers runs Gemma 2 with eager attention only
            continue
        config._attn_implementation = attention
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
        inputs, _ = train.batch(rows, cpu_process(tokenizer.pad_token_id, model.config))
        masks = inputs["attention_mask"]
        masks = masks if isinstance(masks, dict) else {"all layers": masks}
        assert len(masks) == (2 if name == "gemma2" else 1)  # Gemma 2: a mask for its local layers, one for global
        assert all(m.dtype == (torch.bool if attention == "sdpa" else torch.float32) for m in masks.values())
        with torch.no_grad():
            packed = model(**inputs).logits
            worst = 0.0
            for r, i in enumerate(rows):  # the boundaries from the documents packed, not from the batch itself
                a = 0
                for doc in documents_of(train, i):
                    b = a + len(doc)
                    assert inputs["input_ids"][r, a:b].tolist() == doc
                    assert inputs["position_ids"][r, a:b].tolist() == list(range(len(doc)))  # restart per document
                    alone = model(input_ids=torch.tensor([doc])).logits[0]
                    worst = max(worst, (alone - packed[r, a:b]).abs().max().item())
                    a = b
        assert worst < 1e-5, (name, attention, worst)


def test_eval_loss_of_packed_documents_equals_one_document_per_row(tiny, tokenizer):
    torch.manual_seed(0)
    config = next(tiny_models(len(tokenizer)))[1]  # OPT, 256 positions, random weights
    model = loss.CausalLMLoss(AutoModelForCausalLM.from_config(config), 16)
    process = cpu_process(tokenizer.pad_token_id, model.config)
    sums = {}
    for packing in ("isolated", "none"):
        _, evals = data.prepare(data_args(tiny["chats"], block_size=256, packing=packing), tokenizer, seed=0)
        sums[packing] = evaluation.eval_loss_sums(model, evals, 4, process)
    assert sums["isolated"][1] == sums["none"][1] > 0  # the same tokens carry loss
    assert (sums["isolated"][0] / sums["isolated"][1]).item() == pytest.approx(
        (sums["none"][0] / sums["none"][1]).item(), rel=1e-5
    )
    # --compile's in-place compile (dynamo alone here): the eval and the generated answers run eagerly, nothing is
    # compiled for them (in eval mode without gradients every graph would be compiled again)
    from torch._dynamo.utils import counters

    model.compile(backend="eager")
    frames = counters["frames"]["total"]
    compiled = evaluation.eval_loss_sums(model, evals, 4, process)
    answer = models._generate(model, tokenizer, tokenizer("Review:")["input_ids"], process, max_new_tokens=3)
    assert counters["frames"]["total"] == frames and isinstance(answer, str)
    assert torch.equal(compiled, sums["none"])


def test_prepared_once_then_reused(tiny, tokenizer):
    args = data_args(tiny["data"], block_size=48)
    data.prepare(args, tokenizer, seed=0)
    folder = Path(args.cache_dir) / data.cache_key(args, tokenizer, 0)
    stamp = (folder / "meta.json").stat().st_mtime_ns
    data.prepare(args, tokenizer, seed=0)  # a rerun maps what is there
    assert (folder / "meta.json").stat().st_mtime_ns == stamp
    assert data.cache_key(data_args(tiny["data"], block_size=40), tokenizer, 0) != folder.name  # another setting


def test_batches_shift_labels_and_mask_padding(tiny, tokenizer):
    train, _ = data.prepare(data_args(tiny["data"], packing="none", block_size=64), tokenizer, seed=0)
    short, long = int(train.lengths.argmin()), int(train.lengths.argmax())
    inputs, (labels, index, *_) = train.batch([short, long], cpu_process(1, None))
    n, width = int(train.lengths[short]), int(train.lengths[long])
    assert inputs["input_ids"].shape == labels.shape == (2, width)
    assert labels[0, : n - 1].tolist() == inputs["input_ids"][0, 1:n].tolist()  # label t is token t+1
    assert (labels[0, n - 1 :] == -100).all() and (inputs["input_ids"][0, n:] == 1).all()
    assert index.tolist() == torch.nonzero(labels.flatten() != -100).flatten().tolist()
    mask = inputs["attention_mask"][0, 0]
    assert mask[n:, :n].sum() == 0 and mask[n:, n:].equal(torch.eye(width - n, dtype=torch.bool))  # pads: self


def test_global_batches_do_not_depend_on_the_split():
    order = training.GlobalBatches(num_blocks=100, global_batch=8, seed=3)
    assert order.steps_per_epoch == 12
    first_epoch = torch.cat([order(s) for s in range(12)])
    assert len(set(first_epoch.tolist())) == 96  # no sequence twice in an epoch
    assert not torch.equal(order(12), order(0))  # a new shuffle each epoch
    again = training.GlobalBatches(100, 8, seed=3)
    assert torch.equal(again(5), order(5))
    # 2 ranks x micro-batch 2 x 2 micro-steps cover exactly the global batch, micro-step by micro-step
    batch = order(5)
    for k, micro in enumerate(batch.view(2, -1)):
        shares = [micro.view(2, -1)[rank] for rank in range(2)]
        assert torch.cat(shares).tolist() == batch[4 * k : 4 * (k + 1)].tolist()


def test_a_multimodal_models_layers_take_their_windows_from_its_text_config():
    """Gemma 3 from 4B up loads as Gemma3ForConditionalGeneration, whose config keeps the layers' settings (sliding
    window, layer types) in its text config: the documents' masks must read them there, or the local layers would
    attend beyond their window."""
    from transformers import Gemma3Config

    config = Gemma3Config(
        text_config=dict(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=2,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    assert getattr(config, "sliding_window", None) is None  # not at the top
    same = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    masks = blocks.document_masks(same, config, "bool")
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert masks["sliding_attention"][0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert torch.equal(masks["full_attention"], same)


def test_a_mistral_checkpoint_that_lists_layer_types_gets_one_windowed_mask():
    """Mistral's model takes one mask and windows every layer, whatever layer types its config lists (some
    checkpoints list them): a mask per type would crash its first packed batch. The documents' mask of one document
    a row must give the model's own output, its window applied."""
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
        layer_types=["full_attention", "sliding_attention"],
        attn_implementation="sdpa",
    )
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 8))
    mask = blocks.document_masks(torch.ones(1, 1, 8, 8, dtype=torch.bool).tril(), config, "bool")
    assert torch.is_tensor(mask) and mask[0, 0, 7].int().tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        own, ours = model(ids).logits, model(ids, attention_mask=mask).logits
        unwindowed = model(ids, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()).logits
    torch.testing.assert_close(ours, own, rtol=0, atol=1e-6)
    assert (unwindowed - own)[0, 3:].abs().max() > 1e-3  # the window matters here
