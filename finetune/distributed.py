"""Who this process is and how it ends, under any launcher: the variables deepspeed, torchrun and srun set (or a
world of one), the collectives' timeouts and the flight recorder, and the entry point that turns a lost rank into one
line. DeepSpeed starts the process group (deepspeed.init_distributed); this only prepares for it and ends cleanly."""
import datetime
import os
import re
import sys
from pathlib import Path

import torch

from . import checkpoints, hardware
from .base import fail


def launch_env(environ=None, world_of_one=True, visible=None):
    """RANK, LOCAL_RANK (this process's place on its node: one per node prepares the data) and WORLD_SIZE, setting
    them (and the rendezvous) when no launcher did.

    deepspeed and torchrun set them. `srun python3 zero-optimization.py` starts one process per task with SLURM's
    variables only: without this, each task would be a silent world of one training the same batches into the same
    folder. A plain `python3` run is a world of one on this host (DeepSpeed would otherwise look for MPI)."""
    environ = os.environ if environ is None else environ
    environ.update(slurm_env(environ) or {})
    if "RANK" not in environ and world_of_one:  # a free port, so two such runs do not collide
        environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=environ.get("MASTER_PORT") or str(unclaimed_port()))
    # DeepSpeed picks the GPU from LOCAL_RANK (the process group's device_id, the engine, ZeRO-3's Init): a process
    # that sees one GPU only (SLURM's --gpus-per-task) must say 0 there; its place on the node stays what it was
    local_rank = int(environ.get("LOCAL_RANK", 0))
    if visible is None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible:
        environ["LOCAL_RANK"] = str(hardware.device_index(local_rank, visible))
    gloo_interface(environ)
    threads = cpu_threads(environ, len(os.sched_getaffinity(0)), os.cpu_count())
    if threads:  # and said where the HF Trainer's accelerate reads it: unset, it picks its own (see cpu_threads)
        torch.set_num_threads(threads)
        environ["OMP_NUM_THREADS"] = str(threads)
    return int(environ.get("RANK", 0)), local_rank, int(environ.get("WORLD_SIZE", 1))


def cpu_threads(environ, usable, node_cores):
    """This rank's share of the node's cores for its CPU work, where nobody chose one: torch's default is every core,
    so N ranks on a node run N times as many threads as there are cores, and OpenMP's busy-waiting threads then slow
    small operations many times over (measured: the reference pass of bench/dpo.py, 2 ranks on 2 cores, 99.5 s
    against 3.8 s). deepspeed sets OMP_NUM_THREADS only with --bind_cores_to_rank, torchrun to 1; a process whose
    launcher pinned it to fewer cores than the node has (srun, numactl) keeps what it was given. accelerate (under the
    HF Trainer) sets its own count where OMP_NUM_THREADS is unset: the node's cores over LOCAL_WORLD_SIZE, which the
    deepspeed launcher does not set (2 threads a rank on 2 cores: sequence_classification.py's epochs 5x slower)."""
    ranks = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or 1)
    if "OMP_NUM_THREADS" in environ or ranks <= 1 or usable < node_cores:
        return None
    return max(1, usable // ranks)


def unclaimed_port(tries=50):
    """A free TCP port below the kernel's ephemeral range (ip_local_port_range): a port the kernel hands out (to a
    socket bound to port 0, to an outgoing connection) can be handed to another process between our check and our
    bind, and was (a second run's rendezvous refused: "taken"); below the range only a chooser like this one lands."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = [random.randrange(max(1024, low - 12000), low) for _ in range(tries)] if low > 2048 else []
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def gloo_interface(environ):
    """GLOO_SOCKET_IFNAME, where the user set none and the ranks meet on another host's address: the interface
    through which this host reaches MASTER_ADDR. Without it gloo offers the other ranks the address this host's name
    resolves to, 127.0.1.1 on Debian and many containers, and they cannot connect. The stop vote and the hang
    reports use gloo beside NCCL. A value exported in the launching shell does not reach the ranks (DeepSpeed's
    launcher starts even the first host's over ssh): .deepspeed_env's lines do (docs/multinode.md). NCCL needs
    nothing: it skips the loopback interface by itself, and forcing the route's interface could slow it."""
    if environ.get("GLOO_SOCKET_IFNAME") or int(environ.get("WORLD_SIZE", 1)) <= 1 or not environ.get("MASTER_ADDR"):
        return
    name = route_interface(environ["MASTER_ADDR"], int(environ.get("MASTER_PORT", 29500)))
    if name and name != "lo":  # a master on loopback: one host, where gloo's own choice works
        environ["GLOO_SOCKET_IFNAME"] = name


def route_interface(address, port):
    """The name of the interface that holds this host's address toward address:port ('lo' for a loopback one), or
    None where it does not resolve or nothing routes there. Connecting a UDP socket chooses the route and the source
    address and sends nothing; on the master's own host that is MASTER_ADDR itself, on its own interface."""
    import ipaddress
    import socket

    import psutil  # a dependency of DeepSpeed's: the interfaces' names and addresses, as gloo reads them

    try:
        family, _, _, _, target = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            local = s.getsockname()[0].split("%")[0]
    except OSError:
        return None
    if ipaddress.ip_address(local).is_loopback:  # 127.0.1.1 is lo's without being listed on it
        return "lo"
    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.family == family and a.address.split("%")[0] == local for a in addresses)), None)


