"""`as_deepspeed.py VERSION SCRIPT ARGS...`: run SCRIPT with deepspeed.__version__ reading VERSION, as a DeepSpeed
release the mends were not written for would (finetune/internals/mends.py decides from that string alone)."""

import os
import runpy
import sys

import deepspeed

deepspeed.__version__ = sys.argv[1]
script = os.path.abspath(sys.argv[2])
sys.argv, sys.path[0] = sys.argv[2:], os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
