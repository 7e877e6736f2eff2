"""What single-gpu.py and zero-optimization.py share and is not their lesson: checks, quiet output, the batch order,
progress and throughput, evaluation, results (the run folder and its checkpoints: checkpoints.py)."""
import contextlib
import dataclasses
import io
import logging
import math
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from . import hangs, hardware, loss, models, preference, tracking
from .base import ROOT, fail, write_json  # noqa: F401 (the scripts' training.fail, training.write_json)
from .blocks import rank_batches

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
# fp16's dynamic loss scale, the same as the ds_config files' "fp16" block: start at 2^16, halve at an overflow (and
# skip that step), double after 1001 steps without one (DeepSpeed's loss_scale_window 1000 counts one step more than
# torch's growth_interval). DeepSpeed's hysteresis is 1 there: torch has none.
FP16_SCALER = {"init_scale": 2.0**16, "growth_interval": 1001}


def quiet(verbose, rank):
    """Rank 0 prints the project's lines, and the libraries speak up only for errors: no Python warnings, their
    loggers at warning level (transformers' at error on ranks > 0). --verbose brings everything back."""
    if verbose:
        return
    warnings.filterwarnings("ignore", module=r"(torch|deepspeed|transformers|datasets|accelerate|peft|huggingface_hub)")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity(logging.WARNING if rank == 0 else logging.ERROR)
    datasets.utils.logging.set_verbosity_warning()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    ds_comm = sys.modules.get("deepspeed.comm.torch")
    if ds_comm is not None and not getattr(ds_comm.build_shm_op, "quiet", False):
        ds_comm.build_shm_op = _without_print(ds_comm.build_shm_op)


def _without_print(build):
    """On CPUs DeepSpeed loads its shared-memory all-reduce in every process and prints that it did (comm/torch.py,
    build_shm_op): the same line from every rank of every launch. Its output is not ours to show."""
    def quiet_build():
        with contextlib.redirect_stdout(io.StringIO()):
            return build()
    quiet_build.quiet = True
    return quiet_build


@dataclasses.dataclass(frozen=True)
class Process:
    """What this process is, made once in setup and passed whole: where it computes, its place among the ranks, the
    precision it computes in, how batches are laid out and who prints."""
    device: Any  # torch.device
    rank: int
    world_size: int
    autocast: Any  # hardware.autocast's context (nothing under fp32, or where the engine holds 16-bit weights)
    pad_id: int  # the tokenizer's padding token
    model_config: Any  # the model's config as loaded: its attention implementation lays the batches out (blocks.py)
    say: Callable = print  # rank 0's printer (the others print nothing)


def split(config, world_size):
    """How a global batch is made: 'B per micro-step x A micro-steps x R ranks' (with sequence parallelism: R/N
    replicas of N ranks, each sequence split over its N ranks). `config`: the run's Config (flags.py)."""
    sp, train = config.sequence_parallel, config.train
    who = f"{world_size} ranks" if sp == 1 else f"{world_size // sp} replicas of {sp} ranks, a sequence over {sp}"
    return f"{train.batch_size} per micro-step x {train.grad_accum} micro-steps x {who}"


