"""The command line, parsed once into small frozen pieces: what each module takes is in its signature.

Both scripts add the same flags (data, model, train, run: defined here once) and zero-optimization.py adds its own
(Zero). `parse` lays --demo's defaults and a --config FILE (JSON or YAML: a recipe kept beside the fork, or a run's
run.json) under the flags given on the command line and returns a Config whose .data, .model, .train, .run (and
.zero) are frozen dataclasses; `check` says in one line what cannot run. What setup resolves later (the precision,
the learning rate, --resume auto) comes back as a new Config (`Config.resolved`): nothing is written into a parsed
one (docs/config.md).
"""
import argparse
import dataclasses
import json
import os
from pathlib import Path

from . import quantization, tracking
from .base import fail


@dataclasses.dataclass(frozen=True)
class Data:
    dataset: str
    dataset_config: str | None
    text_column: str | None
    prompt_column: str | None
    completion_column: str | None
    messages_column: str | None
    train_on_prompt: bool
    block_size: int
    packing: str
    max_train_samples: int
    eval_dataset: str | None
    eval_fraction: float
    max_eval_samples: int
    num_proc: int
    seed: int  # draws the held-out rows (--eval-fraction, --max-eval-samples)


@dataclasses.dataclass(frozen=True)
class Model:
    model: str
    trust_remote_code: bool
    precision: str  # auto until setup resolves it (hardware.choose_precision)
    gradient_checkpointing: bool
    compile: bool
    attention: str  # auto: hardware.attention's choice
    loss_chunk: int
    lora_rank: int
    lora_alpha: float
    lora_targets: str
    load_in_4bit: bool
    load_in_8bit: bool

    @property
    def bits(self):
        """The frozen base's bits (--load-in-4bit, --load-in-8bit), or None."""
        return quantization.bits(self)


@dataclasses.dataclass(frozen=True)
class Train:
    batch_size: int
    grad_accum: int
    lr: float | None  # None until setup resolves it from the data (preference.learning_rate)
    beta: float
    preference_loss: str
    label_smoothing: float
    simpo_gamma: float
    sft_weight: float
    weight_decay: float
    warmup_ratio: float
    max_grad_norm: float
    epochs: float
    max_steps: int
    seed: int

    @property
    def pair_loss(self):
        """How preference pairs are scored: loss.PairLoss from --preference-loss and its settings."""
        from .loss import PairLoss
        return PairLoss(self.preference_loss, self.beta, self.label_smoothing, self.simpo_gamma, self.sft_weight)


@dataclasses.dataclass(frozen=True)
class Run:
    output_dir: str
    log_every: int
    eval_every: int
    save_every: int
    keep_checkpoints: int
    final: str
    report_to: tuple
    resume: str | None  # newest or None once checked (auto: newest where a checkpoint is)
    overwrite: bool
    prompt: str
    verbose: bool
    demo: bool
    config: str | None


@dataclasses.dataclass(frozen=True)
class Zero:
    deepspeed: str
    zero_stage: int | None
    offload: str | None
    nvme_path: str
    dist_timeout: int
    sequence_parallel: int


@dataclasses.dataclass(frozen=True)
class Config:
    data: Data
    model: Model
    train: Train
    run: Run
    zero: Zero | None = None  # zero-optimization.py's

    def pieces(self):
        return [piece for piece in (self.data, self.model, self.train, self.run, self.zero) if piece is not None]

    def resolved(self, **values):
        """A copy with each value in every piece that has a field of its name (--seed is the data's and the
        training's)."""
        changes = {}
        for field in dataclasses.fields(self):
            piece = getattr(self, field.name)
            mine = {k: v for k, v in values.items() if piece is not None and k in _names(piece)}
            if mine:
                changes[field.name] = dataclasses.replace(piece, **mine)
        missing = set(values) - {k for piece in changes.values() for k in _names(piece)}
        assert not missing, f"no piece has {sorted(missing)}"
        return dataclasses.replace(self, **changes)

    def flat(self):
        """{flag's name: value} over every piece: run.json's "args", the trackers' configuration, --config's input."""
        return {k: list(v) if isinstance(v, tuple) else v for p in self.pieces() for k, v in vars(p).items()}

    @property
    def sequence_parallel(self):
        """Ranks a sequence is split over (zero-optimization.py's --sequence-parallel; 1 in single-gpu.py)."""
        return self.zero.sequence_parallel if self.zero else 1


