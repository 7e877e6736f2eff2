"""--tiled-mlp and --offload-activations (finetune/long_sequences.py): the losses, gradient norms and weights of the
run without them, alone and together, with dropout, with LoRA, under ZeRO-3 on 2 ranks and with sequence
parallelism; each parameter's gradient handed over once; the host copies taken back in the backward's order; a
mixture of experts refused in one line."""

import pytest
import torch
from helpers import (
    assert_close_losses,
    assert_same_weights,
    base_args,
    build,
    check,
    dropout_model,
    launch,
    load_script,
    results,
    weights,
)
from transformers import AutoTokenizer

from finetune import long_sequences

single = load_script("single-gpu.py")
ZERO = "zero-optimization.py"
BOTH = ["--tiled-mlp", "--offload-activations"]


def args(tiny, model, out, **more):
    """Chats in blocks of 64, 4 a micro-step, 2 micro-steps: 256 tokens a micro-step, 8 tiles of the 32-wide models."""
    return base_args(
        tiny,
        out,
        **{"--model": str(model), "--dataset": tiny["chats"], "--block-size": 64, "--batch-size": 4, "--grad-accum": 2}
        | more,
    )


def assert_same_run(a, b, atol=1e-5):
    one, two = results(a), results(b)
    assert_close_losses(one["losses"], two["losses"])
    assert_close_losses(one["grad_norms"], two["grad_norms"])
    assert_same_weights(weights(a / "final"), weights(b / "final"), atol=atol)


@pytest.fixture(scope="module")
def llama(tiny, tmp_path_factory):
    """A tiny Llama: its MLP a module (gate, up and down projections)."""
    folder = tmp_path_factory.mktemp("llama")
    return build("llama", AutoTokenizer.from_pretrained(tiny["model"]), folder / "model")


@pytest.fixture(scope="module")
def opt(tiny, tmp_path_factory):
    """The tiny OPT (its MLP fc1, activation and fc2 written inside the layer) with dropout 0.1, whose masks the
    recomputation must draw as the forward did."""
    return dropout_model(tiny, tmp_path_factory.mktemp("opt") / "model")


@pytest.fixture(scope="module")
def checkpointed(tiny, opt, llama, tmp_path_factory):
    """The runs without the options, gradient checkpointing on, in one process: the OPT and the Llama, full and
    LoRA."""
    root = tmp_path_factory.mktemp("checkpointed")
    runs = {}
    for name, model, extra in (
        ("opt", opt, []),
        ("llama", llama, []),
        ("llama-lora", llama, ["--lora-rank", "8", "--lora-alpha", "16"]),
    ):
        single.main(args(tiny, model, root / name) + ["--gradient-checkpointing"] + extra)
        runs[name] = root / name
    return runs


@pytest.mark.parametrize("options", [["--tiled-mlp"], ["--offload-activations"], BOTH], ids=" ".join)
@pytest.mark.parametrize("name", ["opt", "llama", "llama-lora"])
def test_one_process_trains_as_without_them(tiny, opt, llama, checkpointed, tmp_path, name, options):
    model = opt if name == "opt" else llama
    lora = ["--lora-rank", "8", "--lora-alpha", "16"] if "lora" in name else []
    checkpointing = [] if "--offload-activations" in options else ["--gradient-checkpointing"]
    single.main(args(tiny, model, tmp_path) + options + lora + checkpointing)
    assert_same_run(checkpointed[name], tmp_path)
    ran = results(tmp_path)["ran"]  # read from the model
    assert (ran["tiled_mlp"], ran["offload_activations"]) == (
        "--tiled-mlp" in options,
        "--offload-activations" in options,
    )


