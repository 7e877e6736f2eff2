"""The host's work per steady training step, counted where no GPU is: what makes a small model slow on a GPU under
an engine, and what a CPU shows exactly.

    python3 bench/host_cost.py                  # one process, bf16 and fp32: the table (a minute on 2 CPU cores)
    python3 bench/host_cost.py --ranks 1 2      # ... and on 2 ranks (torchrun), for the collectives
    python3 bench/host_cost.py --where ZeRO-2   # where one run's ops and reads come from, by source line

Per optimizer step, after three steps (the steady state), of single-gpu.py and zero-optimization.py at each ZeRO
stage (and of the HF Trainer's ZeRO-2 step, sequence_classification.py's, with DeepSpeed's mends and without) on a
12-layer narrow OPT (OPT-125m's 196 tensors in 0.6M parameters: the counts are the engine's, not the
model's), 4 sequences of 64 tokens a rank:
- ops: the aten operations dispatched; kernels: those that are not views or allocations (each a kernel launch on a
  GPU, about 5-10 us of host time each);
- reads: operations that read a tensor's value on the host (`.item()`, `bool(t)`, `float(t)`, `.tolist()`, `.cpu()`):
  each a device sync on a GPU when the tensor lives there (both scripts also read 2 of the host's own: the stop
  flag, a CPU tensor);
- syncs: the accelerator's synchronize() (torch.cuda.synchronize, DeepSpeed's get_accelerator().synchronize);
- collectives: the process group's operations (all-reduce, reduce-scatter, all-gather, ...), by name;
- calls: the Python functions called in the next step (counted apart, without the counting mode's own): the host's
  interpreter work, which launches do not count (an engine's per-parameter hooks, each a dozen calls); and the
  project's modules whose code that step runs (what a reader follows a step through).
The counts are those of a GPU run but for the branches DeepSpeed takes only on CUDA (its side streams and events;
docs/gpu.md). bench/BENCHMARKS.md holds the table; tests/test_host_cost.py holds the budgets.
"""

import argparse
import collections
import contextlib
import csv
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from finetune import progress  # noqa: E402
from finetune.internals import demo  # noqa: E402

RUNS = {  # name -> (script, its flags)
    "single-gpu.py": ("single-gpu.py", []),
    "ZeRO-0": ("zero-optimization.py", ["--zero-stage=0", "--deepspeed=ds_config_zero2.json"]),
    "ZeRO-1": ("zero-optimization.py", ["--zero-stage=1", "--deepspeed=ds_config_zero2.json"]),
    "ZeRO-2": ("zero-optimization.py", ["--zero-stage=2", "--deepspeed=ds_config_zero2.json"]),
    "ZeRO-3": ("zero-optimization.py", ["--zero-stage=3", "--deepspeed=ds_config_zero3.json"]),
    "ZeRO-3 + CPU offload": (
        "zero-optimization.py",
        ["--zero-stage=3", "--offload=cpu", "--deepspeed=ds_config_zero3.json"],
    ),
    # the HF Trainer's engine (the classifier on the same model, a one-output head), mended as ours and not
    "Trainer ZeRO-2": ("sequence_classification.py", ["--deepspeed=ds_config_zero2.json"]),
    "Trainer ZeRO-2, --mends none": (
        "sequence_classification.py",
        ["--deepspeed=ds_config_zero2.json", "--mends=none"],
    ),
}
COUNTED_STEP = 3  # steps 1-3 warm up (the optimizer's state, the engine's first-step work); step 4 is counted,
# step 5's Python calls
READS = {torch.ops.aten._local_scalar_dense.default}
ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::set_"}
COLLECTIVES = ("c10d", "deepspeed")  # the namespaces of the process group's operations (and DeepSpeed's CPU one)


