"""The run's progress, kept out of the training loop, one concern a class: what a checkpoint keeps of it (Record), the
hang watchdog's lifecycle (Watch), and what is reported (RunStats: the losses held on the device between log lines,
gathered in one all-reduce a log line with every rank's peak memory and the pairs' metrics, checked for NaN, said and
given to the trackers; tokens, time, MFU). Also what a run trained with (what_ran), the profiler (TRAIN_PROFILE) and
the loss plot."""
import contextlib
import dataclasses
import math
import os
import resource
import threading
import time
from pathlib import Path

import torch

from . import hardware, long_sequences, loss, models, preference, tracking
from .base import fail, write_json
from .evaluation import perplexity
from .internals import hangs, step_time


@dataclasses.dataclass
class Record:
    """What a checkpoint keeps of the run's progress (its "stats"), so that a resume continues the curves, the evals
    and the throughput where they were: per step the loss and the gradient norm (and the pairs' metrics), the evals
    as [step, loss], the log intervals as [step, seconds, tokens, attended share], time and tokens trained."""
    step: int = 0
    losses: list = dataclasses.field(default_factory=list)
    grad_norms: list = dataclasses.field(default_factory=list)
    evals: list = dataclasses.field(default_factory=list)
    eval_time: float = 0.0
    train_time: float = 0.0
    tokens: int = 0
    intervals: list = dataclasses.field(default_factory=list)
    pair_metrics: dict = dataclasses.field(default_factory=lambda: {name: [] for name in preference.METRICS})

    @classmethod
    def restored(cls, state):
        """From a checkpoint's state, also one written before some of it was kept."""
        known = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in state.items() if k in known})
        if "grad_norms" not in state:
            record.grad_norms = [None] * record.step
        logged = len(record.pair_metrics.get("rewards/chosen", []))
        for name in preference.METRICS:  # a metric kept since: none for the steps before
            record.pair_metrics.setdefault(name, [None] * logged)
        return record


class Watch:
    """The hang watchdog's lifecycle (internals/hangs.py), on several ranks with a bound on their collectives
    (--dist-timeout): told of each micro-step (progress), beaten at each step's end, paused around what that bound
    covers (a checkpoint, an evaluation: minutes), stopped after the last step. Nothing in a world of one, or without
    the bound (single-gpu.py). `hung`: set once this rank has reported a hang (training.Stop reads it)."""

    def __init__(self, out, dist_timeout, rank, ranks, trackers):
        self.dog, self.hung = None, threading.Event()
        if ranks > 1 and dist_timeout:
            store = torch.distributed.distributed_c10d._get_default_store()
            self.dog = hangs.Watchdog(out, dist_timeout, rank, ranks, store=store, before_exit=trackers.close)
            self.hung = self.dog.reported

    def progress(self):
        if self.dog:
            self.dog.progress()

    def beat(self, step):
        if self.dog:
            self.dog.beat(step)

    def pause(self, paused):
        if self.dog:
            self.dog.pause(paused)

    def stop(self):
        if self.dog:
            self.dog.stop()


