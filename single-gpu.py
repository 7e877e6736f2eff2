"""Fine-tune a causal language model on one device with plain PyTorch.

    python3 single-gpu.py                          # facebook/opt-125m on yelp_review_full
    python3 single-gpu.py --demo                   # a tiny model learns to answer questions about reviews (CPU ok)
    python3 single-gpu.py --model ./my-model --dataset chats.jsonl --lora-rank 16

single-gpu.py and zero-optimization.py differ only by the edits DeepSpeed ZeRO needs, each marked `# ZeRO:`:
`diff single-gpu.py zero-optimization.py` shows them. Places to tune are marked `To-Do:`.
"""
import argparse
import math

import torch
from tqdm import tqdm
from transformers import AutoConfig

from finetune import base, checkpoints, data, evaluation, flags, hardware, loss, models, preference, progress, training


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # To-Do: --dataset, yours: text, prompt + completion, messages, or preference pairs (DPO), found from the columns
    # (docs/data.md); --model, yours: --lora-rank 16 when full fine-tuning does not fit, then --load-in-4bit;
    # --batch-size, the largest that fits, then --grad-accum for the global batch you want; --lr.
    # Every flag: --help (finetune/flags.py). A recipe to keep: --config FILE (a run's run.json replays the run)
    flags.add_flags(p, *flags.CAUSAL, output_dir="out/single-gpu")
    return flags.parse(p, argv)  # frozen pieces; --demo's and --config's values under the flags given


