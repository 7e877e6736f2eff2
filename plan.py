"""Plan the memory of a fine-tuning run: which ZeRO stage (and offload) fits, and the fastest one that does.

    python3 plan.py --model facebook/opt-1.3b --gpus 8 --gpu-memory 80
    python3 plan.py --model facebook/opt-6.7b --gpus 1 --gpu-memory 24 --lora-rank 16 --gradient-checkpointing
    python3 plan.py --model ./my-model --gpus 8 --nodes 4 --gpu-memory 80 --batch-size 4 --block-size 2048 --json

Per GPU: the model states (weights, gradients, fp32 master weights, Adam moments and DeepSpeed's own buffers) as
DeepSpeed 0.19.8 allocates them on this project's path, one accounting for every stage, read from its source
(runtime/zero/stage_1_and_2.py, stage3.py, fp16/unfused_optimizer.py) and checked against the bytes each rank holds
(tests/test_plan.py: within 0.1% at every stage, offload, precision, 1 and 2 ranks; tests/test_simulated_world.py:
0.5% at 8, 64 and 512 ranks on torch's fake process group; docs/planner.md), for the rank holding the most; then the
peak of a step: activations and logits as the loss path holds them, buckets, transients. Per node: CPU memory.
Activations are counted for the model and precision on a narrowed copy of its layers (finetune/memory.layer_bytes):
on an H100 the planned peaks were 2-7% under the measured. Where DeepSpeed's own estimators disagree with its
source, the source wins (docs/planner.md).
"""
import argparse
import dataclasses
import itertools
import json
import math
import sys
import warnings

from finetune import flags, long_sequences, quantization
from finetune.hardware import experts_per_token
from finetune.internals import memory
from finetune.internals.model_shapes import (  # noqa: F401
    active_parameters,
    count_params,
    layer_params,
    load_config,
    optimizer_groups,
    parameters,
    quantization_constants,
)
from finetune.zero_config import swap_buffer_elements, tuned_values

GiB = 2**30
HEADROOM = 0.9  # of GPU memory usable by tensors: the CUDA context, allocator fragmentation and buffers take the rest
REUSE_DISTANCE = 1e9  # ds_config_zero3.json's stage3_max_reuse_distance: gathered parameters kept this long
SUB_GROUP = MAX_IN_CPU = 10**9  # ZeRO-3's sub_group_size, offload_param.max_in_cpu (DeepSpeed's defaults)
ZERO2_BUCKET = 2.5e7  # ZeRO-1/2's reduce bucket: max(hidden^2, this) elements (zero_config.py), in backward only
OPTIONS = ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2 + CPU offload", "ZeRO-3 + CPU offload",
           "ZeRO-3 + NVMe offload"]  # fastest first


