"""Fine-tune a causal language model on many GPUs and nodes with DeepSpeed ZeRO (data parallel, sharded).

    deepspeed zero-optimization.py --deepspeed                         # all GPUs here, ds_config_zero3.json
    deepspeed --hostfile=job/hostfile zero-optimization.py --deepspeed # many nodes (see job/); also torchrun, srun
    deepspeed --num_gpus 2 zero-optimization.py --demo --zero-stage 2  # tiny demo, also on CPU

single-gpu.py and zero-optimization.py differ only by the edits DeepSpeed ZeRO needs, each marked `# ZeRO:`:
`diff single-gpu.py zero-optimization.py` shows them. Places to tune are marked `To-Do:`.
"""
import argparse
import math

import deepspeed  # ZeRO
import torch
from tqdm import tqdm
from transformers import AutoConfig
from transformers.integrations import HfDeepSpeedConfig  # ZeRO

from finetune import base, checkpoints, data, evaluation, flags, hardware, loss, models, preference, progress, training
from finetune import distributed, zero, zero_config  # ZeRO
from finetune.internals import mends  # ZeRO


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # To-Do: --dataset, yours: text, prompt + completion, messages, or preference pairs (DPO), found from the columns
    # (docs/data.md); --model, yours: --lora-rank 16 when full fine-tuning does not fit, then --load-in-4bit;
    # --batch-size, the largest that fits, then --grad-accum for the global batch you want; --lr.
    # Every flag: --help (finetune/flags.py). A recipe to keep: --config FILE (a run's run.json replays the run)
    # ZeRO: and the DeepSpeed config file, with overrides of what matters most in it (To-Do: stage 2 if the model
    # fits, stage 3 if not, then --offload cpu; more in ds_config_zero*.json)
    flags.add_flags(p, *flags.CAUSAL, flags.Zero, output_dir="out/zero")
    return flags.parse(p, argv)  # frozen pieces; --demo's and --config's values under the flags given


