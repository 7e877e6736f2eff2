"""Each fix among DeepSpeed's mends (finetune/internals/mends.py), on a tiny engine in this process: its defect shown
without it and gone with it; and the registry itself (a DeepSpeed it was not written for, fed as a version string;
--mends; applying twice; undoing what is process-wide). A DeepSpeed upgrade runs this file and
tests/test_mend_speedups.py to learn which mends it can delete."""

import pytest
import torch
from mended import engine, fp16_on_this_cpu, step, weights, world  # noqa: F401 (fixtures)

from finetune.internals import mends

RAN = []  # what the pickle below appends to when a loader runs it


# ----------------------------------------------------------------------------------------------------
# The fixes: each defect without its mend, gone with it


def test_adam_starts_at_the_first_step():
    """ZeRO-0 in bf16 (DeepSpeed's own 16-bit weights): its optimizer steps Adam once on zero gradients as it is
    built, so the first real update is Adam's second (25% short) and weight decay has shrunk the masters."""
    counts = {}
    for without in ((), ("adam_starts_at_the_first_step",)):
        with engine(0, "bf16", without=without) as ds:
            inner = ds.optimizer.optimizer
            assert bool(inner.state) == bool(without)  # the probe: state before any step
            step(ds)
            counts[without] = {float(s["step"]) for s in inner.state.values()}
    assert counts[()] == {1.0} and counts[("adam_starts_at_the_first_step",)] == {2.0}


@pytest.mark.parametrize("mend", ["fp16_loss_scaled_at_stage0", "fp16_norm_unscaled_at_stage0"])
@pytest.mark.usefixtures("fp16_on_this_cpu")
def test_fp16_at_stage0_scales_the_loss_and_reports_the_unscaled_norm(mend):
    """ZeRO-0 in fp16 with torch's optimizer: without the first mend the loss is never scaled but the gradients are
    divided by the scale (2^8 here), so each SGD update is 2^8 times too small; without the second the reported norm
    is the scaled gradients', 2^8 times too large."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}}
    found = {}
    for without in ((), (mend,)):
        with engine(0, "fp16", without=without, optimizer=torch.optim.SGD, lr=1.0, gradient_clipping=0.0, **fp16) as ds:
            before = weights(ds)
            step(ds)
            found[without] = (weights(ds) - before, ds.get_global_grad_norm())
    (update, norm), (update_without, norm_without) = found[()], found[(mend,)]
    if mend == "fp16_loss_scaled_at_stage0":
        assert float(update.norm() / update_without.norm()) == pytest.approx(2**8, rel=1e-2)  # (fp16's rounding)
        assert update.abs().max() > 1e-3
    else:
        assert norm_without == pytest.approx(norm * 2**8, rel=1e-3) and torch.equal(update, update_without)


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.usefixtures("fp16_on_this_cpu")
def test_fp16_grows_the_scale_after_the_update(stage):
    """A clean step that ends the loss scale's window (every step here): DeepSpeed grows the scale before it
    unscales the gradients with it, so that update is half what it should be (SGD shows it)."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1, "hysteresis": 1}}
    updates = {}
    for without in ((), ("fp16_grows_after_the_update",)):
        with engine(
            stage, "fp16", without=without, optimizer=torch.optim.SGD, lr=1.0, gradient_clipping=0.0, **fp16
        ) as ds:
            step(ds)  # (DeepSpeed's first clean step starts the window)
            before = weights(ds)
            step(ds)
            updates[without] = weights(ds) - before
    grown, mended = updates[("fp16_grows_after_the_update",)], updates[()]
    assert mended.abs().max() > 1e-3 and torch.allclose(mended, 2 * grown, rtol=2e-2, atol=1e-6)


def test_clip_keeps_the_norm_at_stage0():
    """ZeRO-0 in fp32 clips and drops the norm: the engine reports none. Mended, the norm torch's clip_grad_norm_
    takes of the same gradients."""
    norms = {}
    for without in ((), ("clip_keeps_the_norm_at_stage0",)):
        with engine(0, without=without) as ds:
            ids = torch.arange(8).unsqueeze(0)
            ds.backward(ds(input_ids=ids, labels=ids).loss)
            expected = torch.nn.utils.get_total_norm([p.grad for p in ds.module.parameters()])
            ds.step()
            norms[without] = (ds.get_global_grad_norm(), float(expected))
    assert norms[("clip_keeps_the_norm_at_stage0",)][0] is None
    assert float(norms[()][0]) == pytest.approx(norms[()][1], rel=1e-6)


