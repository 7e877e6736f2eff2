"""The run folder and its checkpoints: never overwriting a run by accident, resuming from the newest complete
checkpoint (and checking that the resume trains on the same batches), publishing a checkpoint only once every rank
has written it, keeping the newest and the best, the random state, and stopping on a signal with a checkpoint."""
import contextlib
import errno
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .base import ROOT, fail, write_json

STOPPED = 75  # the exit status of a run a signal stopped, its checkpoint written: resume it (EX_TEMPFAIL)
STOPPED_FILE = "stopped.json"  # in the output folder, beside that checkpoint: job/slurm.sbatch requeues on it


def output_dir(run):
    """The run folder (--output-dir), refused in one line where the flags would lose a run in it, before anything is
    read or written: a file; a finished run without --overwrite; an unfinished one without --resume or --overwrite;
    --resume with nothing to resume, or with --overwrite. Nothing is written here: prepare_output_dir does that, once
    nothing else can refuse the run. `run`: flags.Run."""
    out = Path(run.output_dir)
    if out.exists() and not out.is_dir():
        fail(f"--output-dir {out} is a file; pass a folder")
    # started: a complete checkpoint, ours (`latest`) or the HF Trainer's (checkpoint-N); a run killed in its first
    # save has nothing to resume and starts over
    ckpt = out / "checkpoints"
    finished, started = (out / "results.json").exists(), (ckpt / "latest").exists() or any(ckpt.glob("checkpoint-*"))
    if run.overwrite and run.resume:
        fail("--overwrite starts the run over and --resume continues it: pass one of them")
    if finished and not run.overwrite:
        fail(f"{out} holds a finished run; pass --overwrite to replace it or choose another --output-dir")
    if started and not run.resume and not run.overwrite:
        fail(f"{out} holds an unfinished run; pass --resume to continue it or --overwrite to start over")
    if run.resume and not started:
        fail(f"--resume: {out} has no checkpoints to resume from")
    return out


