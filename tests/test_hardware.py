"""Every decision a GPU drives, fed the facts a GPU would give: compute capabilities, visible devices, device
names, SLURM's variables. CPU-green is not GPU-right unless these hold."""

import argparse
import os

import numpy as np
import pytest
import torch
from helpers import cpu_process, load_script

from finetune import blocks, checkpoints, data, distributed, flags, hardware, progress, zero_config
from finetune.hardware import Facts
from finetune.internals import mend_fixes

pytestmark = pytest.mark.quick  # in process: `make test-quick`

H100 = Facts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 8)
A100 = Facts("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 8)
V100 = Facts("cuda", "Tesla V100-SXM2-16GB", (7, 0), 8)
T4 = Facts("cuda", "Tesla T4", (7, 5), 1)
P100 = Facts("cuda", "Tesla P100-PCIE-16GB", (6, 0), 1)
CPU = Facts("cpu")


@pytest.mark.parametrize(
    "facts, auto", [(H100, "bf16"), (A100, "bf16"), (V100, "fp16"), (T4, "fp16"), (P100, "fp32"), (CPU, "fp32")]
)
def test_auto_precision_is_bf16_only_from_ampere(facts, auto):
    """torch.cuda.is_bf16_supported() says True on a V100 (it counts emulation); capability 8.0 is the test."""
    assert hardware.choose_precision("auto", facts) == auto
    assert hardware.choose_precision("fp32", facts) == "fp32"  # never silently TF32


@pytest.mark.parametrize("facts, asked", [(V100, "bf16"), (T4, "tf32"), (CPU, "tf32")])
def test_precisions_a_device_cannot_run_fast_are_one_line(facts, asked):
    with pytest.raises(SystemExit) as e:
        hardware.choose_precision(asked, facts)
    assert str(e.value).startswith("error: --precision " + asked) and "\n" not in str(e.value)
    assert hardware.choose_precision("bf16", H100) == "bf16" and hardware.choose_precision("tf32", A100) == "tf32"


def test_tf32_only_when_asked():
    hardware.set_matmul_precision("tf32")
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    hardware.set_matmul_precision("fp32")
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("local_rank, visible, index", [(0, 8, 0), (5, 8, 5), (3, 1, 0), (0, 1, 0)])
def test_device_from_local_rank_or_the_only_gpu_this_process_sees(local_rank, visible, index):
    assert hardware.device_index(local_rank, visible) == index


def test_a_process_that_sees_one_gpu_keeps_its_place_on_the_node():
    """SLURM's --gpus-per-task=1: each of 8 processes sees one GPU. DeepSpeed must read LOCAL_RANK 0 (its only GPU);
    the scripts keep the process's place on its node, so the data is prepared by one process a node, not by all."""
    environ = {"RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}
    assert distributed.launch_env(environ, visible=1) == (11, 3, 16) and environ["LOCAL_RANK"] == "0"
    environ = {"RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}
    assert distributed.launch_env(environ, visible=8) == (11, 3, 16) and environ["LOCAL_RANK"] == "3"


def test_more_processes_than_gpus_is_one_line():
    with pytest.raises(SystemExit, match="LOCAL_RANK 4 but sees 4 GPUs"):
        hardware.device_index(4, 4)


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),
        ("NVIDIA H100 80GB HBM3", "tf32", 495),
        ("NVIDIA H100 80GB HBM3", "fp32", 67),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "fp32", 60),
        ("NVIDIA H200", "bf16", 989),
        ("NVIDIA H200 NVL", "bf16", 835),
        ("NVIDIA GH200 480GB", "bf16", 989),
        ("NVIDIA B200", "bf16", 2250),
        ("NVIDIA H800", "bf16", 989),
        ("NVIDIA H800 PCIe", "bf16", 756),
        ("NVIDIA A100-SXM4-40GB", "bf16", 312),
        ("NVIDIA A100 80GB PCIe", "tf32", 156),
        ("NVIDIA A800-SXM4-80GB", "bf16", 312),
        ("NVIDIA L40S", "bf16", 362),
        ("NVIDIA L40", "bf16", 181),
        ("NVIDIA L20", "bf16", 119.5),
        ("NVIDIA L4", "bf16", 121),
        ("NVIDIA A10G", "bf16", 70),
        ("NVIDIA A10", "bf16", 125),
        ("NVIDIA RTX 6000 Ada Generation", "bf16", 364),
        ("NVIDIA RTX A6000", "bf16", 155),
        ("NVIDIA GeForce RTX 4090", "bf16", 165),
        ("Tesla V100-SXM2-16GB", "fp16", 125),
        ("Tesla V100-PCIE-32GB", "fp16", 112),
        ("Tesla V100S-PCIE-32GB", "fp16", 130),
        ("Tesla T4", "fp16", 65),
        ("NVIDIA RTX A1000 Laptop GPU", "bf16", None),  # not an A100
        ("Tesla V100-SXM2-16GB", "tf32", None),
        ("NVIDIA GB200", "bf16", None),
    ],
)
def test_peak_flops_match_device_names_exactly(name, precision, peak):
    found = hardware.peak_tflops(name, precision)
    assert (found[0] if found else None) == peak
    if found:
        assert name in found[1]  # the line that says, once, which peak MFU uses


