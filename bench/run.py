"""Benchmark our recipe against the seeds' (bench/seed_recipe.py) on the same model, data and number of sequences.

    python3 bench/run.py --set cpu       # 2 CPU processes, the demo model (a few minutes on 2 cores)
    python3 bench/run.py --set gpu       # one GPU: OPT-125m and OPT-1.3B shapes, ZeRO-0/2/3 and ZeRO-3 + offload, bf16
    python3 bench/run.py --set largest   # one GPU: the largest OPT shape that trains with ZeRO-3 + CPU offload
    python3 bench/run.py --set tiny --out /tmp/bench   # what the tests run: seconds

Writes <out>/BENCHMARKS.md (one row per run: useful tokens/s, samples/s, step time, TFLOPs and MFU on a GPU, peak
memory per rank next to plan.py's figure for it (GPU), final loss, and the ratio to the seeds' recipe measured in
the same run) and <out>/throughput.png. A run marked probe may fail (out of memory): its row says so and the set
goes on.
GPU models are built from the published OPT shapes with random weights (they time exactly like trained ones).
FLOPs per token: 6N + 12·L·H·Q·T (the PaLM appendix, as nanoGPT and torchtitan count them).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import demo  # noqa: E402
import hardware  # noqa: E402
import plan  # noqa: E402

BIN = Path(sys.executable).parent


def run(name, ranks=1, stage=None, offload="none", precision="fp32", packing=True, batch=8, accum=1, compile=False,
        probe=False):
    return dict(name=name, ranks=ranks, stage=stage, offload=offload, precision=precision, packing=packing,
                batch=batch, accum=accum, compile=compile, probe=probe)


SETS = {  # model -> (steps, block size, [runs]); the peer runs once per model with the first run's global batch,
    # except for a model whose runs are all probes
    "tiny": {"demo": (6, 128, [run("ZeRO-2, 2 ranks", ranks=2, stage=2, batch=4)])},
    "cpu": {"demo": (40, 128, [run("ZeRO-2, 2 ranks", ranks=2, stage=2, batch=8),
                               run("single process", batch=16),
                               run("single process, --compile", batch=16, compile=True),
                               run("ZeRO-3, 2 ranks", ranks=2, stage=3, batch=8),
                               run("ZeRO-3 + CPU offload, 2 ranks", ranks=2, stage=3, offload="cpu", batch=8)])},
    "gpu": {shape: (60, 512, [run("single GPU, bf16", precision="bf16", batch=16),
                              run("single GPU, bf16, --compile", precision="bf16", batch=16, compile=True),
                              run("ZeRO-0, bf16", stage=0, precision="bf16", batch=16),
                              run("ZeRO-2, bf16", stage=2, precision="bf16", batch=16),
                              run("ZeRO-2, bf16, --compile", stage=2, precision="bf16", batch=16, compile=True),
                              run("ZeRO-3, bf16", stage=3, precision="bf16", batch=16),
                              run("ZeRO-3 + CPU offload, bf16", stage=3, offload="cpu", precision="bf16", batch=16)])
            for shape in ("opt-125m", "opt-1.3b")},
    # the seed's default was opt-6.7b: which shapes fine-tune on one GPU (and this host's memory) with full offload
    "largest": {shape: (10, 512, [run("ZeRO-3 + CPU offload, bf16", stage=3, offload="cpu", precision="bf16", batch=4,
                                      probe=True)])
                for shape in ("opt-1.3b", "opt-2.7b", "opt-6.7b")},
}


def model_folder(name, out):
    """The demo model, or an OPT shape with random weights and the demo tokenizer."""
    if name == "demo":
        return demo.assets()['lm']
    folder = out / "models" / name
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer
        config = plan.load_config(f"facebook/{name}")
        torch.manual_seed(0)  # saved in bf16: half the disk; the scripts load it in fp32
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        AutoTokenizer.from_pretrained(demo.assets()['lm']).save_pretrained(folder)
    return folder


def launch(cmd, folder, probe=False):
    """The run's results.json; for a probe that failed, the reason (its last error line) instead."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode and probe:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line or "error:" in line]
        return (lines[-1] if lines else f"exit {done.returncode}").strip()[-120:]
    if done.returncode:
        sys.exit(f"error: benchmark run failed ({' '.join(map(str, cmd[:6]))} ...):\n{done.stderr[-3000:]}")
    return json.loads((folder / "results.json").read_text())


