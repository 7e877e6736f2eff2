"""DeepSpeed plumbing for zero-optimization.py (and sequence_classification.py under DeepSpeed): the process
group's environment and timeouts, the config's "auto" values, resharding a checkpoint, the entry point."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from training import ADAM_BETAS, ADAM_EPS, fail, set_rng_state

def single_process_env():
    """Under a launcher (deepspeed, torchrun, srun) these are set; for a plain `python3` run, make it a world of one
    on this host (DeepSpeed would otherwise look for MPI)."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # a free port, so two such runs do not collide
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def collective_timeout(seconds):
    """A bound on every collective. init_process_group's timeout covers only the world group; DeepSpeed builds its
    ZeRO groups with new_group(), which falls back to torch's module default (30 min on gloo, 10 on NCCL), so a
    stuck rank would hang the others that long. Set that default too, before DeepSpeed makes its groups."""
    import datetime

    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    return timeout


def run_distributed(main):
    """Run main() of a distributed script. When a collective fails because another rank died or stopped answering
    (--dist-timeout), end with one line instead of a traceback; the launcher then stops the other ranks and says which
    one exited. After a successful run, leave without the interpreter's teardown: all outputs are written by then,
    and a native thread of the communication stack occasionally aborts the process there ("terminate called without
    an active exception", exit 250), which a launcher would report as a failed run."""
    try:
        main()
    except RuntimeError as e:
        lost = ("timed out", "Timed out", "Connection closed by peer", "Connection reset by peer", "NCCL error")
        if not any(marker in str(e) for marker in lost):
            raise
        rank = os.environ.get("RANK", "?")
        reason = str(e).strip().splitlines()[0].split("] ")[-1][:120]
        raise SystemExit(f"error: rank {rank}: a collective failed ({reason}): another rank died or stopped "
                         f"answering; see the launcher's log for which, then rerun with --resume")
    remove_shm_buffer()
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def remove_shm_buffer():
    """DeepSpeed's CPU all-reduce (its shm_comm op, used when all ranks share one machine) maps a 66 MB file per rank
    in /dev/shm and, in 0.19.8, never removes it (its shared_close is never called): the files pile up in memory with
    every run on a new port. Each rank removes its own once the run has succeeded: every rank mapped them all at
    start-up, and a mapping outlives the name."""
    env = os.environ.get
    Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env('MASTER_ADDR', '')}_{env('MASTER_PORT', '')}_"
         f"{env('RANK', '')}").unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------
# The DeepSpeed config: "auto" means "from the flags", like the HF Trainer

