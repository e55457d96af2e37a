#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (controller + node daemon + munge), for tests of the SLURM paths.
#
#   sudo apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge   # once (Debian 12: SLURM 22.05)
#   bash deployments/slurm/local_cluster.sh up       # write /etc/slurm/slurm.conf, start munged, slurmctld, slurmd
#   bash deployments/slurm/local_cluster.sh status   # sinfo
#   bash deployments/slurm/local_cluster.sh down     # stop the daemons
#
# Needs root (it writes /etc/slurm and starts daemons). The node advertises
# SLURM_LOCAL_CPUS (default 8) CPUs whatever the hardware has, so a few jobs
# (server replicas, a router, dask-jobqueue workers) fit at once on a 2-core CI
# machine, and SLURM_LOCAL_MEM_MB (default 90% of RAM) of memory, so jobs that
# ask for `--mem` (dask-jobqueue always does) are accepted; memory is not a
# consumable resource here (CR_Core), it is only checked against that size.
set -euo pipefail
cmd=${1:-up}
host=$(hostname)
cpus=${SLURM_LOCAL_CPUS:-8}
mem_mb=${SLURM_LOCAL_MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)}

up() {
  for bin in slurmctld slurmd munged sinfo; do
    command -v "$bin" >/dev/null || { echo "$bin not found: install slurmctld slurmd slurm-client munge" >&2; exit 2; }
  done
  if sinfo -h >/dev/null 2>&1; then echo "slurm already up"; sinfo; return; fi
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/munge
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=factory
SlurmctldHost=${host}
AuthType=auth/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=${host} CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown -R munge:munge /etc/munge /run/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 60); do
    state=$(sinfo -h -o %T 2>/dev/null | head -1 || true)
    if [ "$state" = "idle" ] || [ "$state" = "mixed" ] || [ "$state" = "allocated" ]; then sinfo; return; fi
    sleep 1
  done
  echo "slurm did not come up; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
  exit 1
}

down() {
  # The pid files named in the slurm.conf written by `up`.
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  echo "slurm stopped"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) sinfo ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
