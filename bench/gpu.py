"""The GPU benchmark that fits a short GPU slot: one command, one table (bench/gpu.sh runs it).

    bash bench/gpu.sh              # one H100 or H200, at most 8 minutes: out/gpu/GPU.md and PROFILE.md (and in $OUT)
    bash bench/gpu.sh --dry        # any machine: the tiny demo model on the CPU, the same parts and columns (seconds)

Parts, each its own process with its own deadline (a slow part is a row that says so and the rest go on; a part that
cannot finish before the whole budget is skipped), in ORDER's order: at OPT-125m's shape, 16 x 512 tokens, bf16:
single-gpu.py, zero-optimization.py at ZeRO-2 and 3, the HF Trainer's run_clm recipe at ZeRO-2 (bench/peers.py),
ZeRO-0; single-gpu.py at Llama-3.2-1B's shape (its MFU; also --compile, at the largest micro-batch plan.py fits on
this GPU, and in 4 x 2048-token blocks), and with SDPA and the documents' mask at both shapes (--attention sdpa,
against the varlen kernel auto picks), and with --packing stream
(no documents kept apart: the goal is isolated packing at 0.97x its tok/s or more); single-gpu.py on chats, eager
and --compile, and on reviews --compile (TORCH_LOGS=recompiles,graph_breaks in their output.log); then the engine at
the 1B shape and ZeRO-3 + CPU offload. Each a plain `python` process: a world of one. Before them, attention alone
(bench/attention.py: its own table, ATTENTION.md beside GPU.md).

Columns: useful tokens/s after the warm-up (the first log interval) and its ratio to single-gpu.py's and the
Trainer's; MFU; peak memory allocated beside plan.py's planned peak for the run; per step the kernel launches and
device syncs torch.profiler counted over steps 5-8 (TRAIN_PROFILE: progress.Profiler; inside the warm-up interval);
the last loss. Random weights (they time as trained ones), generated reviews and chats; a chats row's ratio is to
single-gpu.py's on chats. PROFILE.md beside it: each run's profiled steps by kind of kernel time (matmuls, attention,
norms and element-wise, the head with the loss and the embedding, the optimizer, communication) and the GPU's idle
time between kernels (internals/step_time.py); at the 1B shape single-gpu.py eager and --compile, and ZeRO-2.
"""

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
RUNS = {  # name -> (script, its flags, plan.py's option, data, its deadline over its shape's)
    "single-gpu.py": ("single-gpu.py", [], "ZeRO-0", "reviews", 1),
    "ZeRO-2": ("zero-optimization.py", ["--zero-stage=2", "--deepspeed=ds_config_zero2.json"], "ZeRO-2", "reviews", 1),
    "ZeRO-3": ("zero-optimization.py", ["--zero-stage=3", "--deepspeed=ds_config_zero3.json"], "ZeRO-3", "reviews", 1),
    "HF Trainer, run_clm, ZeRO-2": ("bench/peers.py", ["--recipe=run_clm", "--deepspeed"], None, "reviews", 1),
    "ZeRO-0": ("zero-optimization.py", ["--zero-stage=0", "--deepspeed=ds_config_zero2.json"], "ZeRO-0", "reviews", 1),
    "single-gpu.py, SDPA with the mask": ("single-gpu.py", ["--attention=sdpa"], "ZeRO-0", "reviews", 1),
    "single-gpu.py, stream packing": ("single-gpu.py", ["--packing=stream"], "ZeRO-0", "reviews", 1),
    "single-gpu.py, blocks 4x as long": ("single-gpu.py", [], "ZeRO-0", "reviews", 1),  # the same tokens a step
    "single-gpu.py, the plan's largest micro-batch": ("single-gpu.py", [], "ZeRO-0", "reviews", 2),  # MFU grows with it
    "single-gpu.py, chats": ("single-gpu.py", [], "ZeRO-0", "questions", 1),
    "single-gpu.py, chats, --compile": ("single-gpu.py", ["--compile"], "ZeRO-0", "questions", 2),
    "single-gpu.py, --compile": ("single-gpu.py", ["--compile"], "ZeRO-0", "reviews", 2),
    "ZeRO-3 + CPU offload": (
        "zero-optimization.py",
        ["--zero-stage=3", "--offload=cpu", "--deepspeed=ds_config_zero3.json"],
        "ZeRO-3 + CPU offload",
        "reviews",
        1,
    ),
    # scale up (Llama-3.1-8B's shape): as users run it on one GPU, the layers' inputs kept (checkpointing)
    "LoRA 16": ("single-gpu.py", ["--lora-rank=16", "--gradient-checkpointing"], "ZeRO-0", "reviews", 1),
    "QLoRA 16, 4-bit base": (
        "single-gpu.py",
        ["--lora-rank=16", "--load-in-4bit", "--gradient-checkpointing"],
        "ZeRO-0",
        "reviews",
        1,
    ),
    "full, ZeRO-3 + CPU offload": (
        "zero-optimization.py",
        ["--zero-stage=3", "--offload=cpu", "--deepspeed=ds_config_zero3.json", "--gradient-checkpointing"],
        "ZeRO-3 + CPU offload",
        "reviews",
        2,
    ),
}
SCALE_UP = ("QLoRA 16, 4-bit base", "LoRA 16", "full, ZeRO-3 + CPU offload")  # the 8B shape's runs, in their order
# long sequences on one GPU (docs/long-context.md): one sequence of 8k-64k tokens (a stream of reviews: whole-length
# attention), checkpointing alone against --offload-activations --tiled-mlp; at the 1B shape full fine-tuning, at the
# 8B shape QLoRA and LoRA
LONG_BLOCKS = (8192, 16384, 32768, 65536)
LONG_WAYS = {
    "checkpointed": ["--gradient-checkpointing"],
    "offloaded + tiled": ["--offload-activations", "--tiled-mlp"],
}
LONG_BASES = {"": [], "QLoRA, ": ["--lora-rank=16", "--load-in-4bit"], "LoRA, ": ["--lora-rank=16"]}
for _base, _lora in LONG_BASES.items():
    for _block in LONG_BLOCKS:
        for _way, _flags in LONG_WAYS.items():
            RUNS[f"{_base}{_block // 1024}k, {_way}"] = (
                "single-gpu.py",
                ["--packing=stream", f"--block-size={_block}", "--batch-size=1", *_lora, *_flags],
                "ZeRO-0",
                "reviews",
                1,
            )
