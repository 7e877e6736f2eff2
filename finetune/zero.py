"""DeepSpeed plumbing for zero-optimization.py (and sequence_classification.py under DeepSpeed) around the engine:
its autocast, gathering the model, resuming on another number of ranks, sequence parallelism's groups and shards, the
gradient's divisor. (The config the engine is made with: zero_config.py; its repairs: internals/mends.py; who this
process is and the entry point: distributed.py.)"""
import os
import shutil
import subprocess
import sys
import time

import torch

from . import checkpoints, hardware
from .base import ROOT, fail
from .internals import sequence_parallel as finetune_sp


def autocast(engine, device, precision):
    """The script's autocast under the engine: none where the engine holds 16-bit weights itself (and fp32 masters);
    at ZeRO-0 in bf16, where the engine autocasts over fp32 weights (zero_config.autocast_at_stage0), the same
    autocast around what runs outside its forward too (generating the samples), as in single-gpu.py."""
    return hardware.autocast(device, precision if engine.torch_autocast_enabled() else "none")


def gathered_state_dict(engine):
    """The model's whole state dict on rank 0 for saving it in Hugging Face format (a collective: every rank calls
    it), or None where rank 0 already holds every weight (ZeRO 0-2). ZeRO-3 gathers the shards one layer at a time,
    in the training precision. Trainable parameters that are few (LoRA adapters) come from the fp32 master weights:
    in a bf16 run the working copies are rounded."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    lora = sum(getattr(p, "ds_numel", p.numel()) for _, p in trainable) < sum(
        getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_partition_weights() else None
    if lora:
        masters = {n: safe_get_full_fp32_param(p) for n, p in trainable}  # a collective under ZeRO-3
        if torch.distributed.get_rank() == 0:
            state = state if state is not None else dict(module.state_dict())
            state.update({n: m.cpu() for n, m in masters.items() if m is not None})  # ZeRO-0 keeps no separate master
    return state


# ----------------------------------------------------------------------------------------------------
# Resume, also on another number of ranks

def resume_folder(out, flags, ds_config, rank, world_size, *, say):
    """The checkpoint to load: the newest one, or, when another number of ranks wrote it, DeepSpeed's universal form
    of it (each parameter's fp32 weights and Adam moments, whole, cut into this run's shards as they load). A
    checkpoint without optimizer shards (ZeRO-0 in fp32 saves the whole optimizer state) loads as it is. `flags`: the
    run's Config."""
    folder, saved = checkpoints.resume_folder(out, flags.train, flags.model, world_size,
                                              sequence_parallel=flags.sequence_parallel,
                                              zero_stage=ds_config["zero_optimization"].get("stage", 0))
    if saved["world_size"] == world_size:
        return folder
    if not list(folder.glob("*optim_states.pt")):
        say(f"{folder.name} was written by {saved['world_size']} ranks and loaded on {world_size}: ZeRO-0 saves the "
            f"whole optimizer state, nothing to reshard")
        return folder
    target = universal_checkpoint(folder, rank)
    ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    say(f"{folder.name} was written by {saved['world_size']} ranks and loaded on {world_size}: DeepSpeed resharded "
        f"ZeRO's optimizer state from {target}")
    return target


def universal_checkpoint(folder, rank, poll_seconds=1.0):
    """Rank 0 converts the checkpoint once with DeepSpeed's ds_to_universal, into a temporary folder that it renames
    when done, with as many processes as the node has cores. The other ranks wait for the folder to appear: a wait on
    a file, not a barrier, so a conversion that takes longer than --dist-timeout (a 7B checkpoint) does not look like
    a lost rank. If rank 0 fails, the launcher stops them."""
    target = folder / "universal"
    if rank == 0 and not target.exists():
        partial = folder / ".tmp-universal"
        shutil.rmtree(partial, ignore_errors=True)
        shards = len(list(folder.glob("*optim_states.pt")))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # extraction: a process per rank's shard; merging: a process per parameter, each holding one whole
        # parameter's three states, so fewer. No Megatron tensor-parallel metadata here: --inject_missing_state.
        # DeepSpeed's ds_to_universal, its torch.load made safe (finetune.checkpoints' __main__)
        convert = subprocess.run([sys.executable, "-m", "finetune.checkpoints", "deepspeed.checkpoint.ds_to_universal",
                                  "--input_folder", str(folder), "--output_folder", str(partial),
                                  "--inject_missing_state", "--num_extract_workers", str(max(1, min(cores, shards))),
                                  "--num_merge_workers", str(max(1, min(cores, 8)))], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                                     str(ROOT), os.environ.get("PYTHONPATH"))))})
        if convert.returncode != 0:
            last = (convert.stderr.strip() or convert.stdout.strip() or "no output").splitlines()[-1]
            fail(f"--resume: DeepSpeed could not convert {folder} to a universal checkpoint ({last}); resume with "
                 f"the number of ranks that wrote it")
        partial.rename(target)
    while not target.exists():
        time.sleep(poll_seconds)
    return target


def sequence_parallel(flags, model):
    """--sequence-parallel's process groups and attention (sequence_parallel.py): the mpu for deepspeed.initialize,
    or None without it."""
    from . import blocks

    rows = 1 if blocks.attention_layout(model.config._attn_implementation) == "varlen" else flags.train.batch_size
    return finetune_sp.setup(flags.sequence_parallel, model, torch.distributed.get_world_size(), rows)


def sequence_shard(rank, sequence_parallel):
    """Which shard of its replica's micro-batch this rank takes: (its place in its SP group, the group's size)."""
    return rank % sequence_parallel, sequence_parallel


def gradient_divisor(engine, world_size, sequence_parallel):
    """What the engine divides the summed gradients of the ranks by (the scripts multiply the loss by it, so the
    gradient is the token mean over the global batch, as in single-gpu.py): all ranks; with sequence parallelism
    the data-parallel replicas at ZeRO 0-2 (engine.py, stage_1_and_2.py: world / sequence_parallel_size) but still
    all ranks at ZeRO-3 (stage3.py's reduce-scatter divides by its group, every rank)."""
    sp = sequence_parallel
    return world_size if sp == 1 or engine.zero_optimization_stage() == 3 else world_size // sp


def grad_norm(engine):
    """The last step's gradient norm before clipping (after mend); infinite where fp16 overflowed."""
    norm = engine.get_global_grad_norm()
    return float("nan") if norm is None else norm


def after_load(folder, state, process, seed):
    """What load_checkpoint leaves to us: each rank's random state (dropout) as saved, a fresh stream for a rank the
    checkpoint did not have (DeepSpeed's universal load is repaired by a mend: universal_load_keeps_steps_and_groups).
    `state`: load_checkpoint's client state; returns the run's progress it holds (RunStats.restore)."""
    stats = state["stats"]
    path = (folder.parent if folder.name == "universal" else folder) / f"rng-{process.rank}.pt"
    if path.exists():
        checkpoints.set_rng_state(checkpoints.load(path), process.device)
    else:
        torch.manual_seed(seed + 1_000_003 * stats["step"] + process.rank)
    return stats
