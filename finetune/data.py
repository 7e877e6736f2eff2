"""Data for the causal-LM pair: read a dataset, turn its rows into documents with a loss mask, and prepare them once
per node (packed into blocks by blocks.py, which also assembles the batches).

The formats, found from the columns (see docs/data.md):
  text                   a `text` column; the loss is on every token
  prompt + completion    TRL's names; the loss is on the completion only
  messages               a list of {role, content}, rendered with the tokenizer's chat template; the loss is on the
                         assistant turns only (--train-on-prompt puts it back on every token, in both)
  preference pairs       chosen + rejected (and prompt): the DPO loss (preference/, docs/preference.md)
  unpaired feedback      prompt + completion + label (true: desirable): the KTO loss (docs/preference.md)
Packing (--packing): `isolated` places whole documents into blocks (best-fit decreasing; only a document longer than
a block is cut) and each attends only to itself, its positions restarting at 0; `stream` concatenates and cuts, as
run_clm does (documents see each other); `none` is one document per row, padded.
"""
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from . import preference
from .base import fail
from .blocks import Blocks, write_split

LOCAL_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}
VERSION = 8  # of the prepared files' layout: part of the cache key (8: unpaired rows, KTO)
# Rows per record batch of the Arrow files the datasets library writes. Opening such a file maps the first 64 KB of
# every batch (the kernel's fault-around on each batch's header): 64 MB per million rows at its default of 1,000.
BATCH = 10_000
# For a tokenizer without a chat template: plain-text headers (no new tokens to learn), and the assistant's turns,
# with the EOS that teaches the model to stop, marked as what the model generates.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{- '### Assistant:\\n' }}"
    "{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '### ' + message['role'] | capitalize + ':\\n' + message['content'] + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '### Assistant:\\n' }}{%- endif %}")


def load_splits(name, config_name=None, *, seed=0, max_train_samples=0, eval_fraction=0.05, eval_name=None,
                max_eval_samples=0):
    """Train and eval splits of a hub dataset (with its subset, `config_name`) or a local file. The eval split:
    `eval_name` (a local file, or a hub name with an optional :split), else the dataset's validation or test split,
    else `eval_fraction` of the training rows; at most `max_eval_samples` rows of it, drawn once with the seed."""
    data = _load(name, config_name)
    train, evaluation = data["train"], data.get("validation") or data.get("test")
    if len(train) == 0:
        fail(f"dataset {name} is empty")
    if eval_name:
        evaluation = _eval_split(eval_name)
    elif evaluation is None:
        if len(train) < 2:
            fail(f"dataset {name} has {len(train)} row: too few to carve an eval split")
        parts = train.train_test_split(test_size=max(1, int(len(train) * eval_fraction)), seed=seed)
        train, evaluation = parts["train"], parts["test"]
    if max_train_samples > 0:  # a quick run on a slice
        train = train.select(range(min(max_train_samples, len(train))))
    if 0 < max_eval_samples < len(evaluation):  # the same rows at every eval, and on a resume
        evaluation = evaluation.shuffle(seed=seed).select(range(max_eval_samples))
    return train, evaluation


def _eval_split(eval_name):
    path = Path(eval_name)
    name, split = (eval_name, None) if path.suffix in LOCAL_FORMATS or path.exists() else (
        eval_name.split(":", 1) if ":" in eval_name else (eval_name, None))
    data = _load(name, None)
    if split is None:  # a file's rows (its one split), or the hub dataset's validation or test split
        split = next((s for s in ("validation", "test", "train") if s in data), None)
    if split not in data:
        fail(f"--eval-dataset {eval_name}: no split {split!r} (it has {', '.join(data)}); name one as {name}:SPLIT")
    if len(data[split]) == 0:
        fail(f"--eval-dataset {eval_name} is empty")
    return data[split]


def _load(name, config_name):
    import datasets

    path = Path(name)
    try:
        if path.suffix in LOCAL_FORMATS or path.exists():
            if not path.is_file():
                fail(f"dataset file {name} does not exist; pass a .csv/.json/.jsonl/.txt/.parquet file or a hub name")
            if path.suffix not in LOCAL_FORMATS:
                fail(f"cannot read {name}: use a .csv, .json, .jsonl, .txt or .parquet file")
            return datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), writer_batch_size=BATCH)
        return datasets.load_dataset(name, config_name, writer_batch_size=BATCH)
    except SystemExit:
        raise
    except Exception as e:  # offline, unknown name, malformed or empty file: all end here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if path.is_file():
            fail(f"could not read {name} ({first}); is it a non-empty {path.suffix} file?")
        fail(f"could not load dataset {name!r} ({first}); check the name (and --dataset-config), the network, or "
             f"pass a local file")


