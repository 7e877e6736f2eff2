"""LoRA (--lora-rank) through peft: the same losses and adapters in one process and under ZeRO-2/3 on 2 ranks, an
adapter saved with its full shapes (never ZeRO-3's empty shards), a merged model that stock transformers loads, the
base weights untouched, resume."""

import json

import pytest
import torch
from helpers import (
    assert_close_losses,
    assert_resumed,
    base_args,
    check,
    crash_after_first_checkpoint,
    launch,
    load_script,
    results,
    weights,
)
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

single = load_script("single-gpu.py")
LORA = {"--lora-rank": 8, "--lora-alpha": 16, "--lr": 5e-3}


def lora_args(tiny, out, **more):
    return base_args(tiny, out, **{"--dataset": tiny["chats"], "--block-size": 64, **LORA, **more})


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-reference")
    single.main(lora_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2}))
    return out


def adapter(folder):
    return load_file(str(folder / "final" / "adapter" / "adapter_model.safetensors"))


@pytest.mark.quick
def test_only_the_adapters_train_and_the_exports_load(tiny, reference):
    r = results(reference)
    assert 0 < r["trainable_params"] < 0.2 * r["total_params"]
    saved = adapter(reference)
    config = json.loads((reference / "final" / "adapter" / "adapter_config.json").read_text())
    targets = {t.split(".")[-1] for t in config["target_modules"]}  # every linear layer of attention and MLP
    assert config["r"] == 8 and targets == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
    b = [t for k, t in saved.items() if "lora_B" in k]
    assert len(b) == 2 * 6 and all(t.abs().max() > 0 for t in b)  # 6 linear layers a block; B moved from zero
    # peft's merge of the base model and the saved adapter is the exported model
    base = AutoModelForCausalLM.from_pretrained(tiny["model"])
    merged = PeftModel.from_pretrained(base, reference / "final" / "adapter").merge_and_unload().state_dict()
    final = weights(reference / "final")
    for k, v in final.items():
        assert (merged[k] - v).abs().max() <= 1e-5, k
    # the base weights did not move: what LoRA does not touch is the original model's, exactly
    original = weights(tiny["model"])
    for k in ("model.decoder.embed_tokens.weight", "model.decoder.layers.0.self_attn_layer_norm.weight"):
        assert torch.equal(final[k], original[k])
    assert not torch.equal(final["model.decoder.layers.0.fc1.weight"], original["model.decoder.layers.0.fc1.weight"])
    loaded = AutoModelForCausalLM.from_pretrained(reference / "final")  # stock transformers, no peft
    assert loaded.model.decoder.layers[0].fc1.weight.shape == original["model.decoder.layers.0.fc1.weight"].shape


@pytest.mark.parametrize(
    "stage, offload, resume_on",
    [(0, "none", None), (1, "cpu", None), (2, "none", "one rank"), (3, "none", "two ranks")],
)
def test_zero_gives_the_single_process_lora(tiny, tmp_path, reference, stage, offload, resume_on):
    """Every stage, offload (at stage 1), and resume: at stage 2 on one rank (another number of ranks), at stage 3
    (with gradient checkpointing) on the same two."""
    out = tmp_path / "run"
    argv = lora_args(tiny, out, **{"--batch-size": 2, "--grad-accum": 2, "--zero-stage": stage, "--offload": offload})
    argv += ["--deepspeed"] + (["--gradient-checkpointing"] if stage == 3 else [])
    check(launch("forked", "zero-optimization.py", argv))
    ref = results(reference)
    for resumed in (False, True) if resume_on else (False,):
        if resumed:
            crash_after_first_checkpoint(out)
            one_rank = ["--batch-size", "4"] if resume_on == "one rank" else []  # the same global batch on one rank
            check(
                launch(
                    "forked-python" if resume_on == "one rank" else "forked",
                    "zero-optimization.py",
                    argv + one_rank + ["--resume"],
                )
            )
            assert_resumed(out)
        r = results(out)
        assert r["ran"] == {
            "weights_dtype": "float32",
            "gradient_checkpointing": stage == 3,
            "offload_activations": False,
            "tiled_mlp": False,
            "zero_stage": stage,
            "engine_precision": "fp32",
            "optimizer": "DeepSpeedCPUAdam on cpu" if offload == "cpu" else "AdamW on cpu",
        }
        assert_close_losses(ref["losses"], r["losses"])
        assert_close_losses(ref["grad_norms"], r["grad_norms"])
        mine, want = adapter(out), adapter(reference)
        assert mine.keys() == want.keys()
        for k in want:  # full shapes, gathered from the shards; the same values
            assert mine[k].shape == want[k].shape and (mine[k] - want[k]).abs().max() <= 1e-5, k
        final, ref_final = weights(out / "final"), weights(reference / "final")
        assert final.keys() == ref_final.keys() and "lm_head.weight" not in final  # the head tied to the embeddings
        assert all((final[k] - ref_final[k]).abs().max() <= 1e-5 for k in ref_final)


