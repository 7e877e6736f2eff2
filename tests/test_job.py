"""job/: a real launch on two hosts over SSH, the preflight check, the SLURM script's launch lines (a real SLURM runs
it in test_slurm.py).

The two hosts are network namespaces on this machine joined by a veth pair, each with its own address and its own
sshd (throwaway keys, its own AuthorizedKeysFile and known_hosts). An `ssh` wrapper first on PATH adds `-F <its
config>`: DeepSpeed's launcher and pdsh both call plain `ssh`. Nothing is written to ~/.ssh."""

import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TEST_HOOKS, assert_close_losses, check, free_port, launch, long_run, results

from finetune import distributed

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def hosts_unavailable():
    """Why this machine cannot make the two hosts, or None."""
    missing = [
        name
        for name, found in (
            ("sshd", os.path.exists(SSHD)),
            ("pdsh", shutil.which("pdsh")),
            ("ssh-keygen", shutil.which("ssh-keygen")),
            ("ip", shutil.which("ip")),
        )
        if not found
    ]
    if missing:
        return (
            f"{', '.join(missing)} missing (.ci/run installs openssh-server, pdsh and iproute2 from Debian's packages)"
        )
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two hosts with their own addresses: network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), each
    with its own sshd on port 22 (throwaway keys), as two nodes of a cluster are. `hosts["on"](1, cmd)` is cmd run on
    the first host. An `ssh` wrapper first on PATH adds `-F <its config>` (DeepSpeed's launcher and pdsh both call
    plain `ssh`). The hosts share this machine's files and its name, which resolves to loopback, as on many clusters.
    Nothing is written to ~/.ssh."""
    problem = hosts_unavailable()
    if problem:
        if os.environ.get("CI"):  # CI must run the multi-node launches, not skip them
            pytest.fail(problem)
        pytest.skip(problem)
    d = tmp_path_factory.mktemp("hosts")
    names, addresses = [f"ft{os.getpid()}-{i}" for i in (1, 2)], ["10.77.0.1", "10.77.0.2"]
    devices = [f"ft{os.getpid() % 10**8}v{i}" for i in (1, 2)]  # an interface's name: at most 15 characters
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)
    for key in ("client_key", "host_key_1", "host_key_2"):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key))
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    (d / "known_hosts").write_text(
        "".join(
            f"{a} {' '.join((d / f'host_key_{i}.pub').read_text().split()[:2])}\n" for i, a in zip((1, 2), addresses)
        )
    )
    (d / "ssh_config").write_text(
        f"Host closed\n  HostName {addresses[1]}\n  Port 2\n"  # nothing listens there: an unreachable host
        f"Host 10.77.0.* closed\n  User {getpass.getuser()}\n  IdentityFile {d}/client_key\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n"
        f"  LogLevel ERROR\n"
    )  # no keep-alive, as a user's: a cut link leaves an ssh waiting (SSH's default)
    (d / "bin").mkdir()
    (d / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n')
    (d / "bin" / "ssh").chmod(0o755)
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder
    on = lambda host, cmd: ["ip", "netns", "exec", names[host - 1], *map(str, cmd)]
    sshds = []
    try:
        for name in names:
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        sh(
            "ip",
            "link",
            "add",
            devices[0],
            "netns",
            names[0],
            "type",
            "veth",
            "peer",
            "name",
            devices[1],
            "netns",
            names[1],
        )
        for i, (name, address, device) in enumerate(zip(names, addresses, devices), 1):
            sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", device)
            sh("ip", "-n", name, "link", "set", device, "up")
            (d / f"sshd_config_{i}").write_text(
                f"Port 22\nListenAddress {address}\nHostKey {d}/host_key_{i}\nAuthorizedKeysFile {d}/authorized_keys\n"
                f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\nUsePAM no\n"
                f"StrictModes no\nPermitRootLogin prohibit-password\nPidFile {d}/sshd_{i}.pid\n"
            )
            sshds.append(
                subprocess.Popen(
                    on(i, [SSHD, "-D", "-e", "-f", d / f"sshd_config_{i}"]), stderr=open(d / f"sshd_{i}.log", "w")
                )
            )
        for address in addresses:  # both sshds answer, seen from the first host
            for _ in range(100):
                if not subprocess.run(
                    on(1, ["bash", "-c", f"exec 3<>/dev/tcp/{address}/22"]), capture_output=True
                ).returncode:
                    break
                time.sleep(0.1)
        path = f"{d}/bin:{Path(sys.executable).parent}:{os.environ['PATH']}"
        # what the remote ranks need of our environment: DeepSpeed's launcher exports the lines of DS_ENV_FILE
        (d / "ds_env").write_text(f"PATH={path}\nOMP_NUM_THREADS=1\nHF_HUB_OFFLINE=1\nHF_DATASETS_OFFLINE=1\n")
        env = {**os.environ, "PATH": path, "DS_ENV_FILE": str(d / "ds_env"), "OMP_NUM_THREADS": "1"}
        yield {"dir": d, "env": env, "addresses": addresses, "names": names, "devices": devices, "on": on}
    finally:
        for sshd in sshds:
            sshd.terminate()
            sshd.wait(timeout=10)
        for name in names:
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)  # what a test left running on a host
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its end of the veth pair with it


def cmdline(pid):
    """A process's command line, or "" once it has ended (between listing the processes and reading it)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_two_hosts_over_ssh_train_and_a_host_lost_mid_run_ends_the_job_and_the_first_resumes_alone(
    hosts, tiny, uninterrupted, tmp_path
):
    """The deepspeed launcher on the first host reaches the second over pdsh with a hostfile of addresses; the ranks
    meet at the first host's address, each through the interface that reaches it (without that, the second rank
    offers gloo's peers 127.0.0.1, what the hosts' name resolves to, and the first cannot connect) and train under
    ZeRO-3. Then the second host's link is cut after a checkpoint (its rank neither answers nor closes a connection):
    within --dist-timeout (20 s here) the first host's rank says which rank did not report, and the whole launch
    ends within --dist-timeout + 30 s of the cut under SSH's defaults (no keep-alive: the launcher's ssh to the lost
    host would wait for ever; the reporting rank ends its sessions, hangs.end_launcher_sessions), nothing of it left
    on the first host, the newest checkpoint whole; `--resume auto` on the first host alone (1 rank, the
    same global batch) continues to the uninterrupted run's losses (ZeRO-2 on 2 ranks of one host: the steps before
    the cut are the two hosts')."""
    hostfile, out, log = tmp_path / "hostfile", tmp_path / "run", tmp_path / "log"
    hostfile.write_text("".join(f"{a} slots=1\n" for a in hosts["addresses"]))
    argv = long_run(tiny, out, "--dist-timeout", "20", "--zero-stage", "3")
    cmd = [
        Path(sys.executable).parent / "deepspeed",
        f"--hostfile={hostfile}",
        f"--master_addr={hosts['addresses'][0]}",
        f"--master_port={free_port()}",
        "zero-optimization.py",
        *argv,
    ]
    launcher = subprocess.Popen(
        hosts["on"](1, cmd),
        cwd=ROOT,
        env=hosts["env"],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "latest").exists():
            assert time.time() < deadline and launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        subprocess.run(["ip", "-n", hosts["names"][1], "link", "set", hosts["devices"][1], "down"], check=True)
        cut = time.time()
        launcher.wait(timeout=120)
        ended_after = time.time() - cut
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        # the link back up: the hosts are the module's, for the tests after this one
        subprocess.run(["ip", "-n", hosts["names"][1], "link", "set", hosts["devices"][1], "up"], check=True)
    text = log.read_text()
    lines = [line for line in text.splitlines() if "error: no progress for " in line]
    assert len(lines) == 1 and "rank 1 did not report" in lines[0] and "rank 0 in " in lines[0], text[-3000:]
    assert launcher.returncode != 0 and ended_after < 20 + 30, ended_after  # the docs' margin: 30 s
    for _ in range(20):  # (the helper that ended the launcher's sessions leaves as soon as pdsh has gone)
        left = [
            pid
            for pid in subprocess.run(
                ["ip", "netns", "pids", hosts["names"][0]], capture_output=True, text=True
            ).stdout.split()
            if "sshd" not in cmdline(pid)
        ]
        if not left:
            break
        time.sleep(0.1)
    assert not left, [cmdline(pid) for pid in left]
    pids = subprocess.run(["ip", "netns", "pids", hosts["names"][1]], capture_output=True, text=True).stdout.split()
    for pid in pids:
        if "zero-optimization" in cmdline(pid):
            os.kill(int(pid), signal.SIGKILL)  # the lost host's rank: its own timeout would end it later
    assert all(f"{a}:" in text for a in hosts["addresses"])  # pdsh ran a launcher on each host
    latest = (out / "checkpoints" / "latest").read_text()
    run = json.loads((out / "checkpoints" / latest / "run.json").read_text())
    assert (run["world_size"], run["global_batch_size"], run["zero_stage"]) == (2, 8, 3), run
    resumed = argv + ["--resume", "auto", "--batch-size", "4"]  # 1 rank: the same global batch
    check(launch("forked", "zero-optimization.py", resumed, nproc=1))
    assert_close_losses(results(uninterrupted)["losses"], results(out)["losses"])


