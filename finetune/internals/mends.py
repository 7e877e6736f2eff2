"""DeepSpeed's defects and slow paths, mended by name: a registry a run reads (--mends all, fixes or none), from which a
forker deletes one entry at a time as DeepSpeed fixes them upstream.

Each Mend says what it is: a fix (DeepSpeed computes something other than single-gpu.py, or loads what it should not)
or a speed mend (more host work a step than the step needs); the DeepSpeed versions it was written against; its
upstream report where there is one; which engines it concerns; and, for a fix, a probe that tells whether another
DeepSpeed still has the defect. tests/test_mends.py shows each defect, or each count saved, without it;
docs/deepspeed-upstream.md says what DeepSpeed would need to change for each to go.

On a DeepSpeed the mends were not written for, nothing stops the run: the speed mends are off (they reach into
private attributes that may have moved), a fix applies only where its probe finds the defect, and one line says what
is off. What a mend changes on an engine lives and dies with that engine; what it changes for the whole process (a
DeepSpeed module's function, a class's method, torch's registration hooks, sys.modules) is undone when the last
engine that uses it is done (Mended.undo: zero-optimization.py calls it at the end), so a second run in the same
process (a notebook, the tests) starts from DeepSpeed's own code and is mended once."""
import dataclasses
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from importlib import import_module

from . import mend_fixes as fixes
from . import mend_speedups as speedups

WRITTEN_FOR = ("0.19.8",)  # the DeepSpeed versions whose private attributes the mends were written against
CHOICES = ("all", "fixes", "none")  # --mends


@dataclasses.dataclass(frozen=True)
class Mend:
    name: str
    kind: str  # "fix" or "speed"
    apply: Callable  # (the engine, or the DeepSpeed config before the engine exists; Patches) -> None
    concerns: Callable  # (the same engine or config) -> whether this run has what it mends
    upstream: str = ""  # DeepSpeed's issue or pull request
    probe: Callable | None = None  # a fix: (engine) -> whether this DeepSpeed still has the defect; None: the fix
    # acts only where it finds the defect itself, on any version
    before_engine: bool = False  # applied to the DeepSpeed config, before deepspeed.initialize
    written_for: tuple = WRITTEN_FOR


def source_digest(qualified):
    """A short hash of a DeepSpeed function's source ('module:Class.function'): a fix's probe compares it with the
    source it was written against, where running the defective path would take a training step."""
    module, _, name = qualified.partition(":")
    target = import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    while "func" in getattr(getattr(target, "__code__", None), "co_freevars", ()):  # DeepSpeed's instrument_w_nvtx
        target = target.__closure__[target.__code__.co_freevars.index("func")].cell_contents
    return hashlib.sha256(textwrap.dedent(inspect.getsource(target)).encode()).hexdigest()[:16]


def unchanged(*functions):
    """A probe: the defect is still there where every function that holds it is the source the fix was written for
    (`functions`: ('module:Class.function', digest), ...)."""
    return lambda engine: all(source_digest(name) == digest for name, digest in functions)


def optimizer_step_unchanged(digests):
    """A probe for a defect in the step of whichever optimizer the engine built: {class's qualified name: digest}."""
    def probe(engine):
        cls = type(engine.optimizer)
        name = f"{cls.__module__}:{cls.__qualname__}.step"
        return name in digests and source_digest(name) == digests[name]
    return probe


def stage0(engine):
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    return not isinstance(engine.optimizer, ZeROOptimizer)


def unfused(engine):
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    return isinstance(engine.optimizer, FP16_UnfusedOptimizer)


def zero12(engine):
    return not stage0(engine) and not engine.zero_optimization_partition_weights()


def zero123_alone(engine):
    """ZeRO 1-3 without sequence parallelism's groups or experts: one data-parallel group holds every gradient."""
    return not stage0(engine) and engine.mpu is None and not engine.has_moe_layers


def one_rank(engine):
    import deepspeed.comm as dist
    group = getattr(engine.optimizer, "dp_process_group", None)
    return group is not None and dist.get_world_size(group=group) == 1


def offloaded(engine):
    return bool(getattr(engine.optimizer, "offload_optimizer", False) or getattr(engine.optimizer, "cpu_offload",
                                                                                  False))


def adam_state_before_any_step(engine):
    """The probe of adam_starts_at_the_first_step: Adam holds state although nothing has stepped yet."""
    return bool(engine.optimizer.optimizer.state)


def checkpoint_engine_runs_pickles(engine):
    """The probe of checkpoints_load_no_code: DeepSpeed's checkpoint engine loads a pickle that weights_only refuses
    (a Fraction: harmless, and not a tensor, number or container)."""
    import fractions
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/probe.pt"
        torch.save({"probe": fractions.Fraction(1, 3)}, path)
        checkpoint_engine = engine.checkpoint_engine
        try:
            return checkpoint_engine.load(path, map_location="cpu")["probe"] == fractions.Fraction(1, 3)
        except Exception:  # noqa: BLE001 (refused: the defect is gone)
            return False


