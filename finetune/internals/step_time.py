"""Where a profiled step's time goes, by kind: TRAIN_PROFILE's progress.Profiler writes it beside its table
(profile-rank<r>-kinds.json); bench/gpu.py makes its profile table of it (docs/gpu.md).

On a GPU every kernel's time goes to one kind, found from its name and from the op that launched it: that op's name,
its ancestors' names (record_function ranges too: torch's optimizers name their step) and its inputs' shapes (an op
on a tensor with the vocabulary as a dimension belongs to the head, the loss or the embedding). The time in the
profiled steps' span when no kernel runs is idle: the GPU waited for the host. On a CPU (bench/gpu.sh --dry) each op's
own time (without the ops it calls) stands for its kernels, and idle is the time in no op: the host's Python."""
import re

KINDS = ("matmuls", "attention", "norms and element-wise", "head, loss and embedding", "optimizer", "communication")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm", "aten::addmv", "aten::mv"}
MATMUL_KERNELS = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|^triton_tem_", re.IGNORECASE)  # cuBLAS', inductor's mm
ATTENTION = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|varlen|attention", re.IGNORECASE)
COMMUNICATION = re.compile(r"nccl|c10d::|gloo|all_?reduce|all_?gather|reduce_scatter|broadcast", re.IGNORECASE)
VOCABULARY_OPS = re.compile(r"embedding|cross_entropy|nll_loss|log_softmax|logsumexp", re.IGNORECASE)


def kind(kernel, context, shapes, vocabulary):
    """The kind of `kernel` (a name), launched by an op whose own name and its ancestors' are `context` (innermost
    first) and whose inputs have `shapes`. The first rule that holds: communication; the optimizer (inside a torch
    optimizer's step, or an Adam kernel); the vocabulary's (an input with `vocabulary` as a dimension: the head's
    matmuls and the loss on its logits; the embedding); attention; matmuls; else norms and element-wise."""
    names = (kernel, *context)
    if any(COMMUNICATION.search(n) for n in names):
        return "communication"
    if any(n.startswith("Optimizer.step") for n in context) or "adam" in kernel.lower():
        return "optimizer"
    if vocabulary and any(vocabulary in (shape or ()) for shape in shapes) or any(VOCABULARY_OPS.search(n)
                                                                                 for n in names):
        return "head, loss and embedding"
    if any(ATTENTION.search(n) for n in names):
        return "attention"
    if (context and context[0] in MATMUL_OPS) or MATMUL_KERNELS.search(kernel):
        return "matmuls"
    return "norms and element-wise"


def breakdown(kernels, busy, span, steps, vocabulary):
    """{"step_ms", "idle_ms", kind: {"ms", "kernels"}} a step, of `kernels`: [(name, context, shapes, us)], `busy`:
    the microseconds some kernel ran, `span`: the microseconds from the first kernel's start to the last one's end.
    (Kernels on several streams overlap: the kinds can add up to more than the busy time.)"""
    out = {k: {"ms": 0.0, "kernels": 0.0} for k in KINDS}
    for name, context, shapes, us in kernels:
        row = out[kind(name, context, shapes, vocabulary)]
        row["ms"] += us / 1e3 / steps
        row["kernels"] += 1 / steps
    return {"step_ms": span / 1e3 / steps, "idle_ms": (span - busy) / 1e3 / steps, **out}


def _context(event):
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def _launches_below(event):
    return any(child.kernels or _launches_below(child) for child in event.cpu_children)


def _covered(intervals):
    """(microseconds covered by at least one interval, from the first start to the last end)."""
    total, reach, first = 0.0, float("-inf"), None
    for start, end in sorted(intervals):
        first = start if first is None else first
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total, (reach - first if first is not None else 0.0)


def of_events(events, steps, vocabulary):
    """breakdown() of torch.profiler's FunctionEvents (profile.events()). On a GPU, torch gives each op the kernels it
    launched (FunctionEvent.kernels: name, duration; matched by CUPTI's correlation, torch/autograd/profiler.py
    _parse_kineto_results) and lists the device's events with their times. A record_function range's GPU annotation
    comes as a "kernel" of the range named as the range, spanning the kernels its ops launched: it is left out (an
    inductor kernel's range bears its kernel's name too, but launches no op's kernels below it)."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    device = [e for e in events if e.device_type != DeviceType.CPU]
    if not device:  # a CPU: each op's own time (without the ops it calls), a range's (Python's) left out
        ops = [e for e in cpu if not getattr(e, "is_user_annotation", False)]
        kernels = [(e.name, _context(e), e.input_shapes, e.self_cpu_time_total) for e in ops]
        span = max((e.time_range.end for e in ops), default=0) - min((e.time_range.start for e in ops), default=0)
        return breakdown(kernels, sum(k[3] for k in kernels), span, steps, vocabulary)
    kernels, annotations = [], set()
    for e in cpu:
        for k in e.kernels:
            if k.name == e.name and _launches_below(e):
                annotations.add(k.name)
            else:
                kernels.append((k.name, _context(e), e.input_shapes, k.duration))
    busy, span = _covered([(d.time_range.start, d.time_range.end) for d in device if d.name not in annotations])
    return breakdown(kernels, busy, span, steps, vocabulary)
