"""Fine-tune an encoder for text classification with the Hugging Face Trainer, optionally under DeepSpeed ZeRO; or,
from a preference file (chosen, rejected), a reward model (finetune/reward.py).

    python3 sequence_classification.py                                          # distilbert-base-uncased on imdb
    deepspeed --num_gpus 2 sequence_classification.py --deepspeed ds_config_zero2.json
    deepspeed --num_gpus 2 sequence_classification.py --demo --deepspeed ds_config_zero3.json   # CPU ok
    python3 sequence_classification.py --dataset reviews.csv --label-column sentiment
    python3 sequence_classification.py --dataset pairs.jsonl --model ./my-sft-model   # a reward model

The same DeepSpeed configs as zero-optimization.py: the Trainer fills their "auto" values from these flags.
Places to tune are marked `To-Do:`.
"""
import argparse
import contextlib
import functools
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

# finetune before the Trainer: importing the Trainer imports bitsandbytes, whose notice finetune/__init__.py quiets
from finetune import base, checkpoints, data, distributed, flags, hardware, models, reward, training, zero_config
from finetune.internals import demo, mends
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          PrinterCallback, Trainer, TrainerCallback, TrainingArguments, pipeline, set_seed)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config


def class_labels(train, evaluation, column, name):
    """Class names in a stable order, and both splits with a `labels` column of class ids 0..K-1. String labels
    become ids; a ClassLabel column keeps its names; integer labels keep their order."""
    if column not in train.column_names:
        base.fail(f"dataset {name} has no column {column!r} (it has {', '.join(train.column_names)}); pass "
                  f"--label-column")
    feature = train.features[column]
    if hasattr(feature, "names"):  # a ClassLabel: already ids, with names
        names = list(feature.names)
    else:
        values = set(train[column]) | set(evaluation[column])
        if None in values:
            base.fail(f"dataset {name} has rows without a label in column {column!r}; drop or label them")
        names = sorted(values, key=lambda v: (isinstance(v, str), v))
    if len(names) < 2:
        base.fail(f"dataset {name} has a single class ({names[0]!r}) in column {column!r}: nothing to learn")
    ids = {v: i for i, v in enumerate(names)} if not hasattr(feature, "names") else {i: i for i in range(len(names))}
    to_ids = lambda batch: {"labels": [ids[v] for v in batch]}
    train, evaluation = (split.map(to_ids, input_columns=column, batched=True) for split in (train, evaluation))
    return [str(n) for n in names], train, evaluation


def texts_and_labels(config, tokenizer):
    """(train, eval, class names, a few eval texts shown at the end), tokenized: the texts and their classes; for a
    preference file (chosen, rejected) its pairs, for a reward model of one output (finetune/reward.py)."""
    dataset, text, max_length = config.data.dataset, config.data.text_column, config.classifier.max_length
    train, evaluation = data.load_splits(dataset, seed=config.train.seed)
    if reward.is_preference(train.column_names):
        (train, dropped), (pairs, _) = (reward.tokenized_pairs(split, tokenizer, max_length, dataset)
                                        for split in (train, evaluation))  # (their texts checked)
        examples = list(reward.pair_texts(evaluation[0], tokenizer)) if len(evaluation) else []
        evaluation = pairs
        if not len(train):
            base.fail(f"every pair of dataset {dataset} is longer than --max-length {max_length}: raise it")
        said = f" ({dropped} longer than --max-length {max_length} left out)" if dropped else ""
        return train, evaluation, ["reward"], examples, f"{len(train)} training and {len(evaluation)} eval pairs{said}"
    if text not in train.column_names:
        base.fail(f"dataset {dataset} has no column {text!r} (it has {', '.join(train.column_names)}); pass "
                  f"--text-column")
    names, train, evaluation = class_labels(train, evaluation, config.classifier.label_column, dataset)
    examples = list(evaluation.select(range(min(3, len(evaluation))))[text])  # shown at the end
    tokenize = lambda batch: tokenizer(batch[text], truncation=True, max_length=max_length)
    train, evaluation = (split.select_columns([text, "labels"]).map(tokenize, batched=True, remove_columns=[text])
                         for split in (train, evaluation))
    said = f"{len(train)} training and {len(evaluation)} eval texts, {len(names)} classes: {', '.join(names[:10])}"
    return train, evaluation, names, examples, said


