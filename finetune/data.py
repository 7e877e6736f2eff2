"""Data for the causal-LM pair: read a dataset, turn its rows into documents with a loss mask, pack them into blocks,
prepare all that once per node, and assemble batches.

Three formats, found from the columns (see docs/data.md):
  text                   a `text` column; the loss is on every token
  prompt + completion    TRL's names; the loss is on the completion only
  messages               a list of {role, content}, rendered with the tokenizer's chat template; the loss is on the
                         assistant turns only (--train-on-prompt puts it back on every token, in both)
Packing (--packing): `isolated` places whole documents into blocks (best-fit decreasing; only a document longer than
a block is cut) and each attends only to itself, its positions restarting at 0; `stream` concatenates and cuts, as
run_clm does (documents see each other); `none` is one document per row, padded.
"""
import hashlib
import inspect
import json
import os
import shutil
import time
from bisect import bisect_left, insort
from pathlib import Path

import numpy as np
import torch

from . import hardware
from .training import fail

LOCAL_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}
CACHE = Path(os.environ.get("DATA_CACHE", Path.home() / ".cache" / "zero-template" / "data"))
VERSION = 2  # of the prepared files' layout: part of the cache key
# Rows per record batch of the Arrow files the datasets library writes. Opening such a file maps the first 64 KB of
# every batch (the kernel's fault-around on each batch's header): 64 MB per million rows at its default of 1,000.
BATCH = 10_000
CHUNK = 4096  # pieces of documents written at a time: at most 48 MB of output pages mapped at once
LOSS, DOC_START = 1, 2  # bits of the per-token flags: this token is predicted (carries loss); a document starts here
# For a tokenizer without a chat template: plain-text headers (no new tokens to learn), and the assistant's turns,
# with the EOS that teaches the model to stop, marked as what the model generates.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{- '### Assistant:\\n' }}"
    "{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '### ' + message['role'] | capitalize + ':\\n' + message['content'] + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '### Assistant:\\n' }}{%- endif %}")