PR_8393 = "https://github.com/deepspeedai/DeepSpeed/pull/8393"
UNFUSED_STEP = ("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer.step", "e06fd288a7cc55a2")
FP16_STEPS = {  # the optimizers whose step grows the loss scale before it unscales the gradients (0.19.8's source)
    "deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer.step": "e06fd288a7cc55a2",
    "deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer.step": "6d5a1f80f8a9c827",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step": "279ae7c6a4e87667",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.step": "1dfecf4f2fb70970",
}

MENDS = (
    # fixes: DeepSpeed computes something other than single-gpu.py, or loads what it should not
    Mend("adam_starts_at_the_first_step", "fix", fixes.adam_starts_at_the_first_step, unfused,
         probe=adam_state_before_any_step),
    Mend("fp16_loss_scaled_at_stage0", "fix", fixes.fp16_loss_scaled_at_stage0,
         lambda e: stage0(e) and e.fp16_enabled(), upstream=PR_8393,
         probe=unchanged(("deepspeed.runtime.engine:DeepSpeedEngine.backward", "99280baf44808c23"))),
    Mend("fp16_grows_after_the_update", "fix", fixes.fp16_grows_after_the_update, lambda e: e.fp16_enabled(),
         probe=optimizer_step_unchanged(FP16_STEPS)),
    Mend("fp16_norm_unscaled_at_stage0", "fix", fixes.fp16_norm_unscaled_at_stage0,
         lambda e: unfused(e) and e.fp16_enabled(), probe=unchanged(UNFUSED_STEP)),
    Mend("clip_keeps_the_norm_at_stage0", "fix", fixes.clip_keeps_the_norm_at_stage0,
         lambda e: stage0(e) and not e.fp16_enabled() and not e.bfloat16_enabled(),
         probe=unchanged(("deepspeed.runtime.engine:DeepSpeedEngine.clip_fp32_gradients", "9ff142d47efad2bc"))),
    Mend("checkpoints_load_no_code", "fix", fixes.checkpoints_load_no_code, lambda e: True,
         probe=checkpoint_engine_runs_pickles),
    Mend("universal_load_keeps_steps_and_groups", "fix", fixes.universal_load_keeps_steps_and_groups,
         lambda e: e.load_universal_checkpoint()),
    # speed: the same step with less host work
    Mend("parameter_list_at_stage0", "speed", speedups.parameter_list_at_stage0,
         lambda e: stage0(e) and not e.fp16_enabled() and not e.bfloat16_enabled()),
    Mend("nothing_to_reduce_at_stage0", "speed", speedups.nothing_to_reduce_at_stage0,
         lambda e: stage0(e) and e.dp_world_size == 1 and e.mpu is None),
    Mend("copies_back_at_once_at_stage0", "speed", speedups.copies_back_at_once_at_stage0,
         lambda e: stage0(e) and not (e.dp_world_size == 1 and e.mpu is None)),
    Mend("no_nvtx_ranges", "speed", speedups.no_nvtx_ranges, lambda e: True),
    Mend("debug_prints_look_first", "speed", speedups.debug_prints_look_first,
         lambda e: e.zero_optimization_partition_weights()),
    Mend("repoint_only_when_moved", "speed", speedups.repoint_only_when_moved, zero12),
    Mend("reduce_nothing_alone", "speed", speedups.reduce_nothing_alone,
         lambda e: zero12(e) and zero123_alone(e) and one_rank(e)),
    Mend("zero3_step_in_place", "speed", speedups.zero3_step_in_place,
         lambda e: e.zero_optimization_partition_weights()),
    Mend("zero3_fetch_alone_without_waiting", "speed", speedups.zero3_fetch_alone_without_waiting,
         lambda e: e.zero_optimization_partition_weights()),
    Mend("zero3_keeps_parameter_lists", "speed", speedups.zero3_keeps_parameter_lists,
         lambda e: e.zero_optimization_partition_weights()),
    Mend("norm_at_once", "speed", speedups.norm_at_once, lambda e: zero123_alone(e) and not offloaded(e)),
    Mend("clip_without_a_read", "speed", speedups.clip_without_a_read,
         lambda e: zero12(e) and zero123_alone(e) and not offloaded(e)),
    Mend("muon_only_when_named", "speed", speedups.muon_only_when_named,
         lambda config: not speedups.muon_in_use(config), before_engine=True),
    Mend("cpu_info_once", "speed", speedups.cpu_info_once, before_engine=True,
         concerns=lambda config: config.get("zero_optimization", {}).get("offload_optimizer", {}).get(
             "device", "none") != "none"),
)


# ----------------------------------------------------------------------------------------------------
# Applying them: which are on for this run, what they changed, and undoing what is process-wide

