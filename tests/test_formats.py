"""The data formats, found from the columns (text, prompt + completion, messages), and which tokens carry loss in each;
local files and the eval split; a row or a file that cannot be used is one line."""

import json

import datasets
import numpy as np
import pytest
import torch
from helpers import cpu_process, data_args, documents_of
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from finetune import blocks, data, loss

pytestmark = pytest.mark.quick  # in process: `make test-quick`


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def documents(split):
    return [d for i in range(len(split)) for d in documents_of(split, i)]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny["model"])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_completion_puts_the_loss_on_the_completion(tmp_path, tiny, tokenizer):
    rows = [{"prompt": f"Review {i}: the pasta was good.", "completion": f" {i % 5 + 1} stars"} for i in range(40)]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    train, evals = data.prepare(data_args(path, block_size=64), tokenizer, seed=0)
    assert train.format == "prompt-completion"
    completion_tokens = sum(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows)
    assert train.predicted.sum() + evals.predicted.sum() == completion_tokens  # + EOS each, nothing of the prompts
    model = loss.CausalLMLoss(AutoModelForCausalLM.from_pretrained(tiny["model"]), 8)
    inputs, labels = train.batch([0], cpu_process(tokenizer.pad_token_id, model.config))
    with torch.no_grad():
        full = model.causal_lm(**inputs).logits  # the model's own forward: all logits
        mine = model(inputs, labels).loss
        target = labels[0].flatten()
        reference = torch.nn.functional.cross_entropy(full.flatten(0, 1), target, reduction="sum")
        assert mine.item() == pytest.approx(reference.item(), rel=1e-6)
        changed = inputs["input_ids"].clone()
        position = int(labels[1][0]) + 1  # a completion token (the first that carries loss)
        changed[0, position] = (changed[0, position] + 1) % len(tokenizer)
        new_labels = labels._replace(labels=labels.labels.clone())
        new_labels.labels[0, position - 1] = changed[0, position]
        assert model({**inputs, "input_ids": changed}, new_labels).loss.item() != mine.item()
    both = data.prepare(data_args(path, block_size=64, train_on_prompt=True), tokenizer, seed=0)
    docs = [
        len(tokenizer(r["prompt"])["input_ids"])
        + len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"])
        + 1
        for r in rows
    ]
    assert sum(b.predicted.sum() for b in both) == sum(d - 1 for d in docs)  # every token but each first