def find_format(columns, data):
    """(format, {role: column}) from the flags, or else from the column names."""
    named = data.text_column or data.prompt_column or data.completion_column or data.messages_column
    if not named and {"chosen", "rejected"} & set(columns):  # preference pairs, for DPO
        missing = {"chosen", "rejected"} - set(columns)
        if missing:
            fail(f"dataset {data.dataset} has a column {({'chosen', 'rejected'} - missing).pop()!r} but no "
                 f"{missing.pop()!r}: preference pairs need both (it has {', '.join(columns)})")
        return "preference", {c: c for c in preference.COLUMNS if c in columns}
    if not named and set(preference.UNPAIRED_COLUMNS) <= set(columns):  # unpaired feedback, for KTO
        return "unpaired", {c: c for c in preference.UNPAIRED_COLUMNS}
    if data.messages_column or (not data.prompt_column and not data.text_column and "messages" in columns):
        fmt, names = "messages", {"messages": data.messages_column or "messages"}
    elif data.prompt_column or data.completion_column or (
            not data.text_column and {"prompt", "completion"} <= set(columns)):
        fmt, names = "prompt-completion", {"prompt": data.prompt_column or "prompt",
                                           "completion": data.completion_column or "completion"}
    else:
        fmt, names = "text", {"text": data.text_column or "text"}
    missing = [c for c in names.values() if c not in columns]
    if missing:
        fail(f"dataset {data.dataset} has no column {missing[0]!r} for the {fmt} format (it has {', '.join(columns)});"
             f" name yours with --text-column, --prompt-column and --completion-column, or --messages-column")
    return fmt, names


# ----------------------------------------------------------------------------------------------------
# Rows -> documents: token ids, and which tokens carry the loss

def _row_error(fmt, row):
    """Why a row cannot be a training document, or None."""
    if fmt == "text":
        return None if isinstance(row["text"], str) else "the text is not a string"
    if fmt == "prompt-completion":
        if not isinstance(row["prompt"], str):
            return "the prompt is not a string"
        return None if isinstance(row["completion"], str) and row["completion"] else "the completion is empty"
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "messages is not a non-empty list of {role, content}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not a {{role, content}} pair of strings"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn: nothing to learn"
    return None


def _chat_document(tokenizer, messages):
    """Token ids of the rendered conversation, and a mask of the assistant's tokens. With {% generation %} markers in
    the template, transformers finds them; otherwise each assistant turn is the text it adds to the rendering of the
    conversation before it (which needs a template that renders earlier turns the same as a conversation grows)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if "{% generation %}" in (tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    text, spans = render(messages, False), []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before, upto = render(messages[:i], True), render(messages[:i + 1], False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError("the chat template renders earlier turns differently as the conversation grows, so "
                                 "the assistant's tokens cannot be found; add {% generation %} markers to it")
            spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and a < e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


def _documents(batch, indices, *, fmt, tokenizer, train_on_prompt, block_size, packing):
    """datasets.map function: each row becomes `ids` and `loss` (1 where a token is predicted), or an `error`."""
    eos, rows = tokenizer.eos_token_id, [dict(zip(batch, values)) for values in zip(*batch.values())]
    if fmt == "preference":  # a pair is one document (preference.py); packed, its prompt held once
        ids, loss, notes = preference.documents(rows, tokenizer, block_size, _chat_document,
                                                share=packing == "isolated")
        return {"ids": ids, "loss": loss, "cut": notes, "error": [None] * len(rows)}  # a bad pair: skipped, counted
    if fmt == "unpaired":  # a row and its KL completion: one unit, as a pair is (preference/rows.py)
        ids, loss, notes = preference.unpaired_documents(rows, tokenizer, block_size, _chat_document,
                                                         share=packing == "isolated")
        return {"ids": ids, "loss": loss, "cut": notes, "error": [None] * len(rows)}
    errors = [_row_error(fmt, row) for row in rows]
    ok = [i for i, e in enumerate(errors) if e is None]
    ids, loss = [[] for _ in rows], [[] for _ in rows]
    if fmt == "text":  # one call for the whole batch: the tokenizer's own threads do the work
        for i, x in zip(ok, tokenizer([rows[i]["text"] for i in ok])["input_ids"] if ok else []):
            ids[i] = x + [eos] if x[-1:] != [eos] and rows[i]["text"] else x if rows[i]["text"] else []
            loss[i] = [1] * len(ids[i])
    elif fmt == "prompt-completion":
        prompts = tokenizer([rows[i]["prompt"] for i in ok])["input_ids"] if ok else []
        completions = (tokenizer([rows[i]["completion"] for i in ok], add_special_tokens=False)["input_ids"]
                       if ok else [])
        for i, p, c in zip(ok, prompts, completions):
            ids[i], loss[i] = p + c + [eos], [0] * len(p) + [1] * (len(c) + 1)
    else:
        for i in ok:
            try:
                ids[i], loss[i] = _chat_document(tokenizer, rows[i]["messages"])
                errors[i] = None if any(loss[i]) else "the chat template marks no assistant token"
            except ValueError as e:
                errors[i] = str(e)
    if train_on_prompt:
        loss = [[1] * len(x) for x in ids]
    return {"ids": ids, "loss": loss, "error": [f"row {k}: {e}" if e else None for k, e in zip(indices, errors)]}


# ----------------------------------------------------------------------------------------------------
# Documents -> blocks

def _record_batches(dataset, columns):
    """The columns of a dataset, a record batch at a time, read (not memory-mapped) from its cache files where it has
    them. Only the files' names are kept: once the caller drops the dataset, its memory map closes, and the preparing
    process's memory stays flat in the corpus size."""
    import pyarrow as pa

    if not dataset.cache_files or dataset._indices is not None:
        return iter(dataset.data.select(columns).to_batches(max_chunksize=50_000))
    files = [file["filename"] for file in dataset.cache_files]

    def read():
        for file in files:
            with pa.OSFile(file) as f:
                for batch in pa.ipc.open_stream(f):
                    yield batch.select(columns)
    return read()


