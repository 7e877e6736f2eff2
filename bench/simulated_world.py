"""ZeRO at the world sizes users run, in one CPU process: what a rank of W holds and sends, beside what plan.py plans.

    python3 bench/simulated_world.py --model DIR --worlds 8 64 512            # ZeRO-1, 2, 3, 3 + CPU offload
    python3 bench/simulated_world.py --model DIR --worlds 64 --options ZeRO-2 --precisions bf16 --json out.json

torch's fake process group (torch.testing._internal.distributed.fake_pg) is a world of W ranks whose collectives do
nothing: this process is one rank of it, any rank. On it, zero-optimization.py's own engine set-up (the shipped
ZeRO config with its "auto" values filled by zero_config.deepspeed_config, the model loaded by models.load_causal_lm
under HfDeepSpeedConfig, the loss module, the optimizer's groups, the mends) runs three steps of a small model; per
rank it counts the bytes of model state held after the third backward and after its step (memory.held_bytes:
weights, gradients, optimizer state, DeepSpeed's buffers, each storage once) and the collectives of that step
with their sizes (each one's whole buffer: an all-gather's output, a reduce-scatter's input). Ranks simulated: 0,
and the one plan.py finds holding the most (ZeRO-1/2: where whole tensors straddle a partition's edge).
The collectives' data is garbage, so the losses and weights mean nothing: only bytes and counts are claimed.
"""

import argparse
import collections
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import plan  # noqa: E402
from finetune import flags, loss, models, training, zero_config  # noqa: E402
from finetune.blocks import Targets  # noqa: E402
from finetune.internals import memory, mends  # noqa: E402

OPTIONS = {
    "ZeRO-1": (1, None),
    "ZeRO-2": (2, None),
    "ZeRO-3": (3, None),
    "ZeRO-3 + CPU offload": (3, "cpu"),
    "ZeRO-2 + CPU offload": (2, "cpu"),
}
TOKENS = (2, 16)  # a micro-batch: 2 sequences of 16 tokens
STEPS = 3  # the last one counted: ZeRO-3 traces its modules' order in the first two (and checks it with broadcasts)


class Collectives(TorchDispatchMode):
    """The process group's operations dispatched while active: {name: [bytes of each call]}, a call's bytes those of
    its largest tensor argument (a list of tensors counts as its sum): an all-reduce's tensor, an all-gather's
    output, a reduce-scatter's input."""

    def __init__(self):
        super().__init__()
        self.seen = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func._schema.name.split("::")
        if namespace == "c10d":
            tensors = lambda a: (
                a
                if isinstance(a, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in a)
                else [a]
                if isinstance(a, torch.Tensor)
                else []
            )
            self.seen[name.rstrip("_")].append(max((sum(t.nbytes for t in tensors(a)) for a in args), default=0))
        return func(*args, **(kwargs or {}))


def join(world, rank):
    """Make this process rank `rank` of a fake world of `world` ranks (leaving any fake world it was in)."""
    import deepspeed

    if dist.is_initialized():
        deepspeed.comm.destroy_process_group()  # and DeepSpeed's cached groups of the old world
    os.environ.update(
        RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    deepspeed.init_distributed()  # DeepSpeed's comm over this group (it sees one already made)


def simulate(folder, option, precision, world, rank):
    """{after_backward, after_step: bytes held, collectives: {name: [bytes of each call]}} of the last step of rank
    `rank` of `world`, the engine built as zero-optimization.py builds it."""
    import deepspeed
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    join(world, rank)
    stage, offload = OPTIONS[option]
    settings = flags.Zero(
        deepspeed=str(zero_config.DEFAULT_CONFIG),
        zero_stage=stage,
        offload=offload,
        nvme_path="",
        dist_timeout=1800,
        sequence_parallel=1,
        mends="all",
    )
    run = dataclasses.replace(
        flags.defaults(model=str(folder), batch_size=TOKENS[0], lr=1e-3, precision=precision), zero=settings
    )
    model_config = AutoConfig.from_pretrained(folder)
    ds_config = zero_config.deepspeed_config(run, world, 10, 1, model_config)
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 (alive while the model loads: ZeRO-3 loads shards)
    model = models.load_causal_lm(run.model, model_config, torch.device("cpu"))
    model = loss.CausalLMLoss(model, run.model.loss_chunk)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=training.param_groups(model, 0.0)
    )
    mends.mend(engine, say=lambda line: None)
    counted = {}
    for step in range(STEPS):
        ids = torch.randint(0, model_config.vocab_size, TOKENS)
        labels = torch.cat([ids[:, 1:], torch.full((TOKENS[0], 1), -100)], dim=1)  # shifted, as blocks.py makes them
        targets = Targets(labels=labels, index=(labels.view(-1) >= 0).nonzero().view(-1))
        with Collectives() as collectives:
            engine.backward(engine(inputs={"input_ids": ids}, targets=targets).loss)
            if step == STEPS - 1:
                counted["after_backward"] = memory.held_bytes(engine, optimizer)
                counted.update(zero12_buffers(optimizer))
            engine.step()
    counted["after_step"] = memory.held_bytes(engine, optimizer)
    engine.destroy()
    return {**counted, "collectives": dict(collectives.seen)}