class RunStats:
    """What the loop reports, kept out of it: the losses held on the device between log lines (one host sync an
    interval) and gathered then (gather: the one all-reduce, its name says so, as log_interval and log_eval that
    call it), tokens and time (checkpoints and the first interval, the warm-up, left out of the steady-state
    figures), FLOPs and MFU, the trackers; its Record is what a checkpoint keeps, its Watch the hang watchdog's.
    `config`: the run's Config (flags.py); `process`: training.Process."""

    def __init__(self, model, config, process):
        self.model_config, self.run, self.device, self.model = process.model_config, config.run, process.device, model
        inner = loss.causal_lm(model)
        numel = hardware.values
        self.total = sum(numel(p) for p in {id(p): p for p in inner.parameters()}.values())
        self.trainable = sum(numel(p) for p in {id(p): p for p in inner.parameters() if p.requires_grad}.values())
        self.matmul_params = hardware.matmul_params(inner)
        self.trained_matmul_params = hardware.matmul_params(inner, trainable_only=True)
        facts = hardware.facts(self.device)
        self.peak = hardware.peak_tflops(facts.name, config.model.precision) if facts.kind == "cuda" else None
        self.precision = config.model.precision
        self.record = Record()  # what a checkpoint keeps
        self.pending, self.pending_norms = [], []  # on the device until the next log line
        self.pairs = preference.PairMetrics()  # preference pairs' metrics, the same way
        self.final_step = None  # the step of the weights in final/ (load_best)
        self.answers_failed = False  # said once: the trackers' eval answers could not be generated
        self.interval_tokens, self.interval_attended = 0, 0
        self.interval_start, self.last_pause = time.perf_counter(), 0.0
        dist = torch.distributed
        self.rank, self.ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.rank_memory = [0.0] * self.ranks  # each rank's peak memory (GiB), brought over with the losses
        self.trackers = tracking.Trackers(self.run.report_to, self.run.output_dir, config.flat(), self.rank)
        self.watch = Watch(self.run.output_dir, config.zero and config.zero.dist_timeout, self.rank, self.ranks,
                           self.trackers)
        vocabulary = hardware.text_config(inner.config).vocab_size  # (Gemma 3's: its text config's)
        self.profiler = Profiler(os.environ.get("TRAIN_PROFILE"), self.rank, vocabulary)

    def describe(self):
        share = f"{self.trainable / 1e6:.2f}M trainable ({100 * self.trainable / self.total:.2f}%)"
        active = self.matmul_params < hardware.matmul_params(loss.causal_lm(self.model), all_experts=True)
        share += f", {self.matmul_params / 1e6:.2f}M active per token" if active else ""
        peak = f" | MFU against {self.peak[1]}" if self.peak else ""
        return " | ".join([f"{self.total / 1e6:.1f}M parameters, {share}{peak}", *models.notes(self.model)])

    def micro_step(self, summed):
        """A micro-step's loss is made (a loss.Summed): progress for the hang watchdog (internals/hangs.py), however
        long a step of many micro-steps takes; preference pairs: their metrics' sums, added up over the step."""
        self.watch.progress()
        if summed.pair_metrics is not None:
            self.pairs.add(summed.pair_metrics)

    def end_step(self, step_loss, blocks, indices, grad_norm):
        """grad_norm: the step's gradient norm before clipping (a tensor or a float, read at the next log line; None
        where the engine has none: ZeRO-0 under --mends none)."""
        self.record.step += 1
        self.pending.append(step_loss)
        self.pending_norms.append(grad_norm)
        if self.pairs.step_sums is not None:  # (a block's count is of its pairs: the global batch's pairs)
            self.pairs.end_step(blocks.predicted[indices].sum())
        self.interval_tokens += int(blocks.lengths[indices].sum())
        self.interval_attended += int(blocks.attended[indices].sum())
        self.profiler.step_done(self.record.step)
        self.watch.beat(self.record.step)


    def gather(self):
        """The pending losses, on the host (a sync), summed over the ranks (the one all-reduce: a collective, every
        rank calls it), given to the trackers and checked: a NaN stops the run before any checkpoint could hold it.
        Each rank's peak memory rides along in the same all-reduce (its own slot), and the pairs' metrics."""
        if not self.pending:
            return
        record = self.record
        memory = torch.zeros(self.ranks, device=self.pending[0].device)
        memory[self.rank] = peak_memory_bytes(self.device) / 2**30
        pairs = self.pairs.take(memory)
        losses = torch.cat([torch.stack(self.pending).float(), memory, pairs])
        if self.ranks > 1:
            torch.distributed.all_reduce(losses)
        n = len(self.pending)
        losses, self.rank_memory, pairs = losses[:n], losses[n:n + self.ranks].tolist(), losses[n + self.ranks:]
        first_pairs = len(record.pair_metrics["rewards/chosen"]) + 1
        for step, values in enumerate(self.pairs.per_step(pairs, self.ranks), first_pairs):
            for name, value in values.items():  # (KTO's kl: kept from its first step on)
                record.pair_metrics.setdefault(name, [None] * (step - 1)).append(value)
            self.trackers.log({f"train/{k}": v for k, v in values.items()}, step)
        first = len(record.losses) + 1
        record.losses += losses.tolist()
        record.grad_norms += [math.nan if norm is None else float(norm) for norm in self.pending_norms]  # every rank's
        self.pending, self.pending_norms = [], []
        for step in range(first, len(record.losses) + 1):
            self.trackers.log({"train/loss": record.losses[step - 1], "train/grad_norm": record.grad_norms[step - 1]},
                              step)
        for step, value in enumerate(record.losses[first - 1:], first):
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

    def log_eval(self, step, result, answers=None):
        """Record the eval loss after `step + 1` steps ((loss, tokens) from evaluation.evaluate, run within paused()),
        give it to the trackers and return the line that says it; `answers` (models.answers) go to the trackers as
        text, or the first time they failed, a word of why. Every rank calls it: the pending losses are gathered and
        logged first (W&B drops steps that come late)."""
        self.gather()
        (value, tokens, metrics), seconds = result, self.last_pause
        failed = ""
        if isinstance(answers, Exception):
            if not self.answers_failed:
                failed = f" | no answers for the trackers ({type(answers).__name__}: {str(answers).strip()[:120]})"
            self.answers_failed, answers = True, None
        if answers:
            self.trackers.text("eval/samples", answers, step + 1)
        self.record.evals.append([step + 1, value])
        self.record.eval_time += seconds
        best = min(self.record.evals, key=lambda e: e[1] if math.isfinite(e[1]) else math.inf)
        mark = " | best so far" if best[0] == step + 1 and len(self.record.evals) > 1 else ""
        if metrics is not None:  # preference pairs: the DPO loss, how often the chosen answer gains more, TRL's rest
            self.trackers.log({"eval/loss": value, **{f"eval/{k}": v for k, v in metrics.items()},
                               "eval/runtime": seconds}, step + 1)
            if "kl" in metrics:  # KTO: no pairs to rank, the desirable completions' margin over the rest
                return (f"step {step + 1} | eval KTO loss {value:.4f} | reward margin {metrics['rewards/margins']:.3f}"
                        f" | kl {metrics['kl']:.4f} | {tokens:,} completions | {seconds:.1f} s{mark}{failed}")
            return (f"step {step + 1} | eval preference loss {value:.4f} | reward accuracy "
                    f"{metrics['rewards/accuracies']:.3f} | {tokens:,} pairs | {seconds:.1f} s{mark}{failed}")
        self.trackers.log({"eval/loss": value, "eval/perplexity": perplexity(value), "eval/runtime": seconds},
                          step + 1)
        return (f"step {step + 1} | eval loss {value:.4f} | perplexity {perplexity(value):.2f} | {tokens:,} tokens | "
                f"{seconds:.1f} s{mark}{failed}")

    def log_interval(self, step, total_steps, lr):
        """The log interval that ends with `step + 1`: its losses gathered (gather: every rank calls it), its
        throughput, MFU and peak memory given to the trackers; the line that says them."""
        self.gather()
        if step + 1 == total_steps:  # the last step: nothing left to watch
            self.watch.stop()
        elapsed = time.perf_counter() - self.interval_start
        self.record.train_time += elapsed
        self.record.tokens += self.interval_tokens
        attended = self.interval_attended / max(1, self.interval_tokens)
        self.record.intervals.append([step + 1, elapsed, self.interval_tokens, attended])
        line = (f"step {step + 1}/{total_steps} | loss {self.record.losses[-1]:.4f} | lr {lr:.2e} | "
                f"{self.interval_tokens / elapsed:,.0f} tok/s")
        intervals = self.record.intervals
        mfu = self.mfu(intervals[-1:]) if len(intervals) > 1 else None  # the first interval warms up
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
        self.watch.pause(True)  # their collectives are bounded by --dist-timeout (a checkpoint may take minutes)
        yield
        if self.ranks > 1:  # the ranks leave together: rank 0 publishes a checkpoint alone, and the others' wait for
            torch.distributed.barrier()  # it must not count as training, nor look like a hang to their watchdogs
        self.watch.pause(False)
        self.last_pause = time.perf_counter() - start
        self.interval_start += self.last_pause

    def state(self):
        """The run's progress, for a checkpoint: also what the trackers have written by then (tracking.py)."""
        self.gather()
        self.trackers.checkpoint()
        return dataclasses.asdict(self.record)

    def restore(self, state):
        """The progress a checkpoint kept (state()), to go on from."""
        self.record = Record.restored(state)
        self.interval_start = time.perf_counter()  # loading the checkpoint was not training

    @property
    def step(self):
        return self.record.step

    @property
    def losses(self):
        return self.record.losses

    @property
    def evals(self):
        return self.record.evals

    def results(self, world_size, global_batch, held_bytes):
        self.profiler.close(self.record.step)
        self.gather()
        self.trackers.close()
        steady = self.record.intervals[1:] or self.record.intervals
        eval_loss = self.record.evals[-1][1] if self.record.evals else None  # at the last step
        finite = [e for e in self.record.evals if math.isfinite(e[1])]
        best = min(finite, key=lambda e: e[1]) if finite else [None, None]
        return {"losses": self.record.losses, "grad_norms": self.record.grad_norms, "eval_loss": eval_loss,
                "perplexity": perplexity(eval_loss) if eval_loss is not None else None, "evals": self.record.evals,
                "best_step": best[0], "best_eval_loss": best[1], "final_step": self.final_step or self.record.step,
                "eval_time_s": self.record.eval_time, **{k: v for k, v in self.record.pair_metrics.items() if v},
                "train_runtime_s": self.record.train_time, "train_tokens": self.record.tokens,
                "tokens_per_sec": self.record.tokens / self.record.train_time if self.record.train_time else None,
                "mfu": self.mfu(steady), "log_intervals": self.record.intervals,
                "peak_memory_bytes": peak_memory_bytes(self.device), "peak_memory_gb_per_rank": self.rank_memory,
                "peak_host_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # this rank's
                "model_state_bytes_per_rank": held_bytes,
                "trainable_params": self.trainable, "total_params": self.total, "world_size": world_size,
                "global_batch_size": global_batch, "precision": self.precision, "ran": what_ran(self.model)}


