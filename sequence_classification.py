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

import numpy as np
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                          TrainingArguments, pipeline)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import common


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
        p.set_defaults(**common.demo_classification_defaults())
        args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)

    # -------------------------------------------------------------------------------- setup
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    say = print if rank == 0 else (lambda *a, **k: None)
    cuda = torch.cuda.is_available()
    args.precision = common.resolve_precision(args.precision, torch.device("cuda" if cuda else "cpu"))
    for flag in ("lr", "batch_size", "grad_accum", "max_length", "epochs"):
        if getattr(args, flag) <= 0:
            common.fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.deepspeed and not os.path.isfile(args.deepspeed):
        common.fail(f"DeepSpeed config {args.deepspeed} does not exist; pass --deepspeed with a JSON file")
    out = common.prepare_output_dir(args.output_dir, args.overwrite, args.resume, rank)
    if args.resume:
        say(f"resuming from {common.check_trainer_resume(out / 'checkpoints', world_size, args.deepspeed).name}")
    if args.deepspeed:  # join DeepSpeed's process group first: under ZeRO-3 the model is partitioned as it loads
        import deepspeed
        common.single_process_env()  # a plain `python3` run is a world of one (DeepSpeed would look for MPI)
        deepspeed.init_distributed()

    # -------------------------------------------------------------------------------- data
    train, evaluation = common.load_splits(args.dataset, args.text_column, args.seed)
    names, train, evaluation = common.class_labels(train, evaluation, args.label_column, args.dataset)
    examples = list(evaluation.select(range(min(3, len(evaluation))))[args.text_column])  # shown at the end
    remote = {"trust_remote_code": args.trust_remote_code}  # off unless asked: it runs code from the model's repo
    tokenizer = common.load_pretrained(AutoTokenizer, args.model, **remote)
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
    model = common.load_pretrained(
        AutoModelForSequenceClassification, args.model, num_labels=len(names), **remote,
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)}, ignore_mismatched_sizes=True)  # a fresh head for our labels
    # The classification loss is a mean over the batch and ignores `num_items_in_batch`; the Trainer (transformers
    # 5.23) would still multiply it by the number of processes, doubling the gradients on 2 ranks.
    model.accepts_loss_kwargs = False

    def compute_metrics(prediction):
        return common.classification_metrics(np.argmax(prediction.predictions, axis=-1), prediction.label_ids,
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
        common.write_json(out / "results.json", results)
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
    common.run_distributed(main)  # one line if a rank is lost; no teardown abort after a good run
