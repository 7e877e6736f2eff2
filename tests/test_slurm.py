"""job/slurm.sbatch on a real SLURM: Debian's slurm-wlm, a one-node cluster with 2 fake GPUs that the tests start on
this machine (tests/slurm_cluster.sh). The script is submitted with sbatch under each launcher; a signal in the form
that reached nothing (deepspeed) or failed the job (torchrun) before, the checkpoint, SLURM's requeue and the resumed
run, whose losses equal the uninterrupted run's; srun's one rank per GPU; a failed run is not requeued."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TEST_HOOKS, assert_close_losses, free_port, long_run, results

TOOLS = ("sbatch", "scontrol", "scancel", "slurmctld", "slurmd", "munged")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment under which sbatch reaches the test cluster."""
    missing = [tool for tool in TOOLS if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}")]
    problem = (
        f"{', '.join(missing)} missing (.ci/run installs slurmctld, slurmd, slurm-client and munge from "
        f"Debian's packages)"
        if missing
        else "slurmd runs jobs as any user: the cluster needs root"
        if os.geteuid()
        else None
    )
    if problem:
        if os.environ.get("CI"):  # CI must run the real SLURM, not skip it
            pytest.fail(problem)
        pytest.skip(problem)
    state = tmp_path_factory.mktemp("slurm")
    script = ROOT / "tests" / "slurm_cluster.sh"
    ports = {"SLURM_TEST_PORT": str(free_port()), "SLURM_TEST_SLURMD_PORT": str(free_port())}
    try:
        started = subprocess.run(
            ["bash", script, "start", state], env={**os.environ, **ports}, capture_output=True, text=True, timeout=120
        )
        assert started.returncode == 0, started.stderr
        env = {
            **os.environ,
            "SLURM_CONF": started.stdout.strip(),
            "PYTHON_BIN": str(Path(sys.executable).parent),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("MASTER_PORT", None)
        yield env
    finally:
        subprocess.run(["bash", script, "stop", state], capture_output=True, timeout=120)


def submit(slurm, launcher, log, flags, **env):
    """The job's id: job/slurm.sbatch submitted as its header says, on 1 node of 2 GPUs and 2 cores."""
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--gpus-per-node=2",
        "--cpus-per-task=2",
        "--partition=gpu",
        "--time=30",
        f"--output={log}",
        "job/slurm.sbatch",
        *flags,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env={**slurm, "LAUNCHER": launcher, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job(slurm, job_id):
    """{JobState, Restarts, ExitCode, ...} of a job, from scontrol."""
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=slurm, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)


def wait_for(condition, what, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.5)


@pytest.mark.parametrize(
    "launcher, signal_form",
    [
        ("deepspeed", ["--signal=USR1"]),  # the steps only: the launcher is a step now (it reached nothing)
        ("torchrun", ["--signal=USR1"]),  # torchrun reports its ranks' 75 as 1: stopped.json decides
        ("srun", ["--batch", "--signal=USR1"]),  # the batch script only (as --signal=B:USR1@...): passed to srun
    ],
)
def test_a_signalled_job_checkpoints_requeues_and_resumes_to_the_uninterrupted_run(
    slurm, tiny, uninterrupted, tmp_path, launcher, signal_form
):
    out, log = tmp_path / "run", tmp_path / "slurm.log"
    # the fresh run waits after step 6 until the signal comes (FINETUNE_TEST_HOLD, tests/hooks): its 54 steps left
    # take seconds, less than a signal can take through slurmctld and slurmd on a busy machine
    job_id = submit(slurm, launcher, log, long_run(tiny, out), FINETUNE_TEST_HOLD="6", PYTHONPATH=TEST_HOOKS)
    # (a state between PENDING and RUNNING, CONFIGURING, is no end: taken for one, the signal went to a job that had
    # no step yet and the run held at step 6 for good)
    wait_for(
        lambda: (out / "checkpoints" / "latest").exists() or job(slurm, job_id)["JobState"] in ENDED, "first checkpoint"
    )
    assert job(slurm, job_id)["JobState"] == "RUNNING", log.read_text()[-3000:]
    subprocess.run(["scancel", *signal_form, job_id], env=slurm, check=True)
    # SLURM starts a requeued job again once the credential of its last run has expired: 120 s by default, 5 s on
    # the test cluster (its cred_expire); `scontrol update StartTime=now` cannot skip it (the job fails: "Job
    # credential revoked")
    wait_for(lambda: job(slurm, job_id)["JobState"] in ENDED, "end of the job")
    said = log.read_text()
    state = job(slurm, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", said[-4000:]
    stopped = re.search(
        rf"the run stopped by SIGUSR1 after step (\d+) with its checkpoint step-(\d+) written \(exit "
        rf"\d+\): requeued job {job_id}\n",
        said,
    )
    assert stopped and stopped[1] == stopped[2] == "6", said[-4000:]  # at the hold: no later
    assert f"resumed at step {stopped[1]} of 60" in said and "the run finished (exit 0)" in said
    r = results(out)
    assert r["world_size"] == 2  # srun: one task per GPU, not the header's one per node
    assert_close_losses(results(uninterrupted)["losses"], r["losses"])


def test_a_failed_job_is_not_requeued_and_one_node_needs_no_ssh(slurm, tmp_path):
    """The deepspeed launcher on one node runs without SSH (the launch itself: `ssh` fails here); a run that failed
    on its own (a model that does not exist) ends the job FAILED, with its status, and no requeue."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ssh").write_text("#!/bin/sh\necho ssh was called >&2\nexit 255\n")
    (tmp_path / "bin" / "ssh").chmod(0o755)
    log = tmp_path / "slurm.log"
    env = {**slurm, "PATH": f"{tmp_path / 'bin'}:{slurm['PATH']}"}
    job_id = submit(env, "deepspeed", log, [f"--output-dir={tmp_path / 'run'}", f"--model={tmp_path / 'none'}"])
    wait_for(lambda: job(slurm, job_id)["JobState"] in ENDED, "end of the job")
    state, said = job(slurm, job_id), log.read_text()
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", said[-3000:]
    assert "error: " in said and "requeue" not in said and "ssh was called" not in said, said[-3000:]