def test_zero3_on_2_ranks_and_with_lora(tiny, llama, checkpointed, tmp_path):
    """ZeRO-3 (each layer gathered whole; with LoRA each linear layer apart, its hooks inside the tiles): every
    parameter's gradient reaches DeepSpeed's hook once a backward pass, as one process computes it."""
    for name, extra in (("llama", []), ("llama-lora", ["--lora-rank", "8", "--lora-alpha", "16"])):
        out = tmp_path / name
        argv = args(tiny, llama, out, **{"--batch-size": 2, "--zero-stage": 3}) + BOTH + extra + ["--deepspeed"]
        check(launch("forked", ZERO, argv))
        assert results(out)["world_size"] == 2
        assert_same_run(checkpointed[name], out, atol=1e-4)


def test_with_sequence_parallelism(tiny, tmp_path):
    """Each sequence over 2 ranks (Ulysses, ZeRO-2): the tiles are of each rank's half of the tokens."""
    model = build("mistral", AutoTokenizer.from_pretrained(tiny["model"]), tmp_path / "mistral", num_key_value_heads=1)
    single.main(args(tiny, model, tmp_path / "one") + ["--gradient-checkpointing"])
    argv = args(tiny, model, tmp_path / "two", **{"--zero-stage": 2}) + BOTH + ["--sequence-parallel", "2"]
    check(launch("forked", ZERO, argv + ["--deepspeed"]))
    assert_same_run(tmp_path / "one", tmp_path / "two", atol=1e-4)


@pytest.mark.quick
def test_a_tiled_block_hands_each_gradient_over_once_and_matches_the_untiled_one():
    """An MLP over 7 tiles of 3 rows (the last of 2): the input's gradient and each weight's equal those of the plain
    MLP; each weight's gradient is summed over the tiles with DeepSpeed told it is not ready but at the last one
    (else it would reduce each tile's and refuse the second)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()
    x = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(20, 8, dtype=torch.float64)
    torch.autograd.backward(mlp(x), grad)
    plain = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    ready = [[] for _ in range(4)]
    for i, p in enumerate(mlp.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, i=i: ready[i].append(getattr(p, "ds_grad_is_ready", True)))
    block = long_sequences.TiledForward(lambda t: torch.nn.Sequential.forward(mlp, t), [mlp], count=7)
    torch.autograd.backward(block(x), grad)
    tiled = [x.grad] + [p.grad for p in mlp.parameters()]
    assert ready == [[False] * 6 + [True]] * 4
    for a, b in zip(plain, tiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.quick
def test_the_layers_inputs_come_back_in_the_backwards_order():
    """Three layers' inputs kept: the backward takes the last first, and taking one starts fetching the one before."""
    host = long_sequences.HostCopies()
    kept = [host.put(torch.full((2,), float(i))) for i in range(3)]
    assert host.take(kept[2]).tolist() == [2.0, 2.0] and kept[1].back is not None and kept[0].back is None
    assert kept[2].back is None and kept[2].host is None  # let go of once taken: the node outlives its backward
    assert host.take(kept[1]).tolist() == [1.0, 1.0] and host.take(kept[0]).tolist() == [0.0, 0.0]
    assert host.kept == []
    abandoned = host.put(torch.ones(2))  # a forward never backpropagated: forgotten with its node
    del abandoned
    host.put(torch.ones(2))
    assert len(host.kept) == 1


@pytest.mark.quick
def test_a_pinned_buffer_is_reused_by_any_shorter_input_of_its_type():
    """The blocks' widths vary from batch to batch: a free buffer serves any input it holds, the smallest first,
    and one of another type or too short none."""
    free = [torch.empty(10), torch.empty(6), torch.empty(8, dtype=torch.bfloat16)]
    assert long_sequences.fitting(free, 5, torch.float32).numel() == 6 and len(free) == 2
    assert long_sequences.fitting(free, 11, torch.float32) is None
    assert long_sequences.fitting(free, 7, torch.bfloat16).numel() == 8 and [b.numel() for b in free] == [10]