def _checked(batches, where):
    """The record batches, after checking that no row of each is an error."""
    for batch in batches:
        errors = batch.column(2).drop_null()
        if len(errors):
            fail(f"{where}, {errors[0].as_py()}; fix or drop that row")
        yield batch


def prepare(data, tokenizer, *, seed, local_rank=0):
    """The train and eval Blocks. Local rank 0 of each node tokenizes and packs them once into a cache keyed by the
    data, the tokenizer and the settings (a rerun or resume starts at once); the other ranks of the node wait for it
    (a wait on a file, not a collective: it does not time out on a large corpus), then every rank memory-maps the
    files, whose pages the node's ranks share. `data`: flags.Data; `seed` draws the held-out rows (--seed)."""
    cache = Path(data.cache_dir)
    folder, started = cache / cache_key(data, tokenizer, seed), time.time()
    failed = folder.with_name(f"{folder.name}.failed")  # what local rank 0 could not prepare, for the others to say
    if local_rank == 0 and not (folder / "meta.json").exists():
        failed.unlink(missing_ok=True)
        partial = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")  # renamed to `folder` once complete
        try:
            _prepare(data, tokenizer, seed, folder, partial)
        except SystemExit as e:
            cache.mkdir(parents=True, exist_ok=True)
            failed.write_text(str(e))
            raise
        finally:  # what a failed or interrupted preparation wrote is of no use to a rerun
            shutil.rmtree(partial, ignore_errors=True)
    while not (folder / "meta.json").exists():
        if failed.exists() and failed.stat().st_mtime >= started - 1:
            raise SystemExit(failed.read_text())
        time.sleep(0.5)
    meta = json.loads((folder / "meta.json").read_text())
    if meta["chat"] and not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE  # as when preparing; saved with the model at the end
    return Blocks(folder / "train", meta), Blocks(folder / "eval", meta)