def load_splits(name, config_name=None, seed=0, max_train_samples=0, eval_fraction=0.05, eval_name=None,
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


def find_format(columns, args):
    """(format, {role: column}) from the flags, or else from the column names."""
    if args.messages_column or (not args.prompt_column and not args.text_column and "messages" in columns):
        fmt, names = "messages", {"messages": args.messages_column or "messages"}
    elif args.prompt_column or args.completion_column or (
            not args.text_column and {"prompt", "completion"} <= set(columns)):
        fmt, names = "prompt-completion", {"prompt": args.prompt_column or "prompt",
                                           "completion": args.completion_column or "completion"}
    else:
        fmt, names = "text", {"text": args.text_column or "text"}
    missing = [c for c in names.values() if c not in columns]
    if missing:
        fail(f"dataset {args.dataset} has no column {missing[0]!r} for the {fmt} format (it has {', '.join(columns)});"
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


def _documents(batch, indices, fmt, tokenizer, train_on_prompt):
    """datasets.map function: each row becomes `ids` and `loss` (1 where a token is predicted), or an `error`."""
    eos, rows = tokenizer.eos_token_id, [dict(zip(batch, values)) for values in zip(*batch.values())]
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

def best_fit_decreasing(lengths, block_size):
    """Place documents into blocks, every document whole unless it is longer than a block: longest first, each into
    the fullest block it fits in. A long document is cut into pieces of a block each, and its last piece is placed
    like a document. Returns the pieces (document, start, length) in block order, and each piece's block."""
    counts = -(-lengths // block_size)  # pieces per document
    doc = np.repeat(np.arange(len(lengths), dtype=np.int32), counts)
    start = ((np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)) * block_size).astype(np.int32)
    length = np.minimum(lengths[doc] - start, block_size).astype(np.int32)
    order = np.argsort(-length, kind="stable")  # longest first; stable, so the placement is reproducible
    block = np.empty(len(doc), dtype=np.int32)
    free, rooms, nblocks = {}, [], 0  # free: room left -> blocks with that much room; rooms: its keys, sorted
    for a in range(0, len(order), 65_536):  # a slice at a time: no million-element Python lists
        for piece, n in zip(order[a:a + 65_536].tolist(), length[order[a:a + 65_536]].tolist()):
            i = bisect_left(rooms, n)
            if i < len(rooms):
                room = rooms[i]
                b = free[room].pop()
                if not free[room]:
                    del free[room], rooms[i]
            else:
                room, b, nblocks = block_size, nblocks, nblocks + 1
            block[piece] = b
            if room - n:
                if room - n not in free:
                    free[room - n] = []
                    insort(rooms, room - n)
                free[room - n].append(b)
    order = np.argsort(block, kind="stable")  # block after block, each block's pieces in document order
    return doc[order], start[order], length[order], block[order]


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


def _write_split(batches, block_size, packing, folder):
    """The split's blocks, as files: tokens.npy and flags.npy (one entry per token, block after block) and
    blocks.npy (per block: start, length, predicted tokens, and the sum of its segments' squared lengths, which
    counts the attention's work). Written in chunks, so memory stays flat in the corpus size."""
    lengths = []
    with open(folder / "source-tokens", "wb") as tokens_out, open(folder / "source-loss", "wb") as loss_out:
        for batch in batches:
            ids, loss = batch.column(0), batch.column(1)
            lengths.append(np.diff(np.asarray(ids.offsets)))
            tokens_out.write(np.asarray(ids.values, dtype=np.int32)[ids.offsets[0].as_py():].tobytes())
            loss_out.write(np.asarray(loss.values, dtype=np.uint8)[loss.offsets[0].as_py():].tobytes())
    lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if packing == "isolated":
        doc, start, n, block = best_fit_decreasing(lengths, block_size)
        src, new_segment = offsets[doc] + start, np.ones(len(doc), bool)
    elif packing == "stream":  # concatenated and cut: each block is one segment, documents see each other
        src = np.arange(0, offsets[-1], block_size)
        n, block, new_segment = np.minimum(block_size, offsets[-1] - src), np.arange(len(src)), np.ones(len(src), bool)
    else:  # one document per row, cut at block_size (the rest is dropped)
        keep = lengths > 0
        src, n = offsets[:-1][keep], np.minimum(lengths[keep], block_size)
        block, new_segment = np.arange(len(src)), np.ones(len(src), bool)
    nblocks = int(block[-1]) + 1 if len(block) else 0
    count = lambda index, weights: np.bincount(index, weights, minlength=nblocks).astype(np.int64)
    table = np.zeros((nblocks, 4), dtype=np.int64)  # start, length, predicted tokens, attended
    table[:, 1], table[:, 3] = count(block, n), count(block, n.astype(np.int64) ** 2)
    table[:, 0] = np.cumsum(table[:, 1]) - table[:, 1]
    out, total = np.cumsum(n, dtype=np.int64) - n, int(n.sum())  # each piece's place in the output
    for name, size in (("tokens.bin", 4), ("flags.bin", 1)):
        with open(folder / name, "wb") as f:
            f.truncate(total * size)
    # The pieces in source order, a chunk at a time, each written to its place. The files are mapped anew per chunk
    # and read in order: a random read of a mapped file maps its neighbouring 64 KB too (the kernel's fault-around),
    # which would map the whole source within a chunk; a write maps its page only.
    order = np.argsort(src, kind="stable")
    for a in range(0, len(order), CHUNK):
        piece = order[a:a + CHUNK]
        m = n[piece]
        first = np.cumsum(m) - m  # each piece's first token in this chunk
        within = np.arange(first[-1] + m[-1]) - np.repeat(first, m)
        read, write = np.repeat(src[piece], m) + within, np.repeat(out[piece], m) + within
        flags = np.memmap(folder / "source-loss", np.uint8, "r")[read] & LOSS
        flags[first[new_segment[piece]]] = DOC_START
        table[:, 2] += count(np.repeat(block[piece], m), flags & LOSS)
        np.memmap(folder / "flags.bin", np.uint8, "r+")[write] = flags
        tokens = np.memmap(folder / "source-tokens", np.int32, "r")[read]
        np.memmap(folder / "tokens.bin", np.int32, "r+")[write] = tokens
    np.save(folder / "blocks.npy", table[table[:, 2] > 0])  # a block with nothing to learn (a long prompt's piece)
    for name in ("source-tokens", "source-loss"):
        (folder / name).unlink()
    return int((lengths > block_size).sum()) if packing != "stream" else 0  # documents cut


def prepare(args, tokenizer, local_rank=0):
    """The train and eval Blocks. Local rank 0 of each node tokenizes and packs them once into a cache keyed by the
    data, the tokenizer and the settings (a rerun or resume starts at once); the other ranks of the node wait for it
    (a wait on a file, not a collective: it does not time out on a large corpus), then every rank memory-maps the
    files, whose pages the node's ranks share."""
    folder, started = CACHE / cache_key(args, tokenizer), time.time()
    failed = folder.with_name(f"{folder.name}.failed")  # what local rank 0 could not prepare, for the others to say
    if local_rank == 0 and not (folder / "meta.json").exists():
        failed.unlink(missing_ok=True)
        partial = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")  # renamed to `folder` once complete
        try:
            _prepare(args, tokenizer, folder, partial)
        except SystemExit as e:
            CACHE.mkdir(parents=True, exist_ok=True)
            failed.write_text(str(e))
            raise
        finally:  # what a failed or interrupted preparation wrote is of no use to a rerun
            shutil.rmtree(partial, ignore_errors=True)
    while not (folder / "meta.json").exists():
        if failed.exists() and failed.stat().st_mtime >= started - 1:
            raise SystemExit(failed.read_text())
        time.sleep(0.5)
    meta = json.loads((folder / "meta.json").read_text())
    if meta["format"] == "messages" and not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE  # as when preparing; saved with the model at the end
    return Blocks(folder / "train", meta), Blocks(folder / "eval", meta)


def cache_key(args, tokenizer):
    """What the prepared blocks depend on: the data (a local file's size and time), the tokenizer (its vocabulary,
    special tokens and chat template) and every flag that changes the tokens or their loss."""
    h = hashlib.sha256()
    path = Path(args.dataset)
    where = lambda p: [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else [str(p)]
    h.update(json.dumps([VERSION, where(path), args.dataset_config, args.max_train_samples, args.seed, args.block_size,
                         args.packing, args.train_on_prompt, args.text_column, args.prompt_column,
                         args.completion_column, args.messages_column, args.eval_fraction, args.max_eval_samples,
                         where(Path(args.eval_dataset)) if args.eval_dataset else None]).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else str(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(json.dumps([tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token]).encode())
    return h.hexdigest()[:16]


def _prepare(args, tokenizer, folder, partial):
    import datasets

    if tokenizer.eos_token_id is None:
        fail("the tokenizer has no EOS token; set tokenizer.eos_token before training")
    train, evaluation = load_splits(args.dataset, args.dataset_config, args.seed, args.max_train_samples,
                                    args.eval_fraction, args.eval_dataset, args.max_eval_samples)
    fmt, names = find_format(train.column_names, args)
    if args.eval_dataset:  # the same kind of data: the columns the training rows are read from
        if not set(names.values()) <= set(evaluation.column_names):
            fail(f"--eval-dataset {args.eval_dataset} has columns {', '.join(evaluation.column_names)} and the "
                 f"training data is {fmt} in {', '.join(names.values())}; give the eval data the same columns")
    if fmt == "messages" and not getattr(tokenizer, "is_fast", False):
        fail(f"{args.model}'s tokenizer is not a fast one: the assistant's tokens are found through a fast "
             f"tokenizer's offsets")
    if fmt == "messages" and not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    meta = {"format": fmt, "columns": names}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32")), "error": datasets.Value("string"),
                                  "loss": datasets.Sequence(datasets.Value("uint8"))})
    for name, split in (("train", train), ("eval", evaluation)):
        (partial / name).mkdir(parents=True, exist_ok=True)
        rows = split.select_columns(list(names.values())).rename_columns({v: k for k, v in names.items()})
        workers = min(args.num_proc or cores, max(1, len(rows) // 2000))  # at least 2,000 rows per process
        if workers > 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism (and no fork warning)
        quiet = datasets.are_progress_bars_disabled()
        if len(rows) > 20_000:  # a progress bar where it takes a while
            datasets.enable_progress_bars()
        docs = rows.map(_documents, with_indices=True, batched=True, remove_columns=list(names), features=features,
                        num_proc=workers if workers > 1 else None, desc=f"tokenizing the {name} split ({fmt})",
                        fn_kwargs=dict(fmt=fmt, tokenizer=tokenizer, train_on_prompt=args.train_on_prompt))
        if quiet:  # as training.quiet had it
            datasets.disable_progress_bars()
        batches = _record_batches(docs, ["ids", "loss", "error"])
        del docs  # its memory map maps 64 KB per record batch (the kernel's fault-around on each batch's header)
        cut = _write_split(_checked(batches, f"dataset {args.dataset} ({name} split)"), args.block_size, args.packing,
                           partial / name)
        meta[name] = {"rows": len(rows), "cut": cut}
    meta["examples"] = [rows[i] for i in range(min(3, len(rows)))]  # held out: the eval split's first rows
    (partial / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    try:
        partial.rename(folder)
    except OSError:  # another node's rank 0 finished first (a shared file system): theirs is the same
        shutil.rmtree(partial, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# Blocks -> batches

class Blocks:
    """A prepared split, memory-mapped. Per block: `lengths` (tokens), `predicted` (tokens that carry loss) and
    `attended` (the tokens each token attends to, summed: for the FLOPs count), known up front, so the loss
    normalization and the throughput figures need no device synchronization."""

    def __init__(self, folder, meta):
        self.tokens = np.memmap(folder / "tokens.bin", np.int32, "r") if (folder / "tokens.bin").stat().st_size else []
        self.flags = np.memmap(folder / "flags.bin", np.uint8, "r") if (folder / "flags.bin").stat().st_size else []
        table = np.load(folder / "blocks.npy")
        self.starts, self.lengths, self.predicted, self.attended = (table[:, i] for i in range(4))
        self.format, self.examples, self.cut = meta["format"], meta.get("examples", []), meta[folder.name]["cut"]
        if len(self.starts) == 0 or self.predicted.sum() == 0:
            cut = f"; {self.cut} documents were cut at the block size: raise --block-size" if self.cut else ""
            fail(f"the {folder.name} split has no tokens to learn from (empty texts, or the loss masked everywhere{cut})")

    def __len__(self):
        return len(self.starts)

    def describe(self, packing):
        cut = f"; {self.cut} documents longer than a block were cut: raise --block-size?" if self.cut else ""
        return f"{len(self)} sequences of <= {self.lengths.max()} tokens ({self.format}, {packing} packing{cut})"

    def batch(self, indices, pad_id, device, config, carry_loss=True, sequence_shard=None):
        """The model's inputs and the loss targets for these blocks. Labels are shifted here, on the host (label t
        is token t+1, or -100), so the loss never copies the logits to shift them; with them comes the flat index
        of the positions that carry loss, so the loss computes logits for those only. Each document attends only to
        itself: a block-diagonal causal mask (unless a row is one whole segment), or, with FlashAttention, the rows
        laid end to end without padding and cut at the documents' boundaries (varlen). Padding attends to itself
        only and carries no loss. `sequence_shard`: (this rank's place, ranks) in a sequence-parallel group: its
        slice of the tokens and targets (sequence_parallel.py), no mask (the attention builds it)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        lengths = self.lengths[indices]
        width = int(lengths.max())
        cols = np.arange(width)
        real = cols[None, :] < lengths[:, None]
        where = np.where(real, self.starts[indices][:, None] + cols[None, :], 0)
        ids = np.where(real, self.tokens[where], pad_id).astype(np.int64)
        flags = np.where(real, self.flags[where], DOC_START)  # each pad token is a segment of its own
        starts = (flags & DOC_START) > 0
        positions = cols[None, :] - np.maximum.accumulate(np.where(starts, cols[None, :], 0), axis=1)
        labels = np.full_like(ids, -100)
        labels[:, :-1] = np.where(flags[:, 1:] & LOSS & carry_loss, ids[:, 1:], -100)
        layout = attention_layout(getattr(config, "_attn_implementation", None))
        if layout == "varlen":  # one row of the real tokens; FlashAttention takes the segments' boundaries
            ids, positions, labels, starts = (x[real][None] for x in (ids, positions, labels, starts))
            bounds = np.append(np.flatnonzero(starts[0]), starts.size).astype(np.int32)
        if sequence_shard and sequence_shard[1] > 1:
            from . import sequence_parallel
            return sequence_parallel.shard(ids, positions, labels, *sequence_shard, device)
        segments = np.cumsum(starts, axis=-1)
        index = torch.from_numpy(np.flatnonzero(labels != -100)).to(device)
        ids, positions, labels, segments = torch.from_numpy(np.stack([ids, positions, labels, segments])).to(device)
        inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
        if layout == "varlen":
            cu = torch.from_numpy(bounds).to(device)
            longest = int(np.diff(bounds).max())
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        elif starts[:, 1:].any():  # one causal segment per row and no padding: the model's own mask
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            inputs["attention_mask"] = document_masks(
                (segments[:, None, :, None] == segments[:, None, None, :]) & causal, config, layout)
        return inputs, (labels, index)


def document_masks(same, config, layout):
    """The 4-D mask of each document attending to itself (`same`), with the model's sliding window where its layers
    have one: a 4-D mask passes transformers' mask building as it is, so a layer that attends only to its last
    `sliding_window` tokens (Mistral's, Gemma 2/3's local layers, gpt-oss's) must get that window here, or training
    would attend further than inference does. Models that mix full and sliding layers take a mask per layer type."""
    config = hardware.text_config(config)  # a multimodal model (Gemma 3 4B and up) keeps its layers' settings there
    window = getattr(config, "sliding_window", None)
    # a mask per layer type where the model takes one (its config class declares layer_types); Mistral's model takes
    # one mask, windowed in every layer, even when a checkpoint's config lists layer types (transformers warns of those)
    declared = any("layer_types" in inspect.get_annotations(k) for k in type(config).__mro__)
    types = getattr(config, "layer_types", None) if declared else None
    kinds = set(types or ["sliding_attention" if window else "full_attention"])
    as_layout = lambda m: m if layout != "additive" else torch.zeros(m.shape, device=m.device).masked_fill_(
        ~m, torch.finfo(torch.float32).min)  # eager attention adds the mask to the scores
    masks = {"full_attention": same}
    if window and "sliding_attention" in kinds:
        i = torch.arange(same.shape[-1], device=same.device)
        masks["sliding_attention"] = same & (i[:, None] - i[None, :] < window)  # the last `window` tokens, itself in
    masks = {kind: as_layout(masks.get(kind, same)) for kind in kinds}
    return masks.popitem()[1] if len(masks) == 1 else masks


def attention_layout(implementation):
    """How a batch tells the model where documents end, for its attention implementation: SDPA takes a boolean 4D
    mask (True: attend), eager attention an additive one (a 4D mask passes transformers' mask building as it is),
    FlashAttention no mask but the documents' boundaries in one padding-free row (its varlen kernel)."""
    if implementation and "flash" in implementation:  # flash_attention_2/3, and the hub's kernels of it
        return "varlen"
    return "additive" if implementation == "eager" else "bool"
