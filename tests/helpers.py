"""What the tests share beside their fixtures (conftest.py): the session's environment (imported first, by
conftest), running the scripts (in process through main(), forked from a pre-imported parent, or under the real
launchers), the run folder's numbers, the independent loss oracle (stock transformers, each document alone), and the
assertions and steps several test files take."""

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# PYTHONPATH for a launch whose ranks a test steers (tests/hooks/sitecustomize.py: FINETUNE_TEST_HOLD, _STALL)
TEST_HOOKS = os.pathsep.join([str(ROOT / "tests" / "hooks"), str(ROOT)])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no "Setting accelerator to CPU" in every process's output
# the venv's tools first, as `make test` and an activated venv have them: a DeepSpeed op built by another ninja (the
# system's) is compiled anew by the next process that loads it with the venv's (each switch a minute)
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
# the prepared (tokenized, packed) data of this session's runs, apart from the user's cache
os.environ["DATA_CACHE"] = tempfile.mkdtemp(prefix="data-cache-")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `make test`'s workers: a core each, as the launched ranks have
    torch.set_num_threads(1)  # (two threads each on two busy cores wait on each other at every op's end)

from finetune import blocks, flags  # noqa: E402


def load_script(name):
    """The scripts have dashes in their names: import them from their paths to call main(argv)."""
    spec = importlib.util.spec_from_file_location(name.replace("-", "_").removesuffix(".py"), ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_args(tiny, out, **overrides):
    args = {
        "--model": tiny["model"],
        "--dataset": tiny["data"],
        "--block-size": 32,
        "--lr": 1e-3,
        "--max-steps": 4,
        "--log-every": 1,
        "--save-every": 2,
        "--output-dir": str(out),
        "--prompt": "",
    }
    args.update(overrides)
    # --flag=value tokens: an empty value survives the remote shell of a multi-node (pdsh) launch
    return [f"{k}={v}" for k, v in args.items() if v is not None]


def long_run(tiny, out, *extra):
    """60 steps of ZeRO-2 on 2 ranks, a checkpoint every 5: long enough to be stopped in many ways."""
    return base_args(
        tiny,
        out,
        **{
            "--batch-size": 2,
            "--grad-accum": 2,
            "--zero-stage": 2,
            "--max-steps": 60,
            "--save-every": 5,
            "--log-every": 5,
        },
    ) + ["--deepspeed", *extra]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Preimported:
    """tests/preimported.py, started once per session: it forks the ranks of each launch from a parent that has
    imported the libraries (7 s a process on 2 cores), for the tests whose launcher is not what they check."""

    server = None

    @classmethod
    def run(cls, script, argv, nproc, env, timeout, torchrun):
        if cls.server is None or cls.server.poll() is not None:
            cls.server = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "preimported.py")],
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
            request = {
                "script": script,
                "argv": argv,
                "nproc": nproc,
                "env": env,
                "cwd": str(ROOT),
                "timeout": timeout,
                "logs": logs,
                "torchrun": torchrun,
            }
            cls.server.stdin.write(json.dumps(request) + "\n")
            cls.server.stdin.flush()
            line = cls.server.stdout.readline()
            if not line:
                raise RuntimeError(f"tests/preimported.py exited ({cls.server.wait()}) on {script} {argv}")
            reply = json.loads(line)
            if reply["timed_out"]:
                raise subprocess.TimeoutExpired(script, timeout)
            out, err = (
                "".join(Path(logs, f"rank-{r}.{kind}").read_text() for r in range(nproc)) for kind in ("out", "err")
            )
        return subprocess.CompletedProcess([script, *argv], reply["returncode"], out, err)


