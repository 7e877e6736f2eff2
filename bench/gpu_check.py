"""The GPU smoke test behind bench/gpu_check.sh: see there. Exit code 0 only if every run agrees and reloads."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from run import model_folder  # noqa: E402

from finetune.internals import demo  # noqa: E402

RUNS = [
    ("single GPU", "single-gpu.py", []),
    ("single GPU, --compile", "single-gpu.py", ["--compile"]),
    ("ZeRO-0", "zero-optimization.py", ["--zero-stage=0"]),
    ("ZeRO-2", "zero-optimization.py", ["--zero-stage=2"]),
    ("ZeRO-3", "zero-optimization.py", ["--zero-stage=3"]),
    ("ZeRO-3 + CPU offload", "zero-optimization.py", ["--zero-stage=3", "--offload=cpu"]),
]
RTOL = 2e-2  # bf16: the engine's 16-bit weights and autocast over fp32 ones round differently (CPU: 1e-4 to 1e-3)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; bench/gpu_check.sh is the GPU smoke test (the CPU tests are `make test`)")
    out = ROOT / "out" / "gpu-check"
    model = model_folder("opt-125m", ROOT / "out" / "bench")
    rows = []
    for name, script, extra in RUNS:
        folder = out / "".join(c if c.isalnum() else "_" for c in name)
        flags = [
            f"--model={model}",
            f"--dataset={demo.assets()['questions']}",
            "--block-size=512",
            "--batch-size=8",
            f"--max-steps={args.steps}",
            "--precision=bf16",
            "--save-every=0",
            "--log-every=10",
            "--prompt=Hi",
            f"--output-dir={folder}",
            "--overwrite",
            *extra,
        ]
        launcher = (
            [sys.executable]
            if script == "single-gpu.py"
            else [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1"]
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if "--compile" in extra:  # what dynamo recompiled or broke off, in the run's output.log
            env["TORCH_LOGS"] = "recompiles,graph_breaks"
        done = subprocess.run(
            [*launcher, script, *flags] + (["--deepspeed"] if script != "single-gpu.py" else []),
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
        )
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "output.log").write_text(done.stdout + done.stderr)  # what a failure said, whole
        if done.returncode:
            rows.append((name, f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:100]}", "", "", "", ""))
            continue
        r = json.loads((folder / "results.json").read_text())
        ref = json.loads((out / "single_GPU" / "results.json").read_text())["losses"]
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref, r["losses"]))
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(folder / "final").cuda()  # stock transformers
        ok = worst < RTOL and torch.isfinite(reloaded(torch.tensor([[2, 100, 200]], device="cuda")).logits).all()
        rows.append(
            (
                name,
                "ok" if ok else "MISMATCH",
                f"{worst:.1e}",
                f"{r['tokens_per_sec']:,.0f}",
                f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-",
                f"{r['peak_memory_bytes'] / 2**30:.1f}",
            )
        )
    print(f"{torch.cuda.get_device_name()}, OPT-125m shape, bf16, {args.steps} steps of 8 x 512 tokens")
    print(f"{'run':<24}{'status':<12}{'loss vs single GPU':>20}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}")
    for row in rows:
        print(f"{row[0]:<24}{row[1]:<12}{row[2]:>20}{row[3]:>10}{row[4]:>8}{row[5]:>10}")
    return 0 if all(row[1] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
