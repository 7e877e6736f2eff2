"""The command line, written once: each flag is a field of the frozen piece it fills (Data, Model, Train, Run, Zero),
with its default, choices and help, and every script builds its parser from the pieces it takes (add_flags), as
HfArgumentParser builds one from dataclasses. What each module takes is in its signature: the piece, not the command
line.

`parse` lays --demo's defaults and a --config FILE (JSON or YAML: a recipe kept beside the fork, or a run's run.json)
under the flags given on the command line and returns a Config whose .data, .model, .train, .run (and .zero) are the
pieces; `check` says in one line what cannot run. What setup resolves later (the precision, the learning rate,
--resume auto) comes back as a new Config (`Config.resolved`): nothing is written into a parsed one
(docs/config.md).
"""
import argparse
import dataclasses
import json
import math
import os
import types
from pathlib import Path

from . import quantization, tracking
from .base import ROOT, fail

ATTENTION = ("sdpa", "eager", "flash_attention_2", "torch_varlen")  # --attention's choices beside auto
PAIR_LOSSES = ("sigmoid", "robust", "ipo", "simpo", "orpo", "kto")  # --preference-loss, TRL's (preference.PairLoss)
# how a run was started and on which machine, not its recipe: --config skips them
RUN_CONTROL = ("resume", "overwrite", "config", "demo", "cache_dir")
ZERO3_CONFIG = str(ROOT / "ds_config_zero3.json")


def flag(default, help=None, **argparse):
    """A field that is a flag: its default, its help, and what else argparse takes (choices, nargs, const, metavar;
    `aliases`: other spellings; `hidden`: not in --help)."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse})


class Piece:
    @classmethod
    def taking(cls, *names):
        """Only these of the piece's flags (a script that takes a few: sequence_classification.py); the others keep
        their defaults in the piece."""
        return cls, names


@dataclasses.dataclass(frozen=True)
class Data(Piece):
    dataset: str = flag("yelp_review_full", "hub name or local .csv/.json/.jsonl/.txt/.parquet")
    dataset_config: str | None = flag(None, "the hub dataset's subset, if it has several")
    text_column: str | None = flag(None, "plain text, the loss on every token (default: a column named text)")
    prompt_column: str | None = flag(None, "the loss on the completion only (default: columns prompt, completion)")
    completion_column: str | None = flag(None)
    messages_column: str | None = flag(None, "chats, the loss on the assistant's turns only (default: messages)")
    train_on_prompt: bool = flag(False, "the loss on prompts and user turns too")
    block_size: int = flag(512, "tokens per training sequence (of a preference pair: each, as TRL's max_length)")
    packing: str = flag("isolated", "isolated: whole documents per block, each attending to itself; stream: cut a "
                        "stream", choices=["isolated", "stream", "none"])
    max_train_samples: int = flag(0, "train on the first N rows only (0: all)")
    eval_dataset: str | None = flag(None, "a file as --dataset takes, or hub name[:split] (default: the dataset's "
                                    "validation or test split, else --eval-fraction of its rows)")
    eval_fraction: float = flag(0.05, "share of the rows held out to evaluate on")
    max_eval_samples: int = flag(1000, "evaluate on N rows drawn once (0: all)")
    num_proc: int = flag(0, "processes that tokenize (0: the cores)")
    cache_dir: str | None = flag(None, "where the prepared data is kept (default: $DATA_CACHE, else "
                                 "~/.cache/zero-template/data)")

    def __post_init__(self):  # the default's environment, read once, as the piece is made
        if self.cache_dir is None:
            default = os.environ.get("DATA_CACHE") or str(Path.home() / ".cache" / "zero-template" / "data")
            object.__setattr__(self, "cache_dir", default)


@dataclasses.dataclass(frozen=True)
class Model(Piece):
    model: str = flag("facebook/opt-125m", "hub id or local folder of a causal LM")
    trust_remote_code: bool = flag(False, "allow a model that ships its own code")
    precision: str = flag("auto", "auto: bf16 from Ampere on, fp16 on older GPUs, fp32 on CPUs",  # resolved in setup
                          choices=["auto", "fp32", "tf32", "bf16", "fp16"])
    gradient_checkpointing: bool = flag(False, "recompute activations: less memory, slower")
    offload_activations: bool = flag(False, "gradient checkpointing with the layers' inputs in host memory "
                                     "(long sequences; docs/long-context.md)")
    tiled_mlp: bool = flag(False, "the MLP over tiles of the tokens, recomputed in the backward (long sequences)")
    compile: bool = flag(False, "torch.compile: faster steps after a slow first one")
    attention: str = flag("auto", "auto: FlashAttention's varlen kernel on Ampere+ GPUs in 16 bits (flash-attn's, "
                          "else torch's where the model fits it), else SDPA (docs/gpu.md)",
                          choices=["auto", *ATTENTION])
    loss_chunk: int = flag(1024, "tokens per piece of the loss, so the logits of all tokens never exist at once (0: at "
                           "once)")
    lora_rank: int = flag(0, "train LoRA adapters of this rank (0: every weight)")
    lora_alpha: float = flag(32, "the adapters' scale is alpha / rank")
    lora_targets: str = flag("all-linear", "comma-separated module names (default: every linear layer of attention "
                             "and MLP)")
    load_in_4bit: bool = flag(False, "QLoRA: the frozen base in 4 bits (NF4), adapters in 32")
    load_in_8bit: bool = flag(False, "the frozen base of LoRA in 8 bits (LLM.int8)")

    @property
    def bits(self):
        """The frozen base's bits (--load-in-4bit, --load-in-8bit), or None."""
        return quantization.bits(self)