class HostWork(TorchDispatchMode):
    """Counts what the host asks of the device while it is active (see the module's docstring); with where=True also
    the source line (outside torch) each op and each read came from."""

    def __init__(self, where=False):
        super().__init__()
        self.where = where
        self.ops = self.kernels = self.reads = self.syncs = 0
        self.collectives, self.read_lines, self.op_lines = (collections.Counter() for _ in range(3))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.ops += 1
        if name.split("::")[0] in COLLECTIVES:
            self.collectives[name.split("::")[1].rstrip("_")] += 1
        elif func in READS:
            self.read(2)
        elif not func.is_view and name not in ALLOCATIONS:
            self.kernels += 1
        if self.where:
            self.op_lines[source_line(2, callers=14 if name.startswith("c10d") else 0)] += 1
        return func(*args, **(kwargs or {}))

    def read(self, depth):
        self.reads += 1
        self.read_lines[source_line(depth + 1, callers=2)] += 1

    @contextlib.contextmanager
    def counting(self):
        """Within: this mode, and the host reads and syncs torch's dispatcher does not see (.tolist() and .cpu() of
        a CPU tensor dispatch nothing; synchronize() is no op at all)."""
        from deepspeed.accelerator import get_accelerator

        accelerator, patched = get_accelerator(), []

        def counted(owner, name, count):
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                count()
                return original(*args, **kwargs)

            patched.append((owner, name, original, owner.__dict__.get(name) is original))
            setattr(owner, name, wrapper)

        for name in ("tolist", "cpu"):  # on a GPU each copies a device tensor to the host, waiting for it (.numpy()
            # refuses a device tensor: the data's own indices)
            counted(torch.Tensor, name, lambda: self.read(2))
        counted(accelerator, "synchronize", lambda: setattr(self, "syncs", self.syncs + 1))
        counted(torch.cuda, "synchronize", lambda: setattr(self, "syncs", self.syncs + 1))
        try:
            with self:
                yield self
        finally:
            for owner, name, original, own in reversed(patched):
                if own:
                    setattr(owner, name, original)
                else:  # an instance's attribute over its class's method: remove it
                    delattr(owner, name)

    def result(self):
        return {
            "ops": self.ops,
            "kernels": self.kernels,
            "reads": self.reads,
            "syncs": self.syncs,
            "collectives": dict(self.collectives),
            "read_lines": dict(self.read_lines.most_common()),
            "op_lines": dict(self.op_lines.most_common(40)),
            "collective_lines": {k: n for k, n in self.op_lines.items() if " < " in k},
        }


def source_line(depth, callers=0):
    """The innermost frame outside torch (and this file), as 'package/file.py:line', and that many of its callers."""
    found = []
    for frame in reversed(traceback.extract_stack()[:-depth]):
        if "/torch/" not in frame.filename and "typing_extensions" not in frame.filename and frame.filename != __file__:
            found.append(f"{frame.filename.split('site-packages/')[-1].replace(str(ROOT) + '/', '')}:{frame.lineno}")
            if len(found) > callers:
                break
    return " < ".join(found) or "?"