def ran_on_load():
    RAN.append("loaded")


class RunsCode:
    def __reduce__(self):
        return ran_on_load, ()


def test_checkpoints_load_no_code(tmp_path):
    """A checkpoint whose pickle runs code as it loads: DeepSpeed's own load runs it; mended, one line refuses the
    file before anything of it runs."""
    for without in (("checkpoints_load_no_code",), ()):
        RAN.clear()
        with engine(0, without=without) as ds:
            assert mends.checkpoint_engine_runs_pickles(ds)  # the probe finds the defect in DeepSpeed's own
            ds.save_checkpoint(tmp_path, "step-1")
            torch.save({"module": RunsCode()}, tmp_path / "step-1" / "mp_rank_00_model_states.pt")
            with pytest.raises((SystemExit, Exception)) as refused:
                ds.load_checkpoint(tmp_path, "step-1")
        assert bool(RAN) == bool(without)  # (DeepSpeed reads the file twice)
    assert "holds more than a checkpoint does" in str(refused.value)


def decayed_matrices_only(parameters, lr):
    parameters = list(parameters)
    return torch.optim.AdamW(
        [
            {"params": [p for p in parameters if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in parameters if p.dim() <= 1], "weight_decay": 0.0},
        ],
        lr=lr,
    )


def test_universal_load_keeps_steps_and_groups():
    """After DeepSpeed's universal load under ZeRO-3 every parameter shares one CPU `step` and every group the first
    group's weight decay: AdamW then advances the shared step once per parameter, and decays biases and norms.
    Mended, each parameter's step is its own (advanced once) and each group decays as it did. The load is DeepSpeed's
    in effect, on this engine's own state (a real universal round trip: test_checkpoints.py)."""

    def as_universal_load_leaves_it(ds):
        inner = ds.optimizer.optimizer
        shared = torch.tensor(5.0)
        for state in inner.state.values():
            state["step"] = shared
        for group in inner.param_groups:
            group["weight_decay"] = inner.param_groups[0]["weight_decay"]

    found = {}
    for without in ((), ("universal_load_keeps_steps_and_groups",)):
        with engine(
            3,
            without=("universal_load_keeps_steps_and_groups", "checkpoints_load_no_code"),
            checkpoint={"load_universal": True},
            optimizer=decayed_matrices_only,
        ) as ds:
            step(ds)
            ds.load_checkpoint = lambda *args, **kwargs: as_universal_load_leaves_it(ds)  # DeepSpeed's own, then
            for entry in mends.MENDS:
                if entry.name == "universal_load_keeps_steps_and_groups" and not without:
                    entry.apply(ds, mends.Patches(None))
            ds.load_checkpoint("folder", "tag")
            step(ds)
            inner = ds.optimizer.optimizer
            found[without] = (
                {float(s["step"]) for s in inner.state.values()},
                [g["weight_decay"] for g in inner.param_groups],
            )
    assert found[()] == ({6.0}, [0.1, 0.0])
    steps, decays = found[("universal_load_keeps_steps_and_groups",)]
    assert min(steps) > 6.0 and decays[1] == 0.1


# ----------------------------------------------------------------------------------------------------
# The registry: another DeepSpeed, --mends, applying twice, undoing


