"""Benchmark our recipe against the two a user would otherwise run, on the same model, data and sequences per step:
run_clm's (the HF Trainer with DeepSpeed ZeRO-2 on packed blocks) and this project's seeds' (every text padded).

    python3 bench/run.py --set cpu       # 2 CPU processes: the demo model and OPT-125m's shape (about 30 minutes)
    python3 bench/run.py --set gpu       # one GPU: OPT-125m and OPT-1.3B shapes, ZeRO-0/2/3 and ZeRO-3 + offload, bf16
    python3 bench/run.py --set largest   # one GPU: the largest OPT shape that trains with ZeRO-3 + CPU offload
    python3 bench/run.py --set tiny      # what the tests run: seconds

Writes <out>/BENCHMARKS.md (default out/bench; `--out bench` updates the committed one) and <out>/throughput.png:
one row per run, each the median of --repeat runs taken in alternating order with its peers: useful (non-padding)
tokens/s and their range, the ratios to both peers, rank 0's peak memory and its ratio to run_clm's, the model states
each rank held next to plan.py's figure, TFLOPs and MFU on a GPU, the final loss. Timing leaves out the first quarter
of the steps (the warm-up). GPU models are OPT shapes with random weights (they time exactly like trained ones).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import plan  # noqa: E402
from finetune import hardware  # noqa: E402
from finetune.internals import demo  # noqa: E402

BIN = Path(sys.executable).parent
PEERS = ("run_clm", "seeds")


def run(
    name,
    ranks=1,
    stage=None,
    offload="none",
    precision="fp32",
    packing="isolated",
    batch=8,
    accum=1,
    compile=False,
    data="reviews",
    loss_chunk=None,
    lora=0,
    probe=False,
    peer=None,
):
    return dict(
        name=name,
        ranks=ranks,
        stage=stage,
        offload=offload,
        precision=precision,
        packing=packing,
        batch=batch,
        accum=accum,
        compile=compile,
        data=data,
        loss_chunk=loss_chunk,
        lora=lora,
        probe=probe,
        peer=peer,
    )


def peers(ranks, batch, precision="fp32"):
    return [
        run(
            "run_clm recipe (Trainer, ZeRO-2, stream-packed blocks)",
            ranks,
            2,
            precision=precision,
            packing="stream",
            batch=batch,
            peer="run_clm",
        ),
        run(
            "seeds' recipe (Trainer, ZeRO-2, every text padded)",
            ranks,
            2,
            precision=precision,
            packing="none",
            batch=batch,
            peer="seeds",
        ),
    ]


def zero2(name, **kw):
    return run(name, ranks=2, stage=2, **kw)


SETS = {  # model -> (steps, block size, repeats, [runs]); peers first
    "tiny": {"demo": (6, 128, 1, [*peers(2, 4), zero2("ZeRO-2, 2 ranks", batch=4)])},
    "cpu": {
        "demo": (
            40,
            128,
            3,
            [
                *peers(2, 8),
                zero2("ZeRO-2, 2 ranks", batch=8),
                zero2("ZeRO-2, 2 ranks, stream packing", batch=8, packing="stream"),
                zero2("ZeRO-2, 2 ranks, chats (loss on answers)", batch=8, data="questions"),
                zero2("ZeRO-2, 2 ranks, LoRA rank 16", batch=8, lora=16),
                run("single process", batch=16),
                run("single process, --compile", batch=16, compile=True),
                run("ZeRO-3, 2 ranks", ranks=2, stage=3, batch=8),
                run("ZeRO-3 + CPU offload, 2 ranks", ranks=2, stage=3, offload="cpu", batch=8),
            ],
        ),
        "opt-125m": (
            12,
            256,
            3,
            [
                *peers(2, 8)[:1],
                zero2("ZeRO-2, 2 ranks", batch=8),
                zero2("ZeRO-2, 2 ranks, stream packing", batch=8, packing="stream"),
                zero2("ZeRO-2, 2 ranks, plain loss (--loss-chunk 0)", batch=8, loss_chunk=0),
            ],
        ),
    },
    "gpu": {
        shape: (
            60,
            512,
            1,
            [
                *peers(1, 16, "bf16"),
                run("single GPU, bf16", precision="bf16", batch=16),
                run("single GPU, bf16, --compile", precision="bf16", batch=16, compile=True),
                run("ZeRO-0, bf16", stage=0, precision="bf16", batch=16),
                run("ZeRO-2, bf16", stage=2, precision="bf16", batch=16),
                run("ZeRO-3, bf16", stage=3, precision="bf16", batch=16),
                run("ZeRO-3 + CPU offload, bf16", stage=3, offload="cpu", precision="bf16", batch=16),
            ],
        )
        for shape in ("opt-125m", "opt-1.3b")
    },
    # the seeds' default was opt-6.7b: which shapes fine-tune on one GPU (and this host's memory) with full offload
    "largest": {
        shape: (
            10,
            512,
            1,
            [run("ZeRO-3 + CPU offload, bf16", stage=3, offload="cpu", precision="bf16", batch=4, probe=True)],
        )
        for shape in ("opt-1.3b", "opt-2.7b", "opt-6.7b")
    },
}


def narrowed_llama_3_1_8b():
    """Llama-3.1-8B's config narrowed for a dry run on a CPU: its vocabulary, its ratios of heads to key-value heads
    and of the MLP's width to the hidden size, 2 layers of width 128."""
    config = plan.load_config("meta-llama/Llama-3.1-8B")
    config.update(
        dict(
            hidden_size=128,
            intermediate_size=448,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=4096,
        )
    )
    return config