def assets(folder):
    """A 12-layer, 64-wide OPT (OPT-125m's tensors, dropout 0) with the demo's tokenizer, and 400 generated reviews."""
    folder = Path(folder)
    if not (folder / "model" / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        demo.make_demo_corpus(folder / "reviews.csv", n=400, seed=1)
        with open(folder / "reviews.csv") as f:
            texts = [row["text"] for row in csv.DictReader(f)]
        tokenizer = demo.make_demo_tokenizer(texts, vocab_size=300)
        demo.make_demo_lm(folder / "model", tokenizer, hidden=64, layers=12, heads=4, positions=128, seed=0)
    return {"model": folder / "model", "data": folder / "reviews.csv"}


def flags(name, precision, files, out):
    script, extra = RUNS[name]
    if script == "sequence_classification.py":  # the reviews' star ratings, 4 texts a rank a step: 6 steps or more
        # (its epochs: of 380 texts, on up to 2 ranks)
        return script, [
            f"--model={files['model']}",
            f"--dataset={files['data']}",
            "--max-length=64",
            "--batch-size=4",
            f"--epochs={(COUNTED_STEP + 3) * 4 * 2 / 380}",
            f"--precision={precision}",
            f"--output-dir={out}",
            "--overwrite",
            *extra,
        ]
    return script, [
        f"--model={files['model']}",
        f"--dataset={files['data']}",
        "--block-size=64",
        "--batch-size=4",
        f"--max-steps={COUNTED_STEP + 3}",
        "--log-every=1000",
        "--save-every=0",
        "--eval-every=0",
        "--max-eval-samples=4",
        "--prompt=",
        f"--precision={precision}",
        f"--output-dir={out}",
        "--overwrite",
        *extra,
    ]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_").removesuffix(".py"), ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count(script, argv, where=False, step=COUNTED_STEP):
    """Run script's main(argv) in this process and count one steady step: from the end of step `step` to the end of
    the next (what the loop does after a step, its checks, then a whole step); then the Python calls of the step
    after it. A step ends at the scripts' RunStats.end_step, or the HF Trainer's on_step_end."""
    from transformers.trainer_callback import CallbackHandler

    counter, end_step, step_end = HostWork(where), progress.RunStats.end_step, CallbackHandler.on_step_end
    active, calls, files = contextlib.ExitStack(), [0], set()

    def call(frame, event, arg):
        if event == "call":  # Python functions; "c_call" is a builtin's
            calls[0] += 1
            files.add(frame.f_code.co_filename)

    def ended(done):  # the step that just ended
        if done == step:
            active.enter_context(counter.counting())
        elif done == step + 1:
            active.close()
            sys.setprofile(call)
        elif done == step + 2:
            sys.setprofile(None)

    def counting_end_step(stats, *args, **kwargs):
        end_step(stats, *args, **kwargs)
        ended(stats.step)

    def counting_step_end(handler, args, state, control):
        control = step_end(handler, args, state, control)
        ended(state.global_step)
        return control

    progress.RunStats.end_step, CallbackHandler.on_step_end = counting_end_step, counting_step_end
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            load_script(script).main(argv)
    finally:
        active.close()
        sys.setprofile(None)
        progress.RunStats.end_step, CallbackHandler.on_step_end = end_step, step_end
    package = ROOT / "finetune"
    modules = sorted(str(Path(f).relative_to(package)) for f in files if Path(f).is_relative_to(package))
    return {**counter.result(), "calls": calls[0], "modules": modules}


def count_run(name, precision, files, ranks=1, where=False, launch=None):
    """Run `name` in `precision` on `ranks` processes (one: plain python, a world of one; more: torchrun), each in a
    fresh process (DeepSpeed keeps its process groups in globals), or through launch(script, argv, ranks): rank 0's
    counts."""
    with tempfile.TemporaryDirectory(prefix="host-cost-") as out:
        script, argv = flags(name, precision, files, Path(out) / "run")
        worker = ["bench/host_cost.py", "--worker", str(Path(out) / "counts"), str(where), script, *argv]
        if launch is None:
            torchrun = str(Path(sys.executable).parent / "torchrun")
            launcher = (
                [sys.executable]
                if ranks == 1
                else [torchrun, f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
            )
            done = subprocess.run(
                [*launcher, *worker],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        else:
            done = launch(worker[0], worker[1:], ranks)
        if done.returncode:
            sys.exit(f"error: {name} ({precision}) on {ranks} ranks failed:\n{done.stderr[-3000:]}")
        return json.loads((Path(out) / "counts" / "rank-0.json").read_text())


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(folder, where, script, argv):
    """One rank of count_run: count, then write this rank's figures."""
    counts = count(script, argv, where == "True")
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(counts))


def table(rows):
    """Markdown: one row per (run, precision, ranks), each figure also as a multiple of single-gpu.py's."""
    lines = [
        "| run | precision | ranks | ops | x single-gpu.py | kernels | reads | syncs | collectives | Python calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, precision, ranks), c in rows.items():
        base = rows.get(("single-gpu.py", precision, 1))
        ratio = f"{c['ops'] / base['ops']:.2f}x" if base else "-"
        collectives = ", ".join(f"{n} {k}" for k, n in sorted(c["collectives"].items())) or "0"
        lines.append(
            f"| {name} | {precision} | {ranks} | {c['ops']:,} | {ratio} | {c['kernels']:,} | {c['reads']} | "
            f"{c['syncs']} | {collectives} | {c['calls']:,} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN")
    p.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1])
    p.add_argument("--where", choices=list(RUNS), help="where this run's ops and reads come from")
    p.add_argument("--assets", default=str(ROOT / "out" / "host-cost"), help="the model and data (made if absent)")
    p.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # count_ranks' ranks
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        return worker(*args.worker[:3], args.worker[3:])
    files = assets(args.assets)
    if args.where:
        for precision in args.precision:
            c = count_run(args.where, precision, files, args.ranks[-1], where=True)
            print(
                f"{args.where}, {precision}, rank 0 of {args.ranks[-1]}: {c['ops']:,} ops, {c['reads']} reads, "
                f"collectives {c['collectives']}"
            )
            print("\n".join(f"  read {n:>5}  {line}" for line, n in c["read_lines"].items()))
            print("\n".join(f"  ops  {n:>5}  {line}" for line, n in c["op_lines"].items()))
            print("\n".join(f"  coll {n:>5}  {line}" for line, n in c["collective_lines"].items()))
        return None
    rows = {}
    for ranks in args.ranks:
        for precision in args.precision:
            for name in args.runs:
                if name == "single-gpu.py" and ranks > 1:
                    continue
                rows[name, precision, ranks] = count_run(name, precision, files, ranks)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