@pytest.mark.parametrize("template", ["default", "chatml without markers", "chatml with markers"])
def test_messages_put_the_loss_on_the_assistant(tmp_path, tiny, template):
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    if template != "default":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = (
            CHATML
            if "without" in template
            else CHATML.replace(
                "{{ '<|im_start|>' + m['role']",
                "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
                "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
                "{{ '<|im_start|>' + m['role']",
            ).replace("'<|im_end|>\n' }}{% endfor %}", "'<|im_end|>\n' }}{% endif %}{% endfor %}")
        )
    chats = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"How was review {i}?"},
                {"role": "assistant", "content": f"Good {i}."},
                {"role": "user", "content": "And the service?"},
                {"role": "assistant", "content": "Slow."},
            ]
        }
        for i in range(30)
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", chats)
    train, evals = data.prepare(data_args(path, block_size=128), tokenizer, seed=0)
    assert train.format == "messages"
    for split in (train, evals):
        for s, n in zip(split.starts, split.lengths):
            tokens, flags = split.tokens[s : s + n], split.flags[s : s + n]
            starts = list(np.flatnonzero(flags & blocks.DOC_START)) + [n]
            assert len(starts) == 2  # one conversation per block here (each is more than half a block)
            predicted = tokenizer.decode(tokens[(flags & blocks.LOSS) > 0])
            # the assistant's two answers and their end markers: nothing of the system, user or headers
            assert predicted.replace(" ", "").startswith("Good") and "Slow." in predicted
            assert "How" not in predicted and "service" not in predicted and "brief" not in predicted


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"messages": [{"role": "user", "content": "hi"}, {"content": "no role"}]}] * 3,
            "row 0: message 1 is not a {role, content} pair of strings",
        ),
        ([{"messages": "hello"}] * 3, "row 0: messages is not a non-empty list"),
        ([{"messages": [{"role": "user", "content": "only a question"}]}] * 3, "row 0: no assistant turn"),
        ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": ""}] * 3, "row 1: the completion is empty"),
    ],
)
def test_a_row_of_the_wrong_shape_is_one_line(tmp_path, tokenizer, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(SystemExit) as e:
        data.prepare(data_args(path, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    text = str(e.value)
    assert text.startswith("error: ") and message in text and "\n" not in text and "fix or drop that row" in text
    # the reason is left for the node's other ranks; the half-written folder is not left at all
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".failed"]


def test_answers_cut_off_by_the_block_are_one_line(tmp_path, tiny, tokenizer):
    """One chat per row, cut at 16 tokens: every answer is beyond the cut, nothing carries loss."""
    with pytest.raises(
        SystemExit,
        match=r"loss masked everywhere; \d+ documents were cut at the block size: raise "
        r"--block-size\)$",
    ):
        data.prepare(
            data_args(tiny["chats"], block_size=16, packing="none", cache_dir=str(tmp_path / "cache")),
            tokenizer,
            seed=0,
        )


def test_formats_from_the_columns_and_the_flags():
    a = lambda **kw: data_args("d", **kw)
    assert data.find_format(["text", "label"], a())[0] == "text"
    assert data.find_format(["prompt", "completion"], a())[0] == "prompt-completion"
    assert data.find_format(["messages", "text"], a())[0] == "messages"
    assert data.find_format(["q", "a"], a(prompt_column="q", completion_column="a"))[1] == {
        "prompt": "q",
        "completion": "a",
    }
    assert data.find_format(["body", "prompt", "completion"], a(text_column="body"))[0] == "text"
    with pytest.raises(SystemExit, match="has no column 'text' for the text format \\(it has q, a\\)"):
        data.find_format(["q", "a"], a())


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".json", ".parquet", ".txt"])
def test_local_formats_and_carved_eval_split(tmp_path, suffix):
    rows = datasets.Dataset.from_dict(
        {"text": [f"review number {i}" for i in range(40)], "label": [i % 5 for i in range(40)]}
    )
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        rows.to_csv(path)
    elif suffix == ".parquet":
        rows.to_parquet(path)
    elif suffix == ".txt":
        path.write_text("\n".join(list(rows["text"])) + "\n")
    else:
        rows.to_json(path, lines=suffix == ".jsonl")
    train, evaluation = data.load_splits(str(path), seed=0)
    assert len(train) + len(evaluation) == 40 and len(evaluation) == 2
    assert sorted(list(train["text"]) + list(evaluation["text"])) == sorted(rows["text"])
    assert len(data.load_splits(str(path), seed=0, max_train_samples=5)[0]) == 5


def test_loading_errors(tmp_path, tiny):
    with pytest.raises(SystemExit, match="does not exist"):
        data.load_splits(str(tmp_path / "missing.csv"))
    (tmp_path / "empty.csv").write_text("text\n")
    with pytest.raises(SystemExit, match="could not read .*empty.csv .*is it a non-empty .csv file"):
        data.load_splits(str(tmp_path / "empty.csv"))
    with pytest.raises(SystemExit, match="could not load dataset 'no-such/dataset'"):
        data.load_splits("no-such/dataset")


def test_an_eval_file_of_its_own(tmp_path, tiny, tokenizer):
    """--eval-dataset: another file format than the training file's, the same kind of rows; evaluated whole (the
    training rows all train), or on --max-eval-samples of its rows; a file of another kind of rows is one line."""
    texts = [f"review number {i} of a place that served food" for i in range(30)]
    write_jsonl(tmp_path / "held-out.jsonl", [{"text": t} for t in texts])
    train, evals = data.prepare(
        data_args(tiny["data"], eval_dataset=str(tmp_path / "held-out.jsonl")), tokenizer, seed=0
    )
    docs = [tuple(x + [tokenizer.eos_token_id]) for x in tokenizer(texts)["input_ids"]]
    assert sorted(map(tuple, documents(evals))) == sorted(docs)  # the file's rows, whole, and nothing else
    rows = datasets.load_dataset("csv", data_files=tiny["data"])["train"]  # every row of the training file trains
    assert train.lengths.sum() == sum(len(x) + 1 for x in tokenizer(list(rows["text"]))["input_ids"])
    _, some = data.prepare(
        data_args(tiny["data"], eval_dataset=str(tmp_path / "held-out.jsonl"), max_eval_samples=7), tokenizer, seed=0
    )
    assert len(documents(some)) == 7 and set(map(tuple, documents(some))) <= set(docs)
    with pytest.raises(SystemExit) as e:
        data.prepare(data_args(tiny["data"], eval_dataset=tiny["chats"]), tokenizer, seed=0)
    assert str(e.value) == (
        f"error: --eval-dataset {tiny['chats']} has columns messages and the training data is "
        f"text in text; give the eval data the same columns"
    )
