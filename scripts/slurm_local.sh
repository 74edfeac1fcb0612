#!/usr/bin/env bash
# A Slurm cluster on this machine (one node, or N nodes on loopback), for the launcher=slurm end-to-end tests.
#
#   bash scripts/slurm_local.sh start    # install (Debian 12 packages) if missing, configure, start, wait until usable
#   SLURM_LOCAL_NODES=2 bash scripts/slurm_local.sh start   # N nodes n1..nN: N slurmd on this machine (CI)
#   bash scripts/slurm_local.sh stop     # stop every daemon this script starts
#   bash scripts/slurm_local.sh status   # which daemons run, the node's state, whether accounting answers
#
# Daemons: munged (authentication), MariaDB + slurmdbd (accounting), slurmctld (controller), slurmd (the
# node). Every one is configured to be reached at 127.0.0.1 and nothing here talks to another machine
# (except apt-get, when the packages are missing). With SLURM_LOCAL_NODES=N > 1 the nodes are n1..nN, each
# its own slurmd (Debian builds slurmd with MULTIPLE_SLURMD) on its own port, all reached at 127.0.0.1 and
# each claiming the whole machine: `sbatch -N2` places one task on each. `start` is idempotent: a daemon that already runs is
# left alone unless its configuration changed, in which case it is restarted. Needs root.
#
# Why accounting at all: submitit polls job states with `sacct`. Without slurmdbd, sacct knows no job,
# and a job that dies hard (killed, node lost) reads UNKNOWN forever, so a waiting launcher never returns.
# With accounting it reads FAILED within seconds.
set -euo pipefail

# Overridable so that a machine whose /etc/slurm is used for something else can point elsewhere; the
# Debian binaries read /etc/slurm/slurm.conf by default, so other locations also need SLURM_CONF exported.
CONF_DIR=${SLURM_LOCAL_CONF_DIR:-/etc/slurm}
CLUSTER=${SLURM_LOCAL_CLUSTER:-ftexp}
PARTITION=${SLURM_LOCAL_PARTITION:-local}
WAIT_S=${SLURM_LOCAL_WAIT_S:-90}            # bound on each wait for a daemon to come up
NODES=${SLURM_LOCAL_NODES:-1}               # slurmd daemons (nodes) on this machine
[[ $NODES =~ ^[1-9][0-9]?$ ]] || { echo "slurm_local: SLURM_LOCAL_NODES=$NODES is not a node count (1-99)" >&2; exit 2; }
LOG_DIR=/var/log/slurm
DB_NAME=slurm_acct_db
DB_USER=slurm
PACKAGES=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server)

export SLURM_CONF="$CONF_DIR/slurm.conf"
NODE=$(hostname -s)
# Slurm's node names: this machine's name for one node; n1..nN for N nodes on this machine.
if ((NODES == 1)); then NODE_NAMES=("$NODE"); else NODE_NAMES=($(seq -f 'n%g' 1 "$NODES")); fi
T0=$(date +%s.%N)
declare -A TIMINGS=()
RESTART=()                                  # daemons whose configuration changed under them

log() { echo "slurm_local: $*" >&2; }
die() { log "error: $*"; exit 1; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, writes $CONF_DIR, starts daemons)"; }

# wait_until <what> <seconds> <command...>: poll the command until it succeeds, or fail naming the log to read.
wait_until() {
    local what=$1 limit=$2 start
    shift 2
    start=$(date +%s)
    until "$@" >/dev/null 2>&1; do
        if (($(date +%s) - start >= limit)); then
            die "$what did not come up within ${limit}s (see the logs in $LOG_DIR/ and /var/log/mysql/)"
        fi
        sleep 0.5
    done
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# write_conf <path> <mode> <daemon-to-restart-if-changed>: content on stdin; rewritten only when it differs.
write_conf() {
    local path=$1 mode=$2 daemon=$3 tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f $path ]] && cmp -s "$tmp" "$path"; then
        rm -f "$tmp"
        return
    fi
    install -D -m "$mode" -o root -g root "$tmp" "$path"
    rm -f "$tmp"
    [[ -n $daemon ]] && RESTART+=("$daemon")
    return 0
}

restarting() { local d; for d in "${RESTART[@]}"; do [[ $d == "$1" ]] && return 0; done; return 1; }