def param_groups(model, weight_decay):
    """AdamW groups: no weight decay on biases and normalization weights (one-dimensional parameters). Under ZeRO-3 a
    parameter is a flat shard: its shape is in ds_shape."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrix = lambda p: len(getattr(p, "ds_shape", p.shape)) >= 2
    return [{"params": [p for p in trainable if matrix(p)], "weight_decay": weight_decay},
            {"params": [p for p in trainable if not matrix(p)], "weight_decay": 0.0}]


def cosine_schedule(optimizer, warmup_steps, total_steps):
    """The learning rate rises linearly from 0 over the warmup steps, then falls along half a cosine to 0 at the last
    step: the schedule of transformers' get_cosine_schedule_with_warmup, whose import brings peft and bitsandbytes
    (2 s of every process's start-up)."""
    def factor(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class GlobalBatches:
    """The order of training: optimizer step s trains on the same global batch of blocks whatever the number of
    ranks, a new seeded shuffle each epoch. Ranks and micro-steps only split it (see the training loops)."""

    def __init__(self, num_blocks, global_batch, seed):
        self.num_blocks, self.global_batch, self.seed = num_blocks, global_batch, seed
        self.steps_per_epoch = num_blocks // global_batch  # a last, partial global batch is dropped
        self._epoch, self._order = None, None

    def __call__(self, step):
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_blocks, generator=generator)
        return self._order[k * self.global_batch:(k + 1) * self.global_batch]


# ----------------------------------------------------------------------------------------------------
# Progress: losses, throughput, MFU

class RunStats:
    """The run's bookkeeping, kept out of the training loop: the losses (held on the device between log lines, so
    the loop has one host sync per interval), tokens and time (checkpoints and the first interval, the warm-up, left
    out of the steady-state figures), FLOPs and MFU. On several ranks, an all-reduce adds their shares of each step's
    loss. `config`: the run's Config (flags.py); `process`: training.Process."""

    def __init__(self, model, config, process):
        self.model_config, self.run, self.device, self.model = process.model_config, config.run, process.device, model
        inner = getattr(model, "module", model)
        numel = hardware.values
        self.total = sum(numel(p) for p in {id(p): p for p in inner.parameters()}.values())
        self.trainable = sum(numel(p) for p in {id(p): p for p in inner.parameters() if p.requires_grad}.values())
        self.matmul_params = hardware.matmul_params(inner)
        self.trained_matmul_params = hardware.matmul_params(inner, trainable_only=True)
        facts = hardware.facts(self.device)
        self.peak = hardware.peak_tflops(facts.name, config.model.precision) if facts.kind == "cuda" else None
        self.precision = config.model.precision
        self.step, self.losses, self.pending, self.intervals = 0, [], [], []
        self.grad_norms, self.pending_norms, self.evals, self.eval_time = [], [], [], 0.0
        self.pair_metrics, self.pending_pairs = {name: [] for name in preference.METRICS}, []  # DPO's, per step
        self.step_pairs = None  # this step's micro-batches' pair metrics, summed (micro_step)
        self.final_step = None  # the step of the weights in final/ (load_best)
        self.answers_failed = False  # said once: the trackers' eval answers could not be generated
        self.train_time, self.tokens, self.interval_tokens, self.interval_attended = 0.0, 0, 0, 0
        self.interval_start, self.last_pause = time.perf_counter(), 0.0
        dist = torch.distributed
        self.rank, self.ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.rank_memory = [0.0] * self.ranks  # each rank's peak memory (GiB), brought over with the losses
        self.trackers = tracking.Trackers(self.run.report_to, self.run.output_dir, config.flat(), self.rank)
        self.watchdog = None  # a hang names itself (hangs.py): on several ranks, with a bound on their collectives
        if self.ranks > 1 and config.zero:
            self.watchdog = hangs.Watchdog(self.run.output_dir, config.zero.dist_timeout, self.rank,
                                           self.ranks, dist.distributed_c10d._get_default_store())

    def describe(self):
        share = f"{self.trainable / 1e6:.2f}M trainable ({100 * self.trainable / self.total:.2f}%)"
        active = self.matmul_params < hardware.matmul_params(self.model, all_experts=True)
        share += f", {self.matmul_params / 1e6:.2f}M active per token" if active else ""
        peak = f" | MFU against {self.peak[1]}" if self.peak else ""
        return " | ".join([f"{self.total / 1e6:.1f}M parameters, {share}{peak}", *models.notes(self.model)])

    def micro_step(self, summed):
        """A micro-step's loss is made (a loss.Summed): progress for the hang watchdog (hangs.py), however long a step
        of many micro-steps takes; preference pairs: their metrics' sums, added up over the step."""
        hangs.progress()
        if summed.pair_metrics is not None:
            self.step_pairs = summed.pair_metrics + (0 if self.step_pairs is None else self.step_pairs)

    def end_step(self, step_loss, blocks, indices, grad_norm):
        """grad_norm: the step's gradient norm before clipping (a tensor or a float; read at the next log line)."""
        self.step += 1
        self.pending.append(step_loss)
        self.pending_norms.append(grad_norm)
        sums, self.step_pairs = self.step_pairs, None  # pairs: this rank's sums, averaged over the global batch's
        if sums is not None:
            self.pending_pairs.append(torch.cat([sums, sums.new_tensor([blocks.predicted[indices].sum()])]))
        self.interval_tokens += int(blocks.lengths[indices].sum())
        self.interval_attended += int(blocks.attended[indices].sum())
        profile(self.step)
        if self.watchdog:
            self.watchdog.beat(self.step)


    def _flush(self):
        """The pending losses, on the host (a sync), summed over the ranks, and checked: a NaN stops the run before
        any checkpoint could hold it. Each rank's peak memory rides along in the same all-reduce (its own slot)."""
        if not self.pending:
            return
        memory = torch.zeros(self.ranks, device=self.pending[0].device)
        memory[self.rank] = peak_memory_bytes(self.device) / 2**30
        pairs = torch.stack(self.pending_pairs).flatten() if self.pending_pairs else memory[:0]
        losses = torch.cat([torch.stack(self.pending).float(), memory, pairs.to(memory.device)])
        if self.ranks > 1:
            torch.distributed.all_reduce(losses)
        n = len(self.pending)
        losses, self.rank_memory, pairs = losses[:n], losses[n:n + self.ranks].tolist(), losses[n + self.ranks:]
        first_pairs = len(self.pair_metrics["rewards/chosen"]) + 1
        for chosen, rejected, right, logp_chosen, logp_rejected, count in pairs.view(-1, 6).tolist():
            count /= self.ranks  # every rank added the global batch's count
            values = [chosen / count, rejected / count, right / count, (chosen - rejected) / count,
                      logp_chosen / count, logp_rejected / count]
            for name, value in zip(preference.METRICS, values):
                self.pair_metrics[name].append(value)
        for step in range(first_pairs, len(self.pair_metrics["rewards/chosen"]) + 1):
            self.trackers.log({f"train/{k}": v[step - 1] for k, v in self.pair_metrics.items()}, step)
        self.pending_pairs = []
        first = len(self.losses) + 1
        self.losses += losses.tolist()
        self.grad_norms += [float(norm) for norm in self.pending_norms]  # the same on every rank
        self.pending, self.pending_norms = [], []
        for step in range(first, len(self.losses) + 1):
            self.trackers.log({"train/loss": self.losses[step - 1], "train/grad_norm": self.grad_norms[step - 1]},
                              step)
        for step, value in enumerate(self.losses[first - 1:], first):
            if not math.isfinite(value):
                fail(f"the loss is {value} at step {step}: training diverged (lower --lr, use bf16 rather than "
                     f"fp16) or the model or data hold NaN/inf; the checkpoints are all from before step {step}")

    def log_due(self, step, total_steps):
        return (step + 1) % self.run.log_every == 0 or step + 1 == total_steps

    def eval_due(self, step, total_steps):
        return bool(self.run.eval_every) and (step + 1) % self.run.eval_every == 0 or step + 1 == total_steps

    def save_due(self, step, total_steps):
        """Every --save-every steps and at the end (0: never; a signal saves whenever it comes: checkpoints.Stop)."""
        every = self.run.save_every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == total_steps)

    def eval_line(self, step, result, answers=None):
        """Record the eval loss after `step + 1` steps ((loss, tokens) from evaluate, run within paused()) and say
        it; `answers` (models.answers) go to the trackers as text, or the first time they failed, a word of why. Every
        rank calls it (the pending losses go to the trackers first: W&B drops steps that come late)."""
        self._flush()
        (value, tokens, accuracy), seconds = result, self.last_pause
        failed = ""
        if isinstance(answers, Exception):
            if not self.answers_failed:
                failed = f" | no answers for the trackers ({type(answers).__name__}: {str(answers).strip()[:120]})"
            self.answers_failed, answers = True, None
        if answers:
            self.trackers.text("eval/samples", answers, step + 1)
        self.evals.append([step + 1, value])
        self.eval_time += seconds
        best = min(self.evals, key=lambda e: e[1] if math.isfinite(e[1]) else math.inf)
        mark = " | best so far" if best[0] == step + 1 and len(self.evals) > 1 else ""
        if accuracy is not None:  # preference pairs: the DPO loss, and how often the chosen answer gains more
            self.trackers.log({"eval/loss": value, "eval/rewards/accuracies": accuracy, "eval/runtime": seconds},
                              step + 1)
            return (f"step {step + 1} | eval DPO loss {value:.4f} | reward accuracy {accuracy:.3f} | {tokens:,} pairs "
                    f"| {seconds:.1f} s{mark}{failed}")
        self.trackers.log({"eval/loss": value, "eval/perplexity": perplexity(value), "eval/runtime": seconds},
                          step + 1)
        return (f"step {step + 1} | eval loss {value:.4f} | perplexity {perplexity(value):.2f} | {tokens:,} tokens | "
                f"{seconds:.1f} s{mark}{failed}")

    def log_line(self, step, total_steps, lr):
        self._flush()
        if self.watchdog and step + 1 == total_steps:  # the last step: nothing left to watch
            self.watchdog.stop()
        elapsed = time.perf_counter() - self.interval_start
        self.train_time, self.tokens = self.train_time + elapsed, self.tokens + self.interval_tokens
        attended = self.interval_attended / max(1, self.interval_tokens)
        self.intervals.append([step + 1, elapsed, self.interval_tokens, attended])
        line = (f"step {step + 1}/{total_steps} | loss {self.losses[-1]:.4f} | lr {lr:.2e} | "
                f"{self.interval_tokens / elapsed:,.0f} tok/s")
        mfu = self.mfu(self.intervals[-1:]) if len(self.intervals) > 1 else None  # the first interval warms up
        most = max(range(self.ranks), key=lambda r: self.rank_memory[r])
        if mfu is not None:
            line += f" | MFU {100 * mfu:.1f}% | peak mem {self.rank_memory[most]:.1f} GiB"
            line += f" (rank {most})" if self.ranks > 1 else ""
        self.trackers.log({"train/learning_rate": lr, "train/tokens_per_second": self.interval_tokens / elapsed,
                           "train/mfu": mfu, "train/peak_memory_gb": self.rank_memory[most],
                           **{f"memory/rank_{r}_peak_gb": gb for r, gb in enumerate(self.rank_memory)}}, step + 1)
        self.interval_start, self.interval_tokens, self.interval_attended = time.perf_counter(), 0, 0
        return line

    def mfu(self, intervals):
        """Model FLOPs utilization over these log intervals: FLOPs done per second per GPU over the peak."""
        if not self.peak or not intervals:
            return None
        per_token = lambda attended: hardware.flops_per_token(self.model_config, self.matmul_params, attended,
                                                              self.trained_matmul_params)
        flops = sum(per_token(a) * t for _, _, t, a in intervals)
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return flops / sum(s for _, s, _, _ in intervals) / world_size / (self.peak[0] * 1e12)

    @contextlib.contextmanager
    def paused(self):
        """Time spent here (writing a checkpoint, evaluating) is not training time (and is kept in last_pause)."""
        start = time.perf_counter()
        if self.watchdog:  # their collectives are bounded by --dist-timeout (a checkpoint may take minutes)
            self.watchdog.pause(True)
        yield
        if self.ranks > 1:  # the ranks leave together: rank 0 publishes a checkpoint alone, and the others' wait for
            torch.distributed.barrier()  # it must not count as training, nor look like a hang to their watchdogs
        if self.watchdog:
            self.watchdog.pause(False)
        self.last_pause = time.perf_counter() - start
        self.interval_start += self.last_pause

    def state(self):
        """The run's progress, for a checkpoint: also what the trackers have written by then (tracking.py)."""
        self._flush()
        self.trackers.checkpoint()
        return {"step": self.step, "losses": self.losses, "train_time": self.train_time, "tokens": self.tokens,
                "intervals": self.intervals, "grad_norms": self.grad_norms, "evals": self.evals,
                "eval_time": self.eval_time, "pair_metrics": self.pair_metrics}

    def restore(self, state):
        self.step, self.losses, self.intervals = state["step"], state["losses"], state["intervals"]
        self.train_time, self.tokens = state["train_time"], state["tokens"]
        self.grad_norms = state.get("grad_norms", [None] * self.step)  # checkpoints written before they were kept
        self.evals, self.eval_time = state.get("evals", []), state.get("eval_time", 0.0)
        self.interval_start = time.perf_counter()  # loading the checkpoint was not training
        self.pair_metrics = state.get("pair_metrics", self.pair_metrics)

    def results(self, world_size, global_batch, held_bytes):
        self._flush()
        self.trackers.close()
        steady = self.intervals[1:] or self.intervals
        eval_loss = self.evals[-1][1] if self.evals else None  # at the last step
        finite = [e for e in self.evals if math.isfinite(e[1])]
        best = min(finite, key=lambda e: e[1]) if finite else [None, None]
        return {"losses": self.losses, "grad_norms": self.grad_norms, "eval_loss": eval_loss,
                "perplexity": perplexity(eval_loss) if eval_loss is not None else None, "evals": self.evals,
                "best_step": best[0], "best_eval_loss": best[1], "final_step": self.final_step or self.step,
                "eval_time_s": self.eval_time, **{k: v for k, v in self.pair_metrics.items() if v},
                "train_runtime_s": self.train_time, "train_tokens": self.tokens,
                "tokens_per_sec": self.tokens / self.train_time if self.train_time else None,
                "mfu": self.mfu(steady), "log_intervals": self.intervals,
                "peak_memory_bytes": peak_memory_bytes(self.device), "peak_memory_gb_per_rank": self.rank_memory,
                "model_state_bytes_per_rank": held_bytes,
                "trainable_params": self.trainable, "total_params": self.total, "world_size": world_size,
                "global_batch_size": global_batch, "precision": self.precision, "ran": what_ran(self.model)}


