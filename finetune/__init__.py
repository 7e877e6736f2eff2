"""What the scripts at the root share and is not their lesson: data, the loss, models, the training loop's helpers,
checkpoints and stopping, the hang report, sequence parallelism, trackers, the GPU's decisions, DeepSpeed's
plumbing, the bytes a rank holds, and the demo."""