def mend(engine, choice="all", say=print, version=None):
    """Apply to the engine (after deepspeed.initialize) the mends that concern it and that `choice` (--mends: all,
    fixes, none) and this DeepSpeed's version allow; one line says what is off where that is not what `choice`
    asked for. Returns the Mended (called again for the same engine: the same one, nothing applied twice)."""
    if "finetune_mended" in engine.__dict__:
        return engine.__dict__["finetune_mended"]
    mended = Mended(choice, version or _installed_version())
    for entry in MENDS:
        if not entry.before_engine and entry.concerns(engine):
            mended.take(entry, engine)
    mended.adopt_pending()
    engine.__dict__["finetune_mended"] = mended
    line = mended.line()
    if line:
        say(line)
    return mended


def before_engine(config, choice="all", version=None):
    """Apply the mends that act on the DeepSpeed config before deepspeed.initialize (what the engine imports and
    asks as it is built); the engine's Mended takes them over (and undoes them with its own)."""
    if str(config.get("optimizer", {}).get("type", "")).lower() == "muon" and speedups.MUON_KEY in _PROCESS_WIDE:
        _PROCESS_WIDE.pop(speedups.MUON_KEY)[0]()  # a live earlier run's stand-ins out: this one needs DeepSpeed's
    pending = Mended(choice, version or _installed_version(), pending=True)
    for entry in MENDS:
        if entry.before_engine and entry.concerns(config):
            pending.take(entry, config)


def _installed_version():
    import deepspeed
    return deepspeed.__version__


# Process-wide changes, kept until the last engine that uses them is done: {key: [undo, the Mended that hold it]}.
# Changes made before an engine exists (before_engine) are held by no one until the next engine's Mended adopts them.
_PROCESS_WIDE = {}


class Mended:
    """The mends one engine got (`applied`), those that concern it but are off with the reason (`off`), and what it
    holds of the process-wide changes (undo)."""

    def __init__(self, choice, version, pending=False):
        if choice not in CHOICES:
            raise ValueError(f"--mends {choice!r}: one of {', '.join(CHOICES)}")
        self.choice, self.version, self.pending = choice, version, pending
        self.applied, self.off, self.holds = [], {}, set()

    def take(self, entry, target):
        """Apply one mend, or say why it stays off."""
        if self.choice == "none" or self.choice == "fixes" and entry.kind == "speed":
            self.off[entry.name] = f"--mends {self.choice}"
        elif self.version not in entry.written_for and entry.kind == "speed":
            self.off[entry.name] = "written for another DeepSpeed"
        elif self.version not in entry.written_for and entry.probe is not None and not entry.probe(target):
            self.off[entry.name] = "this DeepSpeed does not show the defect"
        else:
            entry.apply(target, Patches(None if self.pending else self))
            self.applied.append(entry.name)

    def adopt_pending(self):
        for key, (_, holders) in _PROCESS_WIDE.items():
            if not holders:
                holders.add(id(self))
                self.holds.add(key)

    def line(self):
        """One line where mends are off: by --mends, or because this DeepSpeed is not the one they were written for;
        None where every mend that concerns the engine is on."""
        by_choice = [name for name, why in self.off.items() if why.startswith("--mends")]
        speed = [name for name, why in self.off.items() if why == "written for another DeepSpeed"]
        no_defect = [name for name, why in self.off.items() if why == "this DeepSpeed does not show the defect"]
        if speed or no_defect:
            return (f"DeepSpeed {self.version} is not the {' or '.join(WRITTEN_FOR)} the mends were written for: its "
                    f"own code runs where {len(speed)} speed mends would apply"
                    + (f"; off, its defect not found here: {', '.join(no_defect)}" if no_defect else "")
                    + (f"; on, its defect found: {', '.join(self.applied)}" if self.applied else "")
                    + " (docs/deepspeed-upstream.md)")
        if by_choice:
            return f"--mends {self.choice}: DeepSpeed's own code where {len(by_choice)} mends would apply " \
                   f"({', '.join(by_choice)})"
        return None

    def undo(self):
        """Take back the process-wide changes no other live engine holds (DeepSpeed's functions, torch's hooks)."""
        for key in sorted(self.holds):
            undo, holders = _PROCESS_WIDE[key]
            holders.discard(id(self))
            if not holders:
                del _PROCESS_WIDE[key]
                undo()
        self.holds.clear()


class Patches:
    """How a mend changes what outlives its engine: once for the process while any engine uses it."""

    def __init__(self, mended):
        self.mended = mended  # None: before any engine (the next one adopts what is made here)

    def install(self, key, make):
        """make() changes something for the whole process and returns how to take it back; made once while any
        engine holds `key`. Returns whether it was made now."""
        made = key not in _PROCESS_WIDE
        if made:
            _PROCESS_WIDE[key] = [make(), set()]
        if self.mended is not None and key not in self.mended.holds:
            _PROCESS_WIDE[key][1].add(id(self.mended))
            self.mended.holds.add(key)
        return made

    def replace(self, owner, name, wrap):
        """owner.name = wrap(DeepSpeed's own owner.name) (a module's function or flag, a class's method), put back
        by the undo."""
        def make():
            own = vars(owner)[name]
            setattr(owner, name, wrap(own))
            return lambda: setattr(owner, name, own)
        where = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
        return self.install(f"{where}.{name}", make)
