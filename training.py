"""What single-gpu.py and zero-optimization.py share and is not their lesson: checks of the flags, the loss and
its evaluation, model helpers, the run folder and its checkpoints, random state, results, throughput figures."""
import json
import math
import os
import resource
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def fail(message):
    """Stop with one line that says what is wrong and what to do (no traceback: it is not our bug)."""
    raise SystemExit(f"error: {message}")



def token_loss_sum(logits, labels):
    """Summed next-token cross-entropy; the scripts divide by the global batch's predicted-token count, so each
    token weighs the same however the batch is split over micro-steps and ranks."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


@torch.no_grad()
def evaluate(model, blocks, batch_size, pad_id, device, autocast, rank=0, world_size=1):
    """(summed loss, predicted tokens) over this rank's share of the eval set. Every rank runs the same number of
    forward passes (ZeRO-3 gathers parameters collectively); a rank with nothing left runs a fully masked batch."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    per_step = batch_size * world_size
    for start in range(0, len(blocks), per_step):
        mine = torch.arange(start, min(start + per_step, len(blocks)))[rank * batch_size:(rank + 1) * batch_size]
        batch = blocks.batch(mine if len(mine) else [0], pad_id, device)
        if not len(mine):
            batch["labels"].fill_(-100)
        with autocast:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total[0] += token_loss_sum(logits, batch["labels"]).double()
        total[1] += (batch["labels"][:, 1:] != -100).sum()
    model.train()
    return total


def perplexity(loss):
    return math.exp(loss) if loss < 700 else float("inf")  # exp overflows a float past ~709


# ----------------------------------------------------------------------------------------------------
# Model and optimizer helpers

def load_pretrained(loader, name, **kwargs):
    """loader.from_pretrained(name), with one line saying what to do when it cannot (no weights, unknown id, offline)."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if Path(name).is_dir():
            fail(f"cannot load {name} ({first}); a model folder needs config.json, the weights (model.safetensors) "
                 f"and the tokenizer files, as save_pretrained writes them")
        fail(f"cannot load {name!r}: it is not a local folder, and the hub did not give it ({first}); check the id, "
             f"the network (HF_HUB_OFFLINE), or HF_TOKEN in the environment for a gated model")


def param_groups(model, weight_decay):
    """AdamW groups: no weight decay on biases and normalization weights (one-dimensional parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_precision(precision, device):
    if precision == "auto":  # bf16 where the hardware has it, else fp32 (fp16 only when asked)
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return precision


ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
AMP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_args(args, max_positions):
    for flag in ("lr", "batch_size", "grad_accum", "block_size"):
        if getattr(args, flag) <= 0:
            fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.max_steps <= 0 and args.epochs <= 0:
        fail("set --epochs or --max-steps to a positive number")
    if args.block_size < 2:
        fail("--block-size must be at least 2 (a token and the next one to predict)")
    if max_positions and args.block_size > max_positions:
        fail(f"--block-size {args.block_size} is beyond the model's {max_positions} positions; lower it")


def count_params(model):
    """Parameters that do matrix work (position embeddings are only looked up), counted whole under ZeRO-3 too."""
    return sum(getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if "position" not in n)


def params_held_bytes(model):
    """Bytes of parameters this rank holds; under ZeRO-3 a parameter keeps only its shard (ds_tensor)."""
    return sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size() for p in model.parameters())



# ----------------------------------------------------------------------------------------------------
# Output folder, checkpoints, results