@pytest.mark.quick
def test_lora_resume_gives_the_uninterrupted_run(tiny, tmp_path, reference):
    out = tmp_path / "run"
    argv = lora_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2})
    single.main(argv)
    crash_after_first_checkpoint(out)
    with pytest.raises(SystemExit, match="was written with --lora-rank 8; resume with it"):
        single.main(lora_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2, "--lora-rank": 4}) + ["--resume"])
    single.main(argv + ["--resume"])
    assert_resumed(out)
    assert_close_losses(results(reference)["losses"], results(out)["losses"], rtol=1e-6)
    assert all(torch.equal(v, adapter(reference)[k]) for k, v in adapter(out).items())


def test_lora_under_zero3_trains_in_the_runs_16_bits(tiny, tmp_path, reference):
    """peft makes fp32 adapters after the base's zero.Init, and ZeRO-3 takes the run's dtype from the first trainable
    parameter: unless they are cast first, a bf16 run trains them in fp32 (and fp16 without loss scaling)."""
    out = tmp_path / "run"
    argv = lora_args(tiny, out, **{"--batch-size": 4, "--grad-accum": 2, "--zero-stage": 3, "--precision": "bf16"})
    check(launch("forked-python", "zero-optimization.py", argv + ["--deepspeed"]))
    r = results(out)
    assert r["ran"] == {
        "weights_dtype": "bfloat16",
        "gradient_checkpointing": False,
        "offload_activations": False,
        "tiled_mlp": False,
        "zero_stage": 3,
        "engine_precision": "bf16",
        "optimizer": "AdamW on cpu",
    }
    first = results(reference)["losses"][0]  # before any update (B = 0): the fp32 run's loss, to bf16's rounding
    assert abs(r["losses"][0] - first) < 1e-2 * first


@pytest.mark.quick
def test_the_merge_adds_into_the_gathered_state_and_never_into_the_training_model(tiny, tmp_path):
    """save_final merges the adapters in place: into a state ZeRO-3 gathered (no second copy of the model in rank 0's
    host memory), but never into the weights of a model training on the CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from finetune import models

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny["model"]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()  # adapters that change the weights
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    models.save_final(model, tokenizer, tmp_path / "live")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the training model untouched
    gathered = {k: v.clone() for k, v in model.state_dict().items()}
    models.save_final(model, tokenizer, tmp_path / "gathered", gathered)
    saved, want = weights(tmp_path / "gathered"), weights(tmp_path / "live")
    key = "model.decoder.layers.0.fc1.weight"
    base = f"base_model.model.{key.removesuffix('.weight')}.base_layer.weight"  # its name in the peft model
    assert torch.equal(saved[key], want[key]) and not torch.equal(saved[key], before[base])  # merged, the same
    assert torch.equal(gathered[base], saved[key])  # merged where it lay: the gathered tensor itself, no copy
