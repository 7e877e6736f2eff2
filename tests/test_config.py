"""The DeepSpeed config: "auto" filled from the flags, the optimizer nothing has to compile, offload checks."""

import json
import types

import pytest
from helpers import load_script
from transformers import OPTConfig

from finetune import base, training, zero_config

pytestmark = pytest.mark.quick  # in process: `make test-quick`

ZERO3 = str(base.ROOT / "ds_config_zero3.json")
ZERO2 = str(base.ROOT / "ds_config_zero2.json")


def shape(hidden_size):
    """A 2-layer OPT of this width: a layer holds 12 h^2 + 13 h parameters (OPTDecoderLayer, ZeRO-3's leaf)."""
    return OPTConfig(
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=4 * hidden_size,
        word_embed_proj_dim=hidden_size,
        vocab_size=128,
    )


def layer_params(hidden):
    return 12 * hidden * hidden + 13 * hidden


def ds_args(path=ZERO3, **kw):
    """zero-optimization.py's Config for `path`, with these values."""
    values = dict(
        batch_size=4, grad_accum=2, max_grad_norm=1.0, lr=2e-4, weight_decay=0.01, precision="fp32", nvme_path="/nvme"
    )
    return load_script("zero-optimization.py").parse_args(["--deepspeed", path]).resolved(**{**values, **kw})


def test_auto_values_come_from_the_flags():
    config = zero_config.deepspeed_config(ds_args(), 2, 100, 5, shape(64))
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == (4, 2, 16)
    assert config["optimizer"]["params"] == {
        "lr": 2e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
        "torch_adam": True,
        "fused": True,
    }
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    assert config["gradient_clipping"] == 1.0
    # ZeRO-3 gathers and reduces a transformer layer at a time (zero_config.tuned_values)
    assert config["zero_optimization"]["leaf_module"] == {"classes": ["OPTDecoderLayer"]}
    assert config["zero_optimization"]["reduce_bucket_size"] == layer_params(64) == 49_984
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == layer_params(64)
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert config["zero_optimization"]["memory_efficient_linear"] is False  # torch's linear: fewer kernels and calls
    # the throughput timer's two syncs a step, off; bf16 steps without a host read of an overflow flag
    assert config["timers"] == {"throughput": {"enabled": False}}
    assert config["bf16"]["check_grad_overflow"] is False and "torch_autocast" not in config
    # fp16: the loss scale of single-gpu.py's GradScaler, so both skip the same steps (DeepSpeed grows it after
    # loss_scale_window + 1 clean steps, torch after growth_interval)
    assert (
        2 ** config["fp16"]["initial_scale_power"],
        config["fp16"]["loss_scale_window"] + 1,
        config["fp16"]["hysteresis"],
    ) == (training.FP16_SCALER["init_scale"], training.FP16_SCALER["growth_interval"], 1)
    assert config["fp16"]["loss_scale_window"] == 1000  # DeepSpeed's default, as shipped


@pytest.mark.parametrize(
    "cuda, offload, expect",
    [
        (True, "none", {"torch_adam": True, "fused": True}),  # torch's fused AdamW: no FusedAdam built with nvcc
        (False, "none", {"torch_adam": True, "fused": True}),
        (True, "cpu", {"torch_adam": False}),  # DeepSpeedCPUAdam (C++), which takes no `fused`
    ],
)
def test_the_optimizer_needs_no_compiler_unless_offloaded(cuda, offload, expect):
    config = json.loads(open(ZERO2).read())
    config["zero_optimization"]["offload_optimizer"]["device"] = offload
    params = zero_config.choose_optimizer(config, cuda)["optimizer"]["params"]
    assert {k: params[k] for k in ("torch_adam", "fused") if k in params} == expect