@dataclasses.dataclass(frozen=True)
class Train(Piece):
    batch_size: int = flag(8, "sequences per device per micro-step")
    grad_accum: int = flag(1, "micro-steps per optimizer step")
    lr: float | None = flag(None, "peak learning rate (default 5e-5; preference pairs 1e-6, with LoRA 5e-6)")
    beta: float = flag(0.1, "preference pairs (DPO): how far from the reference the model may move (lower: further)")
    preference_loss: str = flag("sigmoid", "preference pairs: sigmoid (DPO), robust (DPO for noisy labels), ipo, "
                                "simpo, orpo (these two: no reference model); kto, which unpaired rows (prompt, "
                                "completion, label) take (docs/preference.md)", choices=list(PAIR_LOSSES))
    label_smoothing: float = flag(0.0, "robust: the share of pairs taken as flipped")
    simpo_gamma: float = flag(0.5, "simpo: the margin between the answers' rewards")
    sft_weight: float = flag(0.0, "preference pairs: add the chosen answer's negative log-likelihood this many times")
    desirable_weight: float = flag(1.0, "kto: the weight of a desirable completion's loss (TRL's)")
    undesirable_weight: float = flag(1.0, "kto: the weight of an undesirable completion's loss; with fewer of one "
                                     "kind, weigh them so that the two kinds' weighted counts are within 1 to 4/3")
    weight_decay: float = flag(0.0)
    warmup_ratio: float = flag(0.05, "share of the steps spent warming up the LR")
    max_grad_norm: float = flag(1.0, "clip the gradients' norm to this (0: no clipping)")
    epochs: float = flag(1.0)
    max_steps: int = flag(0, "optimizer steps; overrides --epochs when > 0")
    seed: int = flag(42, "the held-out rows' draw, the batches' order, new weights")