def slurm_env(environ):
    """The torch.distributed variables of a task that srun started without a launcher, or None when a launcher set
    them (RANK is there) or this is no multi-task srun step (a batch script, or `srun --pty bash`: one task)."""
    if "RANK" in environ or int(environ.get("SLURM_STEP_NUM_TASKS", "1")) <= 1:
        return None
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if "SLURM_PROCID" not in environ or "SLURM_LOCALID" not in environ or not nodes:
        fail("srun started this task without SLURM_PROCID, SLURM_LOCALID or SLURM_STEP_NODELIST; launch with "
             "`srun torchrun ...` (job/slurm.sbatch) instead")
    job = int(environ.get("SLURM_JOB_ID", "0"))
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": environ["SLURM_LOCALID"], "MASTER_ADDR": environ.get("MASTER_ADDR", first_host(nodes)),
            "MASTER_PORT": environ.get("MASTER_PORT", str(20000 + job % 20000))}  # the same in every task of the job


def first_host(nodelist):
    """The first host of a SLURM node list, as `scontrol show hostnames` gives it: 'gpu[07-08,11],cpu1' -> 'gpu07',
    'rack[1-2]-n[01-04]' -> 'rack1-n01', 'a[1-2]-ib' -> 'a1-ib'."""
    first = re.match(r"((?:[^,\[]|\[[^\]]*\])+)", nodelist.strip())
    if not first:
        fail(f"cannot read SLURM's node list {nodelist!r}; set MASTER_ADDR to the first node's address")
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first.group(1))


def collective_settings(dist_timeout, output_dir):
    """Before the process group is made: a bound on every collective, --dist-timeout, and torch's flight recorder
    on (hangs.py reads it when a rank stops). init_process_group's timeout covers only the world group; DeepSpeed
    builds its ZeRO groups with new_group(), which falls back to torch's module default (30 min on gloo, 10 on NCCL),
    so a stuck rank would hang the others that long. Set that default too, before DeepSpeed makes its groups."""
    import torch.distributed.distributed_c10d as c10d

    from .internals import hangs

    if dist_timeout < hangs.MIN_DIST_TIMEOUT:
        fail(f"--dist-timeout must be at least {hangs.MIN_DIST_TIMEOUT} seconds (it bounds every collective, the "
             f"rendezvous included), got {dist_timeout}")
    hangs.flight_recorder_env(output_dir)
    timeout = datetime.timedelta(seconds=dist_timeout)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    return timeout


JOIN_S = 60  # the longest a rank waits for the others to form the process group before it says so and leaves