def deepspeed_config(path, args, world_size, total_steps, warmup_steps, hidden_size):
    """Read the JSON config and fill its "auto" values from the flags. An explicit value that disagrees with a flag
    is an error naming both; --zero-stage and --offload override the file."""
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        fail(f"DeepSpeed config {path} does not exist; pass --deepspeed_config with a JSON file")
    except json.JSONDecodeError as e:
        fail(f"DeepSpeed config {path} is not valid JSON ({e}); fix the file")
    zero = config.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload is not None:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": args.offload}
        if args.offload == "nvme":
            zero["offload_optimizer"]["nvme_path"] = args.nvme_path
        if zero.get("stage") == 3:  # stage 3 can offload the parameters too
            zero["offload_param"] = {**zero["offload_optimizer"]}
        else:
            zero.pop("offload_param", None)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        config.setdefault(key, "auto")  # the loop needs these three to be what the flags say
    has_scheduler = "scheduler" in config
    values = [  # (key in the JSON, value from the flags, flag named in an error)
        ("train_micro_batch_size_per_gpu", args.batch_size, "--batch-size"),
        ("gradient_accumulation_steps", args.grad_accum, "--grad-accum"),
        ("train_batch_size", args.batch_size * args.grad_accum * world_size,
         f"--batch-size x --grad-accum x {world_size} ranks"),
        ("gradient_clipping", args.max_grad_norm, "--max-grad-norm"),
        ("optimizer.params.lr", args.lr, "--lr"),
        ("optimizer.params.betas", list(ADAM_BETAS), "ADAM_BETAS"),
        ("optimizer.params.eps", ADAM_EPS, "ADAM_EPS"),
        ("optimizer.params.weight_decay", args.weight_decay, "--weight-decay"),
        ("scheduler.params.warmup_min_lr", 0.0, "--lr"),
        ("scheduler.params.warmup_max_lr", args.lr, "--lr"),
        ("scheduler.params.warmup_num_steps", warmup_steps, "--warmup-ratio"),
        ("scheduler.params.total_num_steps", total_steps, "--epochs/--max-steps"),
        ("bf16.enabled", args.precision == "bf16", "--precision"),
        ("fp16.enabled", args.precision == "fp16", "--precision"),
        # ZeRO-3 buffer sizes scale with the hidden size (the HF Trainer's rule)
        ("zero_optimization.reduce_bucket_size", hidden_size * hidden_size, None),
        ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size), None),
        ("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size, None),
    ]
    mismatches = []
    for dotted, value, flag in values:
        *parents, key = dotted.split(".")
        node = config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if not isinstance(node, dict) or key not in node:
            continue
        if node[key] == "auto":
            node[key] = value
        elif flag is not None and node[key] != value:
            mismatches.append(f"{dotted}={node[key]} vs {flag} = {value}")
    if mismatches:
        fail(f"{path} disagrees with the flags: {'; '.join(mismatches)}. Set those keys to \"auto\" or change the flags")
    leftover = [k for k, v in _walk(config) if v == "auto"]
    if leftover:
        fail(f"{path}: no flag fills {', '.join(leftover)}; give them values")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError
    try:  # typos here would otherwise surface as a traceback inside deepspeed.initialize
        DeepSpeedZeroConfig(**config["zero_optimization"])
    except ValidationError as e:
        error = e.errors()[0]
        fail(f"{path}: zero_optimization.{'.'.join(map(str, error['loc']))}: {error['msg']}; fix or remove it")
    return config, has_scheduler


def _walk(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _walk(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value



def universal_checkpoint(folder, rank):
    """DeepSpeed's universal form of a ZeRO checkpoint, for a resume on another number of ranks:
    each parameter's fp32 weights and Adam moments, whole, in <folder>/universal; DeepSpeed cuts them into this
    run's shards as it loads them. Rank 0 converts once (DeepSpeed's ds_to_universal), into a temporary folder that
    it renames when done; the other ranks wait. Returns the folder to load, or `folder` itself when it holds no
    optimizer shards (ZeRO-0 in fp32 saves the whole optimizer state, which loads on any number of ranks)."""
    import torch.distributed as dist
    folder = Path(folder)
    target = folder / "universal"
    if not list(folder.glob("*optim_states.pt")):
        return folder
    if rank == 0 and not target.exists():
        partial = folder / ".tmp-universal"
        shutil.rmtree(partial, ignore_errors=True)
        # our checkpoints carry no Megatron tensor-parallel metadata: --inject_missing_state adds the empty default
        convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                  "--input_folder", str(folder), "--output_folder", str(partial),
                                  "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                                 capture_output=True, text=True)
        if convert.returncode != 0:
            last = (convert.stderr.strip() or convert.stdout.strip() or "no output").splitlines()[-1]
            fail(f"--resume: DeepSpeed could not convert {folder} to a universal checkpoint ({last}); resume with "
                 f"the number of ranks that wrote it")
        partial.rename(target)
    dist.barrier()  # the other ranks load what rank 0 converted
    return target


def restore_rng(folder, rank, seed, step):
    """Each rank's random state (dropout) as saved; a rank the checkpoint did not have starts a fresh stream."""
    path = Path(folder) / f"rng-{rank}.pt"
    if path.exists():
        set_rng_state(torch.load(path, weights_only=False))
    else:
        torch.manual_seed(seed + 1_000_003 * step + rank)


