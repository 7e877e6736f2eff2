"""Several runs of zero-optimization.py in one launch, one after the other in the same processes: what the model
matrix (test_models.py) launches, so that the interpreter, the imports and the process group are paid for once
rather than once a model. Each run is main(argv) as the launcher would start it, but for the group, left open for
the next run. The argvs are a JSON list of lists in the file named by the first argument."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from finetune import distributed  # noqa: E402


def main():
    spec = importlib.util.spec_from_file_location("zero_optimization", ROOT / "zero-optimization.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rank_flag = [a for a in sys.argv[1:] if a.startswith("--local_rank")]  # from the deepspeed launcher
    runs = json.loads(Path(next(a for a in sys.argv[1:] if a not in rank_flag)).read_text())
    close = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # the next run uses the same group
    try:
        for argv in runs:
            script.main(argv + rank_flag)
    finally:
        dist.destroy_process_group = close
    dist.destroy_process_group()


if __name__ == "__main__":
    distributed.run_distributed(main)