def classification_metrics(logits, labels, num_classes):
    """Accuracy and macro-averaged F1 (each class's F1, averaged with equal weight), computed here: evaluate.load
    would need the hub. And the score that picks the best epoch: accuracy, ties broken by the lower mean
    cross-entropy (the eval loss), which moves by less than one example's share of accuracy."""
    logits, labels = np.asarray(logits, dtype=np.float64), np.asarray(labels)
    predictions = np.argmax(logits, axis=-1)
    f1s = []
    for c in range(num_classes):
        tp = np.sum((predictions == c) & (labels == c))
        fp, fn = np.sum((predictions == c) & (labels != c)), np.sum((predictions != c) & (labels == c))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    cross_entropy = float(np.mean(np.log(np.exp(shifted).sum(axis=-1)) - shifted[np.arange(len(labels)), labels]))
    accuracy = float(np.mean(predictions == labels))
    return {"accuracy": accuracy, "f1_macro": float(np.mean(f1s)),
            "accuracy_then_loss": accuracy - min(cross_entropy, 100.0) / (101.0 * len(labels))}


def trainer_deepspeed_config(path, device, hidden_size, train, mend_choice="all"):
    """The JSON for the Trainer, which fills the "auto" values its arguments set, but not the buckets and overlap_comm
    (from the hardware) nor the optimizer (trainer_optimizer); and the TrainingArguments its AdamW section sets.
    `train`: flags.Train; `mend_choice`: --mends."""
    if not path:
        return None, {}
    config = zero_config.choose_optimizer(zero_config.read_config(path), device.type == "cuda")
    mends.before_engine(config, mend_choice)  # what DeepSpeed asks as the Trainer builds the engine, asked once
    section = config.get("zero_optimization", {})
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tuned = zero_config.tuned_values(section.get("stage", 0), hidden_size, device.type == "cuda", world_size)
    for key, value in tuned.items():
        if section.get(key) == "auto":
            section[key] = value
    return config, trainer_optimizer(config, train, path)


def trainer_optimizer(config, train, path):
    """When the DeepSpeed config names the optimizer, transformers gives it all the parameters as one group
    (integrations/deepspeed.py: DummyOptim(params=model_parameters)), so weight decay would fall on biases and norms
    too, unlike the same run without DeepSpeed. So an AdamW section is taken out and the Trainer makes its own AdamW
    (torch's fused one), biases and norms undecayed; DeepSpeed runs it as a client optimizer, and accelerate swaps in
    DeepSpeedCPUAdam, groups kept, when the optimizer state is offloaded. The section's betas and eps become the
    TrainingArguments that set them. Another optimizer stays DeepSpeed's (choose_optimizer fills its "auto")."""
    section = config.get("optimizer") or {}
    params = section.get("params", {})
    if section.get("type", "").lower() not in ("adam", "adamw") or params.get("adam_w_mode") is False:
        return {}
    for key, flag in (("lr", "--lr"), ("weight_decay", "--weight-decay")):
        if params.get(key, "auto") not in ("auto", getattr(train, key)):
            base.fail(f"{path} sets optimizer.params.{key}={params[key]} but {flag} is {getattr(train, key)}; "
                      f"set it to \"auto\" or change the flag")
    config.pop("optimizer")
    kwargs = {}
    if params.get("betas", "auto") != "auto":
        kwargs["adam_beta1"], kwargs["adam_beta2"] = params["betas"]
    if params.get("eps", "auto") != "auto":
        kwargs["adam_epsilon"] = params["eps"]
    return kwargs


class EpochLine(TrainerCallback):
    """One line per epoch, after its evaluation: the training loss of the epoch's last steps and the eval figures."""

    def __init__(self, say):
        self.say, self.loss, self.said = say, None, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.loss = (logs or {}).get("loss", self.loss)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and state.epoch is not None and state.epoch != self.said:  # not again for the final evaluate()
            self.said = state.epoch
            self.say(f"epoch {state.epoch:g}/{args.num_train_epochs:g} | train loss {self.loss or float('nan'):.4f} | "
                     f"eval loss {metrics['eval_loss']:.4f} | accuracy {metrics['eval_accuracy']:.3f}")


@contextlib.contextmanager
def quiet_loading(verbose):
    import transformers

    level = transformers.utils.logging.get_verbosity()
    if not verbose:
        transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)


