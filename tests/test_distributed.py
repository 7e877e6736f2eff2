"""Who a process is and how it ends under any launcher (finetune/distributed.py), fed the facts a launcher would
give: SLURM's variables and node lists, a world of one, Ctrl-C, the CPU teardown."""

from pathlib import Path

import pytest

from finetune import distributed

pytestmark = pytest.mark.quick  # in process: `make test-quick`


def slurm(procid, ntasks=2, localid=None, **more):
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(procid if localid is None else localid),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        **more,
    }


def test_srun_tasks_form_one_world():
    env = distributed.slurm_env(slurm(3, ntasks=16, localid=3))
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 4242 % 20000),
    }
    assert distributed.slurm_env(slurm(0, MASTER_PORT="29600"))["MASTER_PORT"] == "29600"
    assert distributed.slurm_env({**slurm(1), "RANK": "1"}) is None  # torchrun or deepspeed already set it up
    assert distributed.slurm_env(slurm(0, ntasks=1)) is None  # a batch script or `srun --pty bash`: one task
    environ = slurm(1, localid=1)
    assert distributed.launch_env(environ)[:3] == (1, 1, 2) and environ["MASTER_ADDR"] == "gpu07"


def test_srun_without_its_variables_is_one_line():
    broken = slurm(1)
    del broken["SLURM_LOCALID"]
    with pytest.raises(SystemExit, match="error: srun started this task without SLURM_PROCID, SLURM_LOCALID"):
        distributed.slurm_env(broken)


@pytest.mark.parametrize(
    "nodes, first",
    [
        ("gpu[07-08,11],cpu1", "gpu07"),
        ("rack[1-2]-n[01-04]", "rack1-n01"),
        ("a[1-2]-ib", "a1-ib"),
        ("n01,n02", "n01"),
        ("node001", "node001"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert distributed.first_host(nodes) == first


def test_the_teardown_workaround_is_for_cpu_runs_only():
    assert distributed.skip_teardown(cuda_available=False) and not distributed.skip_teardown(cuda_available=True)


def test_ctrl_c_is_one_line_from_rank_0_and_silence_from_the_others(monkeypatch):
    """The terminal sends SIGINT to every rank: rank 0 says what happened, the others exit 130 without a word."""

    def interrupted():
        raise KeyboardInterrupt

    for rank, code in (
        ("0", "stopped by Ctrl-C; what was logged is on disk, and --resume continues from the newest checkpoint"),
        ("1", 130),
    ):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            distributed.run_distributed(interrupted)
        assert e.value.code == code


@pytest.mark.parametrize(
    "facts, launcher, token",
    [
        ({"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, 4021, "deepspeed-4021"),  # deepspeed, one host
        ({"WORLD_SIZE": "4", "LOCAL_SIZE": "2"}, 4021, None),  # deepspeed over two hosts: a launcher on each
        (
            {
                "WORLD_SIZE": "2",
                "LOCAL_SIZE": "2",
                "SLURM_JOB_ID": "77",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_TASKS": "1",
            },
            4021,
            "deepspeed-4021",
        ),  # job/slurm.sbatch: srun starts the deepspeed launcher on the first node
        (
            {"WORLD_SIZE": "4", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "4"},
            None,
            "slurm-77.3",
        ),
        (
            {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"},
            None,
            None,
        ),  # torchrun: its agent
        ({"WORLD_SIZE": "1", "LOCAL_SIZE": "1"}, 4021, None),  # a world of one meets no one
        ({"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, None, None),  # a launcher that is not deepspeed's
    ],
)
def test_a_launch_token_is_the_same_on_every_rank_of_a_launch(facts, launcher, token):
    """Each rank of a launch finds the same token (or none): they differ in RANK and LOCAL_RANK only."""
    found = {
        distributed.launch_token({**facts, "RANK": str(r), "LOCAL_RANK": str(r % 2)}, launcher)
        for r in range(int(facts["WORLD_SIZE"]))
    }
    assert found == {token}


@pytest.mark.quick
def test_a_world_of_one_takes_a_port_the_kernel_hands_nobody():
    """A plain run's rendezvous port is free and below the kernel's ephemeral range, where ports bound to 0 and
    outgoing connections come from (another process took one between the check and the bind, once)."""
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {distributed.unclaimed_port() for _ in range(5)}
    assert all(port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