@dataclasses.dataclass(frozen=True)
class Run(Piece):
    output_dir: str = flag("out/run")
    log_every: int = flag(10, "optimizer steps between log lines")
    eval_every: int = flag(500, "optimizer steps between evals (0: at the end only)")
    save_every: int = flag(500, "optimizer steps between checkpoints (0: none)")
    keep_checkpoints: int = flag(3, "newest checkpoints kept (0: all), and the best")
    final: str = flag("last", "what final/ holds: the model after the last step, or the checkpoint with the lowest "
                      "eval loss", choices=["last", "best"])
    report_to: tuple = flag(("none",), "trackers that get the losses, LR, throughput, evals (under <output-dir>; "
                            "W&B: optional)", choices=list(tracking.TRACKERS))
    resume: str | None = flag(None, "continue from the newest checkpoint in --output-dir (auto: if there is one, "
                              "else start)", nargs="?", const="newest", choices=["newest", "auto"])
    overwrite: bool = flag(False, "replace a run already in --output-dir")
    prompt: str = flag("The food was", "what the trained model answers at the end ('' skips)")
    verbose: bool = flag(False, "the libraries' warnings and logs too")
    demo: bool = flag(False, "tiny model + generated data, made on first use (CPU ok)")
    config: str | None = flag(None, "flags' values from a JSON or YAML file, a run's run.json too (flags given on "
                              "the command line win)", metavar="FILE")


@dataclasses.dataclass(frozen=True)
class Zero(Piece):
    deepspeed: str | None = flag(ZERO3_CONFIG, "DeepSpeed JSON (alone: ZeRO-3's)", aliases=["--deepspeed_config"],
                                 nargs="?", const=ZERO3_CONFIG, metavar="CONFIG")
    zero_stage: int | None = flag(None, "override the config's ZeRO stage", choices=[0, 1, 2, 3])
    offload: str | None = flag(None, "optimizer (and, stage 3, parameter) offload", choices=["none", "cpu", "nvme"])
    nvme_path: str = flag("/local_nvme", "folder on a fast local disk for --offload nvme")
    dist_timeout: int = flag(1800, "seconds a collective waits (a save, a lost rank)")
    sequence_parallel: int = flag(1, "split each sequence over N ranks: longer blocks")
    mends: str = flag("all", "DeepSpeed's defects and slow paths mended: all, the fixes only, or none "
                      "(docs/deepspeed-upstream.md)", choices=["all", "fixes", "none"])


@dataclasses.dataclass(frozen=True)
class Classifier(Piece):
    label_column: str = flag("label", "the class of each text: integers or strings (strings become class ids)")
    max_length: int = flag(512, "tokens per text; longer texts are cut (a reward model's pairs: left out, as TRL does)")
    center_rewards_coefficient: float = flag(0.0, "reward models: add this times the mean squared sum of a pair's "
                                             "rewards (TRL's; 0.01 recommended), so rewards center on 0")
    pair_layout: str = flag("one-row", "reward models on a decoder: one-row: a pair in one row, the tokens its texts "
                            "share (the prompt) computed once; apart: each text padded in a row of its own, as TRL "
                            "(an encoder's are always apart)", choices=["one-row", "apart"])


CAUSAL = (Data, Model, Train, Run)  # what single-gpu.py takes (zero-optimization.py: and Zero)
PIECES = {"data": Data, "model": Model, "train": Train, "run": Run, "zero": Zero, "classifier": Classifier}


@dataclasses.dataclass(frozen=True)
class Config:
    data: Data
    model: Model
    train: Train
    run: Run
    zero: Zero | None = None  # a script's that runs DeepSpeed
    classifier: Classifier | None = None  # sequence_classification.py's
    taken: frozenset = frozenset()  # the flags this script takes (run.json's "args")

    def pieces(self):
        return [getattr(self, name) for name in PIECES if getattr(self, name) is not None]

    def resolved(self, **values):
        """A copy with each value in the piece that has a field of its name."""
        changes = {}
        for field in PIECES:
            piece = getattr(self, field)
            mine = {k: v for k, v in values.items() if piece is not None and k in _names(piece)}
            if mine:
                changes[field] = dataclasses.replace(piece, **mine)
        missing = set(values) - {k for piece in changes.values() for k in _names(piece)}
        assert not missing, f"no piece has {sorted(missing)}"
        return dataclasses.replace(self, **changes)

    def flat(self):
        """{flag's name: value} of the flags this script takes: run.json's "args", the trackers' configuration,
        --config's input."""
        return {k: list(v) if isinstance(v, tuple) else v for p in self.pieces() for k, v in vars(p).items()
                if k in self.taken}

    @property
    def micro_tokens(self):
        """The most tokens a micro-batch holds on a rank (its share of each sequence under --sequence-parallel):
        --tiled-mlp cuts them into the same tiles on every rank, --offload-activations sizes its buffers for them."""
        return self.train.batch_size * math.ceil(self.data.block_size / self.sequence_parallel)

    @property
    def sequence_parallel(self):
        """Ranks a sequence is split over (zero-optimization.py's --sequence-parallel; 1 in single-gpu.py)."""
        return self.zero.sequence_parallel if self.zero else 1


