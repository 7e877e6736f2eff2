"""Data for the causal-LM pair: load a hub dataset or a local file, tokenize, pack into blocks, the batch order."""
from pathlib import Path

import numpy as np
import torch

from training import fail

_LOCAL_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}


def load_splits(name, text_column, seed, eval_fraction=0.05):
    """Train and eval splits of a hub dataset or a local file; carve the eval split if there is none."""
    import datasets

    path = Path(name)
    try:
        if path.suffix in _LOCAL_FORMATS or path.exists():
            if not path.is_file():
                fail(f"dataset file {name} does not exist; pass a .csv/.json/.jsonl/.txt/.parquet file or a hub name")
            if path.suffix not in _LOCAL_FORMATS:
                fail(f"cannot read {name}: use a .csv, .json, .jsonl, .txt or .parquet file")
            data = datasets.load_dataset(_LOCAL_FORMATS[path.suffix], data_files=str(path))
        else:
            data = datasets.load_dataset(name)
    except SystemExit:
        raise
    except Exception as e:  # offline, unknown name, malformed or empty file: all end here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if path.is_file():
            fail(f"could not read {name} ({first}); is it a non-empty {path.suffix} file?")
        fail(f"could not load dataset {name!r} ({first}); check the name, the network, or pass a local file")
    train = data["train"]
    evaluation = data.get("validation") or data.get("test")
    if text_column not in train.column_names:
        fail(f"dataset {name} has no column {text_column!r} (it has {', '.join(train.column_names)}); "
             f"pass --text-column")
    if len(train) == 0:
        fail(f"dataset {name} is empty")
    if evaluation is None:
        if len(train) < 2:
            fail(f"dataset {name} has {len(train)} row: too few to carve an eval split")
        parts = train.train_test_split(test_size=max(1, int(len(train) * eval_fraction)), seed=seed)
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation


def tokenize(split, tokenizer, text_column, block_size, packing):
    """Token sequences of at most block_size tokens, each text followed by EOS.

    packing=True concatenates all texts and cuts the stream into blocks (the last one shorter), so no compute
    goes to padding and no token is dropped; packing=False keeps one text per sequence, cut at block_size."""
    eos = tokenizer.eos_token_id
    if eos is None:
        fail("the tokenizer has no EOS token; set tokenizer.eos_token before training")
    texts = split.select_columns([text_column]).filter(lambda t: bool(t), input_columns=text_column)
    ids = texts.map(lambda batch: {"ids": [x + [eos] for x in tokenizer(batch, add_special_tokens=False)["input_ids"]]},
                    input_columns=text_column, batched=True, remove_columns=[text_column])
    column = ids.data.column("ids").combine_chunks()
    tokens = np.array(column.flatten(), dtype=np.int32)
    if len(tokens) == 0:
        fail("the dataset has no text to train on")
    if packing:
        starts = np.arange(0, len(tokens), block_size)
        ends = np.minimum(starts + block_size, len(tokens))
    else:
        offsets = np.array(column.offsets)
        starts, ends = offsets[:-1], np.minimum(offsets[1:], offsets[:-1] + block_size)
    return TokenBlocks(torch.from_numpy(tokens), torch.from_numpy(starts), torch.from_numpy(ends))


class TokenBlocks:
    """Sequences as (start, end) views of one token array; lengths and predicted-token counts are known up front,
    so the loss normalization and the token throughput need no device synchronization."""

    def __init__(self, tokens, starts, ends):
        self.tokens, self.starts, self.ends = tokens, starts, ends
        self.lengths = ends - starts
        self.targets = (self.lengths - 1).clamp(min=0)  # every token but the first is predicted

    def __len__(self):
        return len(self.starts)

    def batch(self, indices, pad_id, device):
        """Right-pad the chosen sequences to the longest; padding is masked from attention and from the loss."""
        indices = torch.as_tensor(indices).reshape(-1)
        width = int(self.lengths[indices].max()) if len(indices) else 1
        input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices.tolist()):
            n = int(self.lengths[i])
            input_ids[row, :n] = self.tokens[self.starts[i]:self.ends[i]]
            mask[row, :n] = 1
        labels = input_ids.masked_fill(mask == 0, -100)
        pin = device.type == "cuda"
        move = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=pin)
        return {"input_ids": move(input_ids), "attention_mask": move(mask), "labels": move(labels)}


class GlobalBatches:
    """The order of training: optimizer step s trains on the same global batch of sequences whatever the number of
    ranks, a new seeded shuffle each epoch. Ranks and micro-steps only split it (see the training loops)."""

    def __init__(self, num_sequences, global_batch, seed):
        self.num_sequences, self.global_batch, self.seed = num_sequences, global_batch, seed
        self.steps_per_epoch = num_sequences // global_batch  # a last, partial global batch is dropped
        self._epoch, self._order = None, None

    def __call__(self, step):
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_sequences, generator=generator)
        return self._order[k * self.global_batch:(k + 1) * self.global_batch]