def prepare_output_dir(path, overwrite, resume, rank):
    """Refuse to overwrite a run by accident: a finished one needs --overwrite, an unfinished one --resume."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        fail(f"--output-dir {out} is a file; pass a folder")
    finished, started = (out / "results.json").exists(), (out / "checkpoints").exists()
    if overwrite:
        if rank == 0:
            for name in ("results.json", "loss.png"):
                (out / name).unlink(missing_ok=True)
            for name in ("checkpoints", "final"):
                shutil.rmtree(out / name, ignore_errors=True)
    elif finished:
        fail(f"{out} holds a finished run; pass --overwrite to replace it or choose another --output-dir")
    elif started and not resume:
        fail(f"{out} holds an unfinished run; pass --resume to continue it or --overwrite to start over")
    elif resume and not started:
        fail(f"--resume: {out} has no checkpoints to resume from")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for partial in (out / "checkpoints").glob(".tmp-*"):  # a save that was killed half-way
            shutil.rmtree(partial, ignore_errors=True)
    return out


def latest_checkpoint(out):
    """The tag `checkpoints/latest` points to; it only ever points to a complete checkpoint."""
    root = Path(out) / "checkpoints"
    try:
        tag = (root / "latest").read_text().strip()
    except FileNotFoundError:
        fail(f"--resume: {root} has no complete checkpoint (no 'latest' pointer); start over with --overwrite")
    if not (root / tag).is_dir():
        fail(f"--resume: {root / 'latest'} names {tag}, which is missing; point it at a step-N folder there")
    return tag


def check_resume(folder, args, world_size, zero_stage=None):
    """What the checkpoint was written with (its run.json). The batch order is a function of the step and the global
    batch, so a resume that changes the global batch would train on other data: refuse it; and a change of ZeRO
    stage (each stage lays its files out differently)."""
    try:
        saved = json.loads((Path(folder) / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        fail(f"--resume: {folder} has no readable run.json (written by an older version?); start over with --overwrite")
    want, per_micro_step = saved["global_batch_size"], args.batch_size * world_size
    if args.batch_size * args.grad_accum * world_size != want:
        hint = (f"--grad-accum {want // per_micro_step}" if want % per_micro_step == 0
                else "--batch-size and --grad-accum")
        fail(f"--resume: {folder} trained on global batches of {want} sequences and this run makes "
             f"{args.batch_size} x {args.grad_accum} micro-steps x {world_size} ranks = "
             f"{args.batch_size * args.grad_accum * world_size}; pass {hint} to make {want}, or the steps would see "
             f"other data")
    if zero_stage is not None and saved["zero_stage"] != zero_stage:
        fail(f"--resume: {folder} was written with ZeRO stage {saved['zero_stage']} and this run has stage "
             f"{zero_stage}; resume with --zero-stage {saved['zero_stage']} (another number of ranks is fine)")
    return saved



def publish_checkpoint(root, tag, keep):
    """Once every rank has finished writing `.tmp-<tag>`: rename it to <tag>, then point `latest` at it (an atomic
    replace), then delete all but the newest `keep` (0 keeps all). A kill at any moment leaves `latest` naming a
    complete checkpoint."""
    root = Path(root)
    if (root / tag).exists():
        shutil.rmtree(root / tag)
    (root / f".tmp-{tag}").rename(root / tag)
    (root / ".latest.tmp").write_text(tag)
    os.replace(root / ".latest.tmp", root / "latest")
    steps = sorted((d for d in root.glob("step-*") if d.is_dir()), key=lambda d: int(d.name.split("-")[1]))
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def check_finite(losses, first_step):
    """Stop at a NaN or inf loss, naming its step (checked before any checkpoint is written, so none holds it)."""
    for step, loss in enumerate(losses, first_step):
        if not math.isfinite(loss):
            fail(f"the loss is {loss} at step {step}: training diverged (lower --lr, use bf16 rather than fp16) "
                 f"or the model or data hold NaN/inf; the checkpoints are all from before step {step}")


def rng_state():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident memory of this process


def write_json(path, data):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


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


# ----------------------------------------------------------------------------------------------------
# Throughput: FLOPs per token and the device's peak

PEAK_BF16_TFLOPS = {  # dense, no sparsity, from the vendors' data sheets
    "H200": 989, "H100 SXM": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "GH200": 989,
    "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "A10G": 70, "A10": 125, "L4": 121,
    "RTX 4090": 165, "RTX 3090": 71, "V100": 125,  # V100: fp16 (it has no bf16)
}


def peak_tflops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def flops_per_token(config, seq_len, num_params):
    """6N + 12·L·H·Q·T (the PaLM appendix, as in nanoGPT and torchtitan): N parameters in matmuls, L layers, H heads,
    Q head size, T sequence length; the second term is attention's score and value products, forward and back."""
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 6 * num_params + 12 * layers * hidden * seq_len


