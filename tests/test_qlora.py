"""QLoRA (--load-in-4bit, --load-in-8bit): LoRA over a base bitsandbytes holds in 4 or 8 bits. Its gradients are
those of the same model with the base rounded to NF4 and back, computed with stock transformers, peft and
bitsandbytes' own functions; ZeRO-3 (offload, checkpointing) on 2 ranks gives the one process's run; an eval between
steps changes nothing (bitsandbytes' CPU repack would); the export is a plain model; resume; plan = counted bytes."""

import json
import math
import sys

import pytest
import torch
from helpers import (
    assert_close_losses,
    assert_resumed,
    base_args,
    check,
    crash_after_first_checkpoint,
    documents_loss,
    launch,
    load_script,
    results,
    weights,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import plan
from finetune import quantization, training
from finetune.internals import demo

single = load_script("single-gpu.py")
# bitsandbytes packs 4-bit weights in blocks of 64 inputs: a model 64 wide (the tiny one is 32)
QLORA = {
    "--lora-rank": 8,
    "--lora-alpha": 16,
    "--lr": 5e-3,
    "--load-in-4bit": "",
    "--block-size": 64,
    "--batch-size": 4,
    "--grad-accum": 2,
}


def qlora_args(model, tiny, out, **more):
    argv = base_args(tiny, out, **{"--model": model, "--dataset": tiny["chats"], **QLORA, **more})
    return [a.removesuffix("=") if a.startswith("--load-in") else a for a in argv]  # a flag without a value


@pytest.fixture(scope="module")
def wide(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide") / "model"
    demo.make_demo_lm(
        folder, single.models.load_tokenizer(tiny["model"]), hidden=64, layers=2, heads=2, positions=64, seed=0
    )
    return str(folder)


@pytest.fixture(scope="module")
def qlora(tiny, wide, tmp_path_factory):
    """One process, an eval after every step (each one a forward without gradients in eval mode)."""
    out = tmp_path_factory.mktemp("qlora") / "run"
    single.main(qlora_args(wide, tiny, out, **{"--eval-every": 1}))
    return out


def nf4_round_trip(folder, dtype=torch.float64):
    """The stock model with every weight from_pretrained would quantize (each linear layer but the tied head) rounded
    to NF4 with double quantization and back, by bitsandbytes' functions alone."""
    import bitsandbytes.functional as F

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not model.get_output_embeddings():
            packed, state = F.quantize_4bit(module.weight.data, quant_type="nf4", compress_statistics=True)
            module.weight.data = F.dequantize_4bit(packed, state)
    return model.to(dtype)


@pytest.mark.quick
def test_the_gradients_are_those_of_the_dequantized_base(tiny, wide, qlora):
    """Step 1's loss and gradient norm against the same model with its base rounded to NF4 (float64, each document
    alone, the adapters as peft makes them from the run's seed). The loss falls; counts are of values, not bytes."""
    from peft import LoraConfig, get_peft_model

    r = results(qlora)
    argv = qlora_args(wide, tiny, qlora)
    torch.manual_seed(42)  # the run's --seed, before the adapters are made
    model = get_peft_model(
        nf4_round_trip(wide, torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
    ).double()
    config = single.parse_args(argv)
    train = single.data.prepare(config.data, single.models.load_tokenizer(wide), seed=config.train.seed)[0]
    first = training.GlobalBatches(len(train), 8, 42)(0)
    total, _ = documents_loss(model, argv, "train", first.tolist())
    loss = total / int(train.predicted[first].sum())
    loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None)).item()
    assert abs(r["losses"][0] - loss.item()) < 1e-6 * loss.item()
    assert abs(r["grad_norms"][0] - norm) < 1e-5 * norm, (r["grad_norms"][0], norm)
    assert r["losses"][-1] < r["losses"][0] - 0.05
    stock = AutoModelForCausalLM.from_pretrained(wide)
    assert r["total_params"] == sum(p.numel() for p in stock.parameters()) + r["trainable_params"]
    assert r["trainable_params"] == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.quick
def test_the_export_is_a_plain_model_of_the_dequantized_base(tiny, wide, qlora, monkeypatch):
    """final/ loads with stock transformers while bitsandbytes cannot be imported; its weights are peft's merge of
    final/adapter into the base rounded to NF4 and back, in fp32; its eval loss is the trained model's (fp32: 1e-5)."""
    from peft import PeftModel

    assert "quantization_config" not in json.loads((qlora / "final" / "config.json").read_text())
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails
    exported = AutoModelForCausalLM.from_pretrained(qlora / "final", dtype=torch.float64)
    monkeypatch.undo()
    assert type(exported.model.decoder.layers[0].fc1) is torch.nn.Linear
    merged = PeftModel.from_pretrained(nf4_round_trip(wide, torch.float32), qlora / "final" / "adapter")
    merged = merged.merge_and_unload().state_dict()
    final = weights(qlora / "final")
    assert all((merged[k] - v).abs().max() <= 1e-6 for k, v in final.items())
    with torch.no_grad():
        total, count = documents_loss(exported.eval(), qlora_args(wide, tiny, qlora), "eval")
    assert abs(total.item() / count - results(qlora)["eval_loss"]) < 1e-5 * results(qlora)["eval_loss"]


@pytest.mark.quick
def test_resume_gives_the_uninterrupted_run(tiny, wide, qlora, tmp_path):
    out = tmp_path / "run"
    argv = qlora_args(wide, tiny, out, **{"--eval-every": 1})
    single.main(argv)
    crash_after_first_checkpoint(out)
    with pytest.raises(SystemExit, match="was written with --load-in-4bit; resume with it"):
        single.main([a for a in argv if a != "--load-in-4bit"] + ["--resume"])
    single.main(argv + ["--resume"])
    assert_resumed(out)
    assert results(out)["losses"] == results(qlora)["losses"]
    assert results(out)["grad_norms"] == results(qlora)["grad_norms"]


def test_zero3_on_two_ranks_gives_the_one_process_run(tiny, wide, qlora, tmp_path):
    """ZeRO-3 with CPU offload and gradient checkpointing, evaluated at the end only: the losses, gradient norms and
    adapters of the one process that evaluated after every step; also resumed on one rank (the quantized layers keep
    the base they were loaded with). Each run's model states as plan.py plans them."""
    out = tmp_path / "run"
    argv = qlora_args(wide, tiny, out, **{"--batch-size": 2, "--zero-stage": 3, "--offload": "cpu", "--eval-every": 0})
    check(launch("forked", "zero-optimization.py", argv + ["--deepspeed", "--gradient-checkpointing"]))
    mine, ref = results(out), results(qlora)
    for resumed in (False, True):  # then resumed on one rank, from the universal form of step 2's checkpoint
        if resumed:
            crash_after_first_checkpoint(out)
            check(launch("forked-python", "zero-optimization.py", argv + ["--deepspeed", "--batch-size=4", "--resume"]))
            assert_resumed(out)
        assert_close_losses(ref["losses"], results(out)["losses"])
        assert_close_losses(ref["grad_norms"], results(out)["grad_norms"])
        a, b = (load_file(str(o / "final" / "adapter" / "adapter_model.safetensors")) for o in (out, qlora))
        assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
        final, ref_final = weights(out / "final"), weights(qlora / "final")
        assert all((final[k] - ref_final[k]).abs().max() <= 1e-5 for k in ref_final)
    for r, option in ((ref, "ZeRO-0"), (mine, "ZeRO-3 + CPU offload")):
        planned = plan.plan(plan_args(wide, r["world_size"], lora_rank=8, load_in_4bit=True, precision="fp32"))[2]
        planned = next(row for row in planned if row["option"] == option)["held_after_step_bytes_per_rank"]
        for counted in r["model_state_bytes_per_rank"]:
            assert abs(planned - counted) <= 1e-3 * counted, (option, planned, counted)


def plan_args(model, gpus, **flags):
    import argparse

    values = {
        "model": model,
        "gpus": gpus,
        "nodes": 1,
        "gpu_memory": 80,
        "cpu_memory": None,
        "precision": "bf16",
        "batch_size": 1,
        "block_size": 2048,
        "gradient_checkpointing": True,
        "offload_activations": False,
        "tiled_mlp": False,
        "loss_chunk": 1024,
        "lora_rank": 16,
        "lora_targets": "all-linear",
        "sequence_parallel": 1,
        "load_in_4bit": False,
        "load_in_8bit": False,
    }
    return argparse.Namespace(**{**values, **flags})


def test_bf16_under_zero2_gives_the_one_process_bf16_run(tiny, wide, tmp_path):
    """The packed weights are stored in bf16 (bnb_4bit_quant_storage), which the engine's cast to bf16 leaves as
    they are: the same steps as one process, to bf16's rounding."""
    one, two = tmp_path / "one", tmp_path / "two"
    single.main(qlora_args(wide, tiny, one, **{"--precision": "bf16", "--eval-every": 0}))
    argv = qlora_args(wide, tiny, two, **{"--precision": "bf16", "--batch-size": 2, "--zero-stage": 2})
    check(launch("forked", "zero-optimization.py", argv + ["--deepspeed"]))
    assert results(two)["ran"]["engine_precision"] == "bf16"
    assert_close_losses(results(one)["losses"], results(two)["losses"], rtol=1e-3)


@pytest.mark.quick
def test_eight_bits(tiny, wide, tmp_path):
    """LLM.int8 (its activations are rounded too: no exact reference): it trains, and the export is a plain model."""
    out = tmp_path / "run"
    argv = [a for a in qlora_args(wide, tiny, out, **{"--eval-every": 0}) if a != "--load-in-4bit"]
    single.main(argv + ["--load-in-8bit"])
    r = results(out)
    assert r["losses"][-1] < r["losses"][0] - 0.05 and r["total_params"] == results(out)["total_params"]
    exported = AutoModelForCausalLM.from_pretrained(out / "final")
    assert exported.model.decoder.layers[0].fc1.weight.dtype == torch.float32


@pytest.mark.quick
def test_the_plan_of_a_4_bit_base(tmp_path):
    """bitsandbytes' own bytes for a weight are the planner's; Llama-3-8B QLoRA fits a 24 GB GPU (on a 16 GB one its
    16-bit LoRA does not, QLoRA does); 70B QLoRA fits two 80 GB GPUs under ZeRO-3, its 16-bit LoRA does not, and not
    two 40 GB ones (transformers loads the whole quantized model onto each GPU); 8 bits never under ZeRO-3."""
    import bitsandbytes.functional as F
    from transformers import LlamaConfig

    for shape in ((4096, 4096), (14336, 4096), (128, 96)):
        packed, state = F.quantize_4bit(
            torch.randn(shape, dtype=torch.bfloat16),
            quant_type="nf4",
            compress_statistics=True,
            quant_storage=torch.bfloat16,
        )
        stored = [packed, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
        n = shape[0] * shape[1]
        assert sum(t.numel() * t.element_size() for t in stored) == quantization.stored_bytes(n, 4, storage=2)
    llama = {"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192}
    for name, (hidden, layers, ffn) in {"8b": (4096, 32, 14336), "70b": (8192, 80, 28672)}.items():
        LlamaConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=ffn,
            **{**llama, "num_attention_heads": hidden // 128},
        ).save_pretrained(tmp_path / name)
    fits = lambda model, gpus, memory, **q: [
        row["option"]
        for row in plan.plan(plan_args(str(tmp_path / model), gpus, gpu_memory=memory, **q))[2]
        if row["fits"]
    ]
    assert "ZeRO-0" in fits("8b", 1, 24, load_in_4bit=True)
    assert "ZeRO-0" not in fits("8b", 1, 16) and "ZeRO-0" in fits("8b", 1, 16, load_in_4bit=True)
    assert "ZeRO-3" in fits("70b", 2, 80, load_in_4bit=True)
    assert "ZeRO-3" not in fits("70b", 2, 40, load_in_4bit=True)  # each GPU loads the whole 4-bit model first
    assert "ZeRO-3" not in fits("70b", 2, 80)
    eight = fits("8b", 2, 80, load_in_8bit=True)  # never ZeRO-3 (refused), whatever the memory
    assert "ZeRO-0" in eight and not any(option.startswith("ZeRO-3") for option in eight)


@pytest.mark.quick
def test_bad_input(tiny, wide, tmp_path, monkeypatch):
    argv = qlora_args(wide, tiny, tmp_path / "run")
    with pytest.raises(SystemExit, match="--load-in-4bit and --load-in-8bit both given; choose one"):
        single.main(argv + ["--load-in-8bit"])
    with pytest.raises(SystemExit, match="quantizes a frozen base, which only LoRA trains over: add --lora-rank"):
        single.main(argv + ["--lora-rank", "0"])
    with pytest.raises(SystemExit, match="--load-in-8bit cannot be sharded by ZeRO-3"):
        quantization.check(single.parse_args([a for a in argv if a != "--load-in-4bit"] + ["--load-in-8bit"]).model, 3)
    with pytest.raises(SystemExit, match="quantized no layer of OPTForCausalLM.*drop --load-in-4bit"):
        quantization.keep_trainable(AutoModelForCausalLM.from_pretrained(wide), "--load-in-4bit")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(SystemExit, match="--load-in-4bit needs bitsandbytes: pip install bitsandbytes=="):
        single.main(argv)
    assert not (tmp_path / "run").exists()  # nothing written


def test_dpo_over_a_4_bit_base_starts_at_ln_2_and_an_eval_between_steps_changes_nothing(tiny, wide, tmp_path):
    """Preference pairs (DPO) with QLoRA: the reference pass runs the 4-bit base in eval mode without gradients, where
    bitsandbytes' CPU repacking once struck; the first loss is ln 2 (the adapters start at zero: the model is its
    reference), the held-out DPO loss falls below it, and a run that evaluates after every step trains as one that
    evaluates at the end."""
    pairs = tmp_path / "pairs.jsonl"
    demo.make_demo_pairs(pairs, n=48, seed=3, style="strings")
    runs = {}
    for every in (1, 0):
        out = tmp_path / f"eval-every-{every}"
        runs[every] = single.main(
            qlora_args(
                wide,
                tiny,
                out,
                **{
                    "--dataset": str(pairs),
                    "--lr": 1e-3,
                    "--beta": 0.5,
                    "--max-steps": 4,
                    "--eval-every": every,
                    "--warmup-ratio": 0,
                },
            )
        )
    assert runs[1]["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert all(loss < math.log(2) for _, loss in runs[1]["evals"])  # the held-out pairs: the adapters learned
    assert runs[1]["losses"] == runs[0]["losses"] and runs[1]["rewards/accuracies"] == runs[0]["rewards/accuracies"]
    assert len(runs[1]["evals"]) == 4 and runs[1]["evals"][-1] == runs[0]["evals"][-1]
