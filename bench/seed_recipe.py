"""The seeds' recipe, kept as the benchmark's peer: the HF Trainer with DeepSpeed, every text padded to
--max-length, fp32. It trains a causal LM on --num-sequences texts and reports useful (non-padding) tokens per second.

    deepspeed --num_gpus 2 bench/seed_recipe.py --model M --dataset D --num-sequences 256 --deepspeed ds.json
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import training  # noqa: E402
import zero_utils  # noqa: E402


class TrainingTime(TrainerCallback):
    """Seconds from the end of step `warmup` to the end of training (the steady state, as bench/run.py times ours)."""

    def __init__(self, warmup):
        self.warmup = warmup

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--text-column", default="text")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-sequences", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the timing")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--deepspeed", help="DeepSpeed config (the seeds used ZeRO through the Trainer)")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    if args.deepspeed:
        import deepspeed
        deepspeed.init_distributed()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    train, _ = data.load_splits(args.dataset, args.text_column, seed=0)
    texts = list(train.select(range(min(args.num_sequences, len(train))))[args.text_column])
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=args.max_length)  # the seeds' way
    rows = [{"input_ids": ids, "attention_mask": mask, "labels": [t if m else -100 for t, m in zip(ids, mask)]}
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
    cuda = torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=str(Path(args.output_dir) / "trainer"), per_device_train_batch_size=args.batch_size,
        max_steps=len(rows) // (args.batch_size * world_size), learning_rate=5e-5, report_to="none",
        save_strategy="no", logging_steps=10**9, use_cpu=not cuda, disable_tqdm=True,
        # the same optimizer as ours (torch's AdamW, nothing compiled): the comparison is of the recipes
        deepspeed=zero_utils.choose_optimizer(json.loads(Path(args.deepspeed).read_text()), cuda) if args.deepspeed
        else None)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.accepts_loss_kwargs = False  # a mean per batch, as in the seeds (see sequence_classification.py)
    warmup = min(args.warmup_steps, training_args.max_steps - 1)
    clock = TrainingTime(warmup)
    trainer = Trainer(model=model, args=training_args, train_dataset=rows, callbacks=[clock])
    out = trainer.train()
    runtime = clock.seconds
    steps = training_args.max_steps
    useful = sum(sum(r["attention_mask"]) for r in rows[:steps * args.batch_size * world_size])
    # every step costs the same (all padded to --max-length), so the steady steps train the mean useful tokens each
    steady = dict(steps=steps - warmup, seconds=runtime, tokens=useful * (steps - warmup) / steps)
    if int(os.environ.get("RANK", 0)) == 0:
        training.write_json(Path(args.output_dir) / "results.json", {
            "steady": steady, "train_tokens": useful,
            "losses": [out.training_loss], "world_size": world_size, "global_batch_size": args.batch_size * world_size,
            "steps": steps, "peak_memory_bytes": training.peak_memory_bytes(torch.device("cuda" if cuda else "cpu")),
            "padded_tokens": steps * args.batch_size * world_size * args.max_length})


if __name__ == "__main__":
    main()