def zero12_buffers(optimizer):
    """ZeRO-1/2's buffers whose sizes the plan derives (stage_1_and_2.py): each group's flat 16-bit buffer (padded),
    and the rank's gradient buffer after the backward (what its reduced gradients are views of), in elements; {} at
    stage 3."""
    if not hasattr(optimizer, "bit16_groups_flat"):
        return {}
    flat = {"flat_elements": [t.numel() for t in optimizer.bit16_groups_flat]}
    if optimizer.cpu_offload:  # its gradients go to the host as they come: no such buffer
        return flat
    views = [t for group in optimizer.averaged_gradients.values() for t in group]  # into the gradient buffer
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size() for t in views}
    return {**flat, "gradient_buffer_elements": sum(storages.values())}


def planned(folder, option, precision, world, rank):
    """plan.py's model states of rank `rank` of `world` ({after_backward, after_step, ...}), and its worst rank."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    params, groups = plan.parameters(config), plan.optimizer_groups(config)
    states = lambda r: plan.model_states(
        params, config.hidden_size, precision, world, option, layer=plan.layer_params(config), groups=groups, rank=r
    )
    return states(rank), plan.worst_rank(groups, world)


def table(folder, worlds, options, precisions, say=print):
    """Rows of (world, option, precision, rank): counted and planned bytes, collectives."""
    rows = []
    for world in worlds:
        for option in options:
            for precision in precisions:
                # ZeRO-3 pads each tensor to N equal shards: every rank holds the same (and its start-of-step check
                # that the ranks agree reads rank 0's values, which a fake world never sends to the others)
                worst = planned(folder, option, precision, world, 0)[1] if OPTIONS[option][0] < 3 else 0
                for rank in sorted({0, worst}):
                    plan_row = planned(folder, option, precision, world, rank)[0]  # before HfDeepSpeedConfig lives
                    counted = simulate(folder, option, precision, world, rank)
                    row = {
                        "world": world,
                        "option": option,
                        "precision": precision,
                        "rank": rank,
                        **{f"counted_{k}": counted[k] for k in ("after_backward", "after_step")},
                        **{f"planned_{k}": plan_row[k] for k in ("after_backward", "after_step")},
                        **{k: counted[k] for k in ("flat_elements", "gradient_buffer_elements") if k in counted},
                        "collectives": counted["collectives"],
                    }
                    rows.append(row)
                    say(line(row))
    return rows


def line(row):
    ratio = lambda point: row[f"planned_{point}"] / row[f"counted_{point}"]
    sent = ", ".join(
        f"{len(sizes)} {name} {sum(sizes) / 2**20:.2f} MiB" for name, sizes in sorted(row["collectives"].items())
    )
    return (
        f"W={row['world']:<4} {row['option']:<21} {row['precision']:<5} rank {row['rank']:<4} "
        f"after backward {row['counted_after_backward']:>12,} B (plan {ratio('after_backward'):.4f}x), "
        f"after step {row['counted_after_step']:>12,} B (plan {ratio('after_step'):.4f}x) | {sent}"
    )


def markdown(rows):
    """The rows as docs/planner.md's table: MB a rank, planned against counted, and a step's collectives."""
    out = [
        "| W | option | precision | rank | after backward: counted MB (plan) | after step: counted MB (plan) | "
        "collectives a step (count, MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cell = lambda point, r=r: (
            f"{r[f'counted_{point}'] / 1e6:.3f} ({r[f'planned_{point}'] / r[f'counted_{point}']:.4f}x)"
        )
        sent = ", ".join(
            f"{len(sizes)} {name.lstrip('_')} {sum(sizes) / 1e6:.1f}"
            for name, sizes in sorted(r["collectives"].items())
        )
        out.append(
            f"| {r['world']} | {r['option']} | {r['precision']} | {r['rank']} | {cell('after_backward')} | "
            f"{cell('after_step')} | {sent} |"
        )
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder (config and weights, as save_pretrained writes)")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--options", nargs="+", default=list(OPTIONS)[:4], choices=list(OPTIONS))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--markdown", action="store_true", help="and print them as a table")
    args = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    rows = table(args.model, args.worlds, args.options, args.precisions)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