install_packages() {
    local missing=() p t
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    t=$(date +%s.%N)
    log "installing ${missing[*]}"
    # Package scripts must not start the daemons themselves (they would come up with Debian's default
    # configuration): a policy-rc.d that refuses every start, as container images ship, unless one exists.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}")
    # Only refresh the package lists when they lack a package or are too stale to download from.
    local no_candidate
    no_candidate=$(apt-cache policy "${missing[@]}" 2>/dev/null | grep -c "Candidate: (none)" || true)
    if [[ ! -d /var/lib/apt/lists ]] || ((no_candidate)) || ! compgen -G "/var/lib/apt/lists/*Packages*" >/dev/null; then
        apt-get update -q >/dev/null || log "apt-get update reported errors; trying the install anyway"
    fi
    if ! "${apt[@]}" >/tmp/slurm_local.apt.log 2>&1; then
        apt-get update -q >/dev/null || log "apt-get update reported errors; trying the install again anyway"
        "${apt[@]}" >/tmp/slurm_local.apt.log 2>&1 || { ((own_policy)) && rm -f "$policy"; die "apt-get install failed; see /tmp/slurm_local.apt.log"; }
    fi
    ((own_policy)) && rm -f "$policy"
    TIMINGS[install]=$(elapsed "$t")
}

db_password() {
    # Reuse the password already written to slurmdbd.conf so that restarts keep the same credentials.
    local pw=""
    [[ -f $CONF_DIR/slurmdbd.conf ]] && pw=$(sed -n 's/^StoragePass=//p' "$CONF_DIR/slurmdbd.conf")
    [[ -n $pw ]] || pw=$(od -An -tx1 -N12 /dev/urandom | tr -d ' \n')
    echo "$pw"
}

write_configs() {
    mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
    # The node line describes this machine as slurmd sees it (CPUs, sockets, cores, threads, memory), so
    # slurmd registers with exactly what is configured and the node is never drained for a mismatch.
    local hw
    hw=$(slurmd -C | sed -n 's/^NodeName=[^ ]* //p')
    [[ -n $hw ]] || die "slurmd -C did not describe this machine"

    # NoInAddrAny/NoCtldInAddrAny make slurmd, srun, slurmdbd (which reads the same setting from
    # slurmdbd.conf, though its man page does not say so) and slurmctld bind to the address this machine's
    # name resolves to instead of to every interface. Only when that address is loopback: elsewhere they
    # would bind to a public address, where 127.0.0.1 (NodeAddr, SlurmctldHost, DbdAddr) does not reach
    # them. Then they listen on every interface, but are still only ever reached at 127.0.0.1, and only a
    # client holding this machine's munge key gets an answer.
    local comm_params="# $NODE does not resolve to a loopback address: daemons listen on every interface."
    local dbd_comm_params=$comm_params
    if getent ahostsv4 "$NODE" | awk 'NR == 1 { print $1 }' | grep -q '^127\.'; then
        comm_params="# $NODE resolves to loopback: daemons and srun listen there only, not on every interface.
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny"
        dbd_comm_params="# $NODE resolves to loopback: listen there only (see slurm.conf).
CommunicationParameters=NoInAddrAny"
    fi

    # One node: the original single-node layout. N nodes: one line per slurmd, each on its own port, with
    # per-node (%n) pid, spool and log files so that the daemons do not collide.
    local node_lines slurmd_files i
    if ((NODES == 1)); then
        node_lines="SlurmdPort=6818
NodeName=$NODE NodeAddr=127.0.0.1 $hw State=UNKNOWN"
        slurmd_files="SlurmdSpoolDir=/var/spool/slurmd
SlurmdPidFile=/run/slurmd.pid
SlurmdLogFile=$LOG_DIR/slurmd.log"
    else
        node_lines="# $NODES nodes on this machine (MULTIPLE_SLURMD): each slurmd is started as \`slurmd -N <name>\`."
        for i in $(seq 1 "$NODES"); do
            node_lines+=$'\n'"NodeName=n$i NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$((6820 + i)) $hw State=UNKNOWN"
        done
        slurmd_files="SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=$LOG_DIR/slurmd-%n.log"
    fi

    write_conf "$CONF_DIR/slurm.conf" 644 slurm <<EOF
# Written by scripts/slurm_local.sh: a $NODES-node cluster on this machine for the ftexp launcher=slurm tests.
ClusterName=$CLUSTER
# The controller by this machine's name, but reached at the loopback address (daemons, srun, sbatch, sacct).
SlurmctldHost=$NODE(127.0.0.1)
# Every job is submitted by root on this machine; running the daemons as root needs no slurm user setup.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# No systemd and no writable cgroup hierarchy to rely on (containers, gVisor): track job processes through
# /proc and do no CPU binding, which both need cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$comm_params
SchedulerType=sched/backfill
# Allocate cores, not whole nodes, so that several jobs share the node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Accounting through slurmdbd, so that sacct (which submitit polls) knows every job and how it ended.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmctldPort=6817
$slurmd_files
MpiDefault=none
# No mail is ever sent (and no mailer need be installed).
MailProg=/bin/true
# A node that was down (e.g. slurmd restarted) rejoins as soon as it registers again.
ReturnToService=2
# Finished jobs leave the controller's memory quickly; sacct keeps them.
MinJobAge=60
$node_lines
# OverSubscribe=FORCE:4: each core takes up to 4 jobs at once. ftexp nests jobs: a run submitted with
# launcher.wait=false, or a -m sweep point, is a job that holds its CPUs while it submits the per-side
# training jobs and waits for them. On a 2-CPU node, exclusive cores would let two such waiting jobs
# starve their own side jobs forever; a real cluster has the room, this node shares its cores instead.
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

    write_conf "$CONF_DIR/slurmdbd.conf" 600 slurmdbd <<EOF
# Written by scripts/slurm_local.sh. Mode 600 and owned by SlurmUser (root): slurmdbd refuses anything else.
AuthType=auth/munge
# The address slurmctld and the clients reach slurmdbd at (slurm.conf: AccountingStorageHost=127.0.0.1).
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=6819
$dbd_comm_params
SlurmUser=root
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF

    # MariaDB: loopback only; InnoDB settings per Slurm's accounting guide (slurmdbd's schema upgrades and
    # purges hold long locks); its log in a file, since Debian's default (syslog) goes nowhere without a
    # syslog daemon.
    write_conf /etc/mysql/mariadb.conf.d/99-slurm-local.cnf 644 mariadb <<EOF
# Written by scripts/slurm_local.sh
[mysqld]
bind-address = 127.0.0.1
innodb_lock_wait_timeout = 900
innodb_buffer_pool_size = 256M
log_error = /var/log/mysql/error.log

[mysqld_safe]
skip_syslog
log_error = /var/log/mysql/error.log
EOF
}