LONG = {  # shape -> its runs, in the order they are measured
    "long-1b": [f"{b // 1024}k, {w}" for b in LONG_BLOCKS for w in LONG_WAYS],
    "long-8b": [
        f"{q}{b // 1024}k, {w}" for q in ("QLoRA, ", "LoRA, ") for b in (16384, 65536, 8192, 32768) for w in LONG_WAYS
    ],
}
# (shape, run) in the order the goals need them, should the budget run out (issue 66's first): the engine against
# single-gpu.py and the Trainer at both shapes, the 1B step's profile (eager, ZeRO-2, --compile: PROFILE.md) and MFU,
# isolated against stream packing, then compile on chats and reviews and the rest
ORDER = [
    *(("opt-125m", r) for r in ("single-gpu.py", "ZeRO-2", "ZeRO-3", "HF Trainer, run_clm, ZeRO-2", "ZeRO-0")),
    *(("llama-3.2-1b", r) for r in ("single-gpu.py", "ZeRO-2", "single-gpu.py, --compile", "ZeRO-3")),
    ("opt-125m", "single-gpu.py, stream packing"),
    ("llama-3.2-1b", "HF Trainer, run_clm, ZeRO-2"),
    ("llama-3.2-1b", "single-gpu.py, the plan's largest micro-batch"),
    ("llama-3.2-1b", "single-gpu.py, SDPA with the mask"),
    ("opt-125m", "single-gpu.py, SDPA with the mask"),
    *(("opt-125m", r) for r in ("single-gpu.py, chats", "single-gpu.py, chats, --compile", "single-gpu.py, --compile")),
    ("llama-3.2-1b", "single-gpu.py, blocks 4x as long"),
    ("llama-3.2-1b", "ZeRO-0"),
    ("opt-125m", "ZeRO-3 + CPU offload"),
    ("llama-3.2-1b", "ZeRO-3 + CPU offload"),
    *(("llama-3.1-8b", r) for r in SCALE_UP),  # a call of its own: bash bench/gpu.sh --shapes llama-3.1-8b
    *((shape, r) for shape, runs in LONG.items() for r in runs),  # and another: --shapes long-1b long-8b
]
# shape -> (sequences a step, block, steps, log interval, seconds each part may take); the profiler counts steps 5-8,
# inside the first log interval, which the steady figures leave out
SHAPES = {
    "opt-125m": (16, 512, 40, 10, 50),
    "llama-3.2-1b": (16, 512, 20, 10, 75),
    "llama-3.1-8b": (2, 2048, 24, 8, 150),
    "long-1b": (1, 8192, 4, 1, 60),  # the runs' own blocks
    "long-8b": (1, 8192, 4, 1, 90),
}
# dry: the demo model, and for the 8B runs a narrowed copy of Llama-3.1-8B's config (run.model_folder)
DRY = {"demo": (4, 64, 12, 10, 60), "llama-3.1-8b-narrowed": (2, 256, 4, 2, 90), "long-demo": (1, 128, 4, 1, 60)}
MODELS = {"long-1b": "llama-3.2-1b", "long-8b": "llama-3.1-8b", "long-demo": "demo"}  # a shape's model, if another
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # never inherited: a caller's
# rendezvous (a port its own process group holds) is not a part's
ATTENTION_S = 60  # seconds bench/attention.py may take: 4 shapes x 4 kernels x 23 passes of a few ms