def main(argv=None):
    config = parse_args(argv)  # the run's flags, in frozen pieces: config.data, .model, .train, .run (flags.py)

    # -------------------------------------------------------------------------------- setup
    rank, local_rank, world_size = distributed.launch_env()  # ZeRO: from deepspeed, torchrun, srun; or a world of one
    device = hardware.first_device(local_rank)  # this process's GPU, made current before anything touches CUDA
    say = tqdm.write if rank == 0 else (lambda *a, **k: None)
    training.quiet(config.run.verbose, rank)
    distributed.init_distributed(config.zero.dist_timeout, config.run.output_dir)  # ZeRO: the group, its timeouts
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
    global_batch //= config.sequence_parallel  # ZeRO: the ranks of a sequence-parallel group share their rows
    batches = training.GlobalBatches(len(train), global_batch, config.train.seed)
    total_steps = config.train.max_steps or math.ceil(config.train.epochs * batches.steps_per_epoch)
    warmup_steps = math.ceil(config.train.warmup_ratio * total_steps)  # rounded up, as the HF Trainer does
    # -------------------------------------------------------------------------------- model and optimizer
    # ZeRO: fill the JSON's "auto" values from the flags; the engine builds the optimizer it names
    ds_config = zero_config.deepspeed_config(config, world_size, total_steps, warmup_steps, model_config)
    # ZeRO: the newest checkpoint, or its universal form when another number of ranks wrote it
    folder = zero.resume_folder(out, config, ds_config, rank, world_size, say=say) if config.run.resume else None
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # ZeRO-3: from_pretrained loads each rank's shard, never a full copy
    model = models.load_causal_lm(config.model, model_config, device)  # fp32 master weights, the fastest attention
    model_config = model.config  # as loaded: its attention implementation decides the batches' layout (data.py)
    model = models.prepare_model(model, config.model, config.train.seed, config.micro_tokens)  # LoRA, checkpointing
    model = loss.CausalLMLoss(model, config.model.loss_chunk, preference.PairLoss.of(config.train))  # the loss
    schedule = lambda opt: training.cosine_schedule(opt, warmup_steps, total_steps)
    model, optimizer, _, scheduler = deepspeed.initialize(  # ZeRO: wraps model and optimizer, shards their state
        model=model, model_parameters=training.param_groups(model, config.train.weight_decay), config=ds_config,
        lr_scheduler=None if "scheduler" in ds_config else schedule, mpu=zero.sequence_parallel(config, model))
    autocast = zero.autocast(model, device, precision)  # ZeRO: the engine's 16-bit weights, or ZeRO-0's autocast
    if config.model.compile:  # in place: the state dict keeps its names: checkpoints, save_pretrained unchanged
        model.compile()  # ZeRO: the engine's compile (it turns off what would break the graph)
    mended = mends.mend(model, config.zero.mends, say)  # ZeRO: DeepSpeed's defects and slow paths, by name (--mends)
    compiled = training.CompileWarmup(config.model.compile, train.row_tokens, say)  # --compile: one graph
    process = training.Process(device=device, rank=rank, world_size=world_size, autocast=autocast, say=say,
                               pad_id=tokenizer.pad_token_id, model_config=model_config)  # what this process is
    checkpoints.prepare_output_dir(out, config.run.overwrite, rank)  # nothing refuses the run now: --overwrite acts
    stats = progress.RunStats(model, config, process)  # losses, throughput and MFU, out of the loop's way
    stop = training.Stop(out, hung=stats.watch.hung)  # SIGTERM, SIGUSR1: stop at a step's end, with a checkpoint
    if folder:
        _, state = model.load_checkpoint(folder.parent, folder.name)  # ZeRO: every rank loads its shards
        stats.restore(zero.after_load(folder, state, process, config.train.seed))  # ZeRO: and its own random state
        say(f"resumed at step {stats.step} of {total_steps} from {folder}")
    with stats.paused():  # preference pairs (DPO): the model as loaded scores them, once (not training time)
        train, evals = preference.reference(model, (train, evals), config, out, process)  # the pairs with theirs
    # -------------------------------------------------------------------------------- train
    say(f"{stats.describe()} | {train.describe(config.data.packing)} | {total_steps} steps of {global_batch} "
        f"sequences ({training.split(config, world_size)}) | lr {config.train.lr:g} | {precision} | {device}")
    model.train()
    divisor = zero.gradient_divisor(model, world_size, config.sequence_parallel)  # ZeRO: what the engine divides by
    shard = zero.sequence_shard(rank, config.sequence_parallel)  # ZeRO: this rank's part of its replica's sequences
    bar = tqdm(range(stats.step, total_steps), initial=stats.step, total=total_steps,
               disable=True if rank else None)  # None: a bar on a terminal only, not in log files
    for step in bar:
        indices = batches(step)  # the global batch: the same sequences whatever the number of ranks
        predicted = int(train.predicted[indices].sum())  # tokens that carry loss in the whole global batch
        micro_batches = indices.view(config.train.grad_accum, -1, config.train.batch_size)  # ZeRO: every rank's,
        micro_batches = micro_batches[:, rank // config.zero.sequence_parallel]  # ZeRO: and this rank's share
        kl = preference.kl_point(model, train, micro_batches, process) if train.format == "unpaired" else None  # KTO
        step_loss = torch.zeros((), device=device)
        for micro in micro_batches:
            inputs, targets = train.batch(micro, process, width=compiled.width, kl=kl, sequence_shard=shard)  # ZeRO
            with autocast, compiled.after_warmup(step):  # --compile: after its warm-up, no more graphs
                summed = model(inputs=inputs, targets=targets)  # the batch's summed loss (loss.CausalLMLoss)
                batch_loss = summed.loss / predicted
            # ZeRO: the engine averages gradients over ranks and micro-steps; undo both, so the gradient is the
            # token mean over the global batch exactly as in single-gpu.py
            model.backward(batch_loss * divisor, scale_wrt_gas=False)
            model.step()  # ZeRO: at the last micro-step: clip, update, step the LR schedule, zero the gradients
            step_loss += batch_loss.detach()
            stats.micro_step(summed)  # progress, for the hang watchdog; preference pairs: their metrics' sums
        grad_norm = model.get_global_grad_norm()  # ZeRO: the engine's norm before clipping, as clip_grad_norm_'s
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
                    torch.save(checkpoints.rng_state(device), folder / f"rng-{rank}.pt")  # ZeRO: per rank
                    # ZeRO: a collective: every rank writes its shards (DeepSpeed's own `latest` would move before the
                    # other ranks are done: ours moves after the barrier)
                    model.save_checkpoint(folder.parent, folder.name, client_state={"stats": stats.state()},
                                          save_latest=False)
                    torch.distributed.barrier()  # ZeRO: every rank has finished writing
        if stopping:
            stop.exit(step + 1, say)  # every rank, once the checkpoint is published; exit status 75: resume me
    # -------------------------------------------------------------------------------- sample and save
    checkpoints.load_best(model, out, stats, config.run.final, process)  # --final best: its checkpoint
    held = models.held_bytes(model, optimizer)  # per rank: weights, gradients, optimizer state (what plan.py plans)
    sample = models.sample(model, tokenizer, config.run.prompt, evals, process)  # or why not
    state = zero.gathered_state_dict(model)  # ZeRO: the last collective: the shards, whole, on rank 0
    del hf_ds_config  # ZeRO: from here on transformers builds whole models again (rank 0 merges LoRA on its own)
    results = {**stats.results(world_size, global_batch, held), "sample": sample}
    if rank == 0:  # rank 0 writes alone: the HF model (LoRA: merged into it), safetensors; the adapter in final/adapter
        models.save_final(model.module.causal_lm, tokenizer, out / "final", state)  # ZeRO: the engine wraps the model
        base.write_json(out / "results.json", results)
        progress.plot_losses(stats.losses, out / "loss.png")
    say(f"saved {out / 'final'} and {out / 'results.json'}")
    mended.undo()  # ZeRO: DeepSpeed's own functions back for the process (a notebook's next run starts from them)
    torch.distributed.destroy_process_group()  # ZeRO: leave the group cleanly
    return results


if __name__ == "__main__":
    distributed.run_distributed(main)  # ZeRO: one line, not a traceback from every rank, if a rank is lost
