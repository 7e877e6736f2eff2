"""The benchmark's peers: what a user would run instead of this template, written here (not copied), both the Hugging
Face Trainer with DeepSpeed on the same model, data and number of sequences per step:

  --recipe run_clm   transformers' run_clm recipe: texts tokenized, concatenated and cut into blocks of
                     --block-size tokens (group_texts), every token a label, the model's own loss
  --recipe seeds     this project's seeds: every text padded to --block-size, the loss on the real tokens

    deepspeed --num_gpus 2 bench/peers.py --recipe run_clm --model M --dataset D --block-size 256 --steps 40 ...

Writes <output-dir>/results.json: useful (non-padding) tokens and seconds after the warm-up steps, and rank 0's peak
memory (on CPU, its peak resident memory).
"""

import argparse
import json
import os
import sys
import time
from itertools import chain
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from finetune import base, data, distributed, hardware, progress, zero_config  # noqa: E402

# ZeRO-2 as transformers' DeepSpeed integration documents it (docs: "ZeRO-2 example"), "auto" filled by the Trainer
HF_ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto",
            "torch_adam": "auto",
            "fused": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}


class Profile(TrainerCallback):
    """TRAIN_PROFILE=folder: the same profile as progress.Profiler's, of the Trainer's steps."""

    def __init__(self):
        rank = int(os.environ.get("RANK", "0"))
        self.profiler = progress.Profiler(os.environ.get("TRAIN_PROFILE"), rank)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        config = getattr(model, "config", None)  # (its vocabulary marks the head's and the loss's kernels)
        self.profiler.vocabulary = getattr(hardware.text_config(config), "vocab_size", None) if config else None

    def on_step_end(self, args, state, control, **kwargs):
        self.profiler.step_done(state.global_step)


class TrainingTime(TrainerCallback):
    """Seconds from the end of step `warmup` to the end of training (the steady state, as bench/run.py times ours)."""

    def __init__(self, warmup):
        self.warmup, self.start = warmup, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def rows(recipe, texts, tokenizer, block):
    if recipe == "run_clm":  # group_texts: one stream, cut every `block` tokens, the rest dropped
        ids = list(chain.from_iterable(tokenizer(texts)["input_ids"]))
        return [
            {"input_ids": ids[i : i + block], "labels": ids[i : i + block]}
            for i in range(0, len(ids) - block + 1, block)
        ]
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=block)  # the seeds' way
    return [
        {"input_ids": i, "attention_mask": m, "labels": [t if k else -100 for t, k in zip(i, m)]}
        for i, m in zip(encoded["input_ids"], encoded["attention_mask"])
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, choices=["run_clm", "seeds"])
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--text-column", default="text")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the timing")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--deepspeed", action="store_true", help="ZeRO-2 as transformers' documentation configures it")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    if args.deepspeed:
        import deepspeed

        distributed.launch_env()
        deepspeed.init_distributed()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    train, _ = data.load_splits(args.dataset, seed=0)
    needed = args.steps * args.batch_size * world_size
    texts = list(train[args.text_column])
    examples = rows(args.recipe, texts, tokenizer, args.block_size)
    examples = (examples * (needed // max(1, len(examples)) + 1))[:needed]
    cuda = torch.cuda.is_available()
    # the same optimizer as ours (torch's AdamW, nothing compiled): the comparison is of the recipes
    config = zero_config.choose_optimizer(json.loads(json.dumps(HF_ZERO2)), cuda) if args.deepspeed else None
    training_args = TrainingArguments(
        output_dir=str(Path(args.output_dir) / "trainer"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=5e-5,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        use_cpu=not cuda,
        disable_tqdm=True,
        bf16=args.precision == "bf16",
        deepspeed=config,
        seed=0,
        data_seed=0,
        dataloader_pin_memory=cuda,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.recipe == "seeds":
        model.accepts_loss_kwargs = False  # a mean per batch, as in the seeds (see sequence_classification.py)
    warmup = min(args.warmup_steps, args.steps - 1)
    clock = TrainingTime(warmup)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=examples,
        callbacks=[clock, Profile()],
        data_collator=default_data_collator,
    )
    out = trainer.train()
    useful = sum(sum(r.get("attention_mask", [1] * len(r["input_ids"]))) for r in examples)
    # every step costs the same (all rows of the same length), so the steady steps train the mean useful tokens each
    steady = dict(steps=args.steps - warmup, seconds=clock.seconds, tokens=useful * (args.steps - warmup) / args.steps)
    if int(os.environ.get("RANK", 0)) == 0:
        base.write_json(
            Path(args.output_dir) / "results.json",
            {
                "steady": steady,
                "train_tokens": useful,
                "losses": [out.training_loss],
                "world_size": world_size,
                "global_batch_size": args.batch_size * world_size,
                "steps": args.steps,
                "peak_memory_bytes": progress.peak_memory_bytes(torch.device("cuda" if cuda else "cpu")),
            },
        )


if __name__ == "__main__":
    distributed.run_distributed(main)  # as the scripts end: its shared-memory buffer removed, gloo's teardown skipped
