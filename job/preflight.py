"""Check the nodes of a hostfile before a multi-node launch; run it on the node you will launch from.

    python3 job/preflight.py --hostfile job/hostfile [--master-addr HOST] [--master-port 29500]

It checks what the deepspeed launcher needs: a valid hostfile, pdsh here, passwordless SSH and pdsh to every host,
the same Python, repo path and package versions there, and that every host reaches the master port here.
One line per host: ok, or what failed and how to fix it. Exit code 0 only if everything is ok.
"""
import argparse
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
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


def ssh(host, command):
    return run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, command])


def local_versions():
    return run([sys.executable, "-c", VERSIONS])[1].splitlines()[-1]  # the last line: imports may warn first


def check_host(host, master_addr, master_port, want_versions):
    """The first problem found on this host, with its fix, or None."""
    status, out = ssh(host, "true")
    if status:
        return (f"passwordless ssh fails ({out.splitlines()[-1] if out else status}): "
                f"ssh-copy-id {host}, or add it to ~/.ssh/config")
    status, out = run(["pdsh", "-R", "ssh", "-w", host, "true"])
    if status:
        return f"pdsh cannot reach it ({out.splitlines()[-1] if out else status}): check ssh for the user pdsh runs as"
    if ssh(host, f"test -f {shlex.quote(str(REPO / 'zero-optimization.py'))}")[0]:
        return f"no repo at {REPO}: put the repo at the same path on every node (a shared file system is easiest)"
    status, out = ssh(host, f"{shlex.quote(sys.executable)} -c {shlex.quote(VERSIONS)}")
    if status:
        return f"{sys.executable} cannot import {', '.join(PACKAGES)} there: install the same environment on every node"
    if out.splitlines()[-1] != want_versions:
        theirs = out.splitlines()[-1]
        return f"other versions ({', '.join(PACKAGES)}): {theirs} there, {want_versions} here; install the same ones"
    connect = f"import socket; socket.create_connection(({master_addr!r}, {master_port}), timeout=5)"
    if ssh(host, f"{shlex.quote(sys.executable)} -c {shlex.quote(connect)}")[0]:
        return (f"cannot reach {master_addr}:{master_port} (the master port): open it in the firewall, or pass "
                f"--master_addr an address of this node that {host} reaches")
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", default=str(REPO / "job" / "hostfile"))
    p.add_argument("--master-addr", help="address of this node as the others reach it (default: the first host)")
    p.add_argument("--master-port", type=int, default=29500)
    args = p.parse_args(argv)

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
    threading.Thread(target=lambda: [listener.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
    want = local_versions()
    failed = 0
    for host, slots in hosts:
        problem = check_host(host, master_addr, args.master_port, want)
        failed += problem is not None
        print(f"{host} ({slots} slots): {problem or 'ok'}")
    listener.close()
    print("all hosts ok: launch with deepspeed --hostfile" if not failed else f"{failed} host(s) to fix")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