def ours(spec, model, steps, block, out):
    name = f"{Path(model).name} {spec['name']}"
    folder = out / "runs" / name.replace(" ", "_").replace(",", "").replace("+", "plus").replace("--", "")
    flags = [f"--model={model}", f"--dataset={demo.assets()['reviews']}", f"--block-size={block}",
             f"--batch-size={spec['batch']}", f"--grad-accum={spec['accum']}", f"--max-steps={steps}",
             f"--precision={spec['precision']}", "--save-every=0", f"--log-every={max(1, steps // 4)}", "--prompt=",
             f"--output-dir={folder}", "--overwrite"] + ([] if spec["packing"] else ["--packing=none"])
    flags += ["--compile"] if spec["compile"] else []
    if spec["stage"] is None:
        cmd = [BIN / "python", "single-gpu.py", *flags]
    else:
        cmd = [BIN / "deepspeed", "--num_gpus", str(spec["ranks"]), "zero-optimization.py", *flags,
               "--deepspeed_config=ds_config_zero2.json", f"--zero-stage={spec['stage']}", f"--offload={spec['offload']}"]
    r = launch(cmd, folder, spec["probe"])
    if isinstance(r, dict):  # the first log interval is the warm-up: what comes after it is the steady state
        warm, *later = r["log_intervals"]
        r["steady"] = dict(steps=later[-1][0] - warm[0], seconds=sum(i[1] for i in later),
                           tokens=sum(i[2] for i in later))
    return r


def tokens_per_sec(r):
    return r["steady"]["tokens"] / r["steady"]["seconds"]


def planned_bytes(spec, config, block):
    """plan.py's model states + activations per GPU for this run (16-bit training only: its arithmetic's case)."""
    if spec["precision"] not in ("bf16", "fp16"):
        return None
    psi, largest = plan.count_params(config)
    option = "ZeRO-0" if spec["stage"] is None else f"ZeRO-{spec['stage']}"
    option += " + CPU offload" if spec["offload"] == "cpu" else ""
    states = plan.model_states(psi, largest, spec["ranks"], 1)[option][0]
    return states + plan.activations(spec["batch"], block, config.hidden_size, config.num_hidden_layers,
                                     config.vocab_size, checkpointing=False)


def peer(spec, model, steps, block, out):
    folder = out / "runs" / "seeds_recipe"
    max_length = min(512, plan.load_config(str(model)).max_position_embeddings)
    cmd = [BIN / "deepspeed", "--num_gpus", str(spec["ranks"]), "bench/seed_recipe.py", f"--model={model}",
           f"--dataset={demo.assets()['reviews']}", f"--max-length={max_length}", f"--batch-size={spec['batch']}",
           f"--num-sequences={steps * spec['batch'] * spec['accum'] * spec['ranks']}", f"--output-dir={folder}",
           f"--warmup-steps={max(1, steps // 4)}",
           "--deepspeed=ds_config_zero2.json"]
    return launch(cmd, folder), max_length


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="cpu", choices=sorted(SETS))
    p.add_argument("--out", default=str(ROOT / "bench"), help="folder for BENCHMARKS.md and throughput.png")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    found = hardware.peak_tflops(device_name, "bf16") if cuda else None
    peak = found[0] if found else None
    rows = []
    for model_name, (steps, block, specs) in SETS[args.set].items():
        model = model_folder(model_name, out)
        config = plan.load_config(str(model))
        n_params = plan.count_params(config)[0]
        seeds = None
        if not all(spec["probe"] for spec in specs):
            seeds, max_length = peer(specs[0], model, steps, block, out)
            rows.append(dict(model=model_name, run=f"seeds' recipe (Trainer, padded to {max_length}, fp32)",
                             ranks=specs[0]["ranks"], stage="2", offload="none", precision="fp32", packing="no",
                             batch=f"{specs[0]['batch']} x 1", result=seeds, seq=max_length, ratio=1.0, planned=None))
        for spec in specs:
            r = ours(spec, model, steps, block, out)
            failed = isinstance(r, str)
            rows.append(dict(model=model_name, run=spec["name"] + (f": did not run ({r})" if failed else ""),
                             ranks=spec["ranks"], stage="-" if spec["stage"] is None else str(spec["stage"]),
                             offload=spec["offload"], precision=spec["precision"],
                             packing="yes" if spec["packing"] else "no", batch=f"{spec['batch']} x {spec['accum']}",
                             result=None if failed else r, seq=block,
                             ratio=None if failed or seeds is None else tokens_per_sec(r) / tokens_per_sec(seeds),
                             planned=planned_bytes(spec, config, block) if cuda else None))
        for row in rows[-len(specs) - (seeds is not None):]:
            r = row["result"]
            if r is None:
                continue
            steady = r["steady"]
            row["samples_per_sec"] = steady["steps"] * r["global_batch_size"] / steady["seconds"]
            row["step_time"] = steady["seconds"] / steady["steps"]
            tflops = hardware.flops_per_token(config, n_params, row["seq"]) * tokens_per_sec(r) / r["world_size"] / 1e12
            row["tflops"], row["mfu"] = (tflops, tflops / peak) if peak else (None, None)
    write_report(rows, out, args.set, device_name)
    return rows