def _names(piece):
    return {f.name for f in dataclasses.fields(piece)}


def add_flags(p, output_dir):
    """The flags both scripts take, one group per piece (`--help` shows them grouped)."""
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="yelp_review_full", help="hub name or local .csv/.json/.jsonl/.txt/.parquet")
    g.add_argument("--dataset-config", help="the hub dataset's subset, if it has several")
    g.add_argument("--text-column", help="plain text, the loss on every token (default: a column named text)")
    g.add_argument("--prompt-column", help="the loss on the completion only (default: columns prompt, completion)")
    g.add_argument("--completion-column")
    g.add_argument("--messages-column", help="chats, the loss on the assistant's turns only (default: messages)")
    g.add_argument("--train-on-prompt", action="store_true", help="the loss on prompts and user turns too")
    g.add_argument("--block-size", type=int, default=512, help="tokens per training sequence")
    g.add_argument("--packing", default="isolated", choices=["isolated", "stream", "none"],
                   help="isolated: whole documents per block, each attending to itself; stream: cut a stream")
    g.add_argument("--max-train-samples", type=int, default=0, help="train on the first N rows only (0: all)")
    g.add_argument("--eval-dataset", help="a file as --dataset takes, or hub name[:split] (default: the dataset's "
                                          "validation or test split, else --eval-fraction of its rows)")
    g.add_argument("--eval-fraction", type=float, default=0.05, help="share of the rows held out to evaluate on")
    g.add_argument("--max-eval-samples", type=int, default=1000, help="evaluate on N rows drawn once (0: all)")
    g.add_argument("--num-proc", type=int, default=0, help="processes that tokenize (0: the cores)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="facebook/opt-125m", help="hub id or local folder of a causal LM")
    g.add_argument("--trust-remote-code", action="store_true", help="allow a model that ships its own code")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16", "fp16"],
                   help="auto: bf16 from Ampere on, fp16 on older GPUs, fp32 on CPUs")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations: less memory, slower")
    g.add_argument("--compile", action="store_true", help="torch.compile: faster steps after a slow first one")
    g.add_argument("--attention", default="auto", choices=["auto", *ATTENTION],
                   help="auto: FlashAttention's varlen kernel on Ampere+ GPUs in 16 bits (flash-attn's, else torch's "
                        "where the model fits it), else SDPA (docs/gpu.md)")
    g.add_argument("--loss-chunk", type=int, default=1024,
                   help="tokens per piece of the loss, so the logits of all tokens never exist at once (0: at once)")
    g.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    g.add_argument("--lora-alpha", type=float, default=32, help="the adapters' scale is alpha / rank")
    g.add_argument("--lora-targets", default="all-linear", help="comma-separated module names (default: every "
                                                                "linear layer of attention and MLP)")
    g.add_argument("--load-in-4bit", action="store_true", help="QLoRA: the frozen base in 4 bits (NF4), adapters in 32")
    g.add_argument("--load-in-8bit", action="store_true", help="the frozen base of LoRA in 8 bits (LLM.int8)")
    g = p.add_argument_group("train")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per device per micro-step")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=float, help="peak learning rate (default 5e-5; preference pairs 1e-6, with LoRA 5e-6)")
    g.add_argument("--beta", type=float, default=0.1, help="preference pairs (DPO): how far from the reference the "
                                                           "model may move (lower: further)")
    g.add_argument("--preference-loss", default="sigmoid", choices=PAIR_LOSSES,
                   help="preference pairs: sigmoid (DPO), robust (DPO for noisy labels), ipo, simpo, orpo (these two: "
                        "no reference model) (docs/preference.md)")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="robust: the share of pairs taken as flipped")
    g.add_argument("--simpo-gamma", type=float, default=0.5, help="simpo: the margin between the answers' rewards")
    g.add_argument("--sft-weight", type=float, default=0.0,
                   help="preference pairs: add the chosen answer's negative log-likelihood this many times")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--warmup-ratio", type=float, default=0.05, help="share of the steps spent warming up the LR")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradients' norm to this (0: no clipping)")
    g.add_argument("--epochs", type=float, default=1)
    g.add_argument("--max-steps", type=int, default=0, help="optimizer steps; overrides --epochs when > 0")
    g.add_argument("--seed", type=int, default=42)
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default=output_dir)
    g.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    g.add_argument("--eval-every", type=int, default=500, help="optimizer steps between evals (0: at the end only)")
    g.add_argument("--save-every", type=int, default=500, help="optimizer steps between checkpoints (0: none)")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept (0: all), and the best")
    g.add_argument("--final", default="last", choices=["last", "best"],
                   help="what final/ holds: the model after the last step, or the checkpoint with the lowest eval loss")
    g.add_argument("--report-to", nargs="+", default=["none"], choices=tracking.TRACKERS,
                   help="trackers that get the losses, LR, throughput, evals (under <output-dir>; W&B: optional)")
    g.add_argument("--resume", nargs="?", const="newest", choices=["newest", "auto"],
                   help="continue from the newest checkpoint in --output-dir (auto: if there is one, else start)")
    g.add_argument("--overwrite", action="store_true", help="replace a run already in --output-dir")
    g.add_argument("--prompt", default="The food was", help="what the trained model answers at the end ('' skips)")
    g.add_argument("--verbose", action="store_true", help="the libraries' warnings and logs too")
    g.add_argument("--demo", action="store_true", help="tiny model + generated questions about reviews (CPU ok)")
    g.add_argument("--config", metavar="FILE", help="flags' values from a JSON or YAML file, a run's run.json too "
                                                    "(flags given on the command line win)")


