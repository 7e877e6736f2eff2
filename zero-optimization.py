"""Fine-tune a causal language model on many GPUs and nodes with DeepSpeed ZeRO (data parallel, sharded).

    deepspeed zero-optimization.py --deepspeed                         # all GPUs here, ds_config_zero3.json
    deepspeed --hostfile=job/hostfile zero-optimization.py --deepspeed # many nodes (see job/)
    deepspeed --num_gpus 2 zero-optimization.py --demo --zero-stage 2  # tiny demo, also on CPU
    torchrun --nproc_per_node 4 zero-optimization.py --deepspeed_config ds_config_zero2.json --offload cpu

This is single-gpu.py plus the edits DeepSpeed ZeRO needs, each marked `# ZeRO:`;
`diff single-gpu.py zero-optimization.py` shows them. Places to tune are marked `To-Do:`.
"""
import argparse
import contextlib
import math
import os  # ZeRO: LOCAL_RANK from the launcher
import time

import deepspeed  # ZeRO
import torch
import torch.distributed as dist  # ZeRO
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.integrations import HfDeepSpeedConfig  # ZeRO

import data
import demo
import training
import zero_utils


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # data (To-Do: your dataset and its text column; --block-size up to the model's context)
    p.add_argument("--dataset", default="yelp_review_full", help="hub name or local .csv/.json/.jsonl/.txt/.parquet")
    p.add_argument("--text-column", default="text")
    p.add_argument("--block-size", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--no-packing", dest="packing", action="store_false", help="one text per sequence, padded")
    # model (To-Do: your model; bf16 on A100/H100-class GPUs; checkpointing when activations do not fit)
    p.add_argument("--model", default="facebook/opt-125m", help="hub id or local folder of a causal LM")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model that ships its own code")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on GPUs that have it, else fp32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations: less memory, slower")
    p.add_argument("--compile", action="store_true", help="torch.compile: faster steps after a slow first one")
    # train (To-Do: the largest --batch-size that fits, then --grad-accum for the global batch you want; --lr)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per device per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.05, help="share of the steps spent warming up the LR")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="optimizer steps; overrides --epochs when > 0")
    p.add_argument("--seed", type=int, default=42)
    # run
    p.add_argument("--output-dir", default="out/zero")  # ZeRO
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    p.add_argument("--save-every", type=int, default=500, help="optimizer steps between checkpoints (0: none)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept (0: all)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --output-dir")
    p.add_argument("--prompt", default="The food was", help="text to continue with the saved model ('' to skip)")
    p.add_argument("--demo", action="store_true", help="tiny model + generated corpus shipped with the repo")
    # ZeRO: the DeepSpeed config file, and overrides of what matters most in it (To-Do: stage 2 if the model fits,
    # stage 3 if not, then --offload cpu; more in ds_config_zero*.json)
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override the config's ZeRO stage")
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], help="optimizer (and, stage 3, parameter) offload")
    p.add_argument("--nvme-path", default="/local_nvme", help="folder on a fast local disk for --offload nvme")
    p.add_argument("--dist-timeout", type=int, default=300, help="seconds a collective waits for a lost rank")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    args = p.parse_args(argv)
    if args.demo:  # the demo changes the defaults; flags given on the command line still win
        p.set_defaults(**demo.demo_defaults())
        args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)

    # -------------------------------------------------------------------------------- setup
    zero_utils.single_process_env()  # ZeRO: a plain `python3` run is a world of one (no MPI)
    deepspeed.init_distributed(timeout=zero_utils.collective_timeout(args.dist_timeout))  # ZeRO: nccl or gloo
    rank, world_size = dist.get_rank(), dist.get_world_size()  # ZeRO
    device = torch.device(deepspeed.get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))  # ZeRO
    say = tqdm.write if rank == 0 else (lambda *a, **k: None)
    args.precision = training.resolve_precision(args.precision, device)
    remote = {"trust_remote_code": args.trust_remote_code}  # off unless asked: it runs code from the model's repo
    config = training.load_pretrained(AutoConfig, args.model, **remote)
    training.check_args(args, getattr(config, "max_position_embeddings", None))
    out = training.prepare_output_dir(args.output_dir, args.overwrite, args.resume, rank)
    torch.manual_seed(args.seed)

    # -------------------------------------------------------------------------------- data
    tokenizer = training.load_pretrained(AutoTokenizer, args.model, **remote)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_texts, eval_texts = data.load_splits(args.dataset, args.text_column, args.seed)
    train = data.tokenize(train_texts, tokenizer, args.text_column, args.block_size, args.packing)
    evals = data.tokenize(eval_texts, tokenizer, args.text_column, args.block_size, args.packing)
    global_batch = args.batch_size * args.grad_accum * world_size  # sequences per optimizer step
    batches = data.GlobalBatches(len(train), global_batch, args.seed)
    if batches.steps_per_epoch == 0:
        training.fail(f"{len(train)} training sequences is less than one global batch of {global_batch}; "
                    f"lower --batch-size or --grad-accum, or add data")
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.epochs * batches.steps_per_epoch)
    warmup_steps = math.ceil(args.warmup_ratio * total_steps)  # rounded up, as the HF Trainer does

    # -------------------------------------------------------------------------------- model and optimizer
    # ZeRO: fill the JSON's "auto" values from the flags; the engine builds the optimizer it names
    ds_path = args.deepspeed_config or training.HERE / "ds_config_zero3.json"
    ds_config, ds_has_scheduler = zero_utils.deepspeed_config(ds_path, args, world_size, total_steps, warmup_steps,
                                                          config.hidden_size)
    if args.resume:  # ZeRO: from another number of ranks, load DeepSpeed's universal form of the checkpoint
        tag = training.latest_checkpoint(out)
        load_from, stage = out / "checkpoints" / tag, ds_config["zero_optimization"].get("stage", 0)
        saved = training.check_resume(load_from, args, world_size, stage)
        if saved["world_size"] != world_size:
            load_from = zero_utils.universal_checkpoint(load_from, rank)
            if load_from.name == "universal":
                ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    keep_alive = HfDeepSpeedConfig(ds_config)  # ZeRO-3: from_pretrained loads each rank's shard, never a full copy
    model = training.load_pretrained(AutoModelForCausalLM, args.model, dtype=torch.float32, **remote)  # fp32 master
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    schedule = lambda opt: get_cosine_schedule_with_warmup(opt, warmup_steps, total_steps)
    model, optimizer, _, scheduler = deepspeed.initialize(  # ZeRO: wraps model and optimizer, shards their state
        model=model, model_parameters=training.param_groups(model, args.weight_decay), config=ds_config,
        lr_scheduler=None if ds_has_scheduler else schedule)
    autocast = contextlib.nullcontext()  # ZeRO: the engine keeps bf16/fp16 weights itself
    if args.compile:  # in place: the state dict keeps its names, so checkpoints and save_pretrained are unchanged
        model.compile()  # ZeRO: the engine's compile (it turns off what would break the graph)
    n_params = training.count_params(model)
    flops_per_token = training.flops_per_token(config, args.block_size, n_params)

    start_step, losses = 0, []
    if args.resume:
        _, state = model.load_checkpoint(load_from.parent, load_from.name)  # ZeRO: every rank loads its shards
        start_step, losses = state["step"], state["losses"]
        zero_utils.restore_rng(out / "checkpoints" / tag, rank, args.seed, start_step)  # ZeRO: each rank has its own
        say(f"resumed from {tag}: step {start_step} of {total_steps}")
        if saved["world_size"] != world_size:  # ZeRO
            say(f"  {tag} was written by {saved['world_size']} ranks and loaded on {world_size}: " +
                (f"DeepSpeed resharded ZeRO's optimizer state from {load_from}" if load_from.name == "universal"
                 else "ZeRO-0 saves the whole optimizer state, nothing to reshard"))

    # -------------------------------------------------------------------------------- train
    say(f"{n_params / 1e6:.1f}M parameters | {len(train)} sequences of <= {args.block_size} tokens | "
        f"{total_steps} steps of {global_batch} sequences ({args.batch_size} per micro-step x {args.grad_accum} "
        f"micro-steps x {world_size} ranks) | precision {args.precision} | {device}")
    model.train()
    pending, tokens_seen, train_time, skipped_steps, intervals = [], 0, 0.0, 0, []
    interval_start, interval_tokens = time.perf_counter(), 0
    bar = tqdm(range(start_step, total_steps), initial=start_step, total=total_steps, disable=rank != 0)
    for step in bar:
        indices = batches(step)  # the global batch: the same sequences whatever the number of ranks
        n_targets = int(train.targets[indices].sum())  # tokens predicted in the whole global batch
        step_loss = torch.zeros((), device=device)
        for micro in indices.view(args.grad_accum, -1):
            batch = train.batch(micro.view(world_size, -1)[rank], pad_id, device)  # ZeRO: this rank's share
            with autocast:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = training.token_loss_sum(logits, batch["labels"]) / n_targets
            # ZeRO: the engine averages gradients over ranks and micro-steps; undo both, so the gradient is the
            # token mean over the global batch exactly as in single-gpu.py
            model.backward(loss * world_size, scale_wrt_gas=False)
            model.step()  # ZeRO: at the last micro-step: clip, update, step the LR schedule, zero the gradients
            step_loss += loss.detach()
        pending.append(step_loss)
        interval_tokens += int(train.lengths[indices].sum())

        log_now = (step + 1) % args.log_every == 0 or step + 1 == total_steps
        save_now = args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == total_steps)
        if log_now or save_now:  # the one host-device sync: bring the interval's losses over, and check them
            step_losses = torch.stack(pending)
            dist.all_reduce(step_losses)  # ZeRO: each rank holds its share of each step's loss
            training.check_finite(step_losses.tolist(), first_step=len(losses) + 1)
            losses += step_losses.tolist()
            pending = []

        if log_now:
            elapsed = time.perf_counter() - interval_start
            train_time, tokens_seen = train_time + elapsed, tokens_seen + interval_tokens
            intervals.append([step + 1, elapsed, interval_tokens])  # throughput over time, for bench/
            line = (f"step {step + 1}/{total_steps} | loss {losses[-1]:.4f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                    f"{interval_tokens / elapsed:,.0f} tok/s")
            peak = training.peak_tflops(device)
            if peak:
                tflops = flops_per_token * interval_tokens / elapsed / world_size / 1e12
                mem = training.peak_memory_bytes(device) / 2**30
                line += f" | {tflops:.0f} TFLOPs/GPU | MFU {100 * tflops / peak:.1f}% | peak mem {mem:.1f} GiB"
            say(line)
            interval_start, interval_tokens = time.perf_counter(), 0

        if save_now:  # into a temporary folder; published (renamed, then pointed to) only once complete
            save_start, tag, ckpt = time.perf_counter(), f"step-{step + 1}", out / "checkpoints"
            (ckpt / f".tmp-{tag}").mkdir(parents=True, exist_ok=True)
            torch.save(training.rng_state(), ckpt / f".tmp-{tag}" / f"rng-{rank}.pt")  # ZeRO: each rank has its own RNG
            # ZeRO: a collective: every rank writes its shards (DeepSpeed's own `latest` would move before the other
            # ranks are done: we move ours after the barrier)
            model.save_checkpoint(ckpt, f".tmp-{tag}", client_state={"step": step + 1, "losses": losses},
                                  save_latest=False)
            dist.barrier()  # ZeRO: every rank has finished writing
            if rank == 0:
                training.write_json(ckpt / f".tmp-{tag}" / "run.json", {  # what a resume checks
                    "step": step + 1, "global_batch_size": global_batch, "world_size": world_size,
                    "zero_stage": model.zero_optimization_stage()})  # ZeRO
                training.publish_checkpoint(ckpt, tag, args.keep_checkpoints)
            interval_start += time.perf_counter() - save_start  # checkpointing is not training time

    # -------------------------------------------------------------------------------- evaluate
    sums = training.evaluate(model, evals, args.batch_size, pad_id, device, autocast, rank, world_size)
    dist.all_reduce(sums)  # ZeRO: each rank evaluated its share
    eval_loss = (sums[0] / sums[1]).item()
    skipped_steps = model.skipped_steps  # ZeRO: the engine's fp16 loss scaler counts them
    if skipped_steps:
        say(f"fp16: the loss scaler skipped {int(skipped_steps)} of {total_steps - start_step} steps (overflow)")
    say(f"eval loss {eval_loss:.4f} | perplexity {training.perplexity(eval_loss):.2f} | {int(sums[1])} tokens")

    # -------------------------------------------------------------------------------- save
    final = out / "final"
    # ZeRO: a collective: gather the shards one layer at a time into a full state dict on rank 0 (in the training
    # precision: fp32 when training in fp32), then save it in HF format
    state = model._zero3_consolidated_16bit_state_dict() if model.zero_optimization_partition_weights() else None
    if rank == 0:
        model.module.save_pretrained(final, state_dict=state)  # ZeRO: the engine wraps the HF model (safetensors)
        tokenizer.save_pretrained(final)
    params_bytes = [None] * world_size
    dist.all_gather_object(params_bytes, training.params_held_bytes(model))  # ZeRO: what each rank holds
    results = {"losses": losses, "eval_loss": eval_loss, "perplexity": training.perplexity(eval_loss),
               "train_runtime_s": train_time, "train_tokens": tokens_seen, "tokens_per_sec": tokens_seen / train_time,
               "log_intervals": intervals, "peak_memory_bytes": training.peak_memory_bytes(device),
               "params_bytes_per_rank": params_bytes,
               "world_size": world_size, "global_batch_size": global_batch, "precision": args.precision,
               "skipped_steps": int(skipped_steps)}
    if rank == 0:
        training.write_json(out / "results.json", results)
        training.plot_losses(losses, out / "loss.png")
    say(f"saved {final} and {out / 'results.json'}")

    del keep_alive  # ZeRO: from here on from_pretrained loads a whole model again
    if args.prompt and rank == 0:  # reload what was saved, as a user would, and continue the prompt
        reloaded = AutoModelForCausalLM.from_pretrained(final, **remote).to(device).eval()
        prompt = [tokenizer.eos_token_id] + tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
        generated = reloaded.generate(torch.tensor([prompt], device=device), max_new_tokens=30, do_sample=False,
                                      pad_token_id=pad_id)
        say(f"sample: {tokenizer.decode(generated[0, 1:], skip_special_tokens=True)!r}")
    dist.destroy_process_group()  # ZeRO: leave the group cleanly
    return results


if __name__ == "__main__":
    zero_utils.run_distributed(main)  # ZeRO: one line, not a traceback from every rank, if a rank is lost
