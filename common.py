"""What the training scripts share and is not their lesson.

single-gpu.py and zero-optimization.py (and sequence_classification.py) import this module for:
  - the demo: a generated review corpus, a tokenizer trained on it, a tiny model built from a config;
  - data: loading a hub dataset or a local file, tokenizing, packing into blocks, the batch order;
  - the DeepSpeed config: filling its "auto" values from the flags, as the HF Trainer does;
  - reporting: the loss, perplexity, throughput/MFU figures, results.json and the loss plot;
  - guards: one-line errors for bad input, and never overwriting a finished run.
"""
import csv
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
DEMO_DIR = HERE / ".demo"  # built on first use, ignored by git


def fail(message):
    """Stop with one line that says what is wrong and what to do (no traceback: it is not our bug)."""
    raise SystemExit(f"error: {message}")


# ----------------------------------------------------------------------------------------------------
# The demo: everything generated here, nothing downloaded

_DISHES = "pasta ramen tacos burger curry salad pizza soup sushi dumplings steak pancakes noodles sandwich".split()
_PLACES = "place restaurant diner cafe bistro spot kitchen bar".split()
_WORDS = [  # one row per star rating (label 0 = 1 star ... label 4 = 5 stars)
    "awful terrible inedible disgusting cold greasy".split(),
    "bland disappointing overpriced soggy mediocre dry".split(),
    "okay decent average fine forgettable acceptable".split(),
    "good tasty fresh solid enjoyable satisfying".split(),
    "amazing outstanding perfect delicious incredible superb".split(),
]
_SERVICE = [
    "The staff ignored us for {n} minutes and never apologized.",
    "Service was slow and our order came out wrong.",
    "The service was fine, nothing special.",
    "Our server was friendly and checked on us often.",
    "The staff were wonderful and made us feel at home.",
]
_ENDINGS = [
    "Never again.", "I probably will not return.", "I might come back if I am nearby.",
    "I would come back.", "I cannot wait to come back!",
]
_OPENINGS = [
    "We came here for {occasion}.", "I stopped by on a {day} {time}.", "Visited with {company} last week.",
    "First time at this {place}.", "This {place} opened near my office.",
]


def _review(rng, label):
    adj = lambda: rng.choice(_WORDS[label])
    sentences = [
        rng.choice(_OPENINGS).format(
            occasion=rng.choice(["lunch", "dinner", "a birthday", "brunch", "a quick bite"]),
            day=rng.choice(["Monday", "Friday", "Saturday", "Sunday"]),
            time=rng.choice(["morning", "afternoon", "evening", "night"]),
            company=rng.choice(["friends", "my family", "coworkers", "my partner"]),
            place=rng.choice(_PLACES)),
        f"The {rng.choice(_DISHES)} was {adj()} and the {rng.choice(_DISHES)} was {adj()}.",
        _SERVICE[label].format(n=rng.randint(10, 45)),
        f"Prices were {['a rip-off', 'too high', 'fair', 'reasonable', 'a bargain'][label]}"
        f" at about {rng.randint(8, 40)} dollars each.",
        _ENDINGS[label],
    ]
    middle = sentences[1:-1]
    rng.shuffle(middle)
    return " ".join([sentences[0], *middle[: rng.randint(1, 3)], sentences[-1]])