ATTENTION = ("sdpa", "eager", "flash_attention_2", "torch_varlen")  # --attention's choices beside auto
PAIR_LOSSES = ("sigmoid", "robust", "ipo", "simpo", "orpo")  # --preference-loss, TRL's names (loss.PairLoss)
RUN_CONTROL = ("resume", "overwrite", "config", "demo")  # how a run was started, not its recipe: --config skips them


def parse(p, argv=None):
    """The Config of a command line: the flags' defaults, under --demo's, under --config FILE's, under the flags
    given (the same layering the HF Trainer's users know from a JSON of TrainingArguments)."""
    args = p.parse_args(argv)
    recipe = read_recipe(args.config, p) if args.config else {}
    if args.demo or recipe.get("demo"):
        from . import demo  # builds the demo's files on first use

        p.set_defaults(**demo.defaults())
    if args.demo or recipe:
        p.set_defaults(**recipe)
        args = p.parse_args(argv)
    return build(args)


def read_recipe(path, p):
    """--config FILE's values by flag name: a JSON or YAML mapping, or run.json (its "args"); one line for what is
    not a flag of this script or not a value it takes."""
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
    other_script = {f.name for f in dataclasses.fields(Zero)} - set(actions)  # a ZeRO run's recipe in single-gpu.py
    unknown = sorted(set(values) - set(actions) - other_script - {"help"})
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
    """The pieces from argparse's values: each dataclass takes the flags named as its fields."""
    given = vars(args)
    take = lambda cls: cls(**{f.name: _frozen(given[f.name]) for f in dataclasses.fields(cls)})
    return Config(take(Data), take(Model), take(Train), take(Run), take(Zero) if "deepspeed" in given else None)


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def defaults(output_dir="out/single-gpu", **values):
    """single-gpu.py's Config with no flag given, then `values` in their pieces (tests, notebooks)."""
    p = argparse.ArgumentParser()
    add_flags(p, output_dir)
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
    if run.resume == "auto":  # one command line for the first submission and every requeue (--overwrite: start over)
        has = not run.overwrite and (Path(run.output_dir) / "checkpoints" / "latest").exists()
        return config.resolved(resume="newest" if has else None)
    return config
