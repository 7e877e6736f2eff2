"""What the scripts at the root share and is not their lesson: data, the loss, models, the training loop's helpers,
checkpoints and stopping, the hang report, sequence parallelism, trackers, the GPU's decisions, DeepSpeed's
plumbing, the bytes a rank holds, and the demo."""
import logging

# bitsandbytes' CPU backend says at import, on every rank, that an optional package of hub kernels is missing (it runs
# its own): said before training.quiet could silence it, and not ours to show (the transformers Trainer imports it)
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