def model_states(params, hidden, precision, ranks, option, *, layer=None, groups=None, rank=None):
    """Bytes of model states one rank holds: {"after_backward", "after_step", "in_step", "gpu", "cpu"} (gpu/cpu:
    how the after-backward figure splits with offload). b: bytes of a weight in the training precision. layer: the
    parameters of the model's largest transformer layer, ZeRO-3's leaf (zero_config.zero3_layers), or None. groups:
    the optimizer's groups of trainable tensor sizes (optimizer_groups; None: one group, `params`' order); rank:
    which rank (None: the one holding the most, worst_rank)."""
    b = 4 if precision in ("fp32", "tf32") else 2
    n = ranks
    trainable = sum(k for k, t in params if t)
    frozen = sum(k for k, t in params if not t)
    largest = max((k for k, t in params if t), default=0)
    shard = lambda sel: sum(math.ceil(k / n) for k, t in params if sel(t))  # ZeRO-3 pads each tensor to n parts
    zero3 = tuned_values(3, hidden, True, n, layer)  # ZeRO-3's "auto" buckets and persistence threshold
    threshold, rbs = zero3["stage3_param_persistence_threshold"], zero3["reduce_bucket_size"]
    persistent = sum(k for k, t in params if k <= threshold) if n > 1 else 0  # small parameters held whole
    stage = int(option[5])
    if stage == 0:  # the whole of everything on every rank. bf16 is autocast over fp32 weights (both scripts:
        # zero_config.autocast_at_stage0), a frozen base (LoRA) loaded in 16 bits; DeepSpeed's fp16 keeps 16-bit
        # weights and fp32 masters, its fp32 grads in the step
        sixteen = precision == "fp16"
        weights = (2 if sixteen else 4) * trainable + b * frozen
        master = 4 * trainable if sixteen else 0
        grads = (2 if sixteen else 4) * trainable
        held = weights + master + 8 * trainable
        return dict(after_backward=held + grads, after_step=held, gpu=held + grads, cpu=0,
                    in_step=held + grads + (4 * trainable if sixteen else 0))
    if stage in (1, 2):  # a flat 16-bit buffer a group, padded; fp32 master, moments and gradients partitioned
        groups = groups if groups is not None else [[k for k, t in params if t]]
        padded = sum(flat_size(sizes, n) for sizes in groups)
        weights = b * (padded + frozen)
        mine = padded / n
        states = 12 * mine  # fp32 master + 2 Adam moments, always a separate copy (also in fp32 runs)
        if "offload" in option:  # states on the CPU; a 16-bit staging copy there, a gradient buffer on each side
            gpu = weights + b * largest
            cpu = states + 4 * mine + b * mine + b * largest
            return dict(after_backward=gpu + cpu, after_step=gpu + cpu, in_step=gpu + cpu, gpu=gpu, cpu=cpu)
        held = weights + states  # the gradients: on one GPU all of them; on more, the rank's buffer of the whole
        # gradient of every tensor its partition touches, until the step. The step flattens a group's partition
        # (a copy) and casts it to fp32 (another in 16-bit runs; the norm copies none: mend norm_at_once)
        grads = b * (trainable if n == 1 else partition_gradients(groups, n)[worst_rank(groups, n) if rank is None
                                                                            else rank])
        part = max(flat_size(sizes, n) for sizes in groups) // n  # the largest group's partition
        return dict(after_backward=held + grads, after_step=held, gpu=held + grads, cpu=0,
                    in_step=held + grads + b * part + (4 * part if b == 2 else 0))
    # stage 3: everything partitioned: trainable 16-bit shards, a persistent 16-bit gradient partition, fp32 master
    # and moments; frozen shards; small parameters also held whole (gathered, persistent); one reduce bucket.
    # (LoRA adapters, made after the model's zero.Init, are cast to the run's 16 bits before the engine takes them.)
    p_train, p_frozen = shard(lambda t: t), shard(lambda t: not t)
    sharded = (2 * b + 12) * p_train + b * p_frozen
    if "offload" in option:  # parameters and optimizer state on the CPU; the bucket and small parameters stay
        gpu = b * rbs + b * persistent
        cpu = (16 + 2 * b) * p_train + b * p_frozen if "CPU" in option else nvme_buffers(params, n, b)
        return dict(after_backward=gpu + cpu, after_step=gpu + cpu, in_step=gpu + cpu, gpu=gpu, cpu=cpu)
    held = sharded + b * rbs + b * persistent
    return dict(after_backward=held, after_step=held, in_step=held + 4 * p_train - b * persistent, gpu=held, cpu=0)


def flat_size(sizes, ranks):
    """Elements of a ZeRO-1/2 group's flat buffer: its tensors end to end, padded to a multiple of 2N
    (stage_1_and_2.py: nccl_start_alignment_factor x the world), cut into N equal partitions."""
    return math.ceil(sum(sizes) / (2 * ranks)) * 2 * ranks


