#!/usr/bin/env bash
# The GPU smoke test, in one command, on a machine with one NVIDIA GPU: the pair on OPT-125m's shape (random weights),
# bf16: single-gpu.py (also --compile), zero-optimization.py at ZeRO-0, 2, 3 and ZeRO-3 + CPU offload; the losses
# against the single-GPU run's, each export reloaded with stock transformers, a table at the end.
#     bash bench/gpu_check.sh [steps]        (out/gpu-check/; then: python3 bench/run.py --set gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PYTHON" bench/gpu_check.py --steps "${1:-30}"