@pytest.mark.parametrize(
    "fp16, bf16, precision, message",
    [
        (
            False,
            True,
            "fp16",
            "--precision fp16: DeepSpeed does not train in fp16 on this cpu device; pass --precision bf16",
        ),
        (
            True,
            False,
            "bf16",
            "--precision bf16: DeepSpeed does not train in bf16 on this cpu device; pass --precision fp32",
        ),
        (None, False, "fp16", "pass --precision fp32"),  # DeepSpeed's CPU accelerator answers None for no
        (False, False, "fp32", None),
        (True, True, "fp16", None),
        (True, True, "bf16", None),
    ],
)
def test_a_precision_the_device_lacks_is_one_line(fp16, bf16, precision, message):
    device = types.SimpleNamespace(
        is_fp16_supported=lambda: fp16, is_bf16_supported=lambda: bf16, device_name=lambda: "cpu"
    )
    if message is None:
        zero_config.check_precision(precision, device)
    else:
        with pytest.raises(SystemExit, match="^error: ") as e:
            zero_config.check_precision(precision, device)
        assert message in str(e.value)


def test_the_config_asks_deepspeeds_own_accelerator(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: None)  # this CPU, and most
    with pytest.raises(SystemExit, match="does not train in fp16 on this cpu device; pass --precision bf16"):
        zero_config.deepspeed_config(ds_args(precision="fp16"), 1, 10, 1, shape(8))


def test_overrides_and_offload():
    section = zero_config.deepspeed_config(ds_args(offload="cpu"), 1, 10, 1, shape(8))["zero_optimization"]
    assert section["offload_optimizer"]["device"] == "cpu" and section["offload_param"]["device"] == "cpu"
    config = zero_config.deepspeed_config(ds_args(zero_stage=2, offload="cpu"), 1, 10, 1, shape(8))
    assert config["zero_optimization"]["stage"] == 2 and "offload_param" not in config["zero_optimization"]


def test_offload_keeps_the_files_own_keys_for_each_side(tmp_path):
    """--offload sets where both go; the file's offload_param keys stay, and the optimizer's own keys (ratio,
    fast_init) are not copied where DeepSpeed refuses them."""
    path = tmp_path / "ds.json"
    config = json.loads(open(ZERO3).read())
    config["zero_optimization"]["offload_optimizer"].update(ratio=0.5, fast_init=True)
    config["zero_optimization"]["offload_param"].update(buffer_count=8)
    path.write_text(json.dumps(config))
    section = zero_config.deepspeed_config(ds_args(str(path), offload="cpu"), 1, 10, 1, shape(8))["zero_optimization"]
    assert section["offload_param"] == {"device": "cpu", "pin_memory": True, "buffer_count": 8}
    assert section["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5, "fast_init": True}


OPT_1_3B = OPTConfig(
    hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192, word_embed_proj_dim=2048
)  # its largest parameter: the embedding, 50272 x 2048


@pytest.mark.parametrize(
    "ranks, precision, elements",
    [
        (1, "bf16", 102_957_056),  # the whole embedding (DeepSpeed's default buffer: 1e8 elements, too small)
        (8, "bf16", 12_869_632),  # an eighth
        (3, "bf16", 34_319_360),  # ceil(102957056 / 3) = 34319019, up to the next 512 (1024 bytes of 16-bit elements)
        (3, "fp32", 34_319_104),  # up to the next 256
    ],
)
def test_nvme_swap_buffers_hold_the_largest_shard(ranks, precision, elements):
    args = ds_args(offload="nvme", precision=precision)
    section = zero_config.deepspeed_config(args, ranks, 10, 1, OPT_1_3B)["zero_optimization"]
    assert section["offload_optimizer"]["nvme_path"] == "/nvme" and section["offload_param"]["device"] == "nvme"
    assert section["offload_param"]["buffer_size"] == elements


def test_a_too_small_swap_buffer_in_the_file_is_one_line(tmp_path):
    path = tmp_path / "ds.json"
    config = json.loads(open(ZERO3).read())
    config["zero_optimization"]["offload_param"]["buffer_size"] = 100_000_000
    path.write_text(json.dumps(config))
    with pytest.raises(
        SystemExit,
        match="buffer_size=100000000 is smaller than this model's largest parameter shard "
        '\\(102957056 elements\\); set it to "auto" or at least 102957056',
    ):
        zero_config.deepspeed_config(ds_args(str(path), offload="nvme"), 1, 10, 1, OPT_1_3B)
    assert zero_config.deepspeed_config(ds_args(str(path), offload="nvme"), 2, 10, 1, OPT_1_3B)  # half of it fits


def test_nvme_below_stage_3_is_one_line():
    """DeepSpeed would quietly offload to CPU memory instead, ignoring --nvme-path."""
    with pytest.raises(SystemExit, match="error: --offload nvme needs ZeRO stage 3 \\(at stage 2"):
        zero_config.deepspeed_config(ds_args(zero_stage=2, offload="nvme"), 1, 10, 1, shape(8))


def test_a_scheduler_block_is_filled(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {
                        "warmup_min_lr": "auto",
                        "warmup_max_lr": "auto",
                        "warmup_num_steps": "auto",
                        "total_num_steps": "auto",
                    },
                }
            }
        )
    )
    config = zero_config.deepspeed_config(ds_args(str(path)), 1, 100, 5, shape(8))
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 2e-4,
        "warmup_num_steps": 5,
        "total_num_steps": 100,
    }