def init_distributed(dist_timeout, output_dir):
    """deepspeed.init_distributed (nccl or gloo) under collective_settings, bounded: the ranks start together (the
    launchers start them at once), so a group that has not formed within a minute never will, and a rank that
    cannot connect to another would otherwise wait for --dist-timeout (30 minutes) without a word. Such a rank says
    which it is and what it offered the others, and leaves: the launcher then ends the job."""
    import importlib
    import socket
    import threading

    import deepspeed

    timeout = collective_settings(dist_timeout, output_dir)
    # on a CPU DeepSpeed compiles its shared-memory op at a machine's first run (a minute): not part of joining
    importlib.import_module("deepspeed.comm.torch").build_shm_op()
    rank, interface = os.environ.get("RANK", "0"), os.environ.get("GLOO_SOCKET_IFNAME")
    offered = f"interface {interface}" if interface else "the address its host name resolves to"
    line = (f"rank {rank} on {socket.gethostname()} could not join the other ranks {{}}: gloo offered them {offered}, "
            f"the master is {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}. A host that cannot reach "
            f"another, or the wrong interface: see docs/multinode.md, check the hosts with job/preflight.py")
    bound = min(JOIN_S, dist_timeout)

    def leave():
        print("error: " + line.format(f"within {bound} s"), file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(bound, leave)
    timer.daemon = True
    timer.start()
    try:
        deepspeed.init_distributed(timeout=timeout, init_method=launch_rendezvous(launch_token(os.environ,
                                                                                               launcher_pid())))
    except RuntimeError as e:  # refused or reset: the other side gave up, or offered an address nobody can reach
        port = os.environ.get("MASTER_PORT")
        if port_taken(str(e)):  # rank 0 could not listen: not the network, another process here holds the port
            fail(taken_line(port, socket.gethostname(), port_holder(int(port))))
        fail(line.format(f"({str(e).strip().splitlines()[0].split('] ')[-1][:120]})"))
    finally:
        timer.cancel()
    return timeout


def launch_token(environ, launcher):
    """What every rank of this launch shares and no other launch's ranks do, or None where nothing is known to all:
    the rendezvous keys go under it (launch_rendezvous). A second launch given a port the first holds has a rank 0
    that cannot listen (taken_line) and other ranks that reach the first launch's store: under their own token they
    meet no one there, instead of taking a place in the first launch's group as it forms (which broke that healthy
    run). srun's tasks share their job and step; the ranks of a one-host deepspeed launch share their launcher process
    (deepspeed.launcher.launch: `launcher`, its pid, or None where no ancestor runs it). Every rank of a
    launch must find the same, so nothing here reads what differs by rank. None: a world of one; torchrun's ranks,
    which meet in their agent's store (torchrun refuses a taken port itself); a deepspeed launch over several hosts
    (each host has its own launcher process; job/slurm.sbatch gives each job its own port)."""
    world = environ.get("WORLD_SIZE", "1")
    if int(world) <= 1 or environ.get("TORCHELASTIC_RUN_ID"):
        return None
    if environ.get("SLURM_STEP_NUM_TASKS") == world and environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"
    if environ.get("LOCAL_SIZE") == world and launcher:  # deepspeed's launch.py sets LOCAL_SIZE: its ranks here
        return f"deepspeed-{launcher}"
    return None


def launcher_pid():
    """The pid of the nearest ancestor of this process that runs deepspeed's per-host launcher, or None."""
    import psutil

    try:
        return next((p.pid for p in psutil.Process().parents() if "deepspeed.launcher.launch" in p.cmdline()), None)
    except psutil.Error:
        return None


RENDEZVOUS = "finetune-launch"


def launch_rendezvous(token):
    """The init_method that puts a launch's rendezvous under its token, or None (torch's env://) without one: torch's
    own env:// rendezvous (the same store on MASTER_ADDR:MASTER_PORT, rank 0 listening) with a prefix on every key the
    process group, DeepSpeed's groups and the hang reports write."""
    if token is None:
        return None
    from torch.distributed import register_rendezvous_handler

    try:
        register_rendezvous_handler(RENDEZVOUS, token_rendezvous)
    except RuntimeError:  # registered by an earlier group of this process (the tests start several in one)
        pass
    return f"{RENDEZVOUS}://?launch={token}"


def token_rendezvous(url, timeout, **kwargs):
    from urllib.parse import parse_qs, urlparse

    import torch.distributed as dist

    token = parse_qs(urlparse(url).query)["launch"][0]
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    yield dist.PrefixStore(f"{token}/", store), rank, world_size
    raise RuntimeError("a launch's rendezvous cannot be repeated: restart the launch")  # as env:// says


def port_taken(error):
    """Whether the rendezvous failed because rank 0 could not listen on the port: torch's TCPStore says EADDRINUSE
    (errno 98) in its own words ("failed to listen on any local network address ... code: -98")."""
    return "EADDRINUSE" in error or "code: -98" in error or "Address already in use" in error


def taken_line(port, host, holder):
    return (f"port {port} on {host} is taken by another process{f' ({holder})' if holder else ''}: rank 0 cannot open "
            f"this run's rendezvous there. Give each run on a machine its own port: deepspeed --master_port N, "
            f"torchrun --master_port N, MASTER_PORT=N for python (job/slurm.sbatch picks one from the job's id)")


def port_holder(port, proc=Path("/proc")):
    """'pid N: its command line' of the process that listens on this TCP port here, or None: the socket's inode from
    /proc/net/tcp(6) (state 0A: listening), then the process whose file descriptors hold it."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(f"socket:[{fields[9]}]")
    for fd in proc.glob("[0-9]*/fd/*") if inodes else []:
        try:
            if os.readlink(fd) in inodes:
                command = (fd.parent.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {fd.parent.parent.name}: {command.strip()[:100]}"
        except OSError:
            continue
    return None


def run_distributed(main):
    """Run main() of a distributed script. When a collective fails because another rank died or stopped answering
    (--dist-timeout), end with one line instead of a traceback; the launcher then stops the other ranks and says which
    one exited."""
    code = 0
    try:
        main()
    except SystemExit as e:  # stopped by a signal with its checkpoint written (the trackers' records with it): the CPU
        # exit below, with its status
        if e.code != checkpoints.STOPPED:
            raise
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of the terminal's process group: one line, from rank 0
        raise SystemExit("stopped by Ctrl-C; what was logged is on disk, and --resume continues from the newest "
                         "checkpoint" if os.environ.get("RANK", "0") == "0" else 130) from None
    except RuntimeError as e:
        lost = ("timed out", "Timed out", "Connection closed by peer", "Connection reset by peer", "NCCL error")
        if not any(marker in str(e) for marker in lost):
            raise
        rank = os.environ.get("RANK", "?")
        reason = str(e).strip().splitlines()[0].split("] ")[-1][:120]
        raise SystemExit(f"error: rank {rank}: a collective failed ({reason}): another rank died or stopped "
                         f"answering; see the launcher's log for which, then rerun with --resume") from None
    if code and torch.distributed.is_initialized():  # stopped by a signal: main() did not reach its own
        torch.distributed.destroy_process_group()
    remove_shm_buffer()
    if skip_teardown(torch.cuda.is_available()):
        # On CPU (gloo), about one run in 200 aborts in the interpreter's teardown, after every output is written
        # ("terminate called without an active exception", exit 250): a native thread of the CPU communication
        # stack still joinable at exit. A launcher would report that as a failed run, so leave without the teardown
        # there, flushing first. GPU runs (NCCL) exit normally: exit handlers (W&B, TensorBoard, profilers) run.
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


def skip_teardown(cuda_available):
    return not cuda_available


def remove_shm_buffer():
    """DeepSpeed's CPU all-reduce (its shm_comm op, used when all ranks share one machine) maps a 66 MB file per rank
    in /dev/shm and, in 0.19.8, never removes it (its shared_close is never called): the files pile up in memory with
    every run on a new port. Each rank removes its own once the run has succeeded: every rank mapped them all at
    start-up, and a mapping outlives the name."""
    env = os.environ.get
    Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env('MASTER_ADDR', '')}_{env('MASTER_PORT', '')}_"
         f"{env('RANK', '')}").unlink(missing_ok=True)
