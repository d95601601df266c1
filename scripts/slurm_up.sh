#!/usr/bin/env bash
# A one-node SLURM on this machine for the cluster tests (tests/slurm/, `make test-slurm`), without systemd:
# munged, MariaDB, slurmdbd (sacct accounting), slurmctld and slurmd, configured for this host.
# Idempotent: a daemon already running is left as it is; run it again after a reboot.
# Needs root; installs Debian's slurm-wlm, munge, mariadb-server, slurmdbd and bindfs with apt-get if they are missing.
#
# The cluster: one node (`hostname -s`) with CPUs=2 and RealMemory from /proc/meminfo, partition `debug` (and
# `short` on the same node, MaxTime 5 minutes: the impossible-request tests of tests/slurm/test_trust4.py),
# jobs requeueable (JobRequeue=1, PreemptMode=REQUEUE; a requeued job may start again after 30 s,
# AuthInfo=cred_expire=30, not 120), finished jobs leave squeue after MinJobAge=10 s
# (sacct keeps them), a job runs at its submitter's nice value (PropagatePrioProcess=1: `nice make test-slurm` keeps
# the jobs nice on a shared machine), and a QOS `normlab-limited` with MaxSubmitJobsPerUser=3 for the submit-limit test.
set -euo pipefail

[ "$(id -u)" = 0 ] || { echo "slurm_up.sh: run as root (it writes /etc/slurm and starts daemons)" >&2; exit 2; }
PACKAGES="slurm-wlm munge mariadb-server slurmdbd bindfs"  # bindfs: the FUSE mount of tests/slurm/test_store.py
missing() { for bin in munged mariadbd slurmdbd slurmctld slurmd sacctmgr bindfs; do command -v "$bin" >/dev/null || return 0; done; return 1; }
if missing && command -v apt-get >/dev/null; then
    echo "slurm_up.sh: installing $PACKAGES"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q $PACKAGES >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $PACKAGES >/dev/null; }
fi
if missing; then
    echo "slurm_up.sh: SLURM's daemons are missing; install Debian's $PACKAGES" >&2; exit 2
fi

HOST=$(hostname -s)
CPUS=${SLURM_UP_CPUS:-2}
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
DBPASS=normlab-slurmdbd
LOG=/var/log/slurm
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local t=$1 what=$2; shift 2
    for _ in $(seq "$((t * 2))"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
    echo "slurm_up.sh: $what did not come up in ${t}s; see $LOG/" >&2; exit 1
}

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOG" /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge

# --- munge (authentication between the daemons) ---
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
running /run/munge/munged.pid || runuser -u munge -- munged
wait_for 10 munged munge -n

# --- MariaDB and the accounting database ---
if ! mysqladmin ping >/dev/null 2>&1; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
    (setsid mysqld_safe --user=mysql >/dev/null 2>&1 &)
    wait_for 60 mariadb mysqladmin ping
fi
mysql -e "create user if not exists 'slurm'@'localhost' identified by '$DBPASS';
          grant all on slurm_acct_db.* to 'slurm'@'localhost'; flush privileges;"

cat > /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
PidFile=/run/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
EOF
chmod 0600 /etc/slurm/slurmdbd.conf

OLD_CONF=$(cat /etc/slurm/slurm.conf 2>/dev/null || true)
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=normlab
SlurmctldHost=$HOST
AuthType=auth/munge
AuthInfo=cred_expire=30
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageEnforce=associations,limits,qos
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MinJobAge=10
KillWait=10
ReturnToService=2
MaxArraySize=1001
MpiDefault=none
PropagatePrioProcess=1
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=$HOST MaxTime=5 State=UP
EOF

if [ "$OLD_CONF" != "$(cat /etc/slurm/slurm.conf)" ] && running /run/slurmctld.pid; then
    echo "slurm_up.sh: slurm.conf changed; restarting slurmctld and slurmd"
    scontrol shutdown >/dev/null 2>&1 || true
    for _ in $(seq 40); do running /run/slurmctld.pid || running /run/slurmd.pid || break; sleep 0.5; done
fi

# --- slurmdbd, then the cluster, account, user and QOS it holds ---
if ! running /run/slurmdbd.pid; then
    slurmdbd
fi
wait_for 60 slurmdbd sacctmgr -n list cluster
sacctmgr -i add cluster normlab >/dev/null 2>&1 || true
sacctmgr -i add account normlab Cluster=normlab >/dev/null 2>&1 || true
sacctmgr -i add qos normlab-limited MaxSubmitJobsPerUser=3 >/dev/null 2>&1 || true
sacctmgr -i modify qos normlab-limited set MaxSubmitJobsPerUser=3 >/dev/null
for user in root $(getent passwd "${SUDO_USER:-}" | cut -d: -f1); do
    sacctmgr -i add user "$user" Account=normlab Cluster=normlab >/dev/null 2>&1 || true
    sacctmgr -i modify user "$user" set QOS=normal,normlab-limited >/dev/null 2>&1 || true
done

# --- the controller and the node ---
if ! running /run/slurmctld.pid; then
    slurmctld
fi
wait_for 60 slurmctld scontrol ping
if ! running /run/slurmd.pid; then
    slurmd
fi
wait_for 60 "the node $HOST" sh -c "sinfo -h -n $HOST -o %t | grep -Eq '^(idle|mix|alloc)'"
scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
echo "slurm up: node $HOST (CPUs=$CPUS, RealMemory=${MEM_MB} MB), partitions debug and short (MaxTime 5 min), QOS normlab-limited (3 jobs), logs $LOG/"
