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

from finetune import checkpoints, data, demo, hardware, loss, models, preference, tracking, training


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
    p.add_argument("--output-dir", default="out/single-gpu")
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
    args = p.parse_args(argv)
    if args.demo:  # the demo changes the defaults; flags given on the command line still win
        p.set_defaults(**demo.defaults())
        args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)

    # -------------------------------------------------------------------------------- setup
    rank, local_rank, world_size = 0, 0, 1
    device = hardware.first_device(local_rank)  # this process's GPU, made current before anything touches CUDA
    say = tqdm.write if rank == 0 else (lambda *a, **k: None)
    training.quiet(args.verbose, rank)
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
    global_batch = args.batch_size * args.grad_accum * world_size  # sequences per optimizer step
    batches = training.GlobalBatches(len(train), global_batch, args.seed)
    if batches.steps_per_epoch == 0:
        training.fail(f"{len(train)} training sequences is less than one global batch of {global_batch}; "
                      f"lower --batch-size or --grad-accum, or add data")
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.epochs * batches.steps_per_epoch)
    warmup_steps = math.ceil(args.warmup_ratio * total_steps)  # rounded up, as the HF Trainer does

    # -------------------------------------------------------------------------------- model and optimizer
    folder = checkpoints.resume_folder(out, args, world_size)[0] if args.resume else None  # the newest checkpoint
    model = models.load_causal_lm(args, config, device, **remote)  # fp32 master weights, the fastest attention
    config = model.config  # as loaded: its attention implementation decides the batches' layout (data.py)
    model = models.prepare_model(model, args)  # LoRA adapters (--lora-rank), gradient checkpointing, chunked loss
    model.to(device)
    optimizer = torch.optim.AdamW(training.param_groups(model, args.weight_decay), lr=args.lr,
                                  betas=training.ADAM_BETAS, eps=training.ADAM_EPS, fused=True)  # one kernel
    scheduler = training.cosine_schedule(optimizer, warmup_steps, total_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16", **training.FP16_SCALER)
    autocast = hardware.autocast(device, args.precision)  # bf16, fp16: mixed precision over the fp32 weights
    if args.compile:  # in place: the state dict keeps its names, so checkpoints and save_pretrained are unchanged
        model.compile()
    stats = training.RunStats(config, model, args, device)  # losses, throughput and MFU, out of the loop's way
    stop = checkpoints.Stop(out)  # SIGTERM, SIGUSR1 (a scheduler's notice): stop at a step's end with a checkpoint
    if folder:  # into the model, the optimizer, the schedule and the scaler; nothing of the file is kept
        stats.restore(checkpoints.load_state(folder, model, optimizer, scheduler, scaler, device))
        say(f"resumed at step {stats.step} of {total_steps} from {folder}")

    with stats.paused():  # preference pairs (DPO): the model as loaded scores them, once (not training time)
        preference.reference(model, (train, evals), args, out, tokenizer.pad_token_id, device, config, autocast,
                             rank, world_size, say)
    # -------------------------------------------------------------------------------- train
    say(f"{stats.describe()} | {train.describe(args.packing)} | {total_steps} steps of {global_batch} sequences "
        f"({training.split(args, world_size)}) | lr {args.lr:g} | {args.precision} | {device}")
    model.train()
    scale = scaler.get_scale()  # fp16's loss scale, as the last update left it (1.0 without fp16)
    bar = tqdm(range(stats.step, total_steps), initial=stats.step, total=total_steps,
               disable=True if rank else None)  # None: a bar on a terminal only, not in log files
    for step in bar:
        indices = batches(step)  # the global batch: the same sequences whatever the number of ranks
        predicted = int(train.predicted[indices].sum())  # tokens that carry loss in the whole global batch
        step_loss = torch.zeros((), device=device)
        for micro in indices.view(args.grad_accum, -1):
            inputs, labels = train.batch(micro, tokenizer.pad_token_id, device, config)
            with autocast:
                batch_loss = loss.token_loss_sum(model, inputs, labels) / predicted
            scaler.scale(batch_loss).backward()
            step_loss += batch_loss.detach()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # pre-clip
        scaler.step(optimizer)  # fp16: skips the update when a gradient overflowed, and lowers the scale
        scaler.update()
        scale, last_scale = scaler.get_scale(), scale  # fp16 only: a host sync (DeepSpeed syncs for the same check)
        if scale >= last_scale:  # a skipped update leaves the LR schedule where it was, as DeepSpeed does
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
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
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                                "stats": stats.state(), "rng": checkpoints.rng_state(device)}, folder / "state.pt")
        if stopping:
            stop.exit(step + 1, say)  # every rank, once the checkpoint is published; exit status 75: resume me

    # -------------------------------------------------------------------------------- sample
    checkpoints.load_best(model, out, stats, args, world_size, say)  # --final best: its checkpoint
    held = models.held_bytes(model, optimizer)  # per rank: weights, gradients, optimizer state (what plan.py plans)
    sample = models.sample(model, tokenizer, args.prompt, evals, device, say, rank, autocast)  # or a line why

    # -------------------------------------------------------------------------------- save (rank 0 writes alone)
    final = out / "final"
    results = {**stats.results(world_size, global_batch, held), "sample": sample}
    if rank == 0:  # the HF model (LoRA: merged into it), safetensors; the LoRA adapter in final/adapter
        models.save_final(model, tokenizer, final)
        training.write_json(out / "results.json", results)
        training.plot_losses(stats.losses, out / "loss.png")
    say(f"saved {final} and {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
