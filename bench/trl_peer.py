"""The preference peers: one of TRL's trainers with its defaults through the Hugging Face Trainer and DeepSpeed ZeRO-2
(the configuration peers.py uses), on a dataset of TRL's columns, beside ours in bench/dpo.py, bench/kto.py and
bench/reward.py:
  dpo     DPOTrainer: no packing, pairs padded per batch, the reference a second copy of the model
  kto     KTOTrainer: unpaired rows padded per batch, the reference's log-probabilities computed alongside
  reward  RewardTrainer: a one-output head on the model, pairs padded per batch
all with gradient checkpointing on (TRL 1.x's default). --fast: set for speed as a careful user would (gradient
checkpointing off; DPO and KTO: the reference's log-probabilities computed once before training).

    deepspeed --num_gpus 2 bench/trl_peer.py --trainer dpo --model M --dataset pairs.jsonl --output-dir OUT --lr 1e-4

TRL installs beside the pins without its dependencies: pip install --no-deps trl==1.16.0
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from peers import HF_ZERO2  # noqa: E402

from finetune import base, data, distributed, zero_config  # noqa: E402


def trainer_parts(kind):
    """(config class, trainer class, model class, model arguments) of a --trainer."""
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind == "reward":
        return trl.RewardConfig, trl.RewardTrainer, AutoModelForSequenceClassification, {"num_labels": 1}
    name = kind.upper()
    return getattr(trl, f"{name}Config"), getattr(trl, f"{name}Trainer"), AutoModelForCausalLM, {}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=["dpo", "kto", "reward"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--beta", type=float, default=0.1, help="dpo, kto")
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--batch-size", type=int, default=8, help="pairs (kto: rows) per device per step")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--fast", action="store_true", help="gradient_checkpointing=False, precompute_ref_log_probs=True")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    import datasets
    import deepspeed
    from transformers import AutoTokenizer

    distributed.launch_env()
    deepspeed.init_distributed()
    cuda = torch.cuda.is_available()
    config_class, trainer_class, model_class, model_args = trainer_parts(args.trainer)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.chat_template = tokenizer.chat_template or data.DEFAULT_CHAT_TEMPLATE
    train = datasets.load_dataset("json", data_files=args.dataset)["train"]  # every row, as ours trains on
    fast = dict(gradient_checkpointing=False)
    if args.trainer != "reward":
        fast["precompute_ref_log_probs"] = True
    config = config_class(
        output_dir=str(Path(args.output_dir) / "trainer"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_ratio,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_length=args.max_length,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        use_cpu=not cuda,
        disable_tqdm=True,
        bf16=False,
        deepspeed=zero_config.choose_optimizer(json.loads(json.dumps(HF_ZERO2)), cuda),
        seed=42,
        data_seed=42,
        dataloader_pin_memory=cuda,
        **({} if args.trainer == "reward" else {"beta": args.beta}),
        **(fast if args.fast else {}),
    )
    torch.manual_seed(42)  # a reward model's new head, as ours draws it
    model = model_class.from_pretrained(args.model, dtype=torch.float32, **model_args)
    model.config.pad_token_id = tokenizer.pad_token_id
    trainer = trainer_class(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    out = trainer.train()
    trainer.save_model(str(Path(args.output_dir) / "final"))
    if int(os.environ.get("RANK", 0)) == 0:
        tokenizer.save_pretrained(str(Path(args.output_dir) / "final"))
        base.write_json(
            Path(args.output_dir) / "results.json",
            {
                "train_loss": out.training_loss,
                "steps": out.global_step,
                "train_runtime_s": out.metrics["train_runtime"],
                "rows": len(train),
            },
        )


if __name__ == "__main__":
    distributed.run_distributed(main)
