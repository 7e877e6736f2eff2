"""What every module of the package uses, below them all (it imports none of them): the repository's root, the
one-line failure, and the atomic JSON write."""
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: the scripts, the configs, .demo/


def fail(message):
    """Stop with one line that says what is wrong and what to do (no traceback: it is not our bug)."""
    raise SystemExit(f"error: {message}")


def write_json(path, data):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file