@pytest.mark.parametrize("warmup, total", [(0, 1), (1, 4), (3, 40), (5, 7), (10, 10)])
def test_the_schedule_is_transformers_cosine_with_warmup(warmup, total):
    """training.cosine_schedule stands in for transformers' (whose import takes 2 s): the same learning rate at
    every step, bit for bit, past the last step too."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    lrs = []
    for make in (training.cosine_schedule, get_cosine_schedule_with_warmup):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        schedule, seen = make(optimizer, warmup, total), []
        for _ in range(total + 2):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        lrs.append(seen)
    assert lrs[0] == lrs[1] and max(lrs[0]) == 3e-4 and lrs[0][total] == (0.0 if warmup < total else 3e-4)


@pytest.mark.parametrize(
    "content, message",
    [
        ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu=8 vs --batch-size = 4"),
        ({"train_batch_size": 12}, "train_batch_size=12 vs --batch-size x --grad-accum x 2 ranks = 16"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, "optimizer.params.lr=0.1 vs --lr = 0.0002"),
        ({"bf16": {"enabled": True}}, "bf16.enabled=True vs --precision = False"),
        ({"fp16": {"enabled": "auto", "hysteresis": 2}}, "fp16.hysteresis=2 vs torch's GradScaler (no hysteresis) = 1"),
        ({"optimizer": {"type": "AdamW", "params": {"foo": "auto"}}}, "no flag fills optimizer.params.foo"),
    ],
)
def test_errors_name_both_sides(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SystemExit, match="error: ") as e:
        zero_config.deepspeed_config(ds_args(str(path)), 2, 100, 5, shape(8))
    assert message in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        zero_config.deepspeed_config(ds_args(str(tmp_path / "nope.json")), 1, 1, 1, shape(8))
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(SystemExit, match="not valid JSON"):
        zero_config.deepspeed_config(ds_args(str(tmp_path / "bad.json")), 1, 1, 1, shape(8))


@pytest.mark.parametrize("path", [ZERO2, ZERO3])
@pytest.mark.parametrize("device, ranks, overlap", [("cpu", 2, False), ("cuda", 2, True), ("cuda", 1, False)])
def test_the_trainer_leaves_no_auto_value_unfilled(path, device, ranks, overlap, monkeypatch):
    """Accelerate refuses any "auto" the Trainer did not fill (overlap_comm, allgather_bucket_size): we fill those.
    overlap_comm only where there is a reduction to overlap: GPUs, more than one rank."""
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", str(ranks))

    import torch
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    script = load_script("sequence_classification.py")
    flags = SimpleNamespace(lr=1e-4, weight_decay=0.0)
    config, optimizer_args = script.trainer_deepspeed_config(path, torch.device(device), 768, flags)
    assert "optimizer" not in config and optimizer_args == {}  # the Trainer's AdamW, in groups (see the next test)
    hf = HfTrainerDeepSpeedConfig(config)  # what the Trainer (transformers 5.23) does with it
    args = SimpleNamespace(
        world_size=ranks,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
        learning_rate=1e-4,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        save_on_each_node=False,
        fp16=False,
        fp16_full_eval=False,
        bf16=device == "cuda",
        bf16_full_eval=False,
        get_warmup_steps=lambda n: 0,
    )
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=768)), 100)
    assert [k for k, v in zero_config._walk(hf.config) if v == "auto"] == []
    section = hf.config["zero_optimization"]
    assert section["overlap_comm"] is overlap
    bucket = 768 * 768 if section["stage"] == 3 else int(2.5e7)
    assert (section["reduce_bucket_size"], section.get("allgather_bucket_size", bucket)) == (bucket, bucket)


def test_the_trainer_makes_the_adamw_a_config_names():
    """An AdamW section becomes the Trainer's AdamW (biases and norms undecayed), its betas and eps its arguments; an
    explicit lr that is not --lr is one line; another optimizer stays DeepSpeed's."""
    from types import SimpleNamespace

    script = load_script("sequence_classification.py")
    flags = SimpleNamespace(lr=1e-4, weight_decay=0.01)
    adamw = lambda **params: {"optimizer": {"type": "AdamW", "params": {"lr": "auto", **params}}}
    config = adamw(betas=[0.9, 0.95], eps=1e-6, weight_decay=0.01)
    assert script.trainer_optimizer(config, flags, "c.json") == dict(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6)
    assert "optimizer" not in config
    with pytest.raises(SystemExit, match=r"c.json sets optimizer.params.lr=0.001 but --lr is 0.0001; set it to"):
        script.trainer_optimizer(adamw(lr=1e-3), flags, "c.json")
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}
    assert script.trainer_optimizer(lamb, flags, "c.json") == {} and lamb["optimizer"]["type"] == "Lamb"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_at_zero0_is_autocast_over_fp32_weights_and_the_engines_own_above(stage, monkeypatch):
    """At ZeRO-0 --precision bf16 is single-gpu.py's own bf16 (torch's autocast over fp32 weights, torch's fused
    AdamW), not DeepSpeed's unfused 16-bit optimizer (a host read per parameter a step); ZeRO-1/2/3 shard DeepSpeed's
    16-bit copies and keep them. fp16 stays DeepSpeed's (its loss scale; mends.py), on a GPU that has it."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    config = zero_config.deepspeed_config(ds_args(precision="bf16", zero_stage=stage), 1, 10, 1, shape(8))
    if stage == 0:
        assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
        assert config["bf16"]["enabled"] is False
    else:
        assert "torch_autocast" not in config and config["bf16"]["enabled"] is True
    fp16 = zero_config.deepspeed_config(ds_args(precision="fp16", zero_stage=0), 1, 10, 1, shape(8))  # DeepSpeed's
    assert "torch_autocast" not in fp16 and fp16["fp16"]["enabled"] is True


def test_a_files_own_precision_choice_at_zero0_is_kept_or_named(tmp_path):
    """A file that turns DeepSpeed's bf16 on at ZeRO-0 keeps it; a torch_autocast section that contradicts
    --precision is one line."""
    path = tmp_path / "ds.json"
    config = json.loads(open(ZERO2).read())
    config["bf16"]["enabled"] = True
    path.write_text(json.dumps(config))
    kept = zero_config.deepspeed_config(ds_args(str(path), precision="bf16", zero_stage=0), 1, 10, 1, shape(8))
    assert kept["bf16"]["enabled"] is True and "torch_autocast" not in kept
    config = json.loads(open(ZERO2).read())
    config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    path.write_text(json.dumps(config))
    with pytest.raises(
        SystemExit,
        match="torch_autocast autocasts to bfloat16 but --precision is fp32; remove the "
        "torch_autocast section or change --precision",
    ):
        zero_config.deepspeed_config(ds_args(str(path), precision="fp32", zero_stage=0), 1, 10, 1, shape(8))


@pytest.mark.parametrize("cuda, ranks, overlap", [(True, 2, True), (True, 1, False), (False, 2, False)])
def test_overlap_comm_only_where_a_reduction_can_overlap(cuda, ranks, overlap):
    """overlap_comm runs the reductions on a side CUDA stream: on one GPU there is nothing to overlap, only a wait.
    ZeRO-1/2 copy the gradients into contiguous buckets only where there is something to reduce (ZeRO-3: always)."""
    assert zero_config.tuned_values(2, 768, cuda, ranks)["overlap_comm"] is overlap
    for stage in (1, 2, 3):
        assert zero_config.tuned_values(stage, 768, cuda, ranks)["contiguous_gradients"] is (ranks > 1 or stage == 3)


def test_zero3_layers_are_leaves_sized_from_the_model():
    """The model's transformer layers (its _no_split_modules) and a mixture of experts' blocks are ZeRO-3's leaves;
    the reduce and prefetch buckets hold a layer, at most DeepSpeed's own 5e8 elements; without layers, the HF rule."""
    from finetune import zero_config as z

    classes, largest = z.zero3_layers(z.meta_model(shape(64)))
    assert classes == ["OPTDecoderLayer"] and largest == layer_params(64)
    values = z.tuned_values(3, 8192, True, 8, layer_params=12 * 8192 * 8192)  # a 70B-wide layer: capped
    assert values["reduce_bucket_size"] == values["stage3_prefetch_bucket_size"] == z.LARGEST_BUCKET
    assert z.tuned_values(3, 64, True, 8)["stage3_param_persistence_threshold"] == 640  # no layers known: per matrix