def main(argv=None):
    config = parse_args(argv)  # the run's flags, in frozen pieces: config.data, .model, .train, .run (flags.py)

    # -------------------------------------------------------------------------------- setup
    rank, local_rank, world_size = 0, 0, 1
    device = hardware.first_device(local_rank)  # this process's GPU, made current before anything touches CUDA
    say = tqdm.write if rank == 0 else (lambda *a, **k: None)
    training.quiet(config.run.verbose, rank)
    precision = hardware.choose_precision(config.model.precision, hardware.facts(device))  # To-Do: --precision
    config = config.resolved(precision=precision)  # what setup resolves goes into a new Config, never into the old
    hardware.set_matmul_precision(precision)
    remote = {"trust_remote_code": config.model.trust_remote_code}  # off unless asked: it runs the model repo's code
    model_config = models.load_pretrained(AutoConfig, config.model.model, **remote)
    config = flags.check(config, getattr(model_config, "max_position_embeddings", None))  # one line if bad; --resume
    out = checkpoints.output_dir(config.run)  # refused in one line where the flags would lose a run there
    torch.manual_seed(config.train.seed)
    # -------------------------------------------------------------------------------- data
    tokenizer = models.load_tokenizer(config.model.model, **remote)
    # tokenized and packed once per node, then mapped
    train, evals = data.prepare(config.data, tokenizer, seed=config.train.seed, local_rank=local_rank)
    config = preference.resolved(config, train.format)  # the data's loss (pairs: DPO; unpaired rows: KTO), its LR
    global_batch = config.train.batch_size * config.train.grad_accum * world_size  # sequences per optimizer step
    batches = training.GlobalBatches(len(train), global_batch, config.train.seed)
    total_steps = config.train.max_steps or math.ceil(config.train.epochs * batches.steps_per_epoch)
    warmup_steps = math.ceil(config.train.warmup_ratio * total_steps)  # rounded up, as the HF Trainer does
    # -------------------------------------------------------------------------------- model and optimizer
    folder = checkpoints.resume_folder(out, config.train, config.model, world_size)[0] if config.run.resume else None
    model = models.load_causal_lm(config.model, model_config, device)  # fp32 master weights, the fastest attention
    model_config = model.config  # as loaded: its attention implementation decides the batches' layout (data.py)
    model = models.prepare_model(model, config.model, config.train.seed, config.micro_tokens)  # LoRA, checkpointing
    model = loss.CausalLMLoss(model, config.model.loss_chunk, preference.PairLoss.of(config.train))  # the loss
    model.to(device)
    optimizer = torch.optim.AdamW(training.param_groups(model, config.train.weight_decay), lr=config.train.lr,
                                  betas=training.ADAM_BETAS, eps=training.ADAM_EPS, fused=True)  # one kernel
    scheduler = training.cosine_schedule(optimizer, warmup_steps, total_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16", **training.FP16_SCALER)
    autocast = hardware.autocast(device, precision)  # bf16, fp16: mixed precision over the fp32 weights
    if config.model.compile:  # in place: the state dict keeps its names: checkpoints, save_pretrained unchanged
        model.compile()
    compiled = training.CompileWarmup(config.model.compile, train.row_tokens, say)  # --compile: one graph
    process = training.Process(device=device, rank=rank, world_size=world_size, autocast=autocast, say=say,
                               pad_id=tokenizer.pad_token_id, model_config=model_config)  # what this process is
    checkpoints.prepare_output_dir(out, config.run.overwrite, rank)  # nothing refuses the run now: --overwrite acts
    stats = progress.RunStats(model, config, process)  # losses, throughput and MFU, out of the loop's way
    stop = training.Stop(out, hung=stats.watch.hung)  # SIGTERM, SIGUSR1: stop at a step's end, with a checkpoint
    if folder:  # into the model, the optimizer, the schedule and the scaler; nothing of the file is kept
        stats.restore(checkpoints.load_state(folder, device, model=model, optimizer=optimizer, scheduler=scheduler,
                                             scaler=scaler))
        say(f"resumed at step {stats.step} of {total_steps} from {folder}")
    with stats.paused():  # preference pairs (DPO): the model as loaded scores them, once (not training time)
        train, evals = preference.reference(model, (train, evals), config, out, process)  # the pairs with theirs
    # -------------------------------------------------------------------------------- train
    say(f"{stats.describe()} | {train.describe(config.data.packing)} | {total_steps} steps of {global_batch} "
        f"sequences ({training.split(config, world_size)}) | lr {config.train.lr:g} | {precision} | {device}")
    model.train()
    scale = scaler.get_scale()  # fp16's loss scale, as the last update left it (1.0 without fp16)
    bar = tqdm(range(stats.step, total_steps), initial=stats.step, total=total_steps,
               disable=True if rank else None)  # None: a bar on a terminal only, not in log files
    for step in bar:
        indices = batches(step)  # the global batch: the same sequences whatever the number of ranks
        predicted = int(train.predicted[indices].sum())  # tokens that carry loss in the whole global batch
        micro_batches = indices.view(config.train.grad_accum, -1)  # this process's
        kl = preference.kl_point(model, train, micro_batches, process) if train.format == "unpaired" else None  # KTO
        step_loss = torch.zeros((), device=device)
        for micro in micro_batches:
            inputs, targets = train.batch(micro, process, width=compiled.width, kl=kl)  # the model's inputs, targets
            with autocast, compiled.after_warmup(step):  # --compile: after its warm-up, no more graphs
                summed = model(inputs=inputs, targets=targets)  # the batch's summed loss (loss.CausalLMLoss)
                batch_loss = summed.loss / predicted
            scaler.scale(batch_loss).backward()
            step_loss += batch_loss.detach()
            stats.micro_step(summed)  # progress, for the hang watchdog; preference pairs: their metrics' sums
        scaler.unscale_(optimizer)
        grad_norm = training.clip_gradients(optimizer, config.train.max_grad_norm)  # their norm before clipping
        scaler.step(optimizer)  # fp16: skips the update when a gradient overflowed, and lowers the scale
        scaler.update()
        scale, last_scale = scaler.get_scale(), scale  # fp16 only: a host sync (DeepSpeed syncs for the same check)
        if scale >= last_scale:  # a skipped update leaves the LR schedule where it was, as DeepSpeed does
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        stats.end_step(step_loss, train, indices, grad_norm)
        if stats.log_due(step, total_steps):  # the one host-device sync: the interval's losses, checked
            say(stats.log_interval(step, total_steps, scheduler.get_last_lr()[0]))
        if stats.eval_due(step, total_steps):  # every --eval-every steps and at the end; before the checkpoint
            with stats.paused():  # every rank evaluates its share; a few eval prompts answered, for the trackers
                result = evaluation.evaluate(model, evals, config.train.batch_size, process)
                answers = models.answers(model, tokenizer, evals, process) if stats.trackers.names else None
            say(stats.log_eval(step, result, answers))
        stopping = stop.due()  # a signal reached any rank (under ZeRO the ranks agree: one tiny all-reduce)
        if stopping or stats.save_due(step, total_steps):
            with stats.paused():  # into a temporary folder; published (renamed, then pointed to) only once complete
                record = checkpoints.run_record(step + 1, config, model, stats, global_batch)  # run.json
                with checkpoints.saving(out, record, config.run.keep_checkpoints, rank) as folder:  # disk full: a line
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                                "stats": stats.state(), "rng": checkpoints.rng_state(device)}, folder / "state.pt")
        if stopping:
            stop.exit(step + 1, say)  # every rank, once the checkpoint is published; exit status 75: resume me
    # -------------------------------------------------------------------------------- sample and save
    checkpoints.load_best(model, out, stats, config.run.final, process)  # --final best: its checkpoint
    held = models.held_bytes(model, optimizer)  # per rank: weights, gradients, optimizer state (what plan.py plans)
    sample = models.sample(model, tokenizer, config.run.prompt, evals, process)  # or why not
    results = {**stats.results(world_size, global_batch, held), "sample": sample}
    if rank == 0:  # rank 0 writes alone: the HF model (LoRA: merged into it), safetensors; the adapter in final/adapter
        models.save_final(model.causal_lm, tokenizer, out / "final")
        base.write_json(out / "results.json", results)
        progress.plot_losses(stats.losses, out / "loss.png")
    say(f"saved {out / 'final'} and {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
