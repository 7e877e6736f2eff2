"""Plan the memory of a fine-tuning run: which ZeRO stage (and offload) fits, and the fastest one that does.

    python3 plan.py --model facebook/opt-1.3b --gpus 8 --gpu-memory 80
    python3 plan.py --model facebook/opt-6.7b --gpus 1 --gpu-memory 24 --cpu-memory 256 --gradient-checkpointing
    python3 plan.py --model ./my-model --gpus 8 --nodes 4 --gpu-memory 80 --batch-size 4 --block-size 2048

Per GPU: model states (weights, gradients, optimizer state) plus activations for the micro-batch; per node: CPU
memory. Model states for bf16/fp16 training with Adam: ZeRO-0 and ZeRO-1 by the ZeRO paper's arithmetic (2 bytes
of 16-bit weights, 2 of gradients, 12 of fp32 master weights and Adam moments per parameter: 16Psi and
4Psi + 12Psi/N); ZeRO-2 and ZeRO-3, with and without CPU offload, by DeepSpeed's own estimators. Activations by
Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models": 34·s·b·h bytes per
layer in 16-bit with fused attention (no s² scores kept), 2·s·b·h per layer with gradient checkpointing (plus one
layer recomputed at a time), and the logits: 16-bit, their fp32 copy for the loss and its gradient, 10 bytes each.
"""
import argparse
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, OPTConfig

GiB = 2**30
# Published OPT shapes (hidden, layers, heads, FFN), so the planner works offline for these ids.
OPT_SHAPES = {"opt-125m": (768, 12, 12, 3072), "opt-350m": (1024, 24, 16, 4096), "opt-1.3b": (2048, 24, 32, 8192),
              "opt-2.7b": (2560, 32, 32, 10240), "opt-6.7b": (4096, 32, 32, 16384), "opt-13b": (5120, 40, 40, 20480),
              "opt-30b": (7168, 48, 56, 28672), "opt-66b": (9216, 64, 72, 36864)}
HEADROOM = 0.9  # of GPU memory usable by tensors: the CUDA context, allocator fragmentation and buffers take the rest


def load_config(name):
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        shape = OPT_SHAPES.get(name.split("/")[-1])
        if shape is None:
            sys.exit(f"error: cannot load a config for {name!r} (not a local folder, and the hub did not answer); "
                     f"pass a local model folder, or one of: {', '.join('facebook/' + k for k in OPT_SHAPES)}")
        hidden, layers, heads, ffn = shape
        return OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
                         word_embed_proj_dim=512 if name.endswith("350m") else hidden, max_position_embeddings=2048)


def count_params(config):
    """(all parameters, tied ones once; the largest number held directly by one module), without allocating."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def model_states(psi, largest, gpus_per_node, nodes):
    """{option: (GPU bytes, CPU bytes per node)} for model states."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2

    n = gpus_per_node * nodes
    per_node = lambda cpu_gpu: (cpu_gpu[1], cpu_gpu[0])  # DeepSpeed's estimators return (cpu, gpu)
    cpu_load = 4 * psi * gpus_per_node * 1.5  # without offload: each process loads the model on CPU first
    return {
        "ZeRO-0": (16 * psi, cpu_load),
        "ZeRO-1": (4 * psi + 12 * psi / n, cpu_load),
        "ZeRO-2": per_node(zero2(psi, gpus_per_node, nodes, cpu_offload=False)),
        "ZeRO-3": per_node(zero3(psi, largest, gpus_per_node, nodes, cpu_offload=False)),
        "ZeRO-2 + CPU offload": per_node(zero2(psi, gpus_per_node, nodes, cpu_offload=True)),
        "ZeRO-3 + CPU offload": per_node(zero3(psi, largest, gpus_per_node, nodes, cpu_offload=True)),
    }


def activations(batch, seq, hidden, layers, vocab, checkpointing):
    per_layer = 34 * seq * batch * hidden
    kept = 2 * seq * batch * hidden * layers + per_layer if checkpointing else per_layer * layers
    return kept + 10 * batch * seq * vocab


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub id, local folder, or facebook/opt-* (known offline)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU")
    p.add_argument("--cpu-memory", type=float, help="GiB of CPU memory per node (checked when given)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per GPU per micro-step")
    p.add_argument("--block-size", type=int, default=512, help="tokens per sequence")
    p.add_argument("--gradient-checkpointing", action="store_true")
    args = p.parse_args(argv)
    for flag in ("gpus", "nodes", "gpu_memory", "batch_size", "block_size"):
        if getattr(args, flag) <= 0:
            sys.exit(f"error: --{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")

    config = load_config(args.model)
    psi, largest = count_params(config)
    act = activations(args.batch_size, args.block_size, config.hidden_size, config.num_hidden_layers,
                      config.vocab_size, args.gradient_checkpointing)
    usable = args.gpu_memory * GiB * HEADROOM
    print(f"{args.model}: {psi / 1e9:.2f}B parameters; {args.nodes} node(s) x {args.gpus} GPU(s) of "
          f"{args.gpu_memory:g} GiB; micro-batch {args.batch_size} x {args.block_size} tokens, activations "
          f"{act / GiB:.1f} GiB per GPU{' (gradient checkpointing)' if args.gradient_checkpointing else ''}")
    print(f"{'option':<22}{'model states/GPU':>18}{'+ activations':>15}{'CPU/node':>11}  fits")
    plans = []
    for option, (gpu, cpu) in model_states(psi, largest, args.gpus, args.nodes).items():
        fits = gpu + act <= usable and (args.cpu_memory is None or cpu <= args.cpu_memory * GiB)
        plans.append((option, fits))
        print(f"{option:<22}{gpu / GiB:>15.1f} GiB{(gpu + act) / GiB:>11.1f} GiB{cpu / GiB:>7.0f} GiB  "
              f"{'yes' if fits else 'no'}")
    best = next((option for option, fits in plans if fits), None)  # listed from fastest to slowest
    if best:
        print(f"recommended: {best} (the fastest that fits {HEADROOM:.0%} of the GPU memory)")
        return 0
    hint = "" if args.gradient_checkpointing else "--gradient-checkpointing, "
    print(f"nothing fits: try {hint}a smaller --batch-size or --block-size, more GPUs, or --offload nvme")
    return 1


if __name__ == "__main__":
    sys.exit(main())