def what_ran(model):
    """What the run trained with, read from the model (under DeepSpeed the engine), not from the flags: the dtype the
    trainable weights are held in (ZeRO-3: their shards; the engine keeps fp32 masters beside 16-bit ones), gradient
    checkpointing; under DeepSpeed its ZeRO stage, 16-bit mode (its own 16-bit weights, or torch's autocast over fp32
    ones), and the optimizer that steps and where its state is (offload: DeepSpeed's CPU Adam)."""
    net = getattr(model, "module", model)
    trainable = next(p for p in net.parameters() if p.requires_grad)
    held = getattr(trainable, "ds_tensor", trainable)
    name = lambda dtype: str(dtype).removeprefix("torch.")
    ran = {"weights_dtype": name(held.dtype), "gradient_checkpointing": bool(net.is_activation_checkpointing)}
    if hasattr(model, "zero_optimization_stage"):
        ran["zero_stage"] = model.zero_optimization_stage()
        ran["engine_precision"] = "bf16" if model.bfloat16_enabled() else "fp16" if model.fp16_enabled() else \
            f"{str(model.torch_autocast_dtype()).removeprefix('torch.')} autocast" if model.torch_autocast_enabled() \
            else "fp32"
        inner = getattr(model.optimizer, "optimizer", model.optimizer)  # ZeRO's optimizers wrap the one that steps
        moments = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
        ran["optimizer"] = f"{type(inner).__name__} on {moments[0].device.type if moments else 'nothing yet'}"
    return ran


