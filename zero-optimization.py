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

from finetune import checkpoints, data, demo, hardware, loss, models, preference, tracking, training
from finetune import distributed, mends, zero  # ZeRO


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # data (To-Do: your dataset; text, prompt + completion, messages, or preference pairs (DPO), found from the
    # columns: docs/data.md)
    p.add_argument("--dataset", default="yelp_review_full", help="hub name or local .csv/.json/.jsonl/.txt/.parquet")
    p.add_argument("--dataset-config", help="the hub dataset's subset, if it has several")
    p.add_argument("--text-column", help="plain text, the loss on every token (default: a column named text)")
    p.add_argument("--prompt-column", help="the loss on the completion only (default: columns prompt, completion)")
    p.add_argument("--completion-column")
    p.add_argument("--messages-column", help="chats, the loss on the assistant's turns only (default: messages)")
    p.add_argument("--train-on-prompt", action="store_true", help="the loss on prompts and user turns too")
    p.add_argument("--block-size", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--packing", default="isolated", choices=["isolated", "stream", "none"],
                   help="isolated: whole documents per block, each attending to itself; stream: cut a stream")
    p.add_argument("--max-train-samples", type=int, default=0, help="train on the first N rows only (0: all)")
    p.add_argument("--eval-dataset", help="a file as --dataset takes, or hub name[:split] (default: the dataset's "
                                          "validation or test split, else --eval-fraction of its rows)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of the rows held out to evaluate on")
    p.add_argument("--max-eval-samples", type=int, default=1000, help="evaluate on N rows drawn once (0: all)")
    p.add_argument("--num-proc", type=int, default=0, help="processes that tokenize (0: the cores)")
    # model (To-Do: your model; --lora-rank 16 when full fine-tuning does not fit, then --load-in-4bit)
    p.add_argument("--model", default="facebook/opt-125m", help="hub id or local folder of a causal LM")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model that ships its own code")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16", "fp16"],
                   help="auto: bf16 from Ampere on, fp16 on older GPUs, fp32 on CPUs")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations: less memory, slower")
    p.add_argument("--compile", action="store_true", help="torch.compile: faster steps after a slow first one")
    p.add_argument("--loss-chunk", type=int, default=1024,
                   help="tokens per piece of the loss, so the logits of all tokens never exist at once (0: at once)")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    p.add_argument("--lora-alpha", type=float, default=32, help="the adapters' scale is alpha / rank")
    p.add_argument("--lora-targets", default="all-linear", help="comma-separated module names (default: every "
                                                                "linear layer of attention and MLP)")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: the frozen base in 4 bits (NF4), adapters in 32")
    p.add_argument("--load-in-8bit", action="store_true", help="the frozen base of LoRA in 8 bits (LLM.int8)")
    # train (To-Do: the largest --batch-size that fits, then --grad-accum for the global batch you want; --lr)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per device per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, help="peak learning rate (default 5e-5; preference pairs 1e-6, with LoRA 5e-6)")
    p.add_argument("--beta", type=float, default=0.1, help="preference pairs (DPO): how far from the reference the "
                                                           "model may move (lower: further)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.05, help="share of the steps spent warming up the LR")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradients' norm to this (0: no clipping)")
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="optimizer steps; overrides --epochs when > 0")
    p.add_argument("--seed", type=int, default=42)
    # run
    p.add_argument("--output-dir", default="out/zero")  # ZeRO
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    p.add_argument("--eval-every", type=int, default=500, help="optimizer steps between evals (0: at the end only)")
    p.add_argument("--save-every", type=int, default=500, help="optimizer steps between checkpoints (0: none)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept (0: all), and the best")
    p.add_argument("--final", default="last", choices=["last", "best"],
                   help="what final/ holds: the model after the last step, or the checkpoint with the lowest eval loss")
    p.add_argument("--report-to", nargs="+", default=["none"], choices=tracking.TRACKERS,
                   help="trackers that get the losses, LR, throughput, evals (under <output-dir>; W&B: optional)")
    p.add_argument("--resume", nargs="?", const="newest", choices=["newest", "auto"],
                   help="continue from the newest checkpoint in --output-dir (auto: if there is one, else start)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --output-dir")
    p.add_argument("--prompt", default="The food was", help="what the trained model answers at the end ('' skips)")
    p.add_argument("--verbose", action="store_true", help="the libraries' warnings and logs too")
    p.add_argument("--demo", action="store_true", help="tiny model + generated questions about reviews (CPU ok)")
    # ZeRO: the DeepSpeed config file, and overrides of what matters most in it (To-Do: stage 2 if the model fits,
    # stage 3 if not, then --offload cpu; more in ds_config_zero*.json)
    p.add_argument("--deepspeed", "--deepspeed_config", nargs="?", const=str(zero.DEFAULT_CONFIG),
                   default=str(zero.DEFAULT_CONFIG), metavar="CONFIG", help="DeepSpeed JSON (default: ZeRO-3's)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override the config's ZeRO stage")
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], help="optimizer (and, stage 3, parameter) offload")
    p.add_argument("--nvme-path", default="/local_nvme", help="folder on a fast local disk for --offload nvme")
    p.add_argument("--dist-timeout", type=int, default=1800, help="seconds a collective waits (a save, a lost rank)")
    p.add_argument("--sequence-parallel", type=int, default=1, help="split each sequence over N ranks: longer blocks")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    args = p.parse_args(argv)
    if args.demo:  # the demo changes the defaults; flags given on the command line still win
        p.set_defaults(**demo.defaults())
        args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)

    # -------------------------------------------------------------------------------- setup
    rank, local_rank, world_size = distributed.launch_env()  # ZeRO: from deepspeed, torchrun, srun; or a world of one
    device = hardware.first_device(local_rank)  # this process's GPU, made current before anything touches CUDA
    say = tqdm.write if rank == 0 else (lambda *a, **k: None)
    training.quiet(args.verbose, rank)
    distributed.init_distributed(args)  # ZeRO: the process group, nccl or gloo; its timeouts, flight recorder
    args.precision = hardware.choose_precision(args.precision, hardware.facts(device))  # To-Do: --precision
    hardware.set_matmul_precision(args.precision)
    remote = {"trust_remote_code": args.trust_remote_code}  # off unless asked: it runs code from the model's repo
    config = models.load_pretrained(AutoConfig, args.model, **remote)
    training.check_args(args, getattr(config, "max_position_embeddings", None))
    out = checkpoints.prepare_output_dir(args.output_dir, args.overwrite, args.resume, rank)
    torch.manual_seed(args.seed)

    # -------------------------------------------------------------------------------- data
    tokenizer = models.load_tokenizer(args.model, **remote)
    train, evals = data.prepare(args, tokenizer, local_rank)  # tokenized and packed once per node, then mapped
    args.lr = preference.learning_rate(args.lr, train.format, args.lora_rank)  # To-Do: --lr (its default: the data's)
    global_batch = args.batch_size * args.grad_accum * world_size // args.sequence_parallel  # ZeRO: SP ranks share rows
    batches = training.GlobalBatches(len(train), global_batch, args.seed)
    if batches.steps_per_epoch == 0:
        training.fail(f"{len(train)} training sequences is less than one global batch of {global_batch}; "
                      f"lower --batch-size or --grad-accum, or add data")
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.epochs * batches.steps_per_epoch)
    warmup_steps = math.ceil(args.warmup_ratio * total_steps)  # rounded up, as the HF Trainer does

    # -------------------------------------------------------------------------------- model and optimizer
    # ZeRO: fill the JSON's "auto" values from the flags; the engine builds the optimizer it names
    ds_config = zero.deepspeed_config(args, world_size, total_steps, warmup_steps, config)
    # ZeRO: the newest checkpoint, or its universal form when another number of ranks wrote it
    folder = zero.resume_folder(out, args, world_size, ds_config, rank, say) if args.resume else None
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # ZeRO-3: from_pretrained loads each rank's shard, never a full copy
    model = models.load_causal_lm(args, config, device, **remote)  # fp32 master weights, the fastest attention
    config = model.config  # as loaded: its attention implementation decides the batches' layout (data.py)
    model = models.prepare_model(model, args)  # LoRA adapters (--lora-rank), gradient checkpointing, chunked loss
    schedule = lambda opt: training.cosine_schedule(opt, warmup_steps, total_steps)
    model, optimizer, _, scheduler = deepspeed.initialize(  # ZeRO: wraps model and optimizer, shards their state
        model=model, model_parameters=training.param_groups(model, args.weight_decay), config=ds_config,
        lr_scheduler=None if "scheduler" in ds_config else schedule, mpu=zero.sequence_parallel(args, model))
    autocast = zero.autocast(model, device, args.precision)  # ZeRO: the engine's 16-bit weights, or ZeRO-0's autocast
    if args.compile:  # in place: the state dict keeps its names, so checkpoints and save_pretrained are unchanged
        model.compile()  # ZeRO: the engine's compile (it turns off what would break the graph)
    mends.mend(model)  # ZeRO: DeepSpeed's fp16 loss scale where it errs, its slow paths (finetune/mends.py)
    stats = training.RunStats(config, model, args, device)  # losses, throughput and MFU, out of the loop's way
    stop = checkpoints.Stop(out)  # SIGTERM, SIGUSR1 (a scheduler's notice): stop at a step's end with a checkpoint
    if folder:
        _, state = model.load_checkpoint(folder.parent, folder.name)  # ZeRO: every rank loads its shards
        zero.after_load(model, folder, rank, args, state["stats"]["step"], device)  # ZeRO: RNG per rank, ...
        stats.restore(state["stats"])
        say(f"resumed at step {stats.step} of {total_steps} from {folder}")

    with stats.paused():  # preference pairs (DPO): the model as loaded scores them, once (not training time)
        preference.reference(model, (train, evals), args, out, tokenizer.pad_token_id, device, config, autocast,
                             rank, world_size, say)
    # -------------------------------------------------------------------------------- train
    say(f"{stats.describe()} | {train.describe(args.packing)} | {total_steps} steps of {global_batch} sequences "
        f"({training.split(args, world_size)}) | lr {args.lr:g} | {args.precision} | {device}")
    model.train()
    bar = tqdm(range(stats.step, total_steps), initial=stats.step, total=total_steps,
               disable=True if rank else None)  # None: a bar on a terminal only, not in log files
    for step in bar:
        indices = batches(step)  # the global batch: the same sequences whatever the number of ranks
        predicted = int(train.predicted[indices].sum())  # tokens that carry loss in the whole global batch
        step_loss = torch.zeros((), device=device)
        for micro in indices.view(args.grad_accum, -1):
            share = micro.view(-1, args.batch_size)[rank // args.sequence_parallel]  # ZeRO: this replica's share
            inputs, labels = train.batch(share, tokenizer.pad_token_id, device, config,
                                         sequence_shard=zero.sequence_shard(rank, args))  # ZeRO: SP: its tokens
            with autocast:
                batch_loss = loss.token_loss_sum(model, inputs, labels) / predicted
            # ZeRO: the engine averages gradients over ranks and micro-steps; undo both, so the gradient is the
            # token mean over the global batch exactly as in single-gpu.py
            model.backward(batch_loss * zero.gradient_divisor(model, world_size, args), scale_wrt_gas=False)
            model.step()  # ZeRO: at the last micro-step: clip, update, step the LR schedule, zero the gradients
            step_loss += batch_loss.detach()
        grad_norm = zero.grad_norm(model)  # ZeRO: the engine's global norm before clipping, as clip_grad_norm_'s
        stats.end_step(step_loss, train, indices, grad_norm)

        if stats.log_due(step, total_steps):  # the one host-device sync: the interval's losses, checked
            say(stats.log_line(step, total_steps, scheduler.get_last_lr()[0]))
        if stats.eval_due(step, total_steps):  # every --eval-every steps and at the end; before the checkpoint
            with stats.paused():  # every rank evaluates its share of the eval set
                result = training.evaluate(model, evals, args, tokenizer.pad_token_id, device, config, autocast,
                                           rank, world_size)
                answers = models.answers(model, tokenizer, evals.examples, evals.format, device, rank, autocast) \
                    if stats.trackers.names else None  # a few eval prompts answered, for the trackers
            say(stats.eval_line(step, result, answers))
        stopping = stop.due()  # a signal reached any rank (under ZeRO the ranks agree: one tiny all-reduce)
        if stopping or args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == total_steps):
            with stats.paused():  # into a temporary folder; published (renamed, then pointed to) only once complete
                record = checkpoints.run_record(step + 1, args, global_batch, world_size, model, stats)  # run.json
                with checkpoints.saving(out, record, args.keep_checkpoints, rank) as folder:  # a full disk: one line
                    torch.save(checkpoints.rng_state(device), folder / f"rng-{rank}.pt")  # ZeRO: per rank
                    # ZeRO: a collective: every rank writes its shards (DeepSpeed's own `latest` would move before the
                    # other ranks are done: ours moves after the barrier)
                    model.save_checkpoint(folder.parent, folder.name, client_state={"stats": stats.state()},
                                          save_latest=False)
                    torch.distributed.barrier()  # ZeRO: every rank has finished writing
        if stopping:
            stop.exit(step + 1, say)  # every rank, once the checkpoint is published; exit status 75: resume me

    # -------------------------------------------------------------------------------- sample
    checkpoints.load_best(model, out, stats, args, world_size, say)  # --final best: its checkpoint
    held = models.held_bytes(model, optimizer)  # per rank: weights, gradients, optimizer state (what plan.py plans)
    sample = models.sample(model, tokenizer, args.prompt, evals, device, say, rank, autocast)  # or a line why

    # -------------------------------------------------------------------------------- save (rank 0 writes alone)
    final = out / "final"
    state = zero.gathered_state_dict(model)  # ZeRO: the last collective: the shards, whole, on rank 0
    del hf_ds_config  # ZeRO: from here on transformers builds whole models again (rank 0 merges LoRA on its own)
    results = {**stats.results(world_size, global_batch, held), "sample": sample}
    if rank == 0:  # the HF model (LoRA: merged into it), safetensors; the LoRA adapter in final/adapter
        models.save_final(model.module, tokenizer, final, state)  # ZeRO: the engine wraps the model
        training.write_json(out / "results.json", results)
        training.plot_losses(stats.losses, out / "loss.png")
    say(f"saved {final} and {out / 'results.json'}")
    torch.distributed.destroy_process_group()  # ZeRO: leave the group cleanly
    return results


if __name__ == "__main__":
    distributed.run_distributed(main)  # ZeRO: one line, not a traceback from every rank, if a rank is lost