def make_demo_corpus(path, n=4000, seed=0):
    """Write n generated reviews with yelp_review_full's columns (label 0-4, text)."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "text"])
        for _ in range(n):
            label = rng.randrange(5)
            writer.writerow([label, _review(rng, label)])


def make_demo_tokenizer(texts, vocab_size=1000):
    """A byte-level BPE tokenizer trained on the corpus, with OPT's special tokens (</s> begins and ends)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def make_demo_lm(path, tokenizer, hidden=128, layers=2, heads=4, positions=256, seed=0):
    """A tiny OPT-architecture model with random weights, saved like a pretrained one."""
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                       ffn_dim=4 * hidden, num_attention_heads=heads, max_position_embeddings=positions,
                       word_embed_proj_dim=hidden, dropout=0.0, attention_dropout=0.0,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_demo_wordpiece_tokenizer(texts, vocab_size=1000):
    """A lowercasing WordPiece tokenizer trained on the corpus, with BERT's special tokens: [CLS] text [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "attention_mask"])  # DistilBERT: no token types


def make_demo_encoder(path, tokenizer, dim=64, layers=2, heads=2, positions=256, seed=0):
    """A tiny DistilBERT-architecture encoder with random weights and no task head, saved like a pretrained one."""
    from transformers import AutoModel, DistilBertConfig

    config = DistilBertConfig(vocab_size=len(tokenizer), dim=dim, n_layers=layers, n_heads=heads,
                              hidden_dim=4 * dim, max_position_embeddings=positions, dropout=0.0,
                              attention_dropout=0.0, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    AutoModel.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def demo_assets(root=DEMO_DIR):
    """Build the demo corpus and model once (atomically, so ranks racing here are safe); return their paths."""
    root = Path(root)
    if not (root / "DONE").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
        make_demo_corpus(tmp / "reviews.csv")
        with open(tmp / "reviews.csv") as f:
            texts = [row["text"] for row in csv.DictReader(f)]
        make_demo_lm(tmp / "opt-demo", make_demo_tokenizer(texts))
        make_demo_encoder(tmp / "distilbert-demo", make_demo_wordpiece_tokenizer(texts))
        (tmp / "DONE").touch()
        try:
            tmp.rename(root)
        except OSError:  # another process finished first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return root / "reviews.csv", root / "opt-demo", root / "distilbert-demo"


def demo_defaults():
    """--demo: the generated corpus and the tiny model, with settings that train in about a minute on a CPU."""
    corpus, model, _ = demo_assets()
    return {"dataset": str(corpus), "model": str(model), "text_column": "text", "block_size": 128, "lr": 3e-3,
            "epochs": 2, "prompt": "The pasta was"}


def demo_classification_defaults():
    corpus, _, encoder = demo_assets()
    return {"dataset": str(corpus), "model": str(encoder), "text_column": "text", "label_column": "label",
            "max_length": 128, "lr": 1e-3, "epochs": 3, "batch_size": 32}


# ----------------------------------------------------------------------------------------------------
# Data: load, tokenize, pack, and the order of the batches

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


def token_loss_sum(logits, labels):
    """Summed next-token cross-entropy; the scripts divide by the global batch's predicted-token count, so each
    token weighs the same however the batch is split over micro-steps and ranks."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


@torch.no_grad()
def evaluate(model, blocks, batch_size, pad_id, device, autocast, rank=0, world_size=1):
    """(summed loss, predicted tokens) over this rank's share of the eval set. Every rank runs the same number of
    forward passes (ZeRO-3 gathers parameters collectively); a rank with nothing left runs a fully masked batch."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    per_step = batch_size * world_size
    for start in range(0, len(blocks), per_step):
        mine = torch.arange(start, min(start + per_step, len(blocks)))[rank * batch_size:(rank + 1) * batch_size]
        batch = blocks.batch(mine if len(mine) else [0], pad_id, device)
        if not len(mine):
            batch["labels"].fill_(-100)
        with autocast:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total[0] += token_loss_sum(logits, batch["labels"]).double()
        total[1] += (batch["labels"][:, 1:] != -100).sum()
    model.train()
    return total


def class_labels(train, evaluation, column, name):
    """Class names in a stable order, and both splits with a `labels` column of class ids 0..K-1. String labels
    become ids; a ClassLabel column keeps its names; integer labels keep their order."""
    if column not in train.column_names:
        fail(f"dataset {name} has no column {column!r} (it has {', '.join(train.column_names)}); pass --label-column")
    feature = train.features[column]
    if hasattr(feature, "names"):  # a ClassLabel: already ids, with names
        names = list(feature.names)
    else:
        values = set(train[column]) | set(evaluation[column])
        if None in values:
            fail(f"dataset {name} has rows without a label in column {column!r}; drop or label them")
        names = sorted(values, key=lambda v: (isinstance(v, str), v))
    if len(names) < 2:
        fail(f"dataset {name} has a single class ({names[0]!r}) in column {column!r}: nothing to learn")
    ids = {v: i for i, v in enumerate(names)} if not hasattr(feature, "names") else {i: i for i in range(len(names))}
    to_ids = lambda batch: {"labels": [ids[v] for v in batch]}
    train, evaluation = (split.map(to_ids, input_columns=column, batched=True) for split in (train, evaluation))
    return [str(n) for n in names], train, evaluation


def classification_metrics(predictions, labels, num_classes):
    """Accuracy and macro-averaged F1 (each class's F1, averaged with equal weight), computed here: evaluate.load
    would need the hub."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    f1s = []
    for c in range(num_classes):
        tp = np.sum((predictions == c) & (labels == c))
        fp, fn = np.sum((predictions == c) & (labels != c)), np.sum((predictions != c) & (labels == c))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"accuracy": float(np.mean(predictions == labels)), "f1_macro": float(np.mean(f1s))}


