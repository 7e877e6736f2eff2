#!/usr/bin/env bash
# A real one-node SLURM for the tests (Debian's slurm-wlm 22.05 and munge), everything in one state folder:
#     tests/slurm_cluster.sh start STATE_DIR    # prints the SLURM_CONF to use once the node is idle
#     tests/slurm_cluster.sh stop STATE_DIR     # its jobs, slurmd, slurmctld and munged, by their pid files
# As root (slurmd runs the jobs). The node is this machine (`hostname -s`, `nproc` CPUs) with 2 fake GPUs: gres
# `gpu` on character devices made with mknod (slurmd refuses plain files). No accounting, no cgroups
# (proctrack/linuxproc, task/none). cred_expire=5: a requeued job may start again 5 s after it ended (SLURM's
# default, 120 s, is the delay a requeue has on a real cluster).
set -euo pipefail
action=${1:?usage: slurm_cluster.sh start|stop STATE_DIR}
state=${2:?usage: slurm_cluster.sh start|stop STATE_DIR}
mkdir -p "$state"
state=$(cd "$state" && pwd -P)
export SLURM_CONF=$state/slurm.conf
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [ "$action" = stop ]; then
  if alive "$state/run/slurmctld.pid"; then
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -z "${jobs// /}" ] || { scancel --full --signal=KILL $jobs; scancel $jobs; } 2>/dev/null || true
  fi
  for daemon in slurmd slurmctld munged; do
    if alive "$state/run/$daemon.pid"; then
      pid=$(cat "$state/run/$daemon.pid")
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$state/run/$daemon.pid"
  done
  for pid in $(pgrep -x slurmstepd || true); do  # step daemons outlive slurmd: this cluster's, by their folder
    [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" != "$state/spool" ] || kill -9 "$pid" 2>/dev/null || true
  done
  exit 0
fi

for tool in munged slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found: apt-get install munge slurmctld slurmd slurm-client" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "error: slurmd runs jobs as any user: start the cluster as root" >&2; exit 1; }
node=$(hostname -s)
port=${SLURM_TEST_PORT:-6817}  # slurmctld; slurmd: SLURM_TEST_SLURMD_PORT, or the next one
mkdir -p "$state"/{munge,ctld,spool,log,run,dev}
chmod 700 "$state/munge"
for i in 0 1; do [ -c "$state/dev/nvidia$i" ] || mknod "$state/dev/nvidia$i" c 1 3; done  # /dev/null's numbers
[ -s "$state/munge/munge.key" ] || { head -c 1024 /dev/urandom > "$state/munge/munge.key"; chmod 400 "$state/munge/munge.key"; }
cat > "$SLURM_CONF" <<CONF
ClusterName=tests
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=${SLURM_TEST_SLURMD_PORT:-$((port + 1))}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.socket,cred_expire=5
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=30
InactiveLimit=0
MinJobAge=600
PlugStackConfig=$state/plugstack.conf
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=2048 Gres=gpu:2 State=UNKNOWN
PartitionName=gpu Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
echo "NodeName=$node Name=gpu File=$state/dev/nvidia[0-1]" > "$state/gres.conf"
: > "$state/plugstack.conf"  # none of the system's SPANK plugins
if ! alive "$state/run/munged.pid"; then
  rm -f "$state/munge/munge.socket"*
  munged --force --socket="$state/munge/munge.socket" --key-file="$state/munge/munge.key" \
    --pid-file="$state/run/munged.pid" --seed-file="$state/munge/munged.seed" --log-file="$state/log/munged.log"
fi
for _ in $(seq 100); do [ -S "$state/munge/munge.socket" ] && break; sleep 0.05; done
alive "$state/run/slurmctld.pid" || slurmctld -f "$SLURM_CONF" -i  # -i: a fresh, empty queue
alive "$state/run/slurmd.pid" || slurmd -f "$SLURM_CONF"
for _ in $(seq 600); do  # idle: slurmd registered with slurmctld
  [ "$(sinfo -h -n "$node" -o %T 2>/dev/null)" = idle ] && { echo "$SLURM_CONF"; exit 0; }
  sleep 0.1
done
echo "error: node $node not idle after 60 s; logs in $state/log" >&2
exit 1