def test_preflight_passes_on_reachable_hosts_and_names_the_broken_one(hosts, tmp_path):
    first, second = hosts["addresses"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{first} slots=1  # first\n\n{second} slots=1\n")
    preflight = hosts["on"](
        1,
        [
            sys.executable,
            ROOT / "job" / "preflight.py",
            "--hostfile",
            hostfile,
            "--master-addr",
            first,
            "--master-port",
            free_port(),
        ],
    )
    run = subprocess.run(preflight, env=hosts["env"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{first} (1 slots): ok" in run.stdout and f"{second} (1 slots): ok" in run.stdout
    # the gloo group formed, each host through its end of the veth pair (not loopback, what their name resolves to)
    for address, device in zip(hosts["addresses"], hosts["devices"]):
        assert f"{address}: gloo through {device}: ok" in run.stdout, run.stdout
    hostfile.write_text(f"{first} slots=1\nclosed slots=1\n")
    run = subprocess.run(preflight, env=hosts["env"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert f"{first} (1 slots): ok" in run.stdout
    assert "closed (1 slots): passwordless ssh fails" in run.stdout and "ssh-copy-id closed" in run.stdout


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "srun"])
def test_slurm_script_writes_the_hostfile_and_the_launch(tmp_path, launcher):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n'
    )
    (fake / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "GPUS_PER_NODE": "4",
        "DRY_RUN": "1",
        "HOSTFILE": str(tmp_path / "hostfile"),
        "LAUNCHER": launcher,
        "SLURM_CPUS_PER_TASK": "32",
    }
    env.pop("MASTER_PORT", None)
    # the port is the job's own, the one distributed.slurm_env gives tasks srun starts without a launcher
    step = {**env, "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    port = distributed.slurm_env(step)["MASTER_PORT"]
    assert port == "20042"
    run = subprocess.run(
        ["bash", str(ROOT / "job" / "slurm.sbatch"), "--model", "m", "--overwrite"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "hostfile").read_text() == "gpu07 slots=4\ngpu08 slots=4\n"
    flags = "zero-optimization.py --deepspeed --resume auto --model m --overwrite"
    if launcher == "deepspeed":  # one launcher, a job step on the first node (SLURM's signals to the steps reach it)
        assert (
            'srun --nodes=1 --ntasks=1 --nodelist=gpu07 --cpus-per-task=32 bash -c trap "" USR1 TERM; exec '
            f'"$@" deepspeed .venv/bin/deepspeed --hostfile={tmp_path}/hostfile --master_addr=gpu07 '
            f"--master_port=20042 {flags}"
        ) in run.stdout
    elif launcher == "torchrun":  # one torchrun a node, whatever the header's tasks
        assert (
            "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=32 .venv/bin/torchrun --nnodes=2 "
            "--nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=gpu07:20042 --rdzv_id=42 "
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=280 "
            f"{flags}"
        ) in run.stdout
    else:  # one task a GPU on every node, each its share of the node's cores; fewer cores than GPUs: one each
        assert (
            f"srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=8 --kill-on-bad-exit=1 "
            f".venv/bin/python3 {flags}"
        ) in run.stdout
        few = subprocess.run(
            ["bash", str(ROOT / "job" / "slurm.sbatch"), "--model", "m", "--overwrite"],
            env={**env, "SLURM_CPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "2"},
            capture_output=True,
            text=True,
        )
        assert (
            "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=1 --overcommit --kill-on-bad-exit=1"
            in few.stdout
        ), few.stdout + few.stderr
    assert "hosts: gpu07 gpu08 (4 GPUs each" in run.stdout
    # a requeued job continues: never --overwrite
    run = subprocess.run(
        ["bash", str(ROOT / "job" / "slurm.sbatch"), "--model", "m", "--overwrite"],
        env={**env, "SLURM_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "--resume auto --model m\n" in run.stdout and "--overwrite dropped" in run.stdout


@pytest.mark.quick
def test_slurm_script_outside_slurm_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run = subprocess.run(
        ["bash", str(ROOT / "job" / "slurm.sbatch")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 2 and "submit with sbatch" in run.stderr


@pytest.mark.quick
def test_every_shell_script_parses():
    scripts = [*ROOT.glob("job/*.sbatch"), *ROOT.glob("job/*.sh"), *ROOT.glob("bench/*.sh"), ROOT / ".ci" / "run"]
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


def test_a_second_launch_on_a_taken_port_is_named_and_leaves_the_first_undisturbed(tiny, tmp_path, uninterrupted):
    """Two deepspeed launches on one machine and one port (the launcher's default, 29500, where a user gives none).
    The first forms its group slowly (its rank 1 joins once the second has ended); the second's rank 1 reaches the
    first's store while it forms (its rank 0 joins 3 s late). The second ends in one line naming the port and the
    first's rank 0, which holds it; the first trains to the uninterrupted run's losses. Before, the second's rank 1
    took rank 1's place in the first's group, and the first run failed with it (distributed.launch_token)."""
    port, gate = free_port(), tmp_path / "second-ended"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": TEST_HOOKS}
    deepspeed = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "zero-optimization.py",
    ]
    first = subprocess.Popen(
        deepspeed + long_run(tiny, tmp_path / "first"),
        cwd=ROOT,
        text=True,
        env={**env, "FINETUNE_TEST_JOIN": f"1:{gate}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 120
        while distributed.port_holder(port) is None and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)  # the first's rank 0 listens: its store is open
        holder = distributed.port_holder(port)
        assert holder and "--local_rank=0" in holder, (holder, first.poll())
        second = subprocess.run(
            deepspeed + long_run(tiny, tmp_path / "second"),
            cwd=ROOT,
            text=True,
            timeout=120,
            env={**env, "FINETUNE_TEST_JOIN": "0:3"},
            capture_output=True,
        )
        gate.touch()
        log = first.communicate(timeout=300)[0]
    finally:
        gate.touch()
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, log[-3000:]
    assert_close_losses(results(uninterrupted)["losses"], results(tmp_path / "first")["losses"])
    lines = [x for x in (second.stdout + second.stderr).splitlines() if x.startswith("error: ")]
    assert second.returncode != 0 and len(lines) == 1, second.stdout[-3000:] + second.stderr[-3000:]
    assert lines[0].startswith(
        f"error: port {port} on {os.uname().nodename} is taken by another process ({holder[:40]}"
    ), lines[0]
    assert not (tmp_path / "second" / "results.json").exists()