def prepare_output_dir(out, overwrite, rank):
    """The run folder made ready, once nothing can refuse the run any more (every check of the flags, the data, the
    model, the DeepSpeed config and the resume is behind it): with --overwrite the old run's results, checkpoints and
    trackers removed (rank 0), the folder made (every rank: NCCL's flight recorder dumps into it on a timeout, on
    nodes without a shared disk too), a save that was killed half-way removed."""
    out = Path(out)
    if overwrite and rank == 0:
        for name in ("results.json", "loss.png", "wandb-run-id", "reference.pt"):
            (out / name).unlink(missing_ok=True)
        for name in ("checkpoints", "final", "tensorboard", "wandb"):  # the trackers' curves start over too
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for partial in (out / "checkpoints").glob(".tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
    return out


def resume_folder(out, train, model, world_size, *, sequence_parallel=1, zero_stage=None):
    """The newest complete checkpoint (`checkpoints/latest` only ever names one), and what it was written with (its
    run.json). The batch order is a function of the step and the global batch, so a resume that changes the global
    batch would train on other data: refused; and a change of ZeRO stage (each lays its files out differently), of the
    adapters or of their base. `train`, `model`: flags.Train, flags.Model."""
    root = Path(out) / "checkpoints"
    try:
        tag = (root / "latest").read_text().strip()
    except FileNotFoundError:
        fail(f"--resume: {root} has no complete checkpoint (no 'latest' pointer); start over with --overwrite")
    folder = root / tag
    if not folder.is_dir():
        fail(f"--resume: {root / 'latest'} names {tag}, which is missing; point it at a step-N folder there")
    try:
        saved = json.loads((folder / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        fail(f"--resume: {folder} has no readable run.json (written by an older version?); start over with --overwrite")
    replicas = world_size // sequence_parallel  # with sequence parallelism, groups of ranks
    want, per_micro_step = saved["global_batch_size"], train.batch_size * replicas
    if train.batch_size * train.grad_accum * replicas != want:
        hint = (f"--grad-accum {want // per_micro_step}" if want % per_micro_step == 0
                else "--batch-size and --grad-accum")
        unit = "ranks" if replicas == world_size else "replicas"
        fail(f"--resume: {folder} trained on global batches of {want} sequences and this run makes "
             f"{train.batch_size} x {train.grad_accum} micro-steps x {replicas} {unit} = "
             f"{train.batch_size * train.grad_accum * replicas}; pass {hint} to make {want}, or the steps would see "
             f"other data")
    problem = damage(folder, saved)
    if problem:
        earlier = next((f for f in sorted(root.glob("step-*"), key=lambda f: -int(f.name.split("-")[1]))
                        if int(f.name.split("-")[1]) < saved["step"] and (f / "run.json").exists()
                        and not damage(f, json.loads((f / "run.json").read_text()))), None)
        fail(f"--resume: {folder} is damaged: {problem}. " + (
            f"{earlier.name} is whole: point {root / 'latest'} at it (echo {earlier.name} > {root / 'latest'}) and "
            f"rerun with --resume" if earlier else "No earlier checkpoint is whole: start over with --overwrite"))
    if zero_stage is not None and saved.get("zero_stage") != zero_stage:
        fail(f"--resume: {folder} was written with ZeRO stage {saved.get('zero_stage')} and this run has stage "
             f"{zero_stage}; resume with --zero-stage {saved.get('zero_stage')} (another number of ranks is fine)")
    if saved.get("lora_rank", 0) != model.lora_rank:
        fail(f"--resume: {folder} was written with --lora-rank {saved.get('lora_rank', 0)}; resume with it")
    base = lambda a: "--load-in-4bit" if a.get("load_in_4bit") else "--load-in-8bit" if a.get("load_in_8bit") else None
    written = base(saved.get("args", {}))
    if written != base(vars(model)):  # the adapters trained over that base, rounded as it was
        fail(f"--resume: {folder} was written with {written}; resume with it" if written else
             f"--resume: {folder} was written over an unquantized base; resume without {base(vars(model))}")
    return folder, saved


def damage(folder, saved):
    """What is wrong with a published checkpoint, in a phrase, or None: a file missing (each rank's rng-R.pt, and
    DeepSpeed's optimizer shards and ZeRO-3's parameter shards of ranks 0..N-1 for the ranks that wrote it), or a
    file cut short (torch.save writes a zip archive, whose directory comes last: one that does not open was not
    written whole). A universal conversion beside it is not looked at."""
    import re
    import zipfile

    files = [f for f in folder.glob("*.pt")]
    stage, world = saved.get("zero_stage"), saved["world_size"]
    wanted = ["state.pt"] if stage is None else [f"rng-{r}.pt" for r in range(world)] + (
        ["mp_rank_00_model_states.pt"] if stage < 3 else [])
    missing = [name for name in wanted if not (folder / name).exists()]
    if missing:
        return f"{missing[0]} is missing"
    if stage is not None:
        sp = saved.get("args", {}).get("sequence_parallel", 1) or 1
        for kind, stages in (("optim_states", (1, 2, 3)), ("model_states", (3,))):
            if stage in stages:
                ranks = sorted(int(m.group(1)) for f in files if (m := re.search(rf"zero_pp_rank_(\d+)_mp_rank_00_"
                                                                                   rf"{kind}\.pt$", f.name)))
                if ranks != list(range(world)) and ranks != list(range(world // sp)):
                    absent = sorted(set(range(world)) - set(ranks))
                    return f"the {kind.replace('_', ' ')} of rank {absent[0] if absent else '?'} are missing"
    for f in sorted(files):
        try:
            zipfile.ZipFile(f).close()
        except (zipfile.BadZipFile, OSError):
            return f"{f.name} is cut short ({f.stat().st_size:,} bytes: not a whole archive)"
    return None


def publish(root, tag, keep):
    """Once every rank has finished writing `.tmp-<tag>`: rename it to <tag>, then point `latest` at it (an atomic
    replace), then delete all but the newest `keep` (0 keeps all). A kill at any moment leaves `latest` naming a
    complete checkpoint."""
    root = Path(root)
    if (root / tag).exists():
        shutil.rmtree(root / tag)
    (root / f".tmp-{tag}").rename(root / tag)
    (root / ".latest.tmp").write_text(tag)
    os.replace(root / ".latest.tmp", root / "latest")
    number = lambda d: int(d.name.split("-")[1])  # noqa: E731
    steps = sorted((d for d in root.glob("step-*") if d.is_dir()), key=number)
    while number(steps[-1]) > number(root / tag):  # renamed but never published (a kill before `latest` moved): the
        shutil.rmtree(steps.pop(), ignore_errors=True)  # run resumed from before it; it would outrank `latest`
    best_folder = best(root)
    for old in steps[:-keep] if keep > 0 else []:
        if old != best_folder:  # the lowest eval loss is kept whatever its age
            shutil.rmtree(old, ignore_errors=True)


FULL = 16 * 2**20  # bytes: a disk with less free than this after a failed write is full


@contextlib.contextmanager
def saving(out, record, keep, rank):
    """The checkpoint of step record["step"]: every rank writes its part within, into the folder this yields
    (`.tmp-step-N`); then rank 0 writes run.json (`record`, run_record's) and publishes it. A disk too small for
    it, known from the newest complete checkpoint's size (the next one is as large), is one line before anything
    is written; a disk that fills while it is written is one line too, the partial folder removed. Either way the
    newest complete checkpoint stays whole and named by `latest`, and --resume continues from it once there is room
    (torch.save reports a full disk as a RuntimeError from its zip writer, not as an OSError)."""
    root, tag = Path(out) / "checkpoints", f"step-{record['step']}"
    partial = root / f".tmp-{tag}"
    partial.mkdir(parents=True, exist_ok=True)
    newest = root / (root / "latest").read_text().strip() if (root / "latest").exists() else None
    needed = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file() and  # (not a universal conversion's)
                 "universal" not in f.relative_to(newest).parts) if newest and newest.is_dir() else 0
    free = shutil.disk_usage(partial).free
    kept = f"{newest.name}, the newest complete checkpoint, is untouched" if newest else "no checkpoint is complete"
    if needed > free:
        shutil.rmtree(partial, ignore_errors=True)
        fail(f"checkpoint {tag} needs about {gb(needed)} (as {newest.name} did) and {root} has {gb(free)} free: "
             f"nothing written; {kept}. Free some room (or lower --keep-checkpoints, or use an --output-dir on a "
             f"larger disk) and rerun with --resume")  # (newest exists: needed > 0)
    try:
        yield partial
        if rank == 0:
            write_json(partial / "run.json", record)
            publish(root, tag, keep)
    except (OSError, RuntimeError) as e:
        if not (getattr(e, "errno", None) == errno.ENOSPC or ("write" in str(e) or "unexpected pos" in str(e))
                and shutil.disk_usage(root).free < FULL):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        fail(f"the disk of {root} filled while checkpoint {tag} was written ({gb(shutil.disk_usage(root).free)} "
             f"left{f'; it needs about {gb(needed)}' if needed else ''}): the partial checkpoint is removed and "
             f"{kept}. Free some room and rerun{' with --resume' if newest else ''}")


def gb(n):
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def best(root):
    """The checkpoint folder whose run.json has the lowest eval loss (the earliest of equals), or None."""
    scored = []
    for folder in Path(root).glob("step-*"):
        try:
            loss = json.loads((folder / "run.json").read_text()).get("eval_loss")
        except (OSError, ValueError):
            continue
        if loss is not None and math.isfinite(loss):
            scored.append((loss, int(folder.name.split("-")[1]), folder))
    return min(scored)[2] if scored else None


def load_best(model, out, stats, final, process):
    """--final best: load the checkpoint with the lowest eval loss (the earliest of equals; the one publish keeps)
    before the export, unless the model in memory, the last step's, is as good. Rank 0 reads the folder and the
    others take its choice (a shared file system may show them a rename late). Under DeepSpeed every rank loads its
    shards (a collective), as on a resume. `final`: --final; `process`: training.Process."""
    world_size, say = process.world_size, process.say
    stats.final_step = stats.step
    if final != "best":
        return
    choice = [None]  # (step, eval loss, the number of ranks that wrote it)
    folder = best(Path(out) / "checkpoints") if stats.rank == 0 else None
    if folder is not None:
        saved = json.loads((folder / "run.json").read_text())
        step = int(folder.name.split("-")[1])
        if step != stats.step and saved["eval_loss"] <= dict(stats.evals).get(stats.step, math.inf):
            choice = [(step, saved["eval_loss"], saved["world_size"])]
    if stats.ranks > 1:
        torch.distributed.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return
    step, value, written_by = choice[0]
    folder = Path(out) / "checkpoints" / f"step-{step}"
    if written_by != world_size:  # a resume on another number of ranks since: its shards do not load as they are
        say(f"--final best: step {step} was written by {written_by} ranks and this run has {world_size}; final/ is "
            f"the last model (zero_to_fp32.py in the checkpoints folder gives step {step}'s weights)")
        return
    if hasattr(model, "load_checkpoint"):  # a DeepSpeed engine
        model.load_checkpoint(folder.parent, folder.name)
    else:
        model.load_state_dict(load(folder / "state.pt", map_location="cpu", mmap=True)["model"])  # its part read
    stats.final_step = step
    say(f"--final best: final/ is step {step}, eval loss {value:.4f} (the last step's: {stats.evals[-1][1]:.4f})")


def load_state(folder, device, *, model, optimizer, scheduler, scaler):
    """single-gpu.py's resume from its state.pt: read on the host (torch.save kept the tensors' devices: a GPU run
    would load a second copy of its weights onto the GPU), memory-mapped on a GPU run (only what is copied is read),
    copied into the model, the optimizer (onto its parameters' device), the schedule and the scaler, and dropped.
    Returns the run's progress (RunStats.state)."""
    state = load(folder / "state.pt", map_location="cpu", mmap=device.type == "cuda")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], device)
    return state["stats"]


def run_record(step, config, model, stats, global_batch):
    """run.json beside each checkpoint: what a resume checks, the run's arguments, the code's version, and the eval
    loss at this step when it was evaluated (what --keep-checkpoints keeps the best by). `config`: the run's Config
    (flags.py), whose values --config FILE replays; `stats`: progress.RunStats (its evals, its ranks)."""
    try:
        code = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        code = None
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    return {"step": step, "global_batch_size": global_batch, "world_size": stats.ranks, "zero_stage": stage,
            "lora_rank": config.model.lora_rank, "eval_loss": dict(stats.evals).get(step), "args": config.flat(),
            "code_version": code}


# ----------------------------------------------------------------------------------------------------
# Loading without running code: a checkpoint folder copied from elsewhere (a shared file system, a download) could
# hold pickles that run a command as they load, as torch.load(weights_only=False) reads them

_TORCH_LOAD = torch.load  # torch's own, whatever loading_safely() puts in its place meanwhile


def allowed_types():
    """What checkpoints hold beside tensors, numbers, strings and plain containers (all that weights_only=True loads
    by itself): from DeepSpeed 0.19.8's files (every .pt of ZeRO 0-3, offload, fp16, bf16, LoRA and universal
    checkpoints, loaded with weights_only=True) its ZeRO stage, its loss scalers' settings and its optimizer shards'
    fragment addresses. Their constructors set attributes and run nothing else. Imported only where DeepSpeed is."""
    if "deepspeed" not in sys.modules:
        return []
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def load(path, **kwargs):
    """torch.load that runs no code: weights_only (tensors, numbers, strings, plain containers) and allowed_types();
    a file that holds anything else is refused in one line naming it and what it holds."""
    try:
        with torch.serialization.safe_globals(allowed_types()):
            return _TORCH_LOAD(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        found = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
        fail(f"{path} holds more than a checkpoint does ({found[:160]}): loading it could run code, so it is "
             f"refused. Resume from a checkpoint this project wrote, or load the file yourself if you trust it")


@contextlib.contextmanager
def loading_safely():
    """Within, torch.load is load(): DeepSpeed's checkpoint engine and universal conversion call torch.load with
    weights_only=False (runtime/checkpoint_engine/torch_checkpoint_engine.py, checkpoint/ds_to_universal.py)."""
    def safe(path, map_location=None, *args, weights_only=None, **kwargs):
        return load(path, map_location=map_location, **kwargs)
    torch.load = safe
    try:
        yield
    finally:
        torch.load = _TORCH_LOAD


def rng_state(device):
    """This process's random state: the CPU's and its own GPU's only. (get_rng_state_all() would save every GPU the
    process sees, and a resume that sees fewer would fail.)"""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and device.type == "cuda":
        cuda = state["cuda"]
        torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, list) else cuda, device)  # a list: an older checkpoint


if __name__ == "__main__":  # python -m finetune.checkpoints MODULE ARGS...: run MODULE (DeepSpeed's ds_to_universal)
    import runpy  # with torch.load loading safely (its workers too)

    import deepspeed  # noqa: F401 (allowed_types: DeepSpeed's types)
    sys.argv = sys.argv[1:]
    with loading_safely():
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)