def what_ran(model):
    """What the run trained with, read from the model (under DeepSpeed the engine), not from the flags: the dtype the
    trainable weights are held in (ZeRO-3: their shards; the engine keeps fp32 masters beside 16-bit ones), gradient
    checkpointing; under DeepSpeed its ZeRO stage, 16-bit mode (its own 16-bit weights, or torch's autocast over fp32
    ones), and the optimizer that steps and where its state is (offload: DeepSpeed's CPU Adam); whether the layers'
    inputs went to the host (--offload-activations) and the MLPs ran in tiles (--tiled-mlp)."""
    net = loss.causal_lm(model)
    trainable = next(p for p in net.parameters() if p.requires_grad)
    held = getattr(trainable, "ds_tensor", trainable)
    name = lambda dtype: str(dtype).removeprefix("torch.")
    ran = {"weights_dtype": name(held.dtype), "gradient_checkpointing": bool(net.is_activation_checkpointing),
           "offload_activations": any(isinstance(getattr(getattr(m, "_gradient_checkpointing_func", None),
                                                         "__self__", None), long_sequences.HostCopies)
                                      for m in net.modules()),
           "tiled_mlp": any(isinstance(vars(m).get("forward"), long_sequences.TiledForward) for m in net.modules())}
    if hasattr(model, "zero_optimization_stage"):
        ran["zero_stage"] = model.zero_optimization_stage()
        ran["engine_precision"] = "bf16" if model.bfloat16_enabled() else "fp16" if model.fp16_enabled() else \
            f"{str(model.torch_autocast_dtype()).removeprefix('torch.')} autocast" if model.torch_autocast_enabled() \
            else "fp32"
        inner = getattr(model.optimizer, "optimizer", model.optimizer)  # ZeRO's optimizers wrap the one that steps
        moments = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
        ran["optimizer"] = f"{type(inner).__name__} on {moments[0].device.type if moments else 'nothing yet'}"
    return ran