def profile(step, first=4, steps=4):
    """TRAIN_PROFILE=folder: torch.profiler over steps first+1 .. first+steps, each rank's table of where the time went
    written to folder/profile-rank<r>.txt (bench/BENCHMARKS.md has what it found), and how often each event occurred
    per step to folder/profile-rank<r>.json (kernel launches, device syncs: bench/gpu.py). Off unless asked."""
    folder = os.environ.get("TRAIN_PROFILE")
    if not folder or step not in (first, first + steps):
        return
    activities, sort = profiled(torch.cuda.is_available())
    if step == first:
        profile.active = torch.profiler.profile(activities=activities, record_shapes=False)
        profile.active.__enter__()
        return
    profile.active.__exit__(None, None, None)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    Path(folder).mkdir(parents=True, exist_ok=True)
    events = profile.active.key_averages()
    (Path(folder) / f"profile-rank{rank}.txt").write_text(events.table(sort_by=sort, row_limit=25))
    write_json(Path(folder) / f"profile-rank{rank}.json", {e.key: e.count / steps for e in events})


def profiled(cuda):
    """What TRAIN_PROFILE records, and what its table is sorted by: on a GPU its kernels too (a CPU-only profile of a
    GPU run shows the launches, not the work), by their time."""
    cpu, gpu = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    return ([cpu, gpu], "self_device_time_total") if cuda else ([cpu], "self_cpu_time_total")


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident memory of this process