def test_deepspeeds_muon_loads_only_for_a_config_that_names_it(monkeypatch):
    """DeepSpeed imports its Muon optimizer wherever it asks whether the optimizer is Muon, and the import loads the
    compiler (0.8 s of each rank's start on a CPU). A config naming AdamW gets stand-ins that answer the same (no
    optimizer is their MuonWithAuxAdam; their update is never reached, and says so), taken out when the engine is
    done; one naming Muon gets DeepSpeed's (mends: muon_only_when_named)."""
    import sys

    import torch

    from finetune.internals import mend_speedups, mends

    earlier = mends.Mended("all", "0.19.8")  # what the configs of this file's other tests installed, undone
    earlier.adopt_pending()
    earlier.undo()
    for name in mend_speedups.MUON_MODULES:  # as in a process that has not imported them (restored after the test)
        monkeypatch.delitem(sys.modules, name, raising=False)
    mends.before_engine({"optimizer": {"type": "AdamW"}})
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    assert not isinstance(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]), MuonWithAuxAdam)
    with pytest.raises(RuntimeError, match="names another optimizer"):
        muon_update(torch.ones(2, 2), torch.zeros(2, 2))
    mends.before_engine({"optimizer": {"type": "Muon"}})
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam as Muon

    assert issubclass(Muon, torch.optim.Optimizer) and Muon.__module__ == mend_speedups.MUON_MODULES[0]
    monkeypatch.delitem(sys.modules, mend_speedups.MUON_MODULES[0])
    mends.before_engine({"optimizer": {"type": "AdamW"}}, "none")  # --mends none: DeepSpeed's own import
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam as Muon

    assert issubclass(Muon, torch.optim.Optimizer)
    held = mends.Mended("all", "0.19.8")  # what this test installed, held and undone as an engine's Mended would
    held.adopt_pending()
    held.undo()
    assert all(hasattr(sys.modules.get(name, sys), "__file__") for name in mend_speedups.MUON_MODULES)  # no stand-in
