"""Check a machine or the nodes of a hostfile before a launch.

    python3 job/preflight.py --offload cpu     # what ZeRO-Offload needs here (--offload nvme: NVMe offload)
    python3 job/preflight.py --hostfile job/hostfile [--master-addr HOST] [--master-port 29500]

--offload: DeepSpeed compiles its CPU Adam (the optimizer step of ZeRO-Offload) on first use, and for NVMe its
async I/O op; what they need is checked here, without building, one line each, instead of a traceback minutes into
the first run. The default path (no offload) compiles nothing.
--hostfile: what the deepspeed launcher needs: a valid hostfile, pdsh here, passwordless SSH and pdsh to every host,
the same Python, repo path and package versions there, that every host reaches the master port here, and that one
process a host forms a gloo group there (the interface each offers the others is the one the scripts pick). One line
per host and check: ok, or what failed and how to fix it. Exit code 0 only if everything is ok.
"""
import argparse
import contextlib
import os
import re
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")
PACKAGES = ("torch", "deepspeed", "transformers")
VERSIONS = f"import {', '.join(PACKAGES)}; print(' '.join(m.__version__ for m in ({', '.join(PACKAGES)})))"


def parse_hostfile(path):
    """[(host, slots)] in file order; exits with one line naming the file, the line and the fix on any error."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        sys.exit(f"error: cannot read hostfile {path} ({e.strerror}); pass --hostfile")
    hosts, seen = [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path} line {number}: {line!r}"
        match = LINE.match(line)
        if not match:
            sys.exit(f"error: {where}: write '<host> slots=<GPUs>', e.g. 'node1 slots=8'")
        host, slots = match["host"], match["slots"]
        if not slots.isdigit() or int(slots) == 0:
            sys.exit(f"error: {where}: slots must be a positive whole number, e.g. '{host} slots=8'")
        if host in seen:
            sys.exit(f"error: {where}: host {host} is already on line {seen[host]}; list each host once")
        seen[host] = number
        hosts.append((host, int(slots)))
    if not hosts:
        sys.exit(f"error: {path} lists no hosts; add lines like 'node1 slots=8'")
    return hosts


def run(cmd, timeout=20):
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return done.returncode, (done.stdout + done.stderr).strip()
    except subprocess.TimeoutExpired:
        return 124, f"no answer in {timeout} s"


def ssh(host, command, timeout=20):
    return run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, command], timeout)


def local_versions():
    return run([sys.executable, "-c", VERSIONS], timeout=120)[1].splitlines()[-1]  # the last line: imports may warn


# the host's memlock limit (KiB, or "unlimited"), its InfiniBand devices, its GPUs ("-": no nvidia-smi to ask)
HOST_FACTS = ("ulimit -l; ls /sys/class/infiniband 2>/dev/null | wc -l; "
              "if command -v nvidia-smi >/dev/null; then nvidia-smi --list-gpus | wc -l; else echo -; fi")


def limits_problem(host, slots, memlock, infiniband, gpus):
    """What a host's limits would break, from HOST_FACTS' three answers (as the launcher's ssh session sees them), or
    None. NCCL over InfiniBand registers (pins) its buffers, and fails to when the memlock limit is below unlimited;
    the launcher starts one rank per slot, each on its own GPU."""
    if int(infiniband) and memlock != "unlimited":
        return (f"memlock limit is {memlock} KiB, and NCCL over InfiniBand needs it unlimited: add '* - memlock "
                f"unlimited' to /etc/security/limits.conf there (containers: --ulimit memlock=-1)")
    if gpus != "-" and int(gpus) != slots:
        return (f"{gpus} GPUs for {slots} slots: set '{host} slots={gpus}' in the hostfile" if int(gpus) else
                "nvidia-smi sees no GPU: check the driver there")
    return None


def check_host(host, slots, master_addr, master_port, want_versions):
    """The first problem found on this host, with its fix, or None. want_versions: a future of local_versions()."""
    status, out = ssh(host, "true")
    if status:
        return (f"passwordless ssh fails ({out.splitlines()[-1] if out else status}): "
                f"ssh-copy-id {host}, or add it to ~/.ssh/config")
    status, out = run(["pdsh", "-R", "ssh", "-w", host, "true"])
    if status:
        return f"pdsh cannot reach it ({out.splitlines()[-1] if out else status}): check ssh for the user pdsh runs as"
    if ssh(host, f"test -f {shlex.quote(str(REPO / 'zero-optimization.py'))}")[0]:
        return f"no repo at {REPO}: put the repo at the same path on every node (a shared file system is easiest)"
    # importing torch, deepspeed and transformers on a node with a cold file cache can take a while
    status, out = ssh(host, f"{shlex.quote(sys.executable)} -c {shlex.quote(VERSIONS)}", timeout=120)
    if status:
        return f"{sys.executable} cannot import {', '.join(PACKAGES)} there: install the same environment on every node"
    theirs, ours = out.splitlines()[-1], want_versions.result()
    if theirs != ours:
        return f"other versions ({', '.join(PACKAGES)}): {theirs} there, {ours} here; install the same ones"
    connect = f"import socket; socket.create_connection(({master_addr!r}, {master_port}), timeout=5)"
    if ssh(host, f"{shlex.quote(sys.executable)} -c {shlex.quote(connect)}")[0]:
        return (f"cannot reach {master_addr}:{master_port} (the master port): open it in the firewall, or pass "
                f"--master_addr an address of this node that {host} reaches")
    status, out = ssh(host, HOST_FACTS)
    return f"cannot read its limits ({out})" if status else limits_problem(host, slots, *out.split())


# one process a host joins a gloo group at the master, through the interface the scripts pick, and sums its rank
MESH = ("import datetime, os, sys; sys.path.insert(0, {repo!r}); import torch, torch.distributed as dist; "
        "from finetune import distributed; distributed.gloo_interface(os.environ); "
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=30)); t = torch.ones(1); "
        "dist.all_reduce(t); print(os.environ.get('GLOO_SOCKET_IFNAME', 'default'), int(t), flush=True); "
        "os._exit(0)")  # not gloo's teardown at exit: with a peer gone first it may abort ("terminate called ...")


def accept_all(listener):
    """Accept and close every connection until the listener is closed."""
    with contextlib.suppress(OSError):
        while True:
            listener.accept()[0].close()


def free_port():
    """A port free here (the master's host) for the gloo group: the master port's own closed connections may hold it
    a while (TIME_WAIT)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_mesh(hosts, master_addr, master_port):
    """Every host in one gloo group, as the ranks will be (the stop vote and hang reports use gloo beside NCCL): the
    ranks offer each other the address of the interface that reaches the master. [(host, problem or None,
    interface)]; a host that cannot connect is named, within the group's 30 s timeout."""
    procs = []
    for rank, (host, _) in enumerate(hosts):
        env = f"RANK={rank} WORLD_SIZE={len(hosts)} MASTER_ADDR={master_addr} MASTER_PORT={master_port}"
        command = f"{env} {shlex.quote(sys.executable)} -c {shlex.quote(MESH.format(repo=str(REPO)))}"
        procs.append(subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, command],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    found = []
    for (host, _), proc in zip(hosts, procs):
        try:
            out = proc.communicate(timeout=150)[0].strip().splitlines()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = ["no answer in 150 s"]
        words = out[-1].split() if out else []
        if proc.returncode == 0 and len(words) == 2 and words[1] == str(len(hosts)):
            found.append((host, None, words[0]))
        else:
            error = next((line for line in reversed(out) if "Error" in line or "error" in line), out[-1] if out else "")
            found.append((host, f"its rank could not join the others' gloo group ({error.strip()[-160:]}): set "
                                 f"GLOO_SOCKET_IFNAME in .deepspeed_env to the interface between the nodes", None))
    return found


def offload_facts():
    """What this machine has for DeepSpeed's offload ops (read, nothing built)."""
    import sysconfig

    import torch.utils.cpp_extension as ce
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return {"prebuilt_cpu_adam": bool(installed_ops.get("cpu_adam")),
            "prebuilt_aio": bool(installed_ops.get("async_io")),
            "cxx": shutil.which(ce.get_cxx_compiler()), "ninja": ce.is_ninja_available(),
            "python_h": Path(sysconfig.get_paths()["include"], "Python.h").exists(),
            "cuda": __import__("torch").cuda.is_available(), "cuda_home": ce.CUDA_HOME,
            "libaio": AsyncIOBuilder().is_compatible(verbose=False),
            "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0], "root": os.geteuid() == 0}


def offload_problems(kind, have):
    """One line per missing piece for --offload cpu or nvme, given offload_facts(): DeepSpeedCPUAdam is C++ (a compiler
    with OpenMP, ninja, Python's headers; no CUDA toolkit), NVMe adds the async I/O op (libaio's headers and library,
    and on a CUDA machine the CUDA toolkit, CUDA_HOME, which it links against)."""
    problems = []
    if not have["prebuilt_cpu_adam"]:
        if not have["cxx"]:
            problems.append("no C++ compiler for DeepSpeed's CPU Adam: apt-get install g++ (or set CXX)")
        if not have["ninja"]:
            problems.append("no ninja to build DeepSpeed's CPU Adam: pip install ninja")
        if not have["python_h"]:
            problems.append("no Python.h for DeepSpeed's CPU Adam: apt-get install python3-dev")
    if kind == "nvme" and not have["prebuilt_aio"]:
        if not have["libaio"]:
            problems.append("no libaio for NVMe offload: apt-get install libaio-dev (or set CFLAGS/LDFLAGS to yours)")
        if have["cuda"] and not have["cuda_home"]:
            problems.append("no CUDA toolkit (CUDA_HOME) for NVMe offload's async I/O op on this CUDA machine: install "
                            "the toolkit that matches torch.version.cuda and set CUDA_HOME")
    if kind == "nvme" and have["memlock"] != resource.RLIM_INFINITY and not have["root"]:  # root may lock any amount
        problems.append(f"memlock limit {have['memlock'] // 1024} KiB: NVMe offload locks its swap buffers (GBs: "
                        f"plan.py's CPU figure) with mlock, which fails past it: ulimit -l unlimited (limits.conf; "
                        f"containers: --ulimit memlock=-1)")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offload", choices=["cpu", "nvme"], help="check what DeepSpeed's offload needs on this machine")
    p.add_argument("--hostfile", default=str(REPO / "job" / "hostfile"))
    p.add_argument("--master-addr", help="address of this node as the others reach it (default: the first host)")
    p.add_argument("--master-port", type=int, default=29500)
    args = p.parse_args(argv)
    if args.offload:
        problems = offload_problems(args.offload, offload_facts())
        print("\n".join(problems) or f"--offload {args.offload}: everything DeepSpeed needs is here")
        return 1 if problems else 0

    hosts = parse_hostfile(args.hostfile)
    master_addr = args.master_addr or hosts[0][0]
    print(f"{len(hosts)} hosts, {sum(s for _, s in hosts)} processes; master {master_addr}:{args.master_port}")
    if not shutil.which("pdsh"):
        print("here: pdsh is missing: apt-get install pdsh (or yum install pdsh), or use the torchrun recipe")
        return 1
    try:  # listen on the master port while the hosts try to connect, as rank 0 will
        listener = socket.create_server(("", args.master_port))
    except OSError as e:
        print(f"here: cannot listen on port {args.master_port} ({e.strerror}): pick a free one with --master-port")
        return 1
    threading.Thread(target=accept_all, args=(listener,), daemon=True).start()
    # every host at once, and this one's versions beside them: each imports torch, deepspeed and transformers (seconds
    # a host; one after the other, a minute for 16 nodes)
    with ThreadPoolExecutor(max_workers=min(32, len(hosts) + 1)) as pool:
        want = pool.submit(local_versions)
        problems = list(pool.map(lambda h: check_host(*h, master_addr, args.master_port, want), hosts))
    failed = 0
    for (host, slots), problem in zip(hosts, problems):
        failed += problem is not None
        print(f"{host} ({slots} slots): {problem or 'ok'}")
    listener.close()
    if not failed and len(hosts) > 1:  # the hosts' ranks reach each other, not only the master port
        for host, problem, interface in check_mesh(hosts, master_addr, free_port()):
            failed += problem is not None
            print(f"{host}: gloo {'through ' + interface if interface else 'failed'}: {problem or 'ok'}")
    print("all hosts ok: launch with deepspeed --hostfile" if not failed else f"{failed} host(s) to fix")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