def parts(shapes):
    """[(shape, run's name)] to run: ORDER's, or on a dry run every run at the demo's shape."""
    if set(shapes) <= set(DRY):  # the demo's runs, the 8B runs narrowed, the long ones 64x shorter on the demo model
        dry = {
            "demo": [n for n in RUNS if n not in SCALE_UP and "k, " not in n],
            "llama-3.1-8b-narrowed": SCALE_UP,
            "long-demo": LONG["long-1b"][:4],
        }
        return [(shape, name) for shape in shapes for name in dry[shape]]
    return [(shape, name) for shape, name in ORDER if shape in shapes]


def sizes(shape, name, dry, model=None):
    """(sequences a step, block) of a run at a shape: a run with blocks 4x as long has a quarter of the sequences; a
    run at the plan's largest micro-batch, nine tenths of the most plan.py fits on this GPU (up to 4x the shape's)."""
    batch, block = (DRY if dry else SHAPES)[shape][:2]
    if "largest micro-batch" in name:  # 90% of the plan's: its peaks were 2-7% under an H100's (docs/planner.md)
        return max(1, min(4 * batch, int(0.9 * largest_batch(model, name, dry, block)))), block
    own = next((int(f.split("=")[1]) for f in RUNS[name][1] if f.startswith("--block-size=")), None)
    if own:  # a long sequence's run: its own block (on a dry run 64x shorter)
        return 1, own // 64 if dry else own
    return (batch // 4, block * 4) if "4x as long" in name else (batch, block)


def command(shape, name, script, extra, folder, model, dataset, dry):
    (batch, block), (steps, log_every) = sizes(shape, name, dry, model), (DRY if dry else SHAPES)[shape][2:4]
    if script == "bench/peers.py":
        flags = [
            f"--model={model}",
            f"--dataset={dataset}",
            f"--block-size={block}",
            f"--batch-size={batch}",
            f"--steps={steps}",
            f"--warmup-steps={log_every}",
            f"--precision={'fp32' if dry else 'bf16'}",
            f"--output-dir={folder}",
        ]
    else:
        flags = [
            f"--model={model}",
            f"--dataset={dataset}",
            f"--block-size={block}",
            f"--batch-size={batch}",
            f"--max-steps={steps}",
            f"--log-every={log_every}",
            f"--precision={'fp32' if dry else 'bf16'}",
            "--save-every=0",
            "--eval-every=0",
            "--max-eval-samples=16",
            "--prompt=",
            f"--output-dir={folder}",
            "--overwrite",
        ]
    extra = [f for f in extra if not f.startswith(("--block-size=", "--batch-size="))]  # sizes()' own
    return [sys.executable, script, *flags, *extra]


def run_part(cmd, folder, deadline):
    """Run one part in its own process group; stop it (and what it started) at its deadline. (exit status or None
    when stopped, seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}  # each part a world of one of its own
    env.update(TRAIN_PROFILE=str(folder / "profile"), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if "--compile" in cmd:  # what dynamo recompiled or broke off, in the part's output.log
        env["TORCH_LOGS"] = "recompiles,graph_breaks"
    start = time.monotonic()
    with open(folder / "output.log", "w") as log:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    return code, time.monotonic() - start


def steady_tokens_per_sec(r):
    """Useful tokens per second after the first log interval (ours), or after the warm-up steps (the Trainer's)."""
    if "steady" in r:
        return r["steady"]["tokens"] / r["steady"]["seconds"]
    later = r["log_intervals"][1:]
    return sum(i[2] for i in later) / sum(i[1] for i in later) if later else None


def profiled(folder):
    """(kernel launches, device syncs) per step, from progress.Profiler's counts."""
    path = folder / "profile" / "profile-rank0.json"
    if not path.exists():
        return None, None
    events = json.loads(path.read_text())
    return sum(events.get(k, 0) for k in LAUNCHES), sum(events.get(k, 0) for k in SYNCS)


def kinds(folder):
    """A profiled step's time by kind (progress.Profiler: internals/step_time.py), or None."""
    path = folder / "profile" / "profile-rank0-kinds.json"
    return json.loads(path.read_text()) if path.exists() else None


def profile_table(rows, device):
    """Where a step's time went, each run's profiled steps (5-8) by kind: ms a step and the share of the step."""
    from finetune.internals.step_time import KINDS

    lines = [
        f"{device}; {time.strftime('%Y-%m-%d')}: a step's time by kind, ms (share of the step), over steps 5-8",
        "",
        "| shape | run | step ms | " + " | ".join(KINDS) + " | idle |",
        "|" + "---|" * (len(KINDS) + 4),
    ]
    for row in rows:
        step = row.get("kinds")
        if step and step.get("step_ms"):  # (a profile that failed says why in its kinds.json)
            share = lambda ms, step=step: f"{ms:.3g} ({100 * ms / step['step_ms']:.0f}%)"
            cells = [row["shape"], row["run"], f"{step['step_ms']:.3g}", *(share(step[k]["ms"]) for k in KINDS)]
            lines.append("| " + " | ".join([*cells, share(step["idle_ms"])]) + " |")
    return "\n".join(lines)


def planned(model, option, name, dry, *, batch, block, gpu_memory=80):
    """plan.py's row for an option of a run (its flags: RUNS) at this micro-batch and block."""
    import plan

    extra = RUNS[name][1]
    args = argparse.Namespace(
        model=str(model),
        gpus=1,
        nodes=1,
        gpu_memory=gpu_memory,
        cpu_memory=None,
        precision="fp32" if dry else "bf16",
        batch_size=batch,
        block_size=block,
        gradient_checkpointing="--gradient-checkpointing" in extra,
        offload_activations="--offload-activations" in extra,
        tiled_mlp="--tiled-mlp" in extra,
        sequence_parallel=1,
        loss_chunk=1024,
        lora_rank=next((int(f.split("=")[1]) for f in extra if f.startswith("--lora-rank=")), 0),
        lora_targets="all-linear",
        load_in_4bit="--load-in-4bit" in extra,
        load_in_8bit=False,
    )
    return next(r for r in plan.plan(args)[2] if r["option"] == option)


def planned_peak(model, option, shape, name, dry):
    """plan.py's (peak per GPU, CPU memory) for this run (bytes), or (None, None) for the Trainer's."""
    if option is None:
        return None, None
    batch, block = sizes(shape, name, dry, model)
    row = planned(model, option, name, dry, batch=batch, block=block)
    return row["peak_bytes_per_gpu"], row["cpu_bytes_per_node"]


def card_memory():
    """GiB of this GPU's memory."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def largest_batch(model, name, dry, block):
    """plan.py's largest micro-batch for the run at this block on this GPU (a dry run: 80 GiB, as plan.py's example)."""
    memory = 80 if dry else card_memory()
    return planned(model, RUNS[name][2], name, dry, batch=1, block=block, gpu_memory=memory)["largest_batch"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="the tiny demo model on the CPU: the parts and columns only")
    p.add_argument("--budget", type=float, default=450, help="seconds for all parts (the slot's 8 minutes, less start)")
    p.add_argument("--shapes", nargs="+", help="only these shapes (default: all)")
    p.add_argument("--runs", nargs="+", help="only these runs (default: all)")
    p.add_argument("--deadline", type=float, help="seconds each part may take (default: its shape's)")
    p.add_argument("--out", default=str(ROOT / "out" / "gpu"))
    args = p.parse_args(argv)
    import torch
    from run import model_folder

    from finetune.internals import demo

    if not args.dry and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; bench/gpu.sh --dry runs the same parts on the CPU")
    out, began = Path(args.out), time.monotonic()
    device = torch.cuda.get_device_name() if not args.dry else f"CPU ({os.cpu_count()} cores), dry run"
    rows = []
    if (not args.runs and not args.shapes) or "attention" in (args.runs or []):  # attention alone first, its own
        # table (bench/attention.py)
        code, _ = run_part(
            [sys.executable, "bench/attention.py", f"--out={out}", *(["--dry"] if args.dry else [])],
            out / "runs" / "attention",
            ATTENTION_S,
        )
        print(
            f"attention alone: {out / 'ATTENTION.md'}"
            if code == 0
            else f"attention alone: {'over its deadline' if code is None else 'failed'}, see {out}/runs/attention"
        )
    for shape, name in parts(args.shapes or (DRY if args.dry else SHAPES)):
        if args.runs and name not in args.runs:
            continue
        script, extra, option, data, slower = RUNS[name]
        deadline = args.deadline or slower * (DRY if args.dry else SHAPES)[shape][4]
        row = {"shape": shape, "run": name}
        rows.append(row)
        if time.monotonic() - began + deadline > args.budget:
            row["status"] = "skipped: no time left in the budget"
            continue
        missing = [m for m in ("peft", "bitsandbytes") if name in SCALE_UP and importlib.util.find_spec(m) is None]
        if missing:
            row["status"] = f"skipped: no {' or '.join(missing)} here (add its wheel to .whl/: ../shared/gpu/README.md)"
            continue
        model = model_folder(MODELS.get(shape, shape), out)
        row["planned"], row["planned_host"] = planned_peak(model, option, shape, name, args.dry)
        if row["planned_host"] and row["planned_host"] > psutil.virtual_memory().total:
            row["status"] = (
                f"skipped: the plan needs {row['planned_host'] / 2**30:.0f} GiB of host memory, this "
                f"host has {psutil.virtual_memory().total / 2**30:.0f}"
            )
            continue
        folder = out / "runs" / f"{shape}-{''.join(c if c.isalnum() else '_' for c in name)}"
        code, seconds = run_part(
            command(shape, name, script, extra, folder, model, demo.assets()[data], args.dry), folder, deadline
        )
        if code is None or code:
            tail = (folder / "output.log").read_text().strip().splitlines()[-1:] or ["?"]
            row["status"] = f"over its {deadline:.0f} s deadline" if code is None else f"failed: {tail[0][:90]}"
            continue
        r = json.loads((folder / "results.json").read_text())
        row.update(
            status="ok",
            seconds=seconds,
            tok_s=steady_tokens_per_sec(r),
            peak=r["peak_memory_bytes"],
            host=r.get("peak_host_memory_bytes"),
            loss=r["losses"][-1],
        )
        row["launches"], row["syncs"] = profiled(folder)
        row["kinds"] = kinds(folder)
        row["mfu"] = r.get("mfu")  # ours: over the steady intervals, against the card's peak (progress.RunStats)
    keep(report(rows, f"{device}, {'fp32' if args.dry else 'bf16'}"), out / "GPU.md")
    keep(profile_table(rows, f"{device}, {'fp32' if args.dry else 'bf16'}"), out / "PROFILE.md")
    return rows


def keep(table, path):
    """The table to path, to $OUT beside it where set (the device tool brings back what is under $OUT), and out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(table + "\n")
    print(table)


def report(rows, device):
    lines = [
        f"{device}; {time.strftime('%Y-%m-%d')}",
        "",
        "| shape | run | tok/s | x single-gpu.py | x Trainer | MFU | peak GiB | planned GiB | host GiB | "
        "planned host GiB | launches/step | syncs/step | last loss | status |",
        "|" + "---|" * 14,
    ]
    for row in rows:
        plain = "single-gpu.py, chats" if "chats" in row["run"] else "single-gpu.py"  # on the same data
        base = next((r for r in rows if r["shape"] == row["shape"] and r["run"] == plain), {})
        peer = next((r for r in rows if r["shape"] == row["shape"] and r["run"].startswith("HF Trainer")), {})
        # (each used within its iteration)
        ratio = lambda other, row=row: (
            f"{row['tok_s'] / other['tok_s']:.2f}x" if row.get("tok_s") and other.get("tok_s") else "-"
        )
        gib = lambda key, row=row: f"{row[key] / 2**30:.2f}" if row.get(key) else "-"
        count = lambda key, row=row: f"{row[key]:,.0f}" if row.get(key) is not None else "-"
        cells = [
            row["shape"],
            row["run"],
            f"{row['tok_s']:,.0f}" if row.get("tok_s") else "-",
            ratio(base),
            ratio(peer),
            f"{100 * row['mfu']:.1f}%" if row.get("mfu") else "-",
            gib("peak"),
            gib("planned"),
            gib("host"),
            gib("planned_host"),
            count("launches"),
            count("syncs"),
            f"{row['loss']:.3f}" if row.get("loss") is not None else "-",
            row["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