start_munge() {
    if pid_alive /run/munge/munged.pid && ! restarting munge; then return; fi
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    # munged refuses to run as root; the Debian package's daemon user is munge.
    runuser -u munge -- /usr/sbin/munged
    wait_until munged 10 munge -n
}

start_mariadb() {
    if mysqladmin ping >/dev/null 2>&1; then
        restarting mariadb || return 0
        mysqladmin shutdown
    fi
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql >/dev/null
    install -d -o mysql -g mysql /run/mysqld /var/log/mysql
    # No systemd: mysqld_safe is the supervisor. setsid + closed fds so that it outlives this script
    # and does not hold a caller's pipes (CI logs) open.
    setsid mysqld_safe --user=mysql </dev/null >>/var/log/mysql/mysqld_safe.log 2>&1 &
    wait_until MariaDB "$WAIT_S" mysqladmin ping
    # root reaches MariaDB through its unix socket (unix_socket auth, the Debian default).
    mysql <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';
EOF
}

cluster_registered() { sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; }

start_slurmdbd() {
    if pid_alive /run/slurmdbd.pid && ! restarting slurmdbd && ! restarting mariadb; then return; fi
    stop_pidfile slurmdbd /run/slurmdbd.pid
    slurmdbd
    # The first start creates the schema, which takes a few seconds.
    wait_until slurmdbd "$WAIT_S" sacctmgr -n list cluster
}

start_slurmctld() {
    # slurmctld learns its cluster's existence from slurmdbd at start, so register the cluster first.
    cluster_registered || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    if pid_alive /run/slurmctld.pid && ! restarting slurm; then return; fi
    # A changed slurm.conf may change what only a restart applies (node line, plugins). The state saved in
    # StateSaveLocation (queued and running jobs) survives the restart.
    stop_pidfile slurmctld /run/slurmctld.pid
    # -i: start even if saved state from an earlier configuration cannot be read back.
    slurmctld -i
    wait_until slurmctld "$WAIT_S" scontrol ping
}