def test_mfu_counts_untied_input_embeddings_out():
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

    opt = AutoModelForCausalLM.from_config(
        OPTConfig(
            vocab_size=100,
            hidden_size=16,
            num_hidden_layers=1,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=16,
        )
    )
    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=100,
            hidden_size=16,
            num_hidden_layers=1,
            intermediate_size=32,
            num_attention_heads=2,
            tie_word_embeddings=False,
        )
    )
    total = lambda m: sum(p.numel() for p in m.parameters())
    positions = opt.model.decoder.embed_positions.weight.numel()
    assert hardware.matmul_params(opt) == total(opt) - positions  # tied: the shared matrix counts once, as the head
    assert hardware.matmul_params(llama) == total(llama) - 100 * 16  # untied: the input embedding is a lookup
    config = argparse.Namespace(num_hidden_layers=2, hidden_size=16)
    assert hardware.flops_per_token(config, 1000, attended=50) == 6 * 1000 + 12 * 2 * 16 * 50
    # frozen weights (LoRA) need no weight gradient: 4N + 2 x the trainable ones
    for p in llama.parameters():
        p.requires_grad_(p.dim() == 1)  # only the norms train here
    norms = sum(p.numel() for p in llama.parameters() if p.dim() == 1)
    assert hardware.matmul_params(llama, trainable_only=True) == norms
    assert hardware.flops_per_token(config, 1000, 50, trainable=10) == 4 * 1000 + 2 * 10 + 12 * 2 * 16 * 50


def test_attention_implementation_for_the_hardware():
    assert hardware.attention(H100, "bf16", True, True) == "flash_attention_2"
    assert hardware.attention(H100, "fp32", True, True) is None  # FlashAttention runs in 16 bits only
    assert hardware.attention(V100, "fp16", True, True) is None  # FlashAttention-2 needs Ampere
    assert hardware.attention(H100, "bf16", False, True) is None
    assert hardware.attention(H100, "bf16", True, False) is None
    assert blocks.attention_layout("flash_attention_2") == "varlen" and blocks.attention_layout("sdpa") == "bool"
    assert blocks.attention_layout("eager") == "additive" and blocks.attention_layout(None) == "bool"


def test_varlen_batches_lay_documents_end_to_end(tmp_path, tiny):
    """What FlashAttention's varlen path is given: one padding-free row, a boundary at every document."""
    from helpers import data_args, documents_of
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    train, _ = data.prepare(data_args(tiny["chats"], block_size=128), tokenizer, seed=0)
    rows = [i for i in range(len(train)) if len(documents_of(train, i)) >= 2][:3]  # blocks of several documents
    flash = argparse.Namespace(_attn_implementation="flash_attention_2")
    inputs, (labels, index, *_) = train.batch(rows, cpu_process(tokenizer.pad_token_id, flash))
    padded, (padded_labels, *_) = train.batch(rows, cpu_process(tokenizer.pad_token_id, None))
    real = torch.arange(padded["input_ids"].shape[1])[None] < torch.as_tensor(train.lengths[rows])[:, None]
    assert inputs["input_ids"].shape == (1, int(train.lengths[rows].sum())) and "attention_mask" not in inputs
    assert inputs["input_ids"][0].tolist() == padded["input_ids"][real].tolist()
    assert labels[0].tolist() == padded_labels[real].tolist()
    cu = inputs["cu_seq_lens_q"].tolist()
    lengths = [len(d) for i in rows for d in documents_of(train, i)]  # the documents packed, end to end
    assert cu == np.cumsum([0] + lengths).tolist() and inputs["max_length_q"] == max(lengths)
    positions = inputs["position_ids"][0].tolist()
    assert positions == [p for n in lengths for p in range(n)]  # restarting at every document
    assert inputs["cu_seq_lens_q"].dtype == torch.int32


