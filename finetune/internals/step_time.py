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
COMMUNICATION = re.compile(r"nccl|c10d::|gloo|record_param_comms", re.IGNORECASE)
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
    """breakdown() of torch.profiler's FunctionEvents (profile.events()). On a GPU each device event (kernel, memcpy,
    memset) goes to the op that launched it: torch links the two by CUPTI's correlation (torch/autograd/profiler.py
    _parse_kineto_results: the device event's linked_correlation_id is the op's id, and the op lists it in .kernels,
    by name and duration, which is how it is found where the first is missing); one launched by no op is classified
    by its name alone. A record_function range's GPU annotation, a device event spanning its range's kernels, is no
    kernel (is_user_annotation, as torch's own tables leave it out of device time)."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    device = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    if not device:  # a CPU: each op's own time (without the ops it calls), a range's (Python's) left out
        ops = [e for e in cpu if not getattr(e, "is_user_annotation", False)]
        kernels = [(e.name, _context(e), e.input_shapes, e.self_cpu_time_total) for e in ops]
        span = max((e.time_range.end for e in ops), default=0) - min((e.time_range.start for e in ops), default=0)
        return breakdown(kernels, sum(k[3] for k in kernels), span, steps, vocabulary)
    by_id, by_kernel = {}, {}  # the ops that launched kernels, by their id and by (kernel, duration)
    for e in cpu:
        if e.kernels:
            by_id[e.id] = e
            for k in e.kernels:
                by_kernel.setdefault((k.name, k.duration), []).append(e)
    kernels = []
    for d in device:
        us = d.time_range.elapsed_us()
        op = by_id.get(getattr(d, "linked_correlation_id", 0) or None)
        if op is None and by_kernel.get((d.name, us)):
            op = by_kernel[(d.name, us)].pop(0)
        kernels.append((d.name, _context(op) if op else [], op.input_shapes if op else [], us))
    busy, span = _covered([(d.time_range.start, d.time_range.end) for d in device])
    return breakdown(kernels, busy, span, steps, vocabulary)