def write_report(rows, out, name, device_name):
    date = datetime.date.today().isoformat()
    lines = [f"# Benchmarks: set `{name}`, {device_name}, {date}", "",
             "Useful tokens/s counts real (non-padding) tokens trained on, all ranks together, after the first "
             "quarter of the steps (the warm-up: compilation, allocator, DeepSpeed's first steps), as are samples/s and "
             "step time; x seeds is the ratio to "
             "the seeds' recipe (HF Trainer + DeepSpeed ZeRO-2, every text padded to max length, fp32) on the same "
             "model, data and number of sequences, measured in the same run. TFLOPs and MFU (6N + 12·L·H·Q·T FLOPs "
             "per token against the GPU's dense bf16 peak) on GPUs only. Peak memory: rank 0 (GPU allocated, or the "
             "process's resident memory on CPU); planned: `plan.py`'s model states + activations for the same run "
             "(16-bit runs on GPUs).", "",
             *([] if "CPU" not in device_name else [
                 "CPU figures (no GPU was lent to the session that made them): `python3 bench/run.py --set gpu` on a "
                 "GPU machine adds the OPT-125m and OPT-1.3B shapes with TFLOPs and MFU.", ""]),
             "| model | run | ranks | ZeRO | offload | precision | packing | micro-batch x accum | useful tok/s "
             "| samples/s | step time (s) | TFLOPs/GPU | MFU | peak mem/rank (GiB) | planned (GiB) | final loss "
             "| x seeds |",
             "|" + "---|" * 17]
    for row in rows:
        r = row["result"]
        planned = f"{row['planned'] / 2**30:.2f}" if row["planned"] is not None else "-"
        cells = [row["model"], row["run"], row["ranks"], row["stage"], row["offload"], row["precision"],
                 row["packing"], row["batch"]]
        if r is None:  # a probe that did not run
            cells += ["-"] * 6 + [planned, "-", "-"]
        else:
            cells += [f"{tokens_per_sec(r):,.0f}", f"{row['samples_per_sec']:.1f}", f"{row['step_time']:.3f}",
                      f"{row['tflops']:.0f}" if row["tflops"] is not None else "-",
                      f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-",
                      f"{r['peak_memory_bytes'] / 2**30:.2f}", planned, f"{r['losses'][-1]:.3f}",
                      f"{row['ratio']:.1f}x" if row["ratio"] is not None else "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    (out / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    labels = [f"{row['model']}: {row['run'].split(': did not run')[0]}" for row in rows]
    ax.barh(labels, [tokens_per_sec(row["result"]) if row["result"] else 0 for row in rows],
            color=["tab:gray" if row["run"].startswith("seeds") else "tab:blue" for row in rows])
    ax.invert_yaxis()
    ax.set(xlabel="useful tokens per second", title=f"{device_name}, {date}")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