class Profiler:
    """TRAIN_PROFILE=folder (read once, as the run starts; docs/gpu.md): torch.profiler over steps first+1 ..
    first+steps, each rank's table of where the time went written to folder/profile-rank<r>.txt (bench/BENCHMARKS.md
    has what it found), how often each event occurred per step to folder/profile-rank<r>.json (kernel launches,
    device syncs: bench/gpu.py) and a step's time by kind to folder/profile-rank<r>-kinds.json (internals/step_time.py;
    `vocabulary`: the model's, whose dimension marks the head's and the loss's kernels). Off unless asked."""

    def __init__(self, folder, rank, vocabulary=None, first=4, steps=4):
        self.folder, self.rank, self.vocabulary, self.first, self.steps = folder, rank, vocabulary, first, steps
        self.active = None

    def step_done(self, step):
        if not self.folder or step not in (self.first, self.first + self.steps):
            return
        if step == self.first:
            self.active = torch.profiler.profile(activities=profiled(torch.cuda.is_available())[0],
                                                 record_shapes=True)
            self.active.__enter__()
            return
        self.close(step)

    def close(self, step):
        """Stop profiling and write what it counted (also at a run's end before its last profiled step: a profiler
        still running as the interpreter exits crashes it)."""
        if self.active is None:
            return
        active, self.active, steps = self.active, None, step - self.first
        active.__exit__(None, None, None)
        if steps:  # (none when the run ended at the step that started it)
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            events, sort = active.key_averages(), profiled(torch.cuda.is_available())[1]
            (Path(self.folder) / f"profile-rank{self.rank}.txt").write_text(events.table(sort_by=sort, row_limit=25))
            write_json(Path(self.folder) / f"profile-rank{self.rank}.json", {e.key: e.count / steps for e in events})
            try:  # (a benchmark's figure: its failure is said in the file, never the run's)
                kinds = step_time.of_events(active.events(), steps, self.vocabulary)
            except Exception as e:  # noqa: BLE001
                kinds = {"error": f"{type(e).__name__}: {e}"}
            write_json(Path(self.folder) / f"profile-rank{self.rank}-kinds.json", kinds)


def profiled(cuda):
    """What TRAIN_PROFILE records, and what its table is sorted by: on a GPU its kernels too (a CPU-only profile of a
    GPU run shows the launches, not the work), by their time."""
    cpu, gpu = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    return ([cpu, gpu], "self_device_time_total") if cuda else ([cpu], "self_cpu_time_total")


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident memory of this process


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