def _names(piece):
    return {f.name for f in dataclasses.fields(piece)}


def add_flags(p, *pieces, **defaults):
    """Each piece's fields as flags, a group a piece (`--help` shows them grouped): `--name-with-hyphens`, its type
    from the field's, its default, choices and help from the field. A piece is a class (all its flags) or
    Class.taking(names); `defaults`: this script's own (output_dir, ...)."""
    for piece in pieces:
        cls, names = piece if isinstance(piece, tuple) else (piece, None)
        group = p.add_argument_group(cls.__name__.lower())
        for field in dataclasses.fields(cls):
            if names is None or field.name in names:
                add_flag(group, field)
    if any((piece if isinstance(piece, type) else piece[0]) is Zero for piece in pieces):
        p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    p.set_defaults(**defaults)


def add_flag(group, field):
    meta = dict(field.metadata)
    names = [f"--{field.name.replace('_', '-')}", *meta.pop("aliases", [])]
    kinds = [k for k in getattr(field.type, "__args__", [field.type]) if k is not type(None)]
    kind = kinds[0] if isinstance(field.type, types.UnionType) else field.type
    if kind is bool:
        group.add_argument(*names, action="store_true", help=meta["help"])
    elif kind is tuple:
        group.add_argument(*names, nargs="+", default=list(field.default), **meta)
    else:
        group.add_argument(*names, type=kind, default=field.default, **meta)


def parse(p, argv=None, demo_defaults=None):
    """The Config of a command line: the flags' defaults, under --demo's, under --config FILE's, under the flags
    given (the same layering the HF Trainer's users know from a JSON of TrainingArguments). `demo_defaults`: --demo's
    values (default: the causal LM demo's)."""
    args = p.parse_args(argv)
    recipe = read_recipe(args.config, p) if args.config else {}
    if args.demo or recipe.get("demo"):
        from .internals import demo  # builds the demo's files on first use

        p.set_defaults(**(demo_defaults or demo.defaults)())
    if args.demo or recipe:
        p.set_defaults(**recipe)
        args = p.parse_args(argv)
    return build(args)


def read_recipe(path, p):
    """--config FILE's values by flag name: a JSON or YAML mapping, or run.json (its "args"); one line for what is
    no flag of this project or not a value it takes. Another script's flags are left to it (a ZeRO run's recipe in
    single-gpu.py)."""
    path = Path(path)
    try:
        text = path.read_text()
        values = json.loads(text) if path.suffix == ".json" else _yaml(text)
    except (OSError, ValueError) as e:
        fail(f"--config {path}: {str(e).splitlines()[0]}")
    if isinstance(values, dict) and isinstance(values.get("args"), dict):  # a run's run.json
        values = {k: v for k, v in values["args"].items() if k not in RUN_CONTROL}
    if not isinstance(values, dict):
        fail(f"--config {path}: it holds no mapping of flag names to values")
    actions = {a.dest: a for a in p._actions}
    values = {k.replace("-", "_").lstrip("_"): v for k, v in values.items()}
    project = {f.name for cls in PIECES.values() for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(actions) - project - {"help"})
    if unknown:
        fail(f"--config {path}: {', '.join(unknown)} {'is not a flag' if len(unknown) == 1 else 'are not flags'} of "
             f"this script (see --help)")
    for name, value in values.items():
        allowed = actions[name].choices if name in actions else None
        if allowed and value is not None and not set(value if isinstance(value, list) else [value]) <= set(allowed):
            fail(f"--config {path}: {name} {value!r} is not one of {', '.join(map(str, allowed))}")
    return {k: v for k, v in values.items() if k in actions}


