"""Tiny DeepSpeed engines in the test's own process, mended by the mends chosen (tests/test_mends.py,
tests/test_mend_speedups.py): the engines of a file share one process group (DeepSpeed keeps its groups in globals,
stale after a group is destroyed and made anew)."""

import contextlib
import os
import sys

import pytest
import torch
from helpers import free_port, load_script

from finetune.internals import mends

host_cost = load_script("bench/host_cost.py")


@pytest.fixture(scope="module", autouse=True)
def world():
    """One process group of one for a test file's engines."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_deepspeeds_groups()


def forget_deepspeeds_groups():
    """DeepSpeed keeps the groups it made in module globals (deepspeed.utils.groups) and its backend in
    deepspeed.comm: stale once the process group is destroyed, so the next file's engines would use them. Forgotten,
    as in a fresh process."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    for name, value in vars(groups).items():
        if (
            name.startswith("_")
            and name.endswith(("GROUP", "GROUP_RANKS", "WORLD_SIZE", "RANK"))
            and isinstance(value, (dict, type(None)))
            or name.endswith("_GROUP")
            and not callable(value)
        ):
            setattr(groups, name, {} if isinstance(value, dict) else None)
    ds_comm.cdb = None


@pytest.fixture
def fp16_on_this_cpu(monkeypatch):
    """DeepSpeed's fp16 path on a CPU: its accelerator asks oneDNN, which has no fp16 kernels here; torch's own CPU
    kernels compute in fp16 all the same (as tests/cpu_fp16.py)."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def tiny_model():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            ffn_dim=32,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=16,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )


@contextlib.contextmanager
def engine(stage, precision="fp32", *, without=(), only=None, optimizer=torch.optim.AdamW, lr=1e-2, **settings):
    """A tiny OPT under DeepSpeed, mended by every mend that concerns it but `without` (or only those in `only`);
    the process-wide ones undone after."""
    import deepspeed

    model = tiny_model()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **settings,
    }
    if precision in ("bf16", "fp16"):
        config.setdefault(precision, {"enabled": True})
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters(), lr=lr), config=config)
    mended = mends.Mended("all", mends.WRITTEN_FOR[0])
    for entry in mends.MENDS:
        if (
            not entry.before_engine
            and entry.concerns(ds)
            and entry.name not in without
            and (only is None or entry.name in only)
        ):
            mended.take(entry, ds)
    try:
        yield ds
    finally:
        mended.undo()


def step(ds, tokens=8):
    ids = torch.arange(tokens).unsqueeze(0) % 64
    ds.backward(ds(input_ids=ids, labels=ids).loss)
    ds.step()


def weights(ds):
    """The fp32 weights the optimizer updates: ZeRO's masters, ZeRO-0's 16-bit optimizer's, or the weights."""
    from deepspeed.utils import safe_get_full_fp32_param

    if mends.stage0(ds):
        masters = [p for group in getattr(ds.optimizer, "fp32_groups", [list(ds.module.parameters())]) for p in group]
    else:
        masters = [safe_get_full_fp32_param(p) for p in ds.module.parameters()]
    return torch.cat([p.detach().flatten().float() for p in masters])


def counted(ds):
    """One steady step's host work (bench/host_cost.py), after two that warm up; the Python calls of a fourth."""
    step(ds)
    step(ds)
    counter, calls = host_cost.HostWork(), [0]
    with counter.counting():
        step(ds)
    sys.setprofile(lambda frame, event, arg: calls.__setitem__(0, calls[0] + (event == "call")))
    try:
        step(ds)
    finally:
        sys.setprofile(None)
    return {**counter.result(), "calls": calls[0]}