def test_batches_go_to_a_gpu_pinned_and_asynchronously(tiny, monkeypatch):
    """A GPU run's batch: each array pinned, then copied without the host waiting for the device's queue (a pageable
    copy waits for the previous micro-step's backward). The copies are recorded, not made (no GPU here)."""
    from helpers import data_args
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    train, _ = data.prepare(data_args(tiny["chats"], block_size=128), tokenizer, seed=0)
    copies = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: copies.append("pinned") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: copies.append((args, kwargs)) or self)
    flash = argparse.Namespace(_attn_implementation="flash_attention_2")  # no mask: nothing made on the device
    train.batch([0, 1], cpu_process(tokenizer.pad_token_id, flash, "cuda"))
    assert copies == ["pinned", ((torch.device("cuda"),), {"non_blocking": True})] * 3  # targets, inputs, boundaries
    copies.clear()
    train.batch([0, 1], cpu_process(tokenizer.pad_token_id, flash))
    assert copies == [((torch.device("cpu"),), {})] * 3
    assert hardware.pinned_copies("cuda") and not hardware.pinned_copies("cpu") and not hardware.pinned_copies("mps")


def test_random_state_is_this_process_and_its_own_device():
    state = checkpoints.rng_state(torch.device("cpu"))
    assert state["cuda"] is None and state["cpu"].equal(torch.get_rng_state())
    before = torch.rand(3)
    checkpoints.set_rng_state({"cpu": state["cpu"], "cuda": [torch.zeros(1)] * 8}, torch.device("cpu"))  # 8 saved GPUs
    assert torch.rand(3).equal(before)


@pytest.mark.parametrize("fused, where", [(True, "meta"), (False, "cpu")])
def test_a_universal_resume_puts_each_step_where_adamw_reads_it(fused, where):
    """DeepSpeed's universal load leaves `step` on the CPU, shared by every ZeRO-3 partition; a fused AdamW reads it
    on the parameter's device (here the meta device stands in for a GPU)."""
    params = [torch.empty(4, device="meta"), torch.empty(2, device="meta")]
    shared = torch.tensor(7.0, dtype=torch.float64)  # as loaded: on the CPU, one tensor for all
    optimizer = argparse.Namespace(
        param_groups=[{"params": [], "fused": fused, "weight_decay": 0.0}],
        state={p: {"step": shared, "exp_avg": torch.empty(p.shape, device="meta")} for p in params},
    )
    mend_fixes.place_optimizer_steps(optimizer)
    steps = [optimizer.state[p]["step"] for p in params]
    assert all(s.device.type == where and s.dtype == torch.float32 for s in steps)
    assert steps[0] is not steps[1] and steps[0] is not shared
    for p, state in optimizer.state.items():  # every state tensor on its parameter's device, as a fused step needs
        assert all(t.device == p.device for k, t in state.items() if k != "step" or fused)
    if where == "cpu":
        assert steps[0].item() == 7.0


def test_mfu_counts_the_experts_a_token_goes_through_and_the_queries_width():
    """A mixture of experts: each token goes through 2 of the 4 experts, so half of their fused weights count (MFU
    against the active parameters, not all); the attention term uses heads x head size (Gemma 2, gpt-oss: not the
    hidden size)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    mixtral = AutoModelForCausalLM.from_config(
        MixtralConfig(
            vocab_size=100,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    experts = sum(p.numel() for p in mixtral.parameters() if p.dim() == 3)
    dense = sum(p.numel() for p in mixtral.parameters()) - 100 * 16  # the input embedding is a lookup (untied)
    assert experts == 4 * (2 * 32 * 16 + 16 * 32) and hardware.experts_per_token(mixtral.config) == (4, 2)
    assert hardware.matmul_params(mixtral) == dense - experts // 2
    assert hardware.matmul_params(mixtral, all_experts=True) == dense
    assert hardware.flops_per_token(mixtral.config, 1000, attended=50) == 6 * 1000 + 12 * 1 * (4 * 8) * 50


def test_a_model_that_names_its_own_flash_kernels_does_not_get_flash_attention_2():
    """gpt-oss lists hub kernels that keep its attention sinks: transformers would swap FlashAttention-2 for one of
    them (a download, and a package); FlashAttention-2 itself would drop the sinks. It keeps transformers' default."""
    sinks = ["kernels-community/vllm-flash-attn3"]
    assert hardware.attention(H100, "bf16", True, True, sinks) is None
    assert hardware.attention(H100, "bf16", True, True, ["flash_attention_2", *sinks]) == "flash_attention_2"
    assert blocks.attention_layout("kernels-community/vllm-flash-attn3") == "varlen"  # a flash kernel's layout