def perplexity(loss):
    return math.exp(loss) if loss < 700 else float("inf")  # exp overflows a float past ~709


# ----------------------------------------------------------------------------------------------------
# Model and optimizer helpers

def load_pretrained(loader, name, **kwargs):
    """loader.from_pretrained(name), with one line saying what to do when it cannot (no weights, unknown id, offline)."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if Path(name).is_dir():
            fail(f"cannot load {name} ({first}); a model folder needs config.json, the weights (model.safetensors) "
                 f"and the tokenizer files, as save_pretrained writes them")
        fail(f"cannot load {name!r}: it is not a local folder, and the hub did not give it ({first}); check the id, "
             f"the network (HF_HUB_OFFLINE), or HF_TOKEN in the environment for a gated model")


def param_groups(model, weight_decay):
    """AdamW groups: no weight decay on biases and normalization weights (one-dimensional parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_precision(precision, device):
    if precision == "auto":  # bf16 where the hardware has it, else fp32 (fp16 only when asked)
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return precision


AMP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_args(args, max_positions):
    for flag in ("lr", "batch_size", "grad_accum", "block_size"):
        if getattr(args, flag) <= 0:
            fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.max_steps <= 0 and args.epochs <= 0:
        fail("set --epochs or --max-steps to a positive number")
    if args.block_size < 2:
        fail("--block-size must be at least 2 (a token and the next one to predict)")
    if max_positions and args.block_size > max_positions:
        fail(f"--block-size {args.block_size} is beyond the model's {max_positions} positions; lower it")


def count_params(model):
    """Parameters that do matrix work (position embeddings are only looked up), counted whole under ZeRO-3 too."""
    return sum(getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if "position" not in n)


def params_held_bytes(model):
    """Bytes of parameters this rank holds; under ZeRO-3 a parameter keeps only its shard (ds_tensor)."""
    return sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size() for p in model.parameters())


def single_process_env():
    """Under a launcher (deepspeed, torchrun, srun) these are set; for a plain `python3` run, make it a world of one
    on this host (DeepSpeed would otherwise look for MPI)."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # a free port, so two such runs do not collide
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def collective_timeout(seconds):
    """A bound on every collective. init_process_group's timeout covers only the world group; DeepSpeed builds its
    ZeRO groups with new_group(), which falls back to torch's module default (30 min on gloo, 10 on NCCL), so a
    stuck rank would hang the others that long. Set that default too, before DeepSpeed makes its groups."""
    import datetime

    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    return timeout


def run_distributed(main):
    """Run main() of a distributed script. When a collective fails because another rank died or stopped answering
    (--dist-timeout), end with one line instead of a traceback; the launcher then stops the other ranks and says which
    one exited. After a successful run, leave without the interpreter's teardown: all outputs are written by then,
    and a native thread of the communication stack occasionally aborts the process there ("terminate called without
    an active exception", exit 250), which a launcher would report as a failed run."""
    try:
        main()
    except RuntimeError as e:
        lost = ("timed out", "Timed out", "Connection closed by peer", "Connection reset by peer", "NCCL error")
        if not any(marker in str(e) for marker in lost):
            raise
        rank = os.environ.get("RANK", "?")
        reason = str(e).strip().splitlines()[0].split("] ")[-1][:120]
        raise SystemExit(f"error: rank {rank}: a collective failed ({reason}): another rank died or stopped "
                         f"answering; see the launcher's log for which, then rerun with --resume")
    remove_shm_buffer()
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def remove_shm_buffer():
    """DeepSpeed's CPU all-reduce (its shm_comm op, used when all ranks share one machine) maps a 66 MB file per rank
    in /dev/shm and, in 0.19.8, never removes it (its shared_close is never called): the files pile up in memory with
    every run on a new port. Each rank removes its own once the run has succeeded: every rank mapped them all at
    start-up, and a mapping outlives the name."""
    env = os.environ.get
    Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env('MASTER_ADDR', '')}_{env('MASTER_PORT', '')}_"
         f"{env('RANK', '')}").unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------
