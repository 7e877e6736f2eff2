"""`cpu_fp16.py SCRIPT ARGS...`: run SCRIPT with DeepSpeed's CPU accelerator answering yes to fp16, so a test can
take DeepSpeed's fp16 path (16-bit weights, fp32 masters, its dynamic loss scale) on a CPU. DeepSpeed asks oneDNN,
which has no fp16 kernels on most CPUs; torch's own CPU kernels compute in fp16 all the same. FP16_INIT_SCALE and
FP16_GROWTH_INTERVAL set training.FP16_SCALER (which the DeepSpeed config must match), so that a test can make the
first steps overflow, or the scale grow within a few steps."""

import os
import runpy
import sys

from deepspeed.accelerator import get_accelerator

type(get_accelerator()).is_fp16_supported = lambda self: True
script = os.path.abspath(sys.argv[1])
sys.argv, sys.path[0] = sys.argv[1:], os.path.dirname(script)
from finetune import training  # noqa: E402  (after the path: the script's package)

for key, name, kind in (("init_scale", "FP16_INIT_SCALE", float), ("growth_interval", "FP16_GROWTH_INTERVAL", int)):
    training.FP16_SCALER[key] = kind(os.environ.get(name, training.FP16_SCALER[key]))
runpy.run_path(script, run_name="__main__")