def test_a_mixture_of_experts_is_refused_in_one_line(tiny, tmp_path):
    model = build("mixtral", AutoTokenizer.from_pretrained(tiny["model"]), tmp_path / "mixtral", num_local_experts=4)
    with pytest.raises(SystemExit, match="--tiled-mlp: this model's MLP is a mixture of experts"):
        single.main(args(tiny, model, tmp_path / "run") + ["--tiled-mlp"])


@pytest.mark.quick
def test_a_tiled_layer_keeps_no_byte_of_the_mlps_width():
    """memory.layer_bytes counts a layer with --tiled-mlp as it runs: per unit of the MLP's width a Llama layer keeps
    8 bytes in bf16 (gate, up, SiLU, product) and OPT's 2 (ReLU), and tiled none (its input only)."""
    from transformers import LlamaConfig, OPTConfig

    from finetune.internals import memory

    llama = lambda width: LlamaConfig(  # noqa: E731
        hidden_size=512, intermediate_size=width, num_attention_heads=8, num_key_value_heads=2, vocab_size=256
    )
    opt = lambda width: OPTConfig(  # noqa: E731
        hidden_size=256, ffn_dim=width, num_attention_heads=4, word_embed_proj_dim=256, vocab_size=256
    )
    for config, per_width in ((llama, 8), (opt, 2)):
        for tiled, expected in ((False, per_width), (True, 0)):
            wide, narrow = (memory.layer_bytes(config(w), "bf16", tiled=tiled)[0] for w in (2048, 1024))
            assert (wide - narrow) / 1024 == expected, (config, tiled)


def test_the_plan_holds_the_host_copies_a_run_makes(llama):
    """The host memory --offload-activations needs, planned (plan.layer_inputs_bytes), is what a run's forward puts
    there: each layer's input; the backward takes every one back."""
    from transformers import AutoModelForCausalLM

    import plan

    model = AutoModelForCausalLM.from_pretrained(llama).train()
    host = long_sequences.offload_layer_inputs(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    loss = model(input_ids=ids, labels=ids).loss
    kept = sum(ref().host.nbytes for ref in host.kept)
    assert len(host.kept) == model.config.num_hidden_layers
    assert kept == plan.layer_inputs_bytes(3, 40, model.config, "fp32") > 0
    loss.backward()
    assert host.kept == []


@pytest.mark.quick
def test_the_plan_of_long_blocks_on_one_80_gb_gpu():
    """At 64k tokens: the options cut the planned GPU peak of Llama-3.2-1B's full fine-tuning (single-gpu.py) and of
    Llama-3.1-8B's QLoRA, and lengthen the longest block past ALST's and Unsloth's reports (host memory counted:
    128 GiB); the host holds the layers' inputs."""
    from test_plan import plan_args

    import plan

    def row(model, *extra):
        base = (("batch_size", 1), ("block_size", 65536), ("cpu_memory", 128), ("loss_chunk", 1024))
        rows = plan.plan(plan_args(model, 1, 80, *base, *extra))[2]
        return next(r for r in rows if r["option"] == "ZeRO-0")

    on = (("offload_activations", True), ("tiled_mlp", True))
    for model, extra, cut, longest in (
        ("meta-llama/Llama-3.2-1B", (), 0.3, 512 * 1024),
        ("meta-llama/Llama-3.1-8B", (("lora_rank", 16), ("load_in_4bit", True)), 0.6, 350_000),
    ):
        before, after = row(model, ("gradient_checkpointing", True), *extra), row(model, *on, *extra)
        assert after["peak_bytes_per_gpu"] < (1 - cut) * before["peak_bytes_per_gpu"], (model, before, after)
        assert after["longest_block"] >= longest > before["longest_block"], (model, before, after)
        config = plan.load_config(model)
        assert after["cpu_bytes_per_node"] - before["cpu_bytes_per_node"] == plan.layer_inputs_bytes(
            1, 65536, config, "bf16", autocast=not extra
        )