# ----------------------------------------------------------------------------------------------------
# Evaluation and results

@torch.no_grad()
def eval_loss_sums(model, blocks, train, process):
    """(summed loss, predicted tokens, 0) over this rank's share of the eval set, as a float64 tensor to all-reduce;
    for preference pairs (summed DPO loss, pairs, pairs ranked right). Every rank runs the same number of forward
    passes (ZeRO-3 gathers parameters collectively); a rank with nothing left runs a batch whose loss is masked out.
    `train`: flags.Train (--batch-size sequences a rank and pass, --beta); `process`: training.Process."""
    model.eval()
    total = torch.zeros(3, dtype=torch.float64, device=process.device)
    pairs = None
    for mine in rank_batches(len(blocks), train.batch_size, process.rank, process.world_size):
        inputs, targets = blocks.batch(mine if len(mine) else [0], process.pad_id, process.device,
                                       process.model_config, carry_loss=len(mine) > 0)
        # eagerly under --compile: in eval mode without gradients dynamo compiles every graph anew, which takes
        # longer than most evals run (docs/zero.md)
        with process.autocast, torch.compiler.set_stance("force_eager"):
            summed = loss.token_loss_sum(model, inputs, targets, train.beta)
        total[0] += summed.loss.double()
        total[1] += targets.counted
        if summed.pair_metrics is not None:
            pairs = summed.pair_metrics + (0 if pairs is None else pairs)
    if pairs is not None:
        total[2] = pairs[2]
    model.train()
    return total


def evaluate(model, blocks, train, process):
    """(eval loss, tokens, None): the mean loss over the eval set's tokens that carry loss (the answers, for prompt/
    completion and chats), every rank evaluating its share; for preference pairs (the mean DPO loss, pairs, the
    reward accuracy). It draws no random numbers and leaves the model in training mode: a run that evaluates trains
    exactly as one that does not."""
    sums = eval_loss_sums(model, blocks, train, process)
    if process.world_size > 1:
        torch.distributed.all_reduce(sums)
    accuracy = (sums[2] / sums[1]).item() if blocks.pieces is not None else None
    return (sums[0] / sums[1]).item(), int(sums[1]), accuracy


def perplexity(value):
    return math.exp(value) if value < 700 else float("inf")  # exp overflows a float past ~709


def plot_losses(losses, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set(xlabel="optimizer step", ylabel="training loss", title="loss per step (mean over the global batch)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
