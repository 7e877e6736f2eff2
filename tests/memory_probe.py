"""Count the bytes of model state each rank holds, for many ZeRO configurations in one launch, next to plan.py's
figures for them. Run by tests/test_plan.py under `deepspeed --num_gpus 2` and as a world of one:

    deepspeed --num_gpus 2 tests/memory_probe.py --models DIR [DIR ...] --out results.jsonl

For each model, precision and option: the engine as zero-optimization.py builds it (the shipped ZeRO-3 config, its
"auto" values filled), two optimizer steps, and memory.held_bytes after the second backward and after its step; and
the largest fp64 copy the second step made (ZeRO-2 + CPU offload's gradient norm, plan.norm_copy_bytes).
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import plan  # noqa: E402
from finetune import distributed, flags, training, zero_config  # noqa: E402
from finetune.internals import memory, mends  # noqa: E402

OPTIONS = {
    "ZeRO-0": (0, None),
    "ZeRO-1": (1, None),
    "ZeRO-2": (2, None),
    "ZeRO-3": (3, None),
    "ZeRO-2 + CPU offload": (2, "cpu"),
    "ZeRO-3 + CPU offload": (3, "cpu"),
    "ZeRO-3 + NVMe offload": (3, "nvme"),
}


def probe(folder, precision, option, world_size, nvme_path=""):
    config = AutoConfig.from_pretrained(folder)
    # before the HfDeepSpeedConfig: with a ZeRO-3 one alive, transformers would partition even the meta model
    params = plan.parameters(config)
    planned = plan.model_states(
        params,
        config.hidden_size,
        precision,
        world_size,
        option,
        layer=plan.layer_params(config),
        groups=plan.optimizer_groups(config),
        rank=dist.get_rank(),
    )
    stage, offload = OPTIONS[option]
    norm_copy = plan.norm_copy_bytes(params, world_size) if stage in (1, 2) and offload else None
    settings = flags.Zero(
        deepspeed=str(zero_config.DEFAULT_CONFIG),
        zero_stage=stage,
        offload=offload,
        nvme_path=nvme_path,
        dist_timeout=1800,
        sequence_parallel=1,
        mends="all",
    )
    run = dataclasses.replace(flags.defaults(batch_size=2, lr=1e-3, precision=precision), zero=settings)
    ds_config = zero_config.deepspeed_config(run, world_size, 10, 1, config)
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # alive while the model loads, as in the script
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=training.param_groups(model, 0.0)
    )
    mends.mend(engine, say=lambda line: None)  # as zero-optimization.py: ZeRO-1/2's norm makes no fp64 copies
    counts = {}
    for step in range(2):
        ids = torch.randint(0, config.vocab_size, (2, 16), device=engine.device)
        with Fp64Copies() as copies:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if step == 1:
                counts["after_backward"] = memory.held_bytes(engine, optimizer)
            engine.step()
    counts["after_step"] = memory.held_bytes(engine, optimizer)
    engine.destroy()
    del hf_ds_config
    return {
        "model": Path(folder).name,
        "precision": precision,
        "option": option,
        "ranks": world_size,
        "rank": dist.get_rank(),
        **{f"counted_{k}": v for k, v in counts.items()},
        **{f"planned_{k}": planned[k] for k in counts},
        "counted_norm_copy": copies.largest,
        "planned_norm_copy": norm_copy,
    }


class Fp64Copies:
    """The bytes of the largest tensor Tensor.to turns into float64 while active: DeepSpeed's gradient-norm copies."""

    def __enter__(self):
        self.to, self.largest = torch.Tensor.to, 0

        def counting(tensor, *args, **kwargs):
            out = self.to(tensor, *args, **kwargs)
            if out.dtype == torch.float64 and tensor.dtype != torch.float64:
                self.largest = max(self.largest, out.numel() * 8)
            return out

        torch.Tensor.to = counting
        return self

    def __exit__(self, *exc):
        torch.Tensor.to = self.to


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--nvme-path", help="also NVMe offload, swapping to this folder (needs libaio; not in the tests)")
    args = p.parse_args()
    distributed.launch_env()
    deepspeed.init_distributed()
    options = [o for o in OPTIONS if args.nvme_path or "NVMe" not in o]
    rows = [
        probe(m, precision, option, dist.get_world_size(), args.nvme_path)
        for m in args.models
        for precision in ("fp32", "bf16")
        for option in options
    ]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for ranks in every for r in ranks))
    distributed.remove_shm_buffer()
    dist.destroy_process_group()
    os._exit(0)  # as the scripts do on CPUs (see distributed.run_distributed)


if __name__ == "__main__":
    main()