def test_mixtures_of_experts_are_zero3_leaf_modules_found_by_their_structure(tmp_path):
    """Under ZeRO-3 each MoE block (router and experts) is gathered at once: OLMoE's and gpt-oss's blocks, which
    DeepSpeed 0.19.8 does not name, are found by their fused experts; a file's own leaf_module list wins."""
    import json

    from transformers import GptOssConfig, OlmoeConfig

    small = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=2,
    )
    olmoe, gpt_oss = OlmoeConfig(**small, num_experts=4), GptOssConfig(**small, num_local_experts=4, head_dim=8)
    assert zero_config.moe_blocks(zero_config.meta_model(olmoe))[-1:] == ["OlmoeSparseMoeBlock"]
    assert zero_config.moe_blocks(zero_config.meta_model(gpt_oss))[-1:] == ["GptOssMLP"]
    args = load_script("zero-optimization.py").parse_args(
        ["--zero-stage", "3", "--precision", "fp32", "--batch-size", "1", "--lr", "1e-3"]
    )
    leaves = zero_config.deepspeed_config(args, 2, 10, 1, olmoe)["zero_optimization"]["leaf_module"]["classes"]
    assert "OlmoeSparseMoeBlock" in leaves
    own = json.loads(open(zero_config.DEFAULT_CONFIG).read())
    own["zero_optimization"]["leaf_module"] = {"classes": []}  # off
    (tmp_path / "ds.json").write_text(json.dumps(own))
    own_config = zero_config.deepspeed_config(args.resolved(deepspeed=str(tmp_path / "ds.json")), 2, 10, 1, olmoe)
    assert own_config["zero_optimization"]["leaf_module"] == {"classes": []}


def test_a_mixture_of_experts_computes_its_experts_in_the_runs_16_bits(tmp_path, monkeypatch):
    """single-gpu.py's bf16 is autocast over fp32 weights, which transformers' grouped_mm experts do not follow: they
    cast the tokens to the fp32 weights (on a GPU, torch's fp32 fallback: a loop over the experts, host syncs). With
    the experts' kernel load_causal_lm picks for such a run, the experts' matmuls take bf16 operands and the fp32
    weights get fp32 gradients; the exported config names no kernel of ours."""
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig

    from finetune import models

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert (
        hardware.experts_implementation("bf16", 4)
        == hardware.experts_implementation("fp16", 4)
        == "grouped_mm_autocast"
    )
    assert hardware.experts_implementation("fp32", 4) is None and hardware.experts_implementation("bf16", None) is None
    seen, grouped_mm = [], torch.nn.functional.grouped_mm
    monkeypatch.setattr(
        torch.nn.functional,
        "grouped_mm",
        lambda a, b, **kwargs: seen.append((a.dtype, b.dtype)) or grouped_mm(a, b, **kwargs),
    )
    operands = {}
    for precision in ("fp32", "bf16"):  # fp32: transformers' default kernel, as every run had it
        settings = flags.defaults(model=str(tmp_path), precision=precision).model
        model = models.load_causal_lm(settings, AutoConfig.from_pretrained(tmp_path), torch.device("cpu"))
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=torch.arange(16).view(2, 8)).logits
        logits.float().sum().backward()
        operands[precision] = set(seen)
    assert operands == {"fp32": {(torch.float32, torch.float32)}, "bf16": {(torch.bfloat16, torch.bfloat16)}}
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == experts.gate_up_proj.grad.dtype == torch.float32
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0
    assert "grouped_mm_autocast" not in model.config.to_json_string()


def test_a_gpu_runs_profile_records_its_kernels():
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    assert progress.profiled(True) == ([cpu, cuda], "self_device_time_total")
    assert progress.profiled(False) == ([cpu], "self_cpu_time_total")


@pytest.mark.parametrize(
    "environ, usable, node, threads",
    [
        ({"LOCAL_SIZE": "2"}, 2, 2, 1),  # deepspeed, 2 ranks on 2 cores: one thread each, not two
        ({"LOCAL_WORLD_SIZE": "4"}, 64, 64, 16),  # torchrun's variable (with OMP_NUM_THREADS unset by the user)
        ({"LOCAL_SIZE": "8"}, 4, 4, 1),  # more ranks than cores: still one
        ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, 2, 2, None),  # the user's choice stands
        ({"LOCAL_SIZE": "2"}, 8, 64, None),  # pinned by the launcher (srun, numactl) to its share already
        ({}, 2, 2, None),  # one process: every core
    ],
)
def test_ranks_on_a_node_share_its_cores(environ, usable, node, threads):
    assert distributed.cpu_threads(environ, usable, node) == threads


def test_the_share_reaches_the_trainers_accelerate(monkeypatch):
    """Under the deepspeed launcher (LOCAL_SIZE, no LOCAL_WORLD_SIZE): accelerate keeps the share where it finds
    OMP_NUM_THREADS, and otherwise sets the node's cores on each rank."""
    from accelerate.utils.environment import get_int_from_env

    cores = len(os.sched_getaffinity(0))
    if cores != os.cpu_count():
        pytest.skip("this process is pinned to some of the cores: nothing to share")
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        distributed.launch_env(visible=0)
        assert torch.get_num_threads() == get_int_from_env(["OMP_NUM_THREADS"], 0) == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)