def _yaml(text):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not YAML: {e}") from None


def build(args):
    """The pieces from argparse's values: each takes the flags named as its fields (those a script does not take
    keep their defaults); Zero and Classifier only where the script takes any of their flags."""
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    pieces = {}
    for name, cls in PIECES.items():
        names = {f.name for f in dataclasses.fields(cls)}
        if cls in CAUSAL or names & set(given):
            pieces[name] = cls(**{k: given[k] for k in names & set(given)})
    fields = {f.name for cls in PIECES.values() for f in dataclasses.fields(cls)}
    return Config(**pieces, taken=frozenset(given) & fields)


def defaults(**values):
    """single-gpu.py's Config with no flag given, then `values` in their pieces (tests, notebooks)."""
    p = argparse.ArgumentParser()
    add_flags(p, *CAUSAL, output_dir="out/single-gpu")
    return build(p.parse_args([])).resolved(**values)


def check(config, max_positions):
    """One line for a value that cannot run; the Config with --resume auto resolved (newest where a checkpoint is)."""
    data, model, train, run = config.data, config.model, config.train, config.run
    for name, piece in (("lr", train), ("batch_size", train), ("grad_accum", train), ("block_size", data),
                        ("log_every", run)):
        if getattr(piece, name) is not None and getattr(piece, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(piece, name)}")
    for name, piece in (("save_every", run), ("keep_checkpoints", run), ("max_train_samples", data),
                        ("num_proc", data), ("loss_chunk", model), ("lora_rank", model), ("eval_every", run),
                        ("max_eval_samples", data)):
        if getattr(piece, name) < 0:
            fail(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(piece, name)}")
    if not 0 <= train.label_smoothing < 0.5:
        fail(f"--label-smoothing is the share of pairs taken as flipped: from 0 to below 0.5, got "
             f"{train.label_smoothing}")
    if train.sft_weight < 0 or train.beta <= 0:
        fail(f"--sft-weight must be 0 or more and --beta positive, got {train.sft_weight} and {train.beta}")
    if train.desirable_weight <= 0 or train.undesirable_weight <= 0:
        fail(f"--desirable-weight and --undesirable-weight must be positive, got {train.desirable_weight} and "
             f"{train.undesirable_weight}")
    if train.max_steps <= 0 and train.epochs <= 0:
        fail("set --epochs or --max-steps to a positive number")
    if not 0 < data.eval_fraction < 1:
        fail(f"--eval-fraction must be between 0 and 1, got {data.eval_fraction}")
    if "wandb" in run.report_to:  # rank 0 alone writes to W&B, and says what is missing
        tracking.check_wandb(os.environ, say=os.environ.get("RANK", "0") == "0")
    if run.final == "best" and not run.save_every:
        fail("--final best exports the checkpoint with the lowest eval loss: set --save-every (a multiple of "
             "--eval-every) so that there are checkpoints to choose from")
    quantization.check(model)
    if data.block_size < 2:
        fail("--block-size must be at least 2 (a token and the next one to predict)")
    if max_positions and data.block_size > max_positions:
        fail(f"--block-size {data.block_size} is beyond the model's {max_positions} positions; lower it")
    return resolve_resume(config)


def resolve_resume(config):
    """--resume auto: newest where a checkpoint is, else a fresh start (one command line for the first submission and
    every requeue; --overwrite: start over)."""
    run = config.run
    if run.resume == "auto":
        has = not run.overwrite and (Path(run.output_dir) / "checkpoints" / "latest").exists()
        return config.resolved(resume="newest" if has else None)
    return config
