#!/usr/bin/env bash
# The GPU benchmark in one command, for a short GPU slot (at most 8 minutes on one H100 or H200): bench/gpu.py's
# table of tok/s, MFU, peak memory against plan.py's, kernel launches and device syncs per step, for single-gpu.py,
# ZeRO-0/2/3, ZeRO-3 + CPU offload and the HF Trainer's recipe, at OPT-125m's and Llama-3.2-1B's shapes.
#     bash bench/gpu.sh [--dry] [bench/gpu.py's flags]      (out/gpu/GPU.md; also $OUT/GPU.md where $OUT is set)
# A bare GPU machine without network: what it lacks (deepspeed, datasets, ...) comes from .whl/ beside this repo
# (bash ../shared/gpu/wheelhouse.sh builds it), installed under /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PYTHON" -c "import deepspeed, datasets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1
exec "$PYTHON" bench/gpu.py "$@"
