"""Fine-tune an encoder for text classification with the Hugging Face Trainer, optionally under DeepSpeed ZeRO.

    python3 sequence_classification.py                                          # distilbert-base-uncased on imdb
    deepspeed --num_gpus 2 sequence_classification.py --deepspeed ds_config_zero2.json
    deepspeed --num_gpus 2 sequence_classification.py --demo --deepspeed ds_config_zero3.json   # CPU ok
    python3 sequence_classification.py --dataset reviews.csv --label-column sentiment

The same DeepSpeed configs as zero-optimization.py: the Trainer fills their "auto" values from these flags.
Places to tune are marked `To-Do:`.
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                          TrainingArguments, pipeline)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import data
import demo
import training
import zero_utils


def class_labels(train, evaluation, column, name):
    """Class names in a stable order, and both splits with a `labels` column of class ids 0..K-1. String labels
    become ids; a ClassLabel column keeps its names; integer labels keep their order."""
    if column not in train.column_names:
        training.fail(f"dataset {name} has no column {column!r} (it has {', '.join(train.column_names)}); pass --label-column")
    feature = train.features[column]
    if hasattr(feature, "names"):  # a ClassLabel: already ids, with names
        names = list(feature.names)
    else:
        values = set(train[column]) | set(evaluation[column])
        if None in values:
            training.fail(f"dataset {name} has rows without a label in column {column!r}; drop or label them")
        names = sorted(values, key=lambda v: (isinstance(v, str), v))
    if len(names) < 2:
        training.fail(f"dataset {name} has a single class ({names[0]!r}) in column {column!r}: nothing to learn")
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


def check_trainer_resume(folder, world_size, deepspeed):
    """The HF Trainer resumes from its newest checkpoint-N. Under DeepSpeed that holds one optimizer shard per rank,
    which the Trainer loads as it is: another number of ranks would end in DeepSpeed's traceback on every rank."""
    from transformers.trainer_utils import get_last_checkpoint
    last = get_last_checkpoint(str(folder))
    if last is None:
        training.fail(f"--resume: {folder} holds no checkpoint-N yet (the Trainer saves one at the end of each epoch); start "
             f"over with --overwrite")
    saved = len(list(Path(last).glob("rng_state_*.pth"))) or 1  # the Trainer saves one RNG state per process
    if deepspeed and saved != world_size:
        training.fail(f"--resume: {last} was written by {saved} ranks and this run has {world_size}; resume with {saved} (the "
             f"Trainer loads DeepSpeed's optimizer shards as they are; zero-optimization.py can change the number)")
    return Path(last)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # data (To-Do: your dataset, its text and label columns; --max-length to cover most texts)
    p.add_argument("--dataset", default="imdb", help="hub name or local .csv/.json/.jsonl/.parquet")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label", help="integers or strings; strings become class ids")
    p.add_argument("--max-length", type=int, default=512, help="tokens per text; longer texts are cut")
    # model (To-Do: your encoder; bf16 on A100/H100-class GPUs)
    p.add_argument("--model", default="distilbert-base-uncased", help="hub id or local folder of an encoder")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model that ships its own code")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on GPUs that have it, else fp32")
    # train (To-Do: the largest --batch-size that fits, then --grad-accum; --lr)
    p.add_argument("--batch-size", type=int, default=16, help="texts per device per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.05, help="share of the steps spent warming up the LR")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--seed", type=int, default=42)
    # run
    p.add_argument("--output-dir", default="out/classification")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --output-dir")
    p.add_argument("--report-to", default="none", choices=["none", "tensorboard", "wandb"],
                   help="W&B reads WANDB_API_KEY from the environment")
    p.add_argument("--demo", action="store_true", help="tiny encoder + generated corpus shipped with the repo")
    # DeepSpeed (the HF convention: a path; without it, no DeepSpeed)
    p.add_argument("--deepspeed", "--deepspeed_config", dest="deepspeed", help="DeepSpeed JSON config")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    args = p.parse_args(argv)
    if args.demo:  # the demo changes the defaults; flags given on the command line still win
        p.set_defaults(**demo.demo_classification_defaults())
        args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)

    # -------------------------------------------------------------------------------- setup
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    say = print if rank == 0 else (lambda *a, **k: None)
    cuda = torch.cuda.is_available()
    args.precision = training.resolve_precision(args.precision, torch.device("cuda" if cuda else "cpu"))
    for flag in ("lr", "batch_size", "grad_accum", "max_length", "epochs"):
        if getattr(args, flag) <= 0:
            training.fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.deepspeed and not os.path.isfile(args.deepspeed):
        training.fail(f"DeepSpeed config {args.deepspeed} does not exist; pass --deepspeed with a JSON file")
    out = training.prepare_output_dir(args.output_dir, args.overwrite, args.resume, rank)
    if args.resume:
        say(f"resuming from {check_trainer_resume(out / 'checkpoints', world_size, args.deepspeed).name}")
    if args.deepspeed:  # join DeepSpeed's process group first: under ZeRO-3 the model is partitioned as it loads
        import deepspeed
        zero_utils.single_process_env()  # a plain `python3` run is a world of one (DeepSpeed would look for MPI)
        deepspeed.init_distributed()

    # -------------------------------------------------------------------------------- data
    train, evaluation = data.load_splits(args.dataset, args.text_column, args.seed)
    names, train, evaluation = class_labels(train, evaluation, args.label_column, args.dataset)
    examples = list(evaluation.select(range(min(3, len(evaluation))))[args.text_column])  # shown at the end
    remote = {"trust_remote_code": args.trust_remote_code}  # off unless asked: it runs code from the model's repo
    tokenizer = training.load_pretrained(AutoTokenizer, args.model, **remote)
    tokenize = lambda batch: tokenizer(batch[args.text_column], truncation=True, max_length=args.max_length)
    train, evaluation = (split.select_columns([args.text_column, "labels"]).map(
        tokenize, batched=True, remove_columns=[args.text_column]) for split in (train, evaluation))
    say(f"{len(train)} training and {len(evaluation)} eval texts, {len(names)} classes: {', '.join(names[:10])}")

    # -------------------------------------------------------------------------------- trainer
    # TrainingArguments before from_pretrained: with a ZeRO-3 config it makes from_pretrained load each rank's
    # shard only. The Trainer fills the config's "auto" values from these arguments.
    training_args = TrainingArguments(
        output_dir=str(out / "checkpoints"), per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm, num_train_epochs=args.epochs, lr_scheduler_type="cosine",
        seed=args.seed, bf16=args.precision == "bf16", fp16=args.precision == "fp16",
        eval_strategy="epoch", save_strategy="epoch", save_total_limit=2, load_best_model_at_end=True,
        metric_for_best_model="accuracy", logging_steps=10, report_to=args.report_to, deepspeed=args.deepspeed,
        use_cpu=not cuda,  # on a machine without CUDA; without it a distributed launch miscounts the world size
        dataloader_pin_memory=cuda)
    model = training.load_pretrained(
        AutoModelForSequenceClassification, args.model, num_labels=len(names), **remote,
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)}, ignore_mismatched_sizes=True)  # a fresh head for our labels
    # The classification loss is a mean over the batch and ignores `num_items_in_batch`; the Trainer (transformers
    # 5.23) would still multiply it by the number of processes, doubling the gradients on 2 ranks.
    model.accepts_loss_kwargs = False

    def compute_metrics(prediction):
        return classification_metrics(np.argmax(prediction.predictions, axis=-1), prediction.label_ids,
                                             len(names))

    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                      processing_class=tokenizer, data_collator=DataCollatorWithPadding(tokenizer),
                      compute_metrics=compute_metrics)

    # -------------------------------------------------------------------------------- train, evaluate, save
    start = time.perf_counter()
    train_metrics = trainer.train(resume_from_checkpoint=True if args.resume else None).metrics
    train_time = time.perf_counter() - start
    metrics = trainer.evaluate()  # the best epoch's model, reloaded at the end of training
    final = out / "final"
    trainer.save_model(str(final))  # a collective under ZeRO-3: the shards are gathered
    results = {"accuracy": metrics["eval_accuracy"], "f1_macro": metrics["eval_f1_macro"],
               "eval_loss": metrics["eval_loss"], "train_runtime_s": train_time,
               "samples_per_sec": train_metrics["train_samples_per_second"], "world_size": world_size,
               "labels": names}
    unset_hf_deepspeed_config()  # from here on from_pretrained loads a whole model (no ZeRO-3 partitioning)
    if rank == 0:
        training.write_json(out / "results.json", results)
        say(f"accuracy {results['accuracy']:.3f} | macro-F1 {results['f1_macro']:.3f} | "
            f"eval loss {results['eval_loss']:.4f} | saved {final}")
        classify = pipeline("text-classification", model=str(final), device=0 if cuda else -1, **remote)
        for text in examples:
            answer = classify(text)[0]
            say(f"{answer['label']:>12} ({answer['score']:.2f})  {text[:70]!r}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # leave the group cleanly: no abort at exit
    return results


if __name__ == "__main__":
    zero_utils.run_distributed(main)  # one line if a rank is lost; no teardown abort after a good run