def _tokenized(split, name, *, fmt, names, data, tokenizer):
    """One split's documents (preference.documents for pairs): their record batches, read later (_record_batches),
    what became of each pair, the longest document's tokens, the rows' count and the first 3 rows (examples)."""
    import datasets
    import pyarrow.compute as pc

    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32")), "error": datasets.Value("string"),
                                  "loss": datasets.Sequence(datasets.Value("uint8")),
                                  **({"cut": datasets.Value("string")} if fmt in preference.FORMATS else {})})
    rows = split.select_columns(list(names.values())).rename_columns({v: k for k, v in names.items()})
    if fmt == "unpaired":  # each row's mismatched completion, from the split's other rows
        column = lambda name: rows.with_format("arrow")[name].to_pylist()  # whole: a Column reads a row a call
        rows = rows.add_column("kl_completion", preference.mismatched(column("prompt"), column("completion")))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(data.num_proc or cores, max(1, len(rows) // 2000))  # at least 2,000 rows per process
    if workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism (and no fork warning)
    quiet = datasets.are_progress_bars_disabled()
    if len(rows) > 20_000:  # a progress bar where it takes a while
        datasets.enable_progress_bars()
    docs = rows.map(_documents, with_indices=True, batched=True, remove_columns=rows.column_names, features=features,
                    num_proc=workers if workers > 1 else None, desc=f"tokenizing the {name} split ({fmt})",
                    fn_kwargs=dict(fmt=fmt, tokenizer=tokenizer, train_on_prompt=data.train_on_prompt,
                                   block_size=data.block_size, packing=data.packing))
    if quiet:  # as training.quiet had it
        datasets.disable_progress_bars()
    notes = docs["cut"] if fmt in preference.FORMATS else []
    if fmt in preference.FORMATS and len(rows) and all(n and not n.startswith("cut") for n in notes):
        fail(f"no pair of dataset {data.dataset} ({name} split) can be trained on: {preference.counted(notes)}")
    lengths = pc.list_value_length(docs.data.column("ids"))
    longest = (pc.max(lengths).as_py() or 0) if len(lengths) else 0
    kept = np.asarray(lengths.to_numpy(zero_copy_only=False)) > 0
    # KTO: each kept row's label, in the order of the units' places (0 .. pairs_total - 1)
    desirable = np.asarray(rows["label"], dtype=bool)[kept] if fmt == "unpaired" else None
    batches = _record_batches(docs, ["ids", "loss", "error"])
    del docs  # its memory map maps 64 KB per record batch (the kernel's fault-around on each batch's header)
    return {"batches": batches, "notes": notes, "longest": longest, "rows": len(rows), "desirable": desirable,
            "examples": [rows[i] for i in range(min(3, len(rows)))]}



def cache_key(data, tokenizer, seed):
    """What the prepared blocks depend on: the data (a local file's size and time), the tokenizer (its vocabulary,
    special tokens and chat template) and every flag that changes the tokens or their loss."""
    h = hashlib.sha256()
    path = Path(data.dataset)
    where = lambda p: [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else [str(p)]
    h.update(json.dumps([VERSION, where(path), data.dataset_config, data.max_train_samples, seed, data.block_size,
                         data.packing, data.train_on_prompt, data.text_column, data.prompt_column,
                         data.completion_column, data.messages_column, data.eval_fraction, data.max_eval_samples,
                         where(Path(data.eval_dataset)) if data.eval_dataset else None]).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else str(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(json.dumps([tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token]).encode())
    return h.hexdigest()[:16]


def _prepare(data, tokenizer, seed, folder, partial):

    if tokenizer.eos_token_id is None:
        fail("the tokenizer has no EOS token; set tokenizer.eos_token before training")
    train, evaluation = load_splits(data.dataset, data.dataset_config, seed=seed, eval_name=data.eval_dataset,
                                    max_train_samples=data.max_train_samples, eval_fraction=data.eval_fraction,
                                    max_eval_samples=data.max_eval_samples)
    fmt, names = find_format(train.column_names, data)
    if data.eval_dataset:  # the same kind of data: the columns the training rows are read from
        if not set(names.values()) <= set(evaluation.column_names):
            fail(f"--eval-dataset {data.eval_dataset} has columns {', '.join(evaluation.column_names)} and the "
                 f"training data is {fmt} in {', '.join(names.values())}; give the eval data the same columns")
    chat = fmt == "messages" or fmt in preference.FORMATS and isinstance(train[0][names.get("chosen", "completion")],
                                                                        list)
    if fmt in preference.FORMATS and (data.packing == "stream" or data.train_on_prompt):
        fail(f"preference data (DPO, KTO) is trained whole and on its answers: drop "
             f"{'--packing stream' if data.packing == 'stream' else '--train-on-prompt'}")
    if chat and not getattr(tokenizer, "is_fast", False):
        fail(f"{tokenizer.name_or_path}'s tokenizer is not a fast one: the assistant's tokens are found through a fast "
             f"tokenizer's offsets")
    if chat and not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    meta = {"format": fmt, "columns": names, "chat": chat, "packing": data.packing}
    splits = {name: _tokenized(split, name, fmt=fmt, names=names, data=data, tokenizer=tokenizer) for name, split in
              (("train", train), ("eval", evaluation))}
    # a row's most tokens: a block; packed pairs, the longest pair's prompt once and both answers if longer (each
    # sequence within the block, preference/rows.py's fit): up to twice it, the same for both splits
    longest = max(s["longest"] for s in splits.values())
    meta["row_tokens"] = max(data.block_size, longest) if fmt in preference.FORMATS and data.packing == "isolated" \
        else data.block_size
    for name, split in splits.items():
        (partial / name).mkdir(parents=True, exist_ok=True)
        cut = write_split(_checked(split["batches"], f"dataset {data.dataset} ({name} split)"), meta["row_tokens"],
                          data.packing, partial / name, pairs=fmt in preference.FORMATS)
        if split["desirable"] is not None:
            np.save(partial / name / "desirable.npy", split["desirable"])
        notes = split["notes"]  # what became of each pair (preference.documents)
        fitted = sum(1 for n in notes if n and n.startswith("cut"))
        meta[name] = {"rows": split["rows"], "cut": cut + fitted,
                      **({"pairs": preference.counted(notes)} if fmt in preference.FORMATS else {})}
    meta["examples"] = splits["eval"]["examples"]
    (partial / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    try:
        partial.rename(folder)
    except OSError:  # another node's rank 0 finished first (a shared file system): theirs is the same
        shutil.rmtree(partial, ignore_errors=True)