slurmd_pidfile() { if ((NODES == 1)); then echo /run/slurmd.pid; else echo "/run/slurmd-$1.pid"; fi; }

# Every slurmd pid file there is, this layout's or an earlier one's (one node <-> N nodes).
# (not /run/slurmd*.pid: that would match slurmdbd's)
all_slurmd_pidfiles() { compgen -G "/run/slurmd.pid" || true; compgen -G "/run/slurmd-*.pid" || true; }

start_slurmd() {
    local name pidfile f up=1
    for name in "${NODE_NAMES[@]}"; do pid_alive "$(slurmd_pidfile "$name")" || up=0; done
    if ((up)) && ! restarting slurm; then return; fi
    # running jobs' slurmstepd processes carry on without their slurmd
    for f in $(all_slurmd_pidfiles); do stop_pidfile slurmd "$f"; done
    for name in "${NODE_NAMES[@]}"; do
        if ((NODES == 1)); then slurmd; else mkdir -p "/var/spool/slurmd/$name" && slurmd -N "$name"; fi
    done
}

# Usable: idle, mix or alloc with no suffix (idle* = not responding, idle~ = powered down, ...) — every node.
node_idle() {
    local name
    for name in "${NODE_NAMES[@]}"; do sinfo -h -N -n "$name" -o '%t' | grep -Eq '^(idle|mix|alloc)$' || return 1; done
}

start() {
    need_root
    install_packages
    local t
    t=$(date +%s.%N)
    DB_PASS=$(db_password)
    write_configs
    start_munge
    start_mariadb
    TIMINGS[mariadb]=$(elapsed "$t"); t=$(date +%s.%N)
    start_slurmdbd
    start_slurmctld
    start_slurmd
    wait_until "node(s) ${NODE_NAMES[*]} (idle in sinfo)" "$WAIT_S" node_idle
    wait_until "sacct (accounting)" "$WAIT_S" sacct -n -X -a -S now-1minutes
    TIMINGS[slurm]=$(elapsed "$t")
    local state
    state=$(sinfo -h -N -o '%N %t %c' | sort -u | paste -sd, -)
    echo "slurm_local: up in $(elapsed "$T0")s (packages: ${TIMINGS[install]:+installed in }${TIMINGS[install]:-already there}${TIMINGS[install]:+s}," \
        "munge+mariadb ${TIMINGS[mariadb]}s, slurmdbd+slurmctld+slurmd ${TIMINGS[slurm]}s);" \
        "nodes: $state cpus, partition $PARTITION, cluster $CLUSTER, reached at 127.0.0.1"
}

stop_pidfile() {
    local name=$1 pidfile=$2 pid
    pid_alive "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid"
    wait_until "$name to stop" 30 bash -c "! kill -0 $pid"
}

stop() {
    need_root
    local f
    for f in $(all_slurmd_pidfiles); do stop_pidfile slurmd "$f"; done
    stop_pidfile slurmctld /run/slurmctld.pid
    stop_pidfile slurmdbd /run/slurmdbd.pid
    if mysqladmin ping >/dev/null 2>&1; then
        mysqladmin shutdown
    fi
    stop_pidfile munged /run/munge/munged.pid
    echo "slurm_local: stopped in $(elapsed "$T0")s"
}

status() {
    local d pidfile rc=0
    local name
    for name in "${NODE_NAMES[@]}"; do
        pidfile=$(slurmd_pidfile "$name")
        if pid_alive "$pidfile"; then echo "slurmd $name: running (pid $(cat "$pidfile"))"; else echo "slurmd $name: stopped"; rc=1; fi
    done
    for d in munged:/run/munge/munged.pid slurmdbd:/run/slurmdbd.pid slurmctld:/run/slurmctld.pid; do
        pidfile=${d#*:}
        if pid_alive "$pidfile"; then echo "${d%%:*}: running (pid $(cat "$pidfile"))"; else echo "${d%%:*}: stopped"; rc=1; fi
    done
    if mysqladmin ping >/dev/null 2>&1; then echo "mariadb: running"; else echo "mariadb: stopped"; rc=1; fi
    if command -v sinfo >/dev/null && sinfo -h -N -o '%N %P %t %c' 2>/dev/null; then :; else echo "sinfo: no answer"; rc=1; fi
    if sacct -n -X -a -S now-1minutes >/dev/null 2>&1; then echo "sacct: answers"; else echo "sacct: no answer"; rc=1; fi
    return $rc
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