SHAPES = {  # bench shapes by name beside the OPT ones (facebook/opt-*)
    "llama-3.2-1b": lambda: plan.load_config("meta-llama/Llama-3.2-1B"),
    "llama-3.1-8b": lambda: plan.load_config("meta-llama/Llama-3.1-8B"),
    "llama-3.1-8b-narrowed": narrowed_llama_3_1_8b,
}


def model_folder(name, out):
    """The demo model, or an OPT shape (or a Llama one, SHAPES) with random weights and the demo tokenizer."""
    if name == "demo":
        return demo.assets()["lm"]
    folder = out / "models" / name
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = SHAPES[name]() if name in SHAPES else plan.load_config(f"facebook/{name}")
        torch.manual_seed(0)  # saved in bf16: half the disk; the scripts load it in fp32. Made on the GPU where there
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # is one: a 1B model in a second, not 20
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        AutoTokenizer.from_pretrained(demo.assets()["lm"]).save_pretrained(folder)
    return folder


def execute(cmd, env):
    """Run one benchmark command; the tests replace it to fork the ranks from an already-imported parent."""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def launch(cmd, folder, probe=False):
    """The run's results.json; for a probe that failed, the reason (its last error line) instead."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if not torch.cuda.is_available():
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    done = execute(cmd, env)
    if done.returncode and probe:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line or "error:" in line]
        return (lines[-1] if lines else f"exit {done.returncode}").strip()[-120:]
    if done.returncode:
        sys.exit(f"error: benchmark run failed ({' '.join(map(str, cmd[:6]))} ...):\n{done.stderr[-3000:]}")
    return json.loads((folder / "results.json").read_text())


def measure(spec, model, steps, block, out):
    """One run of ours or of a peer; its results with the steady state (after the first quarter of the steps)."""
    folder = out / "runs" / "".join(c if c.isalnum() else "_" for c in f"{Path(model).name} {spec['name']}")
    dataset = demo.assets()[spec["data"]]
    launcher = [BIN / "deepspeed", "--num_gpus", str(spec["ranks"])] if spec["stage"] is not None else [BIN / "python"]
    if spec["peer"]:
        cmd = [
            *launcher,
            "bench/peers.py",
            f"--recipe={spec['peer']}",
            f"--model={model}",
            f"--dataset={dataset}",
            f"--block-size={block}",
            f"--batch-size={spec['batch']}",
            f"--steps={steps}",
            f"--warmup-steps={max(1, steps // 4)}",
            f"--precision={spec['precision']}",
            f"--output-dir={folder}",
            "--deepspeed",
        ]
        return launch(cmd, folder)
    flags = [
        f"--model={model}",
        f"--dataset={dataset}",
        f"--block-size={block}",
        f"--batch-size={spec['batch']}",
        f"--grad-accum={spec['accum']}",
        f"--max-steps={steps}",
        f"--precision={spec['precision']}",
        f"--packing={spec['packing']}",
        "--save-every=0",
        f"--log-every={max(1, steps // 4)}",
        "--prompt=",
        f"--output-dir={folder}",
        "--overwrite",
    ] + (["--compile"] if spec["compile"] else [])
    flags += [] if spec["loss_chunk"] is None else [f"--loss-chunk={spec['loss_chunk']}"]
    flags += [f"--lora-rank={spec['lora']}"] if spec["lora"] else []
    if spec["stage"] is None:
        cmd = [*launcher, "single-gpu.py", *flags]
    else:
        config = "ds_config_zero3.json" if spec["stage"] == 3 else "ds_config_zero2.json"  # each stage's shipped one
        cmd = [
            *launcher,
            "zero-optimization.py",
            *flags,
            f"--deepspeed={config}",
            f"--zero-stage={spec['stage']}",
            f"--offload={spec['offload']}",
        ]
    r = launch(cmd, folder, spec["probe"])
    if isinstance(r, dict):  # the first log interval is the warm-up: what comes after it is the steady state
        warm, *later = r["log_intervals"]
        r["steady"] = dict(
            steps=later[-1][0] - warm[0],
            seconds=sum(i[1] for i in later),
            tokens=sum(i[2] for i in later),
            attended=sum(i[2] * i[3] for i in later),
        )
    return r


def tokens_per_sec(r):
    return r["steady"]["tokens"] / r["steady"]["seconds"]


def planned_bytes(spec, config):
    """plan.py's model states per rank for this run (after the step, as results.json counts them at the end)."""
    option = "ZeRO-0" if spec["stage"] is None else f"ZeRO-{spec['stage']}"
    option += " + CPU offload" if spec["offload"] == "cpu" else ""
    return plan.model_states(
        plan.parameters(config, spec["lora"]),
        config.hidden_size,
        spec["precision"],
        spec["ranks"],
        option,
        layer=plan.layer_params(config, spec["lora"]),
        groups=plan.optimizer_groups(config, spec["lora"]),
    )["after_step"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="cpu", choices=sorted(SETS))
    p.add_argument("--out", default=str(ROOT / "out" / "bench"), help="folder for BENCHMARKS.md and throughput.png")
    p.add_argument("--repeat", type=int, help="runs of each (default: the set's)")
    p.add_argument("--models", nargs="+", help="only these of the set's models")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    rows = []
    for model_name, (steps, block, repeats, specs) in SETS[args.set].items():
        if args.models and model_name not in args.models:
            continue
        model = model_folder(model_name, out)
        config = plan.load_config(str(model))
        with torch.device("meta"):  # nothing allocated
            n_params = hardware.matmul_params(AutoModelForCausalLM.from_config(config))
        runs = {i: [] for i in range(len(specs))}
        for _ in range(args.repeat or repeats):  # alternating order: each repeat runs every spec once
            for i, spec in enumerate(specs):
                runs[i].append(measure(spec, model, steps, block, out))
        for i, spec in enumerate(specs):
            results = [r for r in runs[i] if isinstance(r, dict)]
            failed = runs[i][0] if not results else None
            speeds = sorted(tokens_per_sec(r) for r in results)
            median = statistics.median(speeds) if speeds else None
            row = dict(
                model=model_name,
                spec=spec,
                run=spec["name"] + (f": did not run ({failed})" if failed else ""),
                speeds=speeds,
                median=median,
                result=results[len(results) // 2] if results else None,
                memory=statistics.median(r["peak_memory_bytes"] for r in results) if results else None,
            )
            r = row["result"]
            if r and not spec["peer"]:
                row["held"] = max(r["model_state_bytes_per_rank"])
                row["planned"] = planned_bytes(spec, config)
                found = hardware.peak_tflops(device_name, spec["precision"]) if cuda else None
                if found:
                    attended = r["steady"]["attended"] / r["steady"]["tokens"]
                    flops = hardware.flops_per_token(config, n_params, attended) * median / r["world_size"]
                    row["tflops"], row["mfu"] = flops / 1e12, flops / 1e12 / found[0]
            rows.append(row)
        for row in rows[-len(specs) :]:
            for peer in PEERS:
                ref = next((x for x in rows[-len(specs) :] if x["spec"]["peer"] == peer), None)
                if ref and row["median"] and ref["median"]:
                    row[f"x {peer}"] = row["median"] / ref["median"]
                    row[f"mem {peer}"] = row["memory"] / ref["memory"]
    write_report(rows, out, args.set, device_name)
    return rows


def write_report(rows, out, name, device_name):
    date = datetime.date.today().isoformat()
    gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"
    size = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    lines = [
        f"# Benchmarks: set `{name}`, {device_name}, {date}",
        "",
        "Useful tokens/s counts the real (non-padding) tokens trained on, all ranks together, after the first "
        "quarter of the steps (the warm-up); the median of the runs, taken in alternating order with the peers "
        "(range in brackets). x run_clm and x seeds: ratios to the peers measured in the same run, on the same "
        "model, data and sequences per step. Peak memory: rank 0's (GPU allocated, or the process's peak "
        "resident memory on CPU), and its ratio to run_clm's. Model states: the bytes each rank held after the "
        "last step (`finetune/internals/memory.py`), and `plan.py`'s figure for the run. TFLOPs and MFU on GPUs "
        "only ([docs/gpu.md](../docs/gpu.md)).",
        "",
        "| model | run | ranks | ZeRO | precision | packing | useful tok/s | x run_clm | x seeds | peak mem/rank "
        "(GiB) | mem vs run_clm | model states/rank: counted / planned | TFLOPs/GPU | MFU | final loss |",
        "|" + "---|" * 15,
    ]
    for row in rows:
        spec, r = row["spec"], row["result"]
        speeds = (
            (
                f"{row['median']:,.0f} [{row['speeds'][0]:,.0f}-{row['speeds'][-1]:,.0f}]"
                if len(row["speeds"]) > 1
                else f"{row['median']:,.0f}"
            )
            if row["median"]
            else "-"
        )
        ratio = lambda key, fmt, row=row: fmt.format(row[key]) if key in row else "-"
        states = f"{size(row['held'])} / {size(row['planned'])}" if "held" in row else "-"
        cells = [
            row["model"],
            row["run"],
            spec["ranks"],
            "-" if spec["stage"] is None else spec["stage"],
            spec["precision"],
            spec["packing"],
            speeds,
            ratio("x run_clm", "{:.2f}x"),
            ratio("x seeds", "{:.1f}x"),
            gib(row["memory"]),
            ratio("mem run_clm", "{:.2f}x"),
            states,
            f"{row['tflops']:.0f}" if "tflops" in row else "-",
            f"{100 * row['mfu']:.1f}%" if "mfu" in row else "-",
            f"{r['losses'][-1]:.3f}" if r else "-",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    (out / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    labels = [f"{row['model']}: {row['run'].split(': did not run')[0]}" for row in rows]
    ax.barh(
        labels,
        [row["median"] or 0 for row in rows],
        color=["tab:gray" if row["spec"]["peer"] else "tab:blue" for row in rows],
    )
    ax.invert_yaxis()
    ax.set(xlabel="useful tokens per second", title=f"{device_name}, {date}")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
