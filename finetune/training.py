"""What single-gpu.py and zero-optimization.py share to set a run up and run its loop, and is not their lesson: quiet
output, what a process is, the global batches' order, the optimizer's groups and the LR schedule, clipping,
--compile's warm-up, stopping on a signal. (The run's progress: progress.py;
evaluation: evaluation.py; the run folder and its checkpoints: checkpoints.py.)"""
import contextlib
import dataclasses
import io
import logging
import math
import os
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import hardware
from .base import fail, write_json
from .checkpoints import STOPPED, STOPPED_FILE
from .internals.hangs import HUNG

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


@dataclasses.dataclass(frozen=True, kw_only=True)
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
    pinned: bool | None = None  # batches through pinned memory (hardware.pinned_copies, decided once from the device)

    def __post_init__(self):
        if self.pinned is None:
            object.__setattr__(self, "pinned", hardware.pinned_copies(self.device.type))

    def to_device(self, array):
        """A host array on this process's device: pinned and asynchronous where that lets the host run ahead. torch's
        pinned memory pool keeps the block until the copy has run."""
        tensor = torch.from_numpy(array)
        return tensor.pin_memory().to(self.device, non_blocking=True) if self.pinned else tensor.to(self.device)


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


def clip_gradients(optimizer, max_norm):
    """torch's clip_grad_norm_ over the parameters the optimizer trains (max_norm None or 0: no limit): the gradients'
    norm before clipping, which DeepSpeed's engine reports too. The optimizer's lists, not model.parameters(), which
    walks the module tree at every step (1,900 Python calls for OPT-125m's 196 tensors)."""
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    return torch.nn.utils.clip_grad_norm_(trainable, max_norm or math.inf)


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
    ranks, a new seeded shuffle each epoch. Ranks and micro-steps only split it (see the training loops). Fewer
    blocks than one global batch is one line."""

    def __init__(self, num_blocks, global_batch, seed):
        self.num_blocks, self.global_batch, self.seed = num_blocks, global_batch, seed
        self.steps_per_epoch = num_blocks // global_batch  # a last, partial global batch is dropped
        if self.steps_per_epoch == 0:
            fail(f"{num_blocks} training sequences is less than one global batch of {global_batch}; lower "
                 f"--batch-size or --grad-accum, or add data")
        self._epoch, self._order = None, None

    def __call__(self, step):
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_blocks, generator=generator)
        return self._order[k * self.global_batch:(k + 1) * self.global_batch]


class CompileWarmup:
    """--compile: a run's graphs are compiled in its first steps; after them (STEPS) a batch that would need another
    graph runs eagerly instead (torch's compiler stance eager_on_recompile, around each forward), so a run whose shapes
    keep changing never compiles a step (chats on an H200 ran 10x slower compiled than eagerly). With the rows padded
    to the block size and the loss's sizes dynamic (Blocks.batch's `width`), the warm-up compiles one graph. Said once,
    as the warm-up ends. `width`: what Blocks.batch pads the rows to, a row's most tokens (None without --compile)."""
    STEPS = 3

    def __init__(self, enabled, row_tokens, say):
        self.enabled, self.say, self.first = enabled, say, None
        self.width = row_tokens if enabled else None

    def after_warmup(self, step):
        """The context for step `step`'s forward passes."""
        if not self.enabled:
            return contextlib.nullcontext()
        self.first = step if self.first is None else self.first
        if step - self.first < self.STEPS:
            return contextlib.nullcontext()
        if step - self.first == self.STEPS:
            from torch._dynamo.utils import counters

            graphs = counters["stats"]["unique_graphs"]
            self.say(f"--compile: {graphs} graph{'s' * (graphs != 1)} compiled in the first {self.STEPS} steps; from "
                     f"here a batch of another shape runs eagerly, never compiled anew")
        return torch.compiler.set_stance("eager_on_recompile")



class Stop:
    """SIGTERM (what SLURM, Kubernetes and a spot reclaim send before SIGKILL) and SIGUSR1 (`#SBATCH
    --signal=USR1@120`, sent to the job's steps) ask the run to stop at the end of the step in flight: every rank
    stops at the same step, writes its checkpoint as at any --save-every, and the run exits STOPPED. A second signal
    changes nothing; a kill during the save leaves the previous checkpoint as `latest` (publish_checkpoint).

    `out`/stopped.json says so after the checkpoint (rank 0 writes it; a run that starts removes it): what a batch
    script reads to requeue the job, whatever exit status a launcher made of 75 on the way."""

    def __init__(self, out, hung=None):
        """`hung`: an Event the hang watchdog sets once this rank has written its hang report (progress.Watch.hung):
        a signal then ends the process at once, as it has no step to finish (the launcher is ending it)."""
        self.signal, self.world, self.marker = None, None, Path(out) / STOPPED_FILE
        self.hung = hung
        if os.environ.get("RANK", "0") == "0":
            self.marker.unlink(missing_ok=True)
        for number in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(number, self._ask)

    def _world(self):
        """(ranks, the group they agree on), at the first step's end: the process group may not exist yet when Stop is
        made (the HF Trainer makes it in TrainingArguments). Every rank gets here at the same step (new_group is a
        collective). The group is a CPU one: the flag never waits on a GPU's queue of work (no host sync per step)."""
        if self.world is None:
            dist = torch.distributed
            ranks = dist.get_world_size() if dist.is_initialized() else 1
            self.world = ranks, None if ranks == 1 or dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self.world

    def _ask(self, number, frame):
        if self.hung is not None and self.hung.is_set():  # a hung run has no step to finish
            os._exit(HUNG)
        self.signal = self.signal or number

    def due(self):
        """Whether to stop after this step: a signal reached any rank (only the signalled node knows, on a cluster:
        a one-element all-reduce tells the others)."""
        ranks, group = self._world()
        flag = torch.tensor([self.signal is not None], dtype=torch.int32)
        if ranks > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def exit(self, step, say):
        """After the checkpoint: every rank has finished (a launcher stops the others as soon as one exits), then
        leave with STOPPED."""
        ranks, group = self._world()
        name = signal.Signals(self.signal).name if self.signal else "a signal to another rank"
        if os.environ.get("RANK", "0") == "0":  # before the barrier: once a rank leaves, a launcher stops the others
            write_json(self.marker, {"step": step, "signal": name})
        if ranks > 1:
            torch.distributed.barrier(group=group)
        say(f"stopped by {name} after step {step}, its checkpoint written: rerun with --resume auto to continue")
        raise SystemExit(STOPPED)