# The DeepSpeed config: "auto" means "from the flags", like the HF Trainer

def deepspeed_config(path, args, world_size, total_steps, warmup_steps, hidden_size):
    """Read the JSON config and fill its "auto" values from the flags. An explicit value that disagrees with a flag
    is an error naming both; --zero-stage and --offload override the file."""
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        fail(f"DeepSpeed config {path} does not exist; pass --deepspeed_config with a JSON file")
    except json.JSONDecodeError as e:
        fail(f"DeepSpeed config {path} is not valid JSON ({e}); fix the file")
    zero = config.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload is not None:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": args.offload}
        if args.offload == "nvme":
            zero["offload_optimizer"]["nvme_path"] = args.nvme_path
        if zero.get("stage") == 3:  # stage 3 can offload the parameters too
            zero["offload_param"] = {**zero["offload_optimizer"]}
        else:
            zero.pop("offload_param", None)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        config.setdefault(key, "auto")  # the loop needs these three to be what the flags say
    has_scheduler = "scheduler" in config
    values = [  # (key in the JSON, value from the flags, flag named in an error)
        ("train_micro_batch_size_per_gpu", args.batch_size, "--batch-size"),
        ("gradient_accumulation_steps", args.grad_accum, "--grad-accum"),
        ("train_batch_size", args.batch_size * args.grad_accum * world_size,
         f"--batch-size x --grad-accum x {world_size} ranks"),
        ("gradient_clipping", args.max_grad_norm, "--max-grad-norm"),
        ("optimizer.params.lr", args.lr, "--lr"),
        ("optimizer.params.betas", list(ADAM_BETAS), "ADAM_BETAS"),
        ("optimizer.params.eps", ADAM_EPS, "ADAM_EPS"),
        ("optimizer.params.weight_decay", args.weight_decay, "--weight-decay"),
        ("scheduler.params.warmup_min_lr", 0.0, "--lr"),
        ("scheduler.params.warmup_max_lr", args.lr, "--lr"),
        ("scheduler.params.warmup_num_steps", warmup_steps, "--warmup-ratio"),
        ("scheduler.params.total_num_steps", total_steps, "--epochs/--max-steps"),
        ("bf16.enabled", args.precision == "bf16", "--precision"),
        ("fp16.enabled", args.precision == "fp16", "--precision"),
        # ZeRO-3 buffer sizes scale with the hidden size (the HF Trainer's rule)
        ("zero_optimization.reduce_bucket_size", hidden_size * hidden_size, None),
        ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size), None),
        ("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size, None),
    ]
    mismatches = []
    for dotted, value, flag in values:
        *parents, key = dotted.split(".")
        node = config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if not isinstance(node, dict) or key not in node:
            continue
        if node[key] == "auto":
            node[key] = value
        elif flag is not None and node[key] != value:
            mismatches.append(f"{dotted}={node[key]} vs {flag} = {value}")
    if mismatches:
        fail(f"{path} disagrees with the flags: {'; '.join(mismatches)}. Set those keys to \"auto\" or change the flags")
    leftover = [k for k, v in _walk(config) if v == "auto"]
    if leftover:
        fail(f"{path}: no flag fills {', '.join(leftover)}; give them values")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError
    try:  # typos here would otherwise surface as a traceback inside deepspeed.initialize
        DeepSpeedZeroConfig(**config["zero_optimization"])
    except ValidationError as e:
        error = e.errors()[0]
        fail(f"{path}: zero_optimization.{'.'.join(map(str, error['loc']))}: {error['msg']}; fix or remove it")
    return config, has_scheduler