def partition_gradients(groups, ranks):
    """Per rank, the gradient elements ZeRO-1/2 holds from the backward to the step: the whole size of every tensor
    its partition of each group touches, the first one straddling its start included (stage_1_and_2.py:
    get_partition_info's params_in_partition, copy_grads_in_partition's buffer). A tensor over several partitions
    counts whole on each: the embedding's gradient on every rank it spans."""
    held = [0] * (ranks + 1)
    for sizes in groups:
        part, start = flat_size(sizes, ranks) // ranks, 0
        for k in sizes:  # ranks floor(start / part) .. ceil(end / part) - 1: a difference array
            if k:
                held[start // part] += k
                held[math.ceil((start + k) / part)] -= k
            start += k
    return list(itertools.accumulate(held[:-1]))


def worst_rank(groups, ranks):
    """The rank ZeRO-1/2 gives the most gradient to hold (the lowest of equals); its memory is the run's."""
    held = partition_gradients(groups, ranks)
    return held.index(max(held))


def nvme_buffers(params, ranks, b):
    """CPU bytes of ZeRO-3 + NVMe offload (stage3.py, runtime/swap_tensor/): the trainable 16-bit shards, up to
    offload_param.max_in_cpu elements (1e9), stay in CPU memory with their 16-bit gradient partition; the optimizer
    swaps its fp32 state through 4 pinned buffers of the largest sub-group (parameters taken in order until they pass
    sub_group_size, 1e9 elements; at most a rank's trainable partition), and the parameters through 5 pinned buffers
    of the largest shard (offload_param.buffer_count; finetune/zero_config.py sizes them). Frozen weights live on the
    NVMe."""
    largest = max(k for k, _ in params)
    p_train = sum(math.ceil(k / ranks) for k, t in params if t)
    sub_group = min(p_train, SUB_GROUP + math.ceil(largest / ranks))
    return (b * min(p_train, MAX_IN_CPU) + b * p_train + 4 * 4 * sub_group
            + 5 * b * swap_buffer_elements(largest, ranks, b))


def norm_copy_bytes(params, ranks):
    """ZeRO-2 + CPU offload computes the gradient norm (for clipping, and reported) over each rank's partition one
    gradient piece at a time, each copied to fp64 first, in the backward hook on the GPU (runtime/zero/
    stage_1_and_2.py): 8 bytes for each element of the largest piece, up to a whole partition. At a large vocabulary
    that is the embedding's: Llama-3-8B's 525M elements, 4.2 GB. (Without offload DeepSpeed 0.19.8 did the same in the
    step; mend norm_at_once takes one foreach norm instead, which copies nothing.)"""
    trainable = [k for k, t in params if t]
    return 8 * min(max(trainable, default=0), math.ceil(sum(trainable) / ranks))


def activations(batch, seq, config, precision, *, checkpointing, loss_chunk, sequence_parallel=1, autocast=False,
                tiled_mlp=False, offload=False):
    """Peak bytes of activations per GPU: what a layer keeps for its backward pass (memory.layer_bytes: counted for
    this model and precision; where it cannot be, Korthikanti et al.'s 34·s·b·h in 16 bits, twice that in fp32, 19 of
    them the MLP's at 4h, a mixture of experts' for the experts a token goes through), one layer's and the layers'
    inputs with checkpointing; and the logits as the loss path holds them (logits_bytes). autocast: 16-bit matmuls
    over fp32 weights (ZeRO-0 and single-gpu.py in bf16), whose residual stream and norms stay fp32. With sequence
    parallelism a GPU holds the activations of its 1/N of the tokens (around attention, the whole sequence for 1/N
    of the heads: the same size), and the logits of its tokens. tiled_mlp (--tiled-mlp): a layer keeps its MLP's
    input only (counted so), and the recomputed layer holds one tile's intermediates (a hidden size of tokens);
    offload (--offload-activations): checkpointing with the layers' inputs on the host (layer_inputs_bytes), two of
    them on the GPU: the one recomputed and the one fetched for the next."""
    seq = math.ceil(seq / sequence_parallel)
    scale = 2 if precision in ("fp32", "tf32") else 1
    text = config.get_text_config()
    hidden, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    counted = memory.layer_bytes(config, precision, autocast, tiled=tiled_mlp)
    if tiled_mlp and counted is not None:  # and one tile's intermediates as the untiled layer keeps them
        tile = math.ceil(batch * seq / long_sequences.tiles(batch * seq, hidden))
        untiled = memory.layer_bytes(config, precision, autocast)[0]
        counted = (counted[0] + (untiled - counted[0]) * tile / (batch * seq), counted[1])
    if counted is None:
        experts, k = experts_per_token(config)
        unit = 34
        if experts:
            width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
            unit = 15 + 19 * k * width / (4 * hidden)
        counted = (unit * hidden * scale, 0)
    per_layer = batch * (counted[0] * seq + counted[1] * seq**2)
    inputs = layer_inputs_bytes(batch, seq, config, precision, autocast) / layers  # a layer's, kept by checkpointing
    kept = (inputs * (2 if offload else layers) + per_layer) if checkpointing or offload else per_layer * layers
    return kept + logits_bytes(batch * seq, vocab, precision, loss_chunk)


def pinned(total, layers):
    """Host bytes of the layers' inputs in pinned buffers, one a layer, each rounded up to a power of two by torch."""
    return layers * 2 ** math.ceil(math.log2(max(1, total / layers)))


def layer_inputs_bytes(batch, seq, config, precision, autocast=False):
    """The layers' inputs gradient checkpointing keeps (on the host with --offload-activations): the residual
    stream's, fp32 under autocast and in fp32 runs, else 16 bits; seq: a GPU's share of a sequence."""
    text = config.get_text_config()
    width = 4 if autocast or precision in ("fp32", "tf32") else 2
    return width * seq * batch * text.hidden_size * text.num_hidden_layers


def logits_bytes(tokens, vocab, precision, loss_chunk):
    """The logits' bytes at their peak. In chunks (finetune/loss.py): one chunk's fp32 logits, overwritten by their
    gradient, and its 16-bit copy for the matmuls. All at once (transformers' loss): the logits, their fp32 copy in
    16-bit runs, the log-softmax saved for backward and its gradient."""
    sixteen = precision not in ("fp32", "tf32")
    if loss_chunk:
        return min(tokens, loss_chunk) * vocab * (6 if sixteen else 4)
    return tokens * vocab * (14 if sixteen else 12)


@dataclasses.dataclass(frozen=True)
class Cluster(flags.Piece):
    """plan.py's own flags: the machines it plans for (the rest are the scripts' own, finetune/flags.py)."""
    gpus: int = flags.flag(None, "GPUs per node", required=True)
    nodes: int = flags.flag(1)
    gpu_memory: float = flags.flag(None, "GiB per GPU", required=True)
    cpu_memory: float | None = flags.flag(None, "GiB of CPU memory per node (checked when given)")
    json: bool = flags.flag(False, "one JSON object instead of the table")


@dataclasses.dataclass(frozen=True)
class Request:
    """What plan() plans for, flat: the run's flags as the scripts take them, and the machines."""
    model: str
    precision: str
    batch_size: int
    block_size: int
    gradient_checkpointing: bool
    offload_activations: bool
    tiled_mlp: bool
    sequence_parallel: int
    loss_chunk: int
    lora_rank: int
    lora_targets: str
    load_in_4bit: bool
    load_in_8bit: bool
    gpus: int
    nodes: int
    gpu_memory: float
    cpu_memory: float | None
    json: bool

    @classmethod
    def of(cls, config, cluster):
        """From the scripts' pieces (flags.Config) and the Cluster."""
        pieces = [config.model, config.train, config.data, config.zero, cluster]
        values = {k: v for piece in pieces for k, v in vars(piece).items()}
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


MODEL = ("model", "precision", "gradient_checkpointing", "offload_activations", "tiled_mlp", "loss_chunk", "lora_rank",
         "lora_targets", "load_in_4bit", "load_in_8bit")


def plan(args):
    """(the model's config, its parameters, a row per option); `args`: a Request."""
    config = load_config(args.model)
    params = parameters(config, args.lora_rank, args.lora_targets)
    bits = quantization.bits(args)  # QLoRA: the frozen base as bitsandbytes stores it, its scales beside it
    held = parameters(config, args.lora_rank, args.lora_targets, bits, args.precision) if bits else params
    constants, dequantized = (quantization_constants(config, bits, args.lora_rank, args.lora_targets) if bits
                              else (0, 0))
    ranks = args.gpus * args.nodes
    b = 4 if args.precision in ("fp32", "tf32") else 2
    total, hidden = sum(k for k, _ in held), config.get_text_config().hidden_size
    layer = layer_params(config, args.lora_rank, args.lora_targets)
    groups = optimizer_groups(config, args.lora_rank, args.lora_targets)  # ZeRO-1/2's partitions: the worst rank's
    rows = []
    for option in OPTIONS:
        # ZeRO-0 in bf16 autocasts over fp32 weights (zero_config.autocast_at_stage0), but for a 16-bit frozen base
        autocast = option == "ZeRO-0" and args.precision == "bf16" and not args.lora_rank and not bits
        acts_at = lambda block, batch, autocast=autocast: activations(  # noqa: E731 (this option's autocast)
            batch, block, config, args.precision, checkpointing=args.gradient_checkpointing,
            loss_chunk=args.loss_chunk, sequence_parallel=args.sequence_parallel, autocast=autocast,
            tiled_mlp=args.tiled_mlp, offload=args.offload_activations)
        acts = acts_at(args.block_size, args.batch_size)
        # --offload-activations: each GPU's process keeps its layers' inputs in this node's memory
        offloaded = lambda block, batch, autocast=autocast: args.gpus * pinned(layer_inputs_bytes(  # noqa: E731
            batch, math.ceil(block / args.sequence_parallel), config, args.precision, autocast),
            config.get_text_config().num_hidden_layers) if args.offload_activations else 0
        states = {k: v + (constants if k != "cpu" else 0)
                  for k, v in model_states(held, hidden, args.precision, ranks, option, layer=layer,
                                                   groups=groups).items()}
        transient = b * dequantized  # a quantized layer's weight, dequantized for its matmul
        # the reduce buckets (x2: overlap_comm, 2+ GPUs); on one GPU without offload nothing is reduced
        if option in ("ZeRO-1", "ZeRO-2", "ZeRO-2 + CPU offload") and (ranks > 1 or "offload" in option):
            transient += (2 if ranks > 1 else 1) * b * max(hidden ** 2, ZERO2_BUCKET)
            # and a gradient larger than the bucket, which bypasses it until reduced (stage_1_and_2.py)
            transient += b * max((k for k, t in params if t), default=0) if "offload" not in option else 0
        if option == "ZeRO-2 + CPU offload":  # the norm's fp64 copy is made in the backward pass here
            transient += norm_copy_bytes(params, ranks)
        if option.startswith("ZeRO-3"):  # gathered parameters kept from forward to backward (reuse distance)
            transient += b * min(total, REUSE_DISTANCE)
        # QLoRA: transformers loads the whole quantized model onto each rank's GPU (its device_map {"": this GPU},
        # quantizers/quantizer_bnb_4bit.py), skipping zero.Init: ZeRO-3 partitions it only in deepspeed.initialize
        loaded = b * total + constants if bits else 0
        peak_at = lambda block, batch, states=states, transient=transient, loaded=loaded, acts_at=acts_at: max(
            states["gpu"] + transient + acts_at(block, batch), states["in_step"] - states["cpu"], loaded)
        budget = args.gpu_memory * GiB * HEADROOM
        # each process loads the model on CPU: fp32, a LoRA base in the run's precision (models.load_causal_lm)
        load = 0 if option.startswith("ZeRO-3") or bits else (b if args.lora_rank else 4) * total * args.gpus
        cpu_at = lambda block, batch, base=states["cpu"] * args.gpus + load, off=offloaded: base + off(block, batch)
        # (its GPU peak, and the host memory where it is given; both grow with the block and the micro-batch)
        fits_at = lambda block, batch, peak_at=peak_at, cpu_at=cpu_at, budget=budget: peak_at(  # noqa: E731
            block, batch) <= budget and (args.cpu_memory is None or cpu_at(block, batch) <= args.cpu_memory * GiB)
        refused = bits == 8 and option.startswith("ZeRO-3")  # ZeRO-3 cannot shard LLM.int8's weights
        run, sp = (args.block_size, args.batch_size), args.sequence_parallel  # (a block: a multiple of 64 and of sp)
        rows.append({"option": option, "model_states_bytes_per_gpu": states["gpu"],
                     "held_after_step_bytes_per_rank": states["after_step"], "activations_bytes_per_gpu": acts,
                     "peak_bytes_per_gpu": peak_at(*run), "cpu_bytes_per_node": cpu_at(*run),
                     "fits": fits_at(*run) and not refused,
                     "longest_block": largest(lambda n, f=fits_at: f(n, args.batch_size), 64 * sp // math.gcd(64, sp)),
                     "largest_batch": 0 if refused else largest(lambda n, f=fits_at: f(args.block_size, n), 1, 2**16)})
    return config, params, rows


def largest(fits, step, limit=2**24):
    """The largest multiple of `step` up to `limit` that fits (fits() holds up to some value, then no more), or 0:
    the longest block, the largest micro-batch (MFU grows with it)."""
    low, high = 0, limit // step
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle - 1)
    return low * step


def recommend(rows, gpus, nodes):
    """The fastest option that fits. On one GPU, ZeRO-1, 2 and 3 shard nothing: ZeRO-0 (single-gpu.py) or offload."""
    for row in rows:
        if gpus * nodes == 1 and row["option"] in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
            continue
        if row["fits"]:
            return row["option"]
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the scripts' flags where they mean the same (finetune/flags.py: --model, --precision, --batch-size, ...), the
    # machines' own (Cluster); planned in bf16 unless --precision says otherwise
    flags.add_flags(p, flags.Model.taking(*MODEL), flags.Train.taking("batch_size"), flags.Data.taking("block_size"),
                    flags.Zero.taking("sequence_parallel"), Cluster, model=None, precision="bf16")
    parsed = p.parse_args(argv)
    cluster = Cluster(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(Cluster)})
    args = Request.of(flags.build(parsed), cluster)
    if args.model is None:
        sys.exit("error: pass --model (a hub id or a local folder)")
    if args.precision == "auto":  # the GPUs planned for: bf16 from Ampere on
        args = dataclasses.replace(args, precision="bf16")
    warnings.filterwarnings("ignore")  # the libraries' deprecation notes, from building the model on the meta device
    for flag in ("gpus", "nodes", "gpu_memory", "batch_size", "block_size", "sequence_parallel"):
        if getattr(args, flag) <= 0:
            sys.exit(f"error: --{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if (args.gpus * args.nodes) % args.sequence_parallel:
        sys.exit(f"error: --sequence-parallel {args.sequence_parallel} does not divide the {args.gpus * args.nodes} "
                 f"GPUs; use a divisor")

    quantization.check(args, library=False)
    config, params, rows = plan(args)
    best = recommend(rows, args.gpus, args.nodes)
    total, trainable = sum(k for k, _ in params), sum(k for k, t in params if t)
    if args.json:
        print(json.dumps({"model": args.model, "parameters": total, "active_parameters": active_parameters(config),
                          "trainable_parameters": trainable,
                          "options": {r.pop("option"): r for r in rows}, "recommended": best}, indent=1))
        return 0 if best else 1
    lora = f", LoRA rank {args.lora_rank}: {trainable / 1e6:.1f}M trainable" if args.lora_rank else ""
    lora += f" over a {quantization.bits(args)}-bit base" if quantization.bits(args) else ""
    active = active_parameters(config)
    moe = f" ({active / 1e9:.2f}B active per token: all experts' states, the active ones' activations)" if active \
        else ""
    print(f"{args.model}: {total / 1e9:.2f}B parameters{moe}{lora}; {args.nodes} node(s) x {args.gpus} GPU(s) of "
          f"{args.gpu_memory:g} GiB; {args.precision}, micro-batch {args.batch_size} x {args.block_size} tokens, "
          f"activations {rows[0]['activations_bytes_per_gpu'] / GiB:.1f} GiB per GPU"
          f"{' (gradient checkpointing)' if args.gradient_checkpointing and not args.offload_activations else ''}"
          f"{' (checkpointed, layer inputs on the host)' if args.offload_activations else ''}"
          f"{' (the MLP in tiles)' if args.tiled_mlp else ''}"
          f"{f', each sequence over {args.sequence_parallel} GPUs' if args.sequence_parallel > 1 else ''}")
    print(f"{'option':<24}{'model states/GPU':>17}{'peak/GPU':>11}{'CPU/node':>11}  fits  longest block  largest batch")
    for r in rows:
        states, peak, cpu = (r[k] / GiB for k in ("model_states_bytes_per_gpu", "peak_bytes_per_gpu",
                                                   "cpu_bytes_per_node"))
        print(f"{r['option']:<24}{states:>13.1f} GiB{peak:>7.1f} GiB{cpu:>7.0f} GiB  {'yes' if r['fits'] else 'no ':<4}"
              f"{r['longest_block']:>14,}{r['largest_batch']:>15,}")
    if best:
        where = " (single-gpu.py on one GPU)" if best == "ZeRO-0" and args.gpus * args.nodes == 1 else ""
        print(f"recommended: {best}{where}, the fastest that fits {HEADROOM:.0%} of the GPU memory")
        return 0
    hints = [h for h, on in (("--gradient-checkpointing", not args.gradient_checkpointing),
                             ("--lora-rank 16", not args.lora_rank)) if on]
    print(f"nothing fits: try {', '.join(hints + ['a smaller --batch-size or --block-size, more GPUs'])}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
