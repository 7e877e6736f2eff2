"""Long sequences on one GPU: what is left once gradient checkpointing, the chunked loss and varlen attention are on.

- `--tiled-mlp`: each layer's MLP runs over tiles of the tokens (as many as the tokens over the hidden size, as
  Arctic Long Sequence Training does), one tile's intermediate at a time (three tensors of the MLP's width: at 8B and
  256k tokens, 21 GiB at once), none kept for the backward pass: each tile is recomputed there.
- `--offload-activations`: gradient checkpointing with each layer's input in host memory from its forward to its
  backward (2·s·h bytes a layer on the GPU otherwise: 64 GiB at 8B and 256k tokens); on a GPU copied on a side stream
  into reused pinned buffers, the next layer's input fetched back while the backward runs the current one.

Both recompute as checkpointing does, with the random state of the forward (dropout's masks) and its autocast, and
hand DeepSpeed each parameter's gradient once a backward pass, whole (it refuses a second at every stage): the numbers
are those of the run without them, to fp32 rounding (tests/test_long_sequences.py).
"""
import contextlib
import inspect
import math
import weakref

import torch
from torch.utils._pytree import tree_leaves

from .base import fail
from .hardware import experts_per_token


def tile_mlps(model, config, tokens):
    """--tiled-mlp: every decoder layer's MLP computed over tiles of the tokens, as many as `tokens` (a micro-batch's
    at most) over the hidden size, on every rank the same count whatever its batch holds: under ZeRO-3 each tile
    gathers a LoRA layer's weights, and the ranks' gathers must pair. A layer's MLP is its `mlp` module (Llama, Qwen,
    Mistral, Gemma, GPT-2, Phi) or, as OPT writes it, fc1, its activation and fc2 inside the layer."""
    if experts_per_token(config)[0]:
        fail("--tiled-mlp: this model's MLP is a mixture of experts, which is not tiled; leave --tiled-mlp off")
    count = tiles(tokens, config.get_text_config().hidden_size)
    layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))
              and (isinstance(getattr(m, "mlp", None), torch.nn.Module) or hasattr(m, "fc2"))]
    if not layers:
        fail(f"--tiled-mlp: no MLP found in {type(model).__name__}'s layers (a module `mlp`, or fc1 and fc2); leave "
             f"--tiled-mlp off for this model")
    for layer in layers:
        if isinstance(getattr(layer, "mlp", None), torch.nn.Module):
            mlp = layer.mlp
            taken = [p for p in inspect.signature(type(mlp).forward).parameters.values()
                     if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
            if len(taken) != 2:  # (self, x): Bloom's also takes the residual
                fail(f"--tiled-mlp: {type(mlp).__name__}.forward takes more than the hidden states; leave "
                     f"--tiled-mlp off for this model")
            mlp.forward = TiledForward(lambda x, mlp=mlp: type(mlp).forward(mlp, x), [mlp], count)
        else:  # OPT: fc1's call computes the whole block; the layer's activation and fc2 then pass it through
            fc1, act, fc2 = layer.fc1, layer.activation_fn, FC2(layer.fc2)
            fc1.forward = TiledForward(lambda x, fc1=fc1, act=act, fc2=fc2: fc2.within(act(type(fc1).forward(fc1, x))),
                                       [fc1, fc2.module], count)
            layer.activation_fn, layer.fc2.forward = torch.nn.Identity(), fc2
    return model


class FC2:
    """OPT's fc2 inside a tile: computed through its own call (under ZeRO-3 its hooks gather its weights there), and
    passed through where the layer calls it after the tiles."""

    def __init__(self, module):
        self.module, self.inside = module, False

    def within(self, x):
        self.inside = True
        try:
            return self.module(x)
        finally:
            self.inside = False

    def __call__(self, x):
        return type(self.module).forward(self.module, x) if self.inside else x


class TiledForward:
    """The forward of an MLP over `count` tiles of the tokens (equal but the last; some empty when there are fewer
    tokens than tiles): a callable kept as the module's `forward`, so its hooks (ZeRO-3's) still run around it.
    Without gradients (evaluation, a reference pass) the tiles are computed and nothing is kept."""

    def __init__(self, block, modules, count):
        self.block, self.modules, self.count = block, modules, count

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled():
            trainable = [p for m in self.modules for p in m.parameters() if p.requires_grad]
            out = TiledMLP.apply(self.block, self.count, trainable, _requires_grad(), flat)
        else:
            out = torch.cat([self.block(flat[a:b]) for a, b in spans(len(flat), self.count)])
        return out.view(*x.shape[:-1], out.shape[-1])


def spans(rows, count):
    """`count` tiles of `rows` rows, (start, stop) each: equal but the last; empty ones at the end when there are
    fewer rows."""
    size = max(1, math.ceil(rows / count))
    return [(min(i * size, rows), min((i + 1) * size, rows)) for i in range(count)]


def _requires_grad():
    """A tensor that requires a gradient, passed along so that the output of a recomputed block requires one even
    where its input does not (LoRA's first layer, over frozen embeddings): else its adapters would get none."""
    return torch.empty(0, requires_grad=True)


class TiledMLP(torch.autograd.Function):
    """block(x) a tile of rows at a time, nothing kept but x; in backward each tile recomputed and differentiated,
    the parameters' gradients summed over the tiles in their .grad. DeepSpeed reduces a gradient as it is summed
    (and refuses a second one) unless the parameter says it is not ready: `ds_grad_is_ready`, false until the last
    tile (its own tiled computations' flag, runtime/zero/stage3.py and stage_1_and_2.py)."""

    @staticmethod
    def forward(ctx, block, count, trainable, _, x):
        ctx.block, ctx.trainable, ctx.needs, ctx.count = block, trainable, x.requires_grad, count
        ctx.state = Replay(x.device)  # dropout's random state, autocast
        ctx.save_for_backward(x)
        return torch.cat([block(x[a:b]) for a, b in spans(len(x), count)])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs else None
        try:
            with ctx.state.random():  # the tiles' dropout drawn in the forward's order
                for i, (a, b) in enumerate(spans(len(x), ctx.count)):
                    for p in ctx.trainable:
                        p.ds_grad_is_ready = i == ctx.count - 1
                    piece = x[a:b].detach().requires_grad_(ctx.needs)
                    with ctx.state.autocast(), torch.enable_grad():  # (not the backward: it runs as the outer one)
                        out = ctx.block(piece)
                    if out.requires_grad:  # (else nothing here trains, and x needs no gradient)
                        torch.autograd.backward(out, grad[a:b])
                    if ctx.needs:
                        grad_x[a:b] = piece.grad if piece.grad is not None else 0
        finally:
            for p in ctx.trainable:
                p.ds_grad_is_ready = True
        return None, None, None, None, grad_x


class Replay:
    """What a recomputation must replay of its forward: the random state (dropout's masks) and autocast, the
    device's and the CPU's (as torch.utils.checkpoint does)."""

    def __init__(self, device):
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocasts = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                          for kind in {device.type, "cpu"}}

    @contextlib.contextmanager
    def random(self):
        """The forward's random state, the current one restored after."""
        devices = [self.device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            yield

    @contextlib.contextmanager
    def autocast(self):
        with contextlib.ExitStack() as stack:
            for kind, (enabled, dtype) in self.autocasts.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            yield


def offload_layer_inputs(model, tokens=None):
    """--offload-activations: gradient checkpointing whose kept layer inputs live in host memory (the HostCopies
    returned; `tokens`: a micro-batch's at most, each pinned buffer made for that many). transformers' checkpointed
    layers call `_gradient_checkpointing_func(forward, *args)` (modeling_layers.py): it is this."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    host = HostCopies(tokens)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = host.checkpoint
    return host


class Kept:
    """One layer's input in host memory (`host`; on a GPU a view of the pinned `buffer`), and once fetched back
    `back` (with its copy's event, `ready`)."""

    __slots__ = ("host", "buffer", "device", "back", "ready", "returned", "__weakref__")

    def __init__(self, host, device, buffer=None, returned=None):
        self.host, self.device, self.buffer, self.back, self.ready = host, device, buffer, None, None
        self.returned = returned  # gives the buffer back if the handle dies untaken (a forward without a backward)


class HostCopies:
    """The layers' inputs in host memory, in the order their forwards ran; the backward takes them back in reverse,
    fetching the next one while the current layer recomputes. On a GPU: pinned buffers, each made for a
    micro-batch's most tokens and reused (a pinned allocation is slow, and torch's rounds it up to a power of two),
    the copies on a side stream of their own, each waited for by an event of its own."""

    def __init__(self, tokens=None):
        self.kept, self.free = [], []  # weak references to the handles not yet taken; pinned buffers to reuse
        self.tokens, self.stream = tokens, None

    def checkpoint(self, forward, *args):
        if not torch.is_grad_enabled():  # a pass without a backward (a reference, KTO's KL point): nothing to keep
            return forward(*args)
        tensors = [a for a in args if torch.is_tensor(a)]
        kwargs = tree_leaves(getattr(forward, "keywords", {}))
        if len(tensors) != len(args) or any(torch.is_tensor(v) and v.requires_grad for v in kwargs):
            fail("--offload-activations: this model's layers take inputs it cannot keep on the host (a tensor "
                 "keyword that needs a gradient); use --gradient-checkpointing alone")
        return Offloaded.apply(forward, self, _requires_grad(), *args)

    def put(self, x):
        """The host copy of x (on a CPU: a copy all the same), started; a handle for take()."""
        self.kept = [ref for ref in self.kept if ref() is not None]
        if x.device.type != "cuda":
            handle = Kept(x.detach().clone(), x.device)
        else:
            if self.stream is None:
                self.stream = torch.cuda.Stream(x.device)
            buffer = fitting(self.free, x.numel(), x.dtype)
            if buffer is None:  # made for the most a micro-batch holds, so that every later input fits it
                most = max(x.numel(), (self.tokens or 0) * x.shape[-1])
                buffer = torch.empty(most, dtype=x.dtype, pin_memory=True)
            host = buffer[: x.numel()].view(x.shape)
            self.stream.wait_stream(torch.cuda.current_stream(x.device))  # x is made on the main stream
            with torch.cuda.stream(self.stream):
                host.copy_(x.detach(), non_blocking=True)
            x.record_stream(self.stream)  # its memory not reused before the copy has read it
            handle = Kept(host, x.device, buffer)
            handle.returned = weakref.finalize(handle, self.free.append, buffer)  # later copies: the same stream
        self.kept.append(weakref.ref(handle))
        return handle

    def take(self, handle):
        """x back on its device; the previous layer's input starts coming back (the backward's next). The handle
        lets go of both copies: the node keeping it outlives its backward."""
        self.fetch(handle)
        index = next(i for i, ref in enumerate(self.kept) if ref() is handle)
        if index and self.kept[index - 1]() is not None:
            self.fetch(self.kept[index - 1]())
        self.kept.pop(index)
        back, handle.back, handle.host = handle.back, None, None
        if back.device.type == "cuda":
            main = torch.cuda.current_stream(back.device)
            main.wait_event(handle.ready)  # this copy only: the prefetch goes on beside the recomputation
            back.record_stream(main)  # made on the side stream, used on the main one
            handle.returned.detach()
            self.free.append(handle.buffer)  # its next copy, on the same stream, comes after this one
            handle.buffer = handle.ready = None
        return back

    def fetch(self, handle):
        if handle.back is not None:
            return
        if handle.device.type != "cuda":
            handle.back = handle.host
            return
        with torch.cuda.stream(self.stream):
            handle.back = handle.host.to(handle.device, non_blocking=True)
            handle.ready = torch.cuda.Event()
            handle.ready.record(self.stream)


def fitting(free, numel, dtype):
    """The smallest free buffer of `dtype` holding `numel` elements, taken from `free`; None if none does (the
    blocks' widths vary: a buffer serves any shorter one)."""
    fits = [b for b in free if b.dtype == dtype and b.numel() >= numel]
    if not fits:
        return None
    best = min(fits, key=torch.Tensor.numel)
    del free[next(i for i, b in enumerate(free) if b is best)]
    return best


class Offloaded(torch.autograd.Function):
    """forward(*inputs) of a checkpointed layer, its inputs kept by `host`; in backward recomputed (the forward's
    random state and autocast replayed) and differentiated in one pass: each parameter's gradient once."""

    @staticmethod
    def forward(ctx, forward, host, _, *inputs):
        ctx.forward, ctx.host, ctx.needs = forward, host, [x.requires_grad for x in inputs]
        ctx.state = Replay(inputs[0].device)
        ctx.kept = [host.put(x) for x in inputs]
        return forward(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        try:
            inputs = [ctx.host.take(h).detach().requires_grad_(need) for h, need in zip(ctx.kept, ctx.needs,
                                                                                         strict=True)]
            with ctx.state.random(), ctx.state.autocast(), torch.enable_grad():
                outputs = ctx.forward(*inputs)
        finally:  # the node outlives its backward (as long as the loss is held): let go of what it kept
            ctx.kept = ctx.forward = ctx.state = None
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=False)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, None, *(x.grad if need else None for x, need in zip(inputs, ctx.needs, strict=True))


def tiles(tokens, hidden):
    """How many tiles --tiled-mlp cuts a micro-batch of up to `tokens` into: one a `hidden` tokens (ALST's count)."""
    return max(1, math.ceil(tokens / hidden))