def _walk(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _walk(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


# ----------------------------------------------------------------------------------------------------
# Output folder, checkpoints, results

def prepare_output_dir(path, overwrite, resume, rank):
    """Refuse to overwrite a run by accident: a finished one needs --overwrite, an unfinished one --resume."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        fail(f"--output-dir {out} is a file; pass a folder")
    finished, started = (out / "results.json").exists(), (out / "checkpoints").exists()
    if overwrite:
        if rank == 0:
            for name in ("results.json", "loss.png"):
                (out / name).unlink(missing_ok=True)
            for name in ("checkpoints", "final"):
                shutil.rmtree(out / name, ignore_errors=True)
    elif finished:
        fail(f"{out} holds a finished run; pass --overwrite to replace it or choose another --output-dir")
    elif started and not resume:
        fail(f"{out} holds an unfinished run; pass --resume to continue it or --overwrite to start over")
    elif resume and not started:
        fail(f"--resume: {out} has no checkpoints to resume from")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for partial in (out / "checkpoints").glob(".tmp-*"):  # a save that was killed half-way
            shutil.rmtree(partial, ignore_errors=True)
    return out


def latest_checkpoint(out):
    """The tag `checkpoints/latest` points to; it only ever points to a complete checkpoint."""
    root = Path(out) / "checkpoints"
    try:
        tag = (root / "latest").read_text().strip()
    except FileNotFoundError:
        fail(f"--resume: {root} has no complete checkpoint (no 'latest' pointer); start over with --overwrite")
    if not (root / tag).is_dir():
        fail(f"--resume: {root / 'latest'} names {tag}, which is missing; point it at a step-N folder there")
    return tag


def check_resume(folder, args, world_size, zero_stage=None):
    """What the checkpoint was written with (its run.json). The batch order is a function of the step and the global
    batch, so a resume that changes the global batch would train on other data: refuse it; and a change of ZeRO
    stage (each stage lays its files out differently)."""
    try:
        saved = json.loads((Path(folder) / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        fail(f"--resume: {folder} has no readable run.json (written by an older version?); start over with --overwrite")
    want, per_micro_step = saved["global_batch_size"], args.batch_size * world_size
    if args.batch_size * args.grad_accum * world_size != want:
        hint = (f"--grad-accum {want // per_micro_step}" if want % per_micro_step == 0
                else "--batch-size and --grad-accum")
        fail(f"--resume: {folder} trained on global batches of {want} sequences and this run makes "
             f"{args.batch_size} x {args.grad_accum} micro-steps x {world_size} ranks = "
             f"{args.batch_size * args.grad_accum * world_size}; pass {hint} to make {want}, or the steps would see "
             f"other data")
    if zero_stage is not None and saved["zero_stage"] != zero_stage:
        fail(f"--resume: {folder} was written with ZeRO stage {saved['zero_stage']} and this run has stage "
             f"{zero_stage}; resume with --zero-stage {saved['zero_stage']} (another number of ranks is fine)")
    return saved


def check_trainer_resume(folder, world_size, deepspeed):
    """The HF Trainer resumes from its newest checkpoint-N. Under DeepSpeed that holds one optimizer shard per rank,
    which the Trainer loads as it is: another number of ranks would end in DeepSpeed's traceback on every rank."""
    from transformers.trainer_utils import get_last_checkpoint
    last = get_last_checkpoint(str(folder))
    if last is None:
        fail(f"--resume: {folder} holds no checkpoint-N yet (the Trainer saves one at the end of each epoch); start "
             f"over with --overwrite")
    saved = len(list(Path(last).glob("rng_state_*.pth"))) or 1  # the Trainer saves one RNG state per process
    if deepspeed and saved != world_size:
        fail(f"--resume: {last} was written by {saved} ranks and this run has {world_size}; resume with {saved} (the "
             f"Trainer loads DeepSpeed's optimizer shards as they are; zero-optimization.py can change the number)")
    return Path(last)


def universal_checkpoint(folder, rank):
    """DeepSpeed's universal form of a ZeRO checkpoint, for a resume on another number of ranks:
    each parameter's fp32 weights and Adam moments, whole, in <folder>/universal; DeepSpeed cuts them into this
    run's shards as it loads them. Rank 0 converts once (DeepSpeed's ds_to_universal), into a temporary folder that
    it renames when done; the other ranks wait. Returns the folder to load, or `folder` itself when it holds no
    optimizer shards (ZeRO-0 in fp32 saves the whole optimizer state, which loads on any number of ranks)."""
    import torch.distributed as dist
    folder = Path(folder)
    target = folder / "universal"
    if not list(folder.glob("*optim_states.pt")):
        return folder
    if rank == 0 and not target.exists():
        partial = folder / ".tmp-universal"
        shutil.rmtree(partial, ignore_errors=True)
        # our checkpoints carry no Megatron tensor-parallel metadata: --inject_missing_state adds the empty default
        convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                  "--input_folder", str(folder), "--output_folder", str(partial),
                                  "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                                 capture_output=True, text=True)
        if convert.returncode != 0:
            last = (convert.stderr.strip() or convert.stdout.strip() or "no output").splitlines()[-1]
            fail(f"--resume: DeepSpeed could not convert {folder} to a universal checkpoint ({last}); resume with "
                 f"the number of ranks that wrote it")
        partial.rename(target)
    dist.barrier()  # the other ranks load what rank 0 converted
    return target


def restore_rng(folder, rank, seed, step):
    """Each rank's random state (dropout) as saved; a rank the checkpoint did not have starts a fresh stream."""
    path = Path(folder) / f"rng-{rank}.pt"
    if path.exists():
        set_rng_state(torch.load(path, weights_only=False))
    else:
        torch.manual_seed(seed + 1_000_003 * step + rank)


def publish_checkpoint(root, tag, keep):
    """Once every rank has finished writing `.tmp-<tag>`: rename it to <tag>, then point `latest` at it (an atomic
    replace), then delete all but the newest `keep` (0 keeps all). A kill at any moment leaves `latest` naming a
    complete checkpoint."""
    root = Path(root)
    if (root / tag).exists():
        shutil.rmtree(root / tag)
    (root / f".tmp-{tag}").rename(root / tag)
    (root / ".latest.tmp").write_text(tag)
    os.replace(root / ".latest.tmp", root / "latest")
    steps = sorted((d for d in root.glob("step-*") if d.is_dir()), key=lambda d: int(d.name.split("-")[1]))
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def check_finite(losses, first_step):
    """Stop at a NaN or inf loss, naming its step (checked before any checkpoint is written, so none holds it)."""
    for step, loss in enumerate(losses, first_step):
        if not math.isfinite(loss):
            fail(f"the loss is {loss} at step {step}: training diverged (lower --lr, use bf16 rather than fp16) "
                 f"or the model or data hold NaN/inf; the checkpoints are all from before step {step}")


def rng_state():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident memory of this process


def write_json(path, data):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def plot_losses(losses, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set(xlabel="optimizer step", ylabel="training loss", title="loss per step (mean over the global batch)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Throughput: FLOPs per token and the device's peak

PEAK_BF16_TFLOPS = {  # dense, no sparsity, from the vendors' data sheets
    "H200": 989, "H100 SXM": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "GH200": 989,
    "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "A10G": 70, "A10": 125, "L4": 121,
    "RTX 4090": 165, "RTX 3090": 71, "V100": 125,  # V100: fp16 (it has no bf16)
}


def peak_tflops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def flops_per_token(config, seq_len, num_params):
    """6N + 12·L·H·Q·T (the PaLM appendix, as in nanoGPT and torchtitan): N parameters in matmuls, L layers, H heads,
    Q head size, T sequence length; the second term is attention's score and value products, forward and back."""
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 6 * num_params + 12 * layers * hidden * seq_len


def compare_runs(a, b, first=5):
    """Print how two runs' losses agree (make demo: single-gpu.py vs zero-optimization.py on the same batches)."""
    ra, rb = (json.loads((Path(d) / "results.json").read_text()) for d in (a, b))
    la, lb = np.array(ra["losses"]), np.array(rb["losses"])
    n = min(len(la), len(lb))
    rel = np.abs(la[:n] - lb[:n]) / np.abs(la[:n])
    for d, r, losses in ((a, ra, la), (b, rb, lb)):
        print(f"{d}: {r['world_size']} rank(s), final loss {losses[-1]:.4f}, eval loss {r['eval_loss']:.4f}, "
              f"{r['tokens_per_sec']:,.0f} tok/s")
    print(f"same global batches: step losses agree to {rel[:first].max():.1e} (relative) over the first {first} "
          f"steps, {rel.max():.1e} at most over all {n}: fp32 rounding differences (another reduction order) grow "
          f"under Adam at the demo's high learning rate; the tests hold ZeRO 0-3 to 1e-5 at a lower one")