def launch(launcher, script, argv, nproc=2, timeout=600, env=None):
    """Run a script under deepspeed, torchrun or plain python; or its ranks forked from a pre-imported parent where
    the launcher is not what a test checks: "forked" (the variables torchrun sets) or "forked-python" (one process
    without them, a world of one). Return the CompletedProcess."""
    bin_dir = Path(sys.executable).parent
    port = str(free_port())
    if launcher in ("forked", "forked-python"):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": port, **(env or {})}
        torchrun = launcher == "forked"
        result = Preimported.run(script, argv, nproc if torchrun else 1, full_env, timeout, torchrun)
        result.port = port
        return result
    if launcher == "deepspeed":
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, script]
    elif launcher == "torchrun":
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port, script]
    else:
        cmd = [sys.executable, script]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(cmd + argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    result.port = port
    return result


def stop_everything(launcher):
    """Kill a launcher and everything under it."""
    children = []
    with contextlib.suppress(psutil.NoSuchProcess):  # any of them may end between the listing and the kill
        children = psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    launcher.kill()


def check(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def results(out):
    return json.loads((Path(out) / "results.json").read_text())


def weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


def independent_loss(model_folder, argv, split, indices=None, **load):
    """(summed cross-entropy, tokens) over the tokens that carry loss in these blocks of a split the scripts prepared
    (`argv`: their flags), computed without their batch, mask or loss code: each document alone through the stock
    model, in float64, its loss tokens read from the per-token flags."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float64, **load).eval()
    with torch.no_grad():
        total, count = documents_loss(model, argv, split, indices)
    return total.item(), count


def documents_loss(model, argv, split, indices=None):
    """independent_loss's sum (a tensor: backward() gives its gradients) through a model given."""
    import numpy as np
    import torch.nn.functional as F

    from finetune import blocks, data, models

    config = load_script("single-gpu.py").parse_args(argv)
    splits = data.prepare(config.data, models.load_tokenizer(config.model.model), seed=config.train.seed)
    split_blocks = splits[0 if split == "train" else 1]
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(len(split_blocks)) if indices is None else indices:
        start, length = int(split_blocks.starts[i]), int(split_blocks.lengths[i])
        ids = torch.from_numpy(np.asarray(split_blocks.tokens[start : start + length], dtype=np.int64))
        flags = np.asarray(split_blocks.flags[start : start + length])
        bounds = [*np.flatnonzero(flags & blocks.DOC_START), length]
        for a, b in zip(bounds[:-1], bounds[1:]):
            carries = torch.from_numpy((flags[a + 1 : b] & blocks.LOSS) > 0)  # token t+1, predicted at position t
            logits = model(ids[None, a:b]).logits[0, :-1]
            total = total + F.cross_entropy(logits[carries].double(), ids[a + 1 : b][carries], reduction="sum")
            count += int(carries.sum())
    return total, count


def assert_close_losses(a, b, rtol=1e-5):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    rel = ((a - b).abs() / a.abs()).max().item()
    assert rel < rtol, f"losses differ by {rel:.2e} relative:\n{a.tolist()}\n{b.tolist()}"


def assert_same_weights(wa, wb, atol=1e-5):
    assert wa.keys() == wb.keys()
    for k in wa:
        diff = (wa[k].float() - wb[k].float()).abs().max().item()
        assert diff <= atol, f"{k} differs by {diff:.2e}"


def crash_after_first_checkpoint(out):
    """Make a finished 4-step run look like one killed just after its step-2 checkpoint."""
    for name in ("results.json", "loss.png"):
        (out / name).unlink()
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-4")
    (out / "checkpoints" / "latest").write_text("step-2")
    (out / "checkpoints" / "step-2" / "resume-from-here").touch()  # gone if a run saves step-2 again


def assert_resumed(out):
    """The run continued from step-2 rather than starting over (which would give the same numbers, and rewrite it)."""
    assert (out / "checkpoints" / "step-2" / "resume-from-here").exists() and (out / "final").is_dir()


def dropout_model(tiny, folder):
    """The tiny model with dropout 0.1: a run that draws one random number more or less shows it in its losses."""
    shutil.copytree(tiny["model"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dropout": 0.1}))
    return folder


def cpu_process(pad_id, model_config, device="cpu"):
    """training.Process of a test's own batches: this process alone, fp32, on `device`."""
    import contextlib

    import torch

    from finetune import training

    return training.Process(
        device=torch.device(device),
        rank=0,
        world_size=1,
        autocast=contextlib.nullcontext(),
        pad_id=pad_id,
        model_config=model_config,
    )


def data_args(dataset, **kw):
    """flags.Data: the defaults but a seed of 0, 32-token blocks and every held-out row."""
    return flags.defaults(**{"dataset": str(dataset), "seed": 0, "block_size": 32, "max_eval_samples": 0, **kw}).data


def documents_of(split, i):
    """The segments of block i of a split, as token lists (a segment starts at a DOC_START flag)."""
    s, n = split.starts[i], split.lengths[i]
    tokens, flags = split.tokens[s : s + n], split.flags[s : s + n]
    starts = list(np.flatnonzero(flags & blocks.DOC_START)) + [n]
    return [tokens[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]


# The architectures people fine-tune, each as a tiny model (test_models.py's matrix)
SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# family: (the config class, what makes it itself beyond the sizes above, what a user knows it as)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            head_dim=8,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        "Llama 3",
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "Qwen 2.5"),
    "qwen3": ("Qwen3Config", dict(head_dim=8, tie_word_embeddings=True), "Qwen 3"),
    "mistral": ("MistralConfig", dict(head_dim=8, sliding_window=16), "Mistral"),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=16,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        ),
        "Gemma 2",
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=8, query_pre_attn_scalar=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"]
        ),
        "Gemma 3",
    ),
    "phi3": ("Phi3Config", dict(sliding_window=None), "Phi-3"),
    "olmo2": ("Olmo2Config", dict(), "OLMo 2"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), "Mixtral"),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        "Qwen3-MoE",
    ),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), "OLMoE"),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=16,
            max_position_embeddings=131072,
        ),
        "gpt-oss",
    ),
}


def build(name, tokenizer, folder, **changes):
    """The family's tiny model with random weights, saved as a pretrained one, with the tests' tokenizer."""
    import transformers

    class_name, features, _ = FAMILIES[name]
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = getattr(transformers, class_name)(**{**SIZES, **ids, **features, **changes})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def sequences(split):
    """Every pair of a split as (chosen tokens, its loss flags, rejected tokens, its flags), in the pairs' order; a
    rejected sequence whole, with the prompt it shares with the chosen one (packed) put back before it."""
    out = {}
    for b in range(len(split)):
        s, n = split.starts[b], split.lengths[b]
        tokens, flags = np.asarray(split.tokens[s : s + n]), np.asarray(split.flags[s : s + n])
        bounds = [*np.flatnonzero(flags & blocks.DOC_START), n]
        segments = [(tokens[a:z].tolist(), flags[a:z]) for a, z in zip(bounds, bounds[1:])]
        loss = lambda f: ((f & blocks.LOSS) > 0).astype(int).tolist()
        for k, pair in enumerate(split.pair_ids([b])):
            (c, cf), (r, rf) = segments[2 * k], segments[2 * k + 1]
            keep = int(((cf & blocks.SHARED) > 0).sum())
            assert not (cf[keep:] & blocks.SHARED).any() and not (rf & blocks.SHARED).any()  # the prompt's start only
            out[int(pair)] = (c, loss(cf), c[:keep] + r, [0] * keep + loss(rf))
    return [out[i] for i in range(len(out))]
