"""What a forker should not need to open: DeepSpeed's mends (a registry, --mends), the hang report, the bytes a rank
holds, FlashAttention's varlen plumbing, sequence parallelism's all-to-all and the demo's generated assets. The
training step, the loss, the data and the checkpoints are one level up, in finetune/."""
