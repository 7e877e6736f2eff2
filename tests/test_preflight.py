"""job/preflight.py in process: what each host's limits and a hostfile say, the shipped hostfile, what DeepSpeed's
offload needs on a machine (the run across real hosts: test_job.py)."""

import os
import resource
import subprocess
import sys

import pytest
from helpers import ROOT

GPU_MACHINE = {
    "prebuilt_cpu_adam": False,
    "prebuilt_aio": False,
    "cxx": "/usr/bin/c++",
    "ninja": True,
    "python_h": True,
    "cuda": True,
    "cuda_home": "/usr/local/cuda",
    "libaio": True,
    "memlock": resource.RLIM_INFINITY,
    "root": False,
}


@pytest.mark.parametrize(
    "facts, problem",
    [
        ("unlimited 4 8", None),
        ("64 0 8", None),  # no InfiniBand: NCCL's sockets pin nothing
        ("8192 0 -", None),  # no nvidia-smi (a CPU host): the GPUs are not counted
        ("64 4 8", "memlock limit is 64 KiB, and NCCL over InfiniBand needs it unlimited"),
        ("unlimited 2 4", "4 GPUs for 8 slots: set 'gpu07 slots=4' in the hostfile"),
        ("unlimited 2 0", "nvidia-smi sees no GPU"),
    ],
)
@pytest.mark.quick
def test_preflight_reads_each_hosts_limits(facts, problem):
    sys.path.insert(0, str(ROOT / "job"))
    import preflight

    found = preflight.limits_problem("gpu07", 8, *facts.split())
    assert found == problem if problem is None else found.startswith(problem)


@pytest.mark.parametrize(
    "content, message",
    [
        ("node1 slots=8\nnode2 slots=eight\n", "line 2: 'node2 slots=eight': slots must be a positive whole number"),
        ("node1 slots=8\nnode1 slots=8\n", "line 2: 'node1 slots=8': host node1 is already on line 1"),
        ("node1 8\n", "line 1: 'node1 8': write '<host> slots=<GPUs>'"),
        ("node1 slots=0\n", "slots must be a positive whole number"),
        ("# only comments\n\n", "lists no hosts"),
    ],
)
@pytest.mark.quick
def test_preflight_rejects_bad_hostfiles(tmp_path, content, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(content)
    run = subprocess.run(
        [sys.executable, str(ROOT / "job" / "preflight.py"), "--hostfile", str(hostfile)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and run.stderr.startswith("error: ") and message in run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.quick
def test_the_shipped_hostfile_parses():
    sys.path.insert(0, str(ROOT / "job"))
    import preflight

    assert preflight.parse_hostfile(ROOT / "job" / "hostfile") == [("node1", 8), ("node2", 8)]


@pytest.mark.parametrize(
    "kind, missing, lines",
    [
        ("cpu", {}, []),
        ("cpu", {"cxx": None, "python_h": False}, ["no C++ compiler", "no Python.h"]),
        ("cpu", {"cuda_home": None}, []),  # CPU Adam is C++ only: no CUDA toolkit needed (torch from PyPI has none)
        ("nvme", {"cuda_home": None, "libaio": False}, ["no libaio", "no CUDA toolkit (CUDA_HOME)"]),
        ("nvme", {"cuda": False, "cuda_home": None}, []),  # on a CPU machine async I/O needs no toolkit
        ("nvme", {"prebuilt_cpu_adam": True, "prebuilt_aio": True, "cxx": None, "libaio": False}, []),  # ops prebuilt
        ("nvme", {"prebuilt_aio": True, "memlock": 8 << 20}, ["memlock limit 8192 KiB"]),  # mlock fails past it
        ("nvme", {"memlock": 8 << 20, "root": True}, []),
        ("cpu", {"memlock": 8 << 20}, []),  # CPU offload pins through torch (cudaHostAlloc), not mlock
    ],
)
@pytest.mark.quick
def test_offload_preflight_says_what_is_missing(kind, missing, lines):
    sys.path.insert(0, str(ROOT / "job"))
    import preflight

    problems = preflight.offload_problems(kind, {**GPU_MACHINE, **missing})
    assert len(problems) == len(lines) and all(p.startswith(line) for p, line in zip(problems, lines)), problems


def test_offload_preflight_on_this_machine():
    """This machine has a compiler, ninja and Python's headers (CI's too): CPU offload is ready."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "job" / "preflight.py"), "--offload", "cpu"],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0 and "--offload cpu: everything DeepSpeed needs is here" in run.stdout, run.stdout