@pytest.mark.usefixtures("fp16_on_this_cpu")
def test_every_fixs_probe_finds_its_defect_in_the_deepspeed_it_was_written_for():
    """The probes' sources are 0.19.8's (each digest right), and the behavioural ones find their defect here: on
    another version a fix is applied only where its probe says so."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    for stage in (0, 1, 2, 3):
        with engine(stage, "fp16", only=(), **fp16) as ds:
            for entry in mends.MENDS:
                if entry.kind == "fix" and entry.probe is not None and entry.concerns(ds):
                    assert entry.probe(ds), (entry.name, stage)
    with engine(0, "bf16", only=()) as ds:
        assert mends.adam_state_before_any_step(ds)


def test_another_deepspeed_turns_the_speed_mends_off_and_the_fixes_its_source_still_needs_on(monkeypatch):
    lines = []
    with engine(3, only=()) as ds:
        mended = mends.mend(ds, "all", lines.append, version="0.19.9")
        try:
            assert mended.applied == ["checkpoints_load_no_code"]  # the one fix that concerns a fp32 ZeRO-3 engine
            assert set(mended.off) == {
                "no_nvtx_ranges",
                "debug_prints_look_first",
                "zero3_step_in_place",
                "zero3_fetch_alone_without_waiting",
                "zero3_keeps_parameter_lists",
                "norm_at_once",
            }
            assert lines == [
                "DeepSpeed 0.19.9 is not the 0.19.8 the mends were written for: its own code runs where "
                "6 speed mends would apply; on, its defect found: checkpoints_load_no_code "
                "(docs/deepspeed-upstream.md)"
            ]
            step(ds)  # trains with DeepSpeed's own code
        finally:
            mended.undo()
    lines.clear()
    monkeypatch.setattr(mends, "source_digest", lambda name: "another source")  # DeepSpeed changed the functions
    with engine(0, only=()) as ds:
        mended = mends.mend(ds, "all", lines.append, version="0.20.0")
        assert mended.off["clip_keeps_the_norm_at_stage0"] == "this DeepSpeed does not show the defect"
        assert "off, its defect not found here: clip_keeps_the_norm_at_stage0" in lines[0]
        mended.undo()


@pytest.mark.parametrize("choice", ["fixes", "none"])
def test_mends_fixes_or_none(choice):
    """--mends fixes: DeepSpeed's own code where it is only slow; none: DeepSpeed's own code throughout; one line."""
    lines = []
    with engine(2, only=()) as ds:
        mended = mends.mend(ds, choice, lines.append)
        assert mended.applied == (["checkpoints_load_no_code"] if choice == "fixes" else [])
        assert lines == [
            f"--mends {choice}: DeepSpeed's own code where {len(mended.off)} mends would apply "
            f"({', '.join(mended.off)})"
        ]
        assert "norm_at_once" in mended.off and "get_grad_norm_direct" not in vars(ds.optimizer)
        mended.undo()


@pytest.mark.usefixtures("fp16_on_this_cpu")
def test_mending_twice_mends_once_and_undo_gives_deepspeed_its_own_functions_back():
    """mend() again on the same engine: the same Mended, nothing wrapped twice (an fp16 norm divided twice by the
    scale, before). Two engines in one process: the process-wide mends stay while either is alive and go with the
    last one's undo (a notebook's next run starts from DeepSpeed's own code)."""
    import deepspeed.utils.nvtx
    from deepspeed.runtime.zero import partition_parameters as zp
    from deepspeed.runtime.zero import stage3

    with engine(0, "fp16", only=(), fp16={"enabled": True}) as ds:
        first = mends.mend(ds, say=lambda line: None)
        wrapped = ds.optimizer.step
        assert mends.mend(ds, say=lambda line: None) is first and ds.optimizer.step is wrapped
        first.undo()
    own = (zp.NoGatherCoalescedHandle.wait, stage3.print_rank_0, deepspeed.utils.nvtx.enable_nvtx)
    with engine(3, only=()) as one, engine(3, only=()) as two:
        mended = [mends.mend(ds, say=lambda line: None) for ds in (one, two)]
        patched = (zp.NoGatherCoalescedHandle.wait, stage3.print_rank_0, deepspeed.utils.nvtx.enable_nvtx)
        assert all(p is not o for p, o in zip(patched, own)) and patched[2] is False
        mended[0].undo()
        assert (zp.NoGatherCoalescedHandle.wait, stage3.print_rank_0) == patched[:2]  # the second still uses them
        mended[1].undo()
        assert (zp.NoGatherCoalescedHandle.wait, stage3.print_rank_0, deepspeed.utils.nvtx.enable_nvtx) == own