def complete_checkpoints(folder):
    """The Trainer's checkpoint-N folders that were written to the end (trainer_state.json is its last file: the
    Trainer writes into checkpoint-N directly, so a kill in a save leaves a partial one), oldest first."""
    done = [p for p in Path(folder).glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def check_trainer_resume(folder, world_size, deepspeed, rank):
    """The newest complete checkpoint-N, to resume from; newer partial ones are removed (rank 0). Under DeepSpeed it
    holds one optimizer shard per rank, which the Trainer loads as it is: another number of ranks would end in
    DeepSpeed's traceback on every rank."""
    done = complete_checkpoints(folder)
    if not done:
        base.fail(f"--resume: {folder} has no complete checkpoint; start over with --overwrite")
    last = done[-1]
    for partial in Path(folder).glob("checkpoint-*"):
        if rank == 0 and partial not in done and int(partial.name.split("-")[1]) > int(last.name.split("-")[1]):
            shutil.rmtree(partial, ignore_errors=True)
    saved = len(list(Path(last).glob("rng_state_*.pth"))) or 1  # the Trainer saves one RNG state per process
    if deepspeed and saved != world_size:
        base.fail(f"--resume: {last} was written by {saved} ranks and this run has {world_size}; resume with "
                  f"{saved} (the Trainer loads DeepSpeed's optimizer shards as they are; zero-optimization.py can "
                  f"change the number)")
    return Path(last)


@contextlib.contextmanager
def mended_engines(accelerator, choice, say):
    """DeepSpeed's defects and slow paths mended (--mends; finetune/internals/mends.py) on each training engine the
    HF Trainer builds, as zero-optimization.py mends its own: as accelerate's prepare() returns it, so before a resume
    loads its checkpoint and before the first step. What they changed for the whole process is undone at the end."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        yield
        return
    from deepspeed import DeepSpeedEngine

    prepare, mended = accelerator.prepare, {}

    def prepare_and_mend(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        for part in prepared if isinstance(prepared, tuple) else [prepared]:
            if isinstance(part, DeepSpeedEngine) and part.optimizer is not None:  # (not an evaluation's engine)
                mended[id(part)] = mends.mend(part, choice, say)
        return prepared

    accelerator.prepare = prepare_and_mend
    try:
        yield
    finally:
        accelerator.prepare = prepare
        for engine_mends in mended.values():
            engine_mends.undo()  # DeepSpeed's own functions back, for a next run in this process


class StopOnSignal(TrainerCallback):
    """SIGTERM or SIGUSR1 on any rank (training.Stop): after the step in flight the Trainer saves a checkpoint and
    stops training, on every rank; main() then exits 75, to be resumed (`--resume auto`)."""

    def __init__(self, stop):
        self.stop, self.step = stop, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.due():  # every rank, every step: the ranks agree (one tiny all-reduce)
            control.should_save = control.should_training_stop = True
            self.step = state.global_step


TRAIN = ("batch_size", "grad_accum", "lr", "weight_decay", "warmup_ratio", "max_grad_norm", "epochs", "seed")
RUN = ("output_dir", "resume", "overwrite", "report_to", "verbose", "demo", "config")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # To-Do: --dataset, its --text-column and --label-column, --max-length to cover most texts; your encoder (--model;
    # --precision bf16 on A100/H100-class GPUs); the largest --batch-size that fits, then --grad-accum; --lr. The
    # flags are the causal scripts' where they mean the same (finetune/flags.py), with this script's defaults; no
    # --deepspeed: plain PyTorch. A recipe to keep: --config FILE (this run's run.json replays it)
    flags.add_flags(p, flags.Data.taking("dataset", "text_column"), flags.Classifier,
                    flags.Model.taking("model", "trust_remote_code", "precision"), flags.Train.taking(*TRAIN),
                    flags.Run.taking(*RUN), flags.Zero.taking("deepspeed", "dist_timeout", "mends"), dataset="imdb",
                    text_column="text", model="distilbert-base-uncased", batch_size=16, lr=5e-5, weight_decay=0.01,
                    epochs=2, output_dir="out/classification", deepspeed=None)
    return flags.parse(p, argv, demo_defaults=demo.classification_defaults)


def main(argv=None):
    config = parse_args(argv)  # frozen pieces: config.data, .classifier, .model, .train, .run, .zero (flags.py)
    model_flags, train_flags, run_flags = config.model, config.train, config.run
    ds_path = config.zero.deepspeed  # DeepSpeed's config file, or None

    # -------------------------------------------------------------------------------- setup
    # who this process is (srun's tasks too), and its GPU, made current before anything touches CUDA: the Trainer
    # would set it only once it builds its state, after DeepSpeed's process group and the model
    rank, local_rank, world_size = distributed.launch_env(world_of_one=bool(ds_path))
    device = hardware.first_device(local_rank)
    say = print if rank == 0 else (lambda *a, **k: None)
    if ds_path:  # imported before quiet(), which silences the line its CPU all-reduce prints on every rank
        import deepspeed
    training.quiet(run_flags.verbose, rank)
    precision = hardware.choose_precision(model_flags.precision, hardware.facts(device))
    config = config.resolved(precision=precision)  # (run.json keeps what ran)
    hardware.set_matmul_precision(precision)
    for name, value in (("lr", train_flags.lr), ("batch_size", train_flags.batch_size), ("epochs", train_flags.epochs),
                        ("grad_accum", train_flags.grad_accum), ("max_length", config.classifier.max_length)):
        if value <= 0:
            base.fail(f"--{name.replace('_', '-')} must be positive, got {value}")
    remote = {"trust_remote_code": model_flags.trust_remote_code}  # off unless asked: it runs the model repo's code
    hidden_size = models.load_pretrained(AutoConfig, model_flags.model, **remote).hidden_size
    ds_config, optimizer_args = trainer_deepspeed_config(ds_path, device, hidden_size, train_flags, config.zero.mends)
    if run_flags.resume == "auto":  # one command line for the first submission and every requeue
        done = complete_checkpoints(Path(run_flags.output_dir) / "checkpoints")
        config = config.resolved(resume="newest" if done and not run_flags.overwrite else None)
    out = checkpoints.output_dir(config.run)  # refused in one line where the flags would lose a run there
    resume = check_trainer_resume(out / "checkpoints", world_size, ds_path, rank) if config.run.resume else None
    # before any process group: the bound on every collective
    timeout = distributed.collective_settings(config.zero.dist_timeout, run_flags.output_dir)
    if ds_path:  # join DeepSpeed's process group first: under ZeRO-3 the model is partitioned as it loads
        deepspeed.init_distributed(timeout=timeout)

    # -------------------------------------------------------------------------------- data
    tokenizer = models.load_pretrained(AutoTokenizer, model_flags.model, **remote)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # a decoder's: its EOS (as TRL), for the batches
    train, evaluation, names, examples, said = texts_and_labels(config, tokenizer)  # classes, or a reward's pairs
    rewards = names == ["reward"]  # a preference file: a reward model
    say(said)

    # -------------------------------------------------------------------------------- trainer
    # TrainingArguments before from_pretrained: with a ZeRO-3 config it makes from_pretrained load each rank's
    # shard only. The Trainer fills the config's "auto" values from these arguments.
    training_args = TrainingArguments(
        output_dir=str(out / "checkpoints"), per_device_train_batch_size=train_flags.batch_size,
        per_device_eval_batch_size=train_flags.batch_size, gradient_accumulation_steps=train_flags.grad_accum,
        learning_rate=train_flags.lr, weight_decay=train_flags.weight_decay, warmup_steps=train_flags.warmup_ratio,
        max_grad_norm=train_flags.max_grad_norm, num_train_epochs=train_flags.epochs, lr_scheduler_type="cosine",
        seed=train_flags.seed, bf16=precision == "bf16", fp16=precision == "fp16",
        eval_strategy="epoch", save_strategy="epoch", save_total_limit=2, load_best_model_at_end=True,
        metric_for_best_model="accuracy_then_loss", greater_is_better=True,  # of equal accuracies, the lower loss
        logging_steps=10, report_to=list(run_flags.report_to), deepspeed=ds_config,
        logging_nan_inf_filter=False,  # (its check reads each step's loss on the host; a NaN now shows in the logs)
        disable_tqdm=not run_flags.verbose, log_level="warning" if run_flags.verbose else "error",
        use_cpu=device.type == "cpu",  # on a machine without CUDA; without it a distributed launch miscounts ranks
        dataloader_pin_memory=device.type == "cuda", ddp_timeout=config.zero.dist_timeout,
        remove_unused_columns=not rewards, **optimizer_args)  # (a reward's pairs: two texts a row, not the model's)
    set_seed(train_flags.seed)  # the new head's random weights: the Trainer seeds only once the model exists
    with quiet_loading(run_flags.verbose):  # transformers says the new head's weights are missing: new on purpose
        model = models.load_pretrained(
            AutoModelForSequenceClassification, model_flags.model, num_labels=len(names), **remote,
            id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)}, ignore_mismatched_sizes=True)  # a fresh head for our labels
    model.config.pad_token_id = tokenizer.pad_token_id  # a decoder reads its last token that is not padding
    say(f"{model_flags.model}: a new head for {'a reward' if rewards else f'{len(names)} classes'}")
    # The classification loss is a mean over the batch and ignores `num_items_in_batch`; the Trainer (transformers
    # 5.23) would still multiply it by the number of processes, doubling the gradients on 2 ranks.
    model.accepts_loss_kwargs = False
    checkpoints.prepare_output_dir(out, run_flags.overwrite, rank)  # nothing refuses the run now: --overwrite acts
    if rank == 0:  # what ran, replayed by --config <output-dir>/run.json
        base.write_json(out / "run.json", {"args": config.flat(), "world_size": world_size})
    if resume:
        say(f"resuming from {resume.name}")
    stop = StopOnSignal(training.Stop(out))  # SIGTERM, SIGUSR1: a checkpoint after the step in flight, then exit 75
    if rewards:  # a reward model: Bradley-Terry over pairs, each in a row on a decoder, else its texts padded apart
        trainer_class = functools.partial(reward.RewardTrainer, center=config.classifier.center_rewards_coefficient)
        layout = reward.one_row_layout(model, config.classifier.pair_layout, training_args.n_gpu)  # a pair a row
        collator = reward.OneRowCollator(tokenizer.pad_token_id, model.config, layout) if layout else \
            reward.PairCollator(tokenizer)
        scores = lambda p: reward.reward_metrics(p.predictions)
    else:
        trainer_class, collator = Trainer, DataCollatorWithPadding(tokenizer)
        scores = lambda p: classification_metrics(p.predictions, p.label_ids, len(names))
    trainer = trainer_class(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer, data_collator=collator, compute_metrics=scores,
                            callbacks=[EpochLine(say), stop])
    if not run_flags.verbose:
        trainer.remove_callback(PrinterCallback)  # a dict of figures every logging_steps: EpochLine instead

    # -------------------------------------------------------------------------------- train, evaluate, save
    start = time.perf_counter()
    with mended_engines(trainer.accelerator, config.zero.mends, say):  # DeepSpeed's defects, slow paths (--mends)
        with checkpoints.loading_safely():  # a resume loads no code (DeepSpeed's engine asks for weights_only=False)
            train_metrics = trainer.train(resume_from_checkpoint=str(resume) if resume else None).metrics
        train_time = time.perf_counter() - start
        if stop.step is not None:  # stopped by a signal, its checkpoint written
            stop.stop.exit(stop.step, say)
        metrics = trainer.evaluate()  # the best epoch's model, reloaded at the end of training
        final = out / "final"
        trainer.save_model(str(final))  # a collective under ZeRO-3: the shards are gathered
    results = {"accuracy": metrics["eval_accuracy"], "f1_macro": metrics.get("eval_f1_macro"),
               "eval_loss": metrics["eval_loss"], "train_runtime_s": train_time,
               "samples_per_sec": train_metrics["train_samples_per_second"], "world_size": world_size,
               "labels": names, "train_log": [{k: h[k] for k in ("step", "loss", "grad_norm") if k in h}
                                              for h in trainer.state.log_history if "loss" in h]}
    unset_hf_deepspeed_config()  # from here on from_pretrained loads a whole model (no ZeRO-3 partitioning)
    if rank == 0:
        base.write_json(out / "results.json", results)
        scored = f"margin {metrics['eval_margin']:.3f}" if rewards else f"macro-F1 {results['f1_macro']:.3f}"
        say(f"accuracy {results['accuracy']:.3f} | {scored} | eval loss {results['eval_loss']:.4f} | saved {final}")
        classify = pipeline("text-classification", model=str(final), device=device, **remote)
        for example in examples:  # a reward model: the first eval pair's chosen and rejected texts, and their rewards
            answer = classify(example, **({"function_to_apply": "none"} if rewards else {}))[0]  # (a reward: raw)
            say(f"{answer['label']:>12} ({answer['score']:.2f})  {example[:70]!r}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # leave the group cleanly: no abort at exit
    return results


if __name__ == "__main__":
    distributed.run_distributed(main)  # one line if a rank is lost; no teardown abort after a good run
