#!/usr/bin/env bash
# Emulated hosts on one machine, for tests and rehearsals of a deployment (docs/deployment.md,
# "Hosts and links on one machine"). Needs root, iproute2 (ip, tc) and util-linux (unshare,
# nsenter, setpriv); scripts/install-deps.sh installs them.
#
# A *set* of hosts is a star network that lives only in namespaces of its own:
# - each host is a network namespace SET.HOST with `lo` and one interface `eth0`, addressed
#   $RESHARD_HOSTS_SUBNET.N/24 (default 10.77.0.N, N = 1, 2, ... in the order given), no other
#   route: traffic between hosts never touches the machine's real interfaces;
# - each host also has its own PID, IPC, UTS (its hostname is HOST) and mount namespace with a
#   private /dev/shm, held by a small init process (PID 1 of the host): every process run on
#   the host shares them, and no shared memory, SysV IPC or cross-memory attach
#   (process_vm_readv needs the other process's pid, which a host cannot see) crosses hosts;
# - the hosts' `eth0` are veth pairs whose other ends (named HOST) are ports of the bridge `br0`
#   in a namespace SET.sw (the switch), never in the root namespace;
# - a link may carry a `tc tbf` rate limit, on both ends (host egress and switch egress).
#
#   hosts.sh create SET HOST[:RATE]...  makes the set (RATE as tc spells it, e.g. 40mbit);
#                                       prints "HOST ADDRESS" per host.
#                                       RESHARD_HOSTS_OWNER_PID: destroy the set once that
#                                       process is gone (a killed test runs no destructor)
#   hosts.sh run SET HOST CMD [ARG...]  runs CMD on HOST (this process becomes nsenter, which
#                                       waits for CMD; killing it kills CMD, never CMD's
#                                       children, which stay on the host until `destroy`)
#   hosts.sh addr SET HOST              prints HOST's address
#   hosts.sh down|up SET HOST           takes HOST's link down or up: its switch port, as if the
#                                       cable were pulled (the host keeps its address and its
#                                       sockets; packets are lost until `up`)
#   hosts.sh rate SET HOST RATE|none    sets or removes HOST's link rate limit
#   hosts.sh bytes SET HOST             prints "FROM TO": bytes the switch received from HOST
#                                       and sent to it
#   hosts.sh destroy SET                kills every process on the set's hosts and removes its
#                                       namespaces; idempotent
#   hosts.sh check                      exits 0 when this machine can run hosts, else says why
#
# State (each host's init pid and address) is kept in $RESHARD_HOSTS_STATE/SET (default
# /run/reshard-hosts/SET); /run and the namespaces both go at reboot.
set -euo pipefail

state_root=${RESHARD_HOSTS_STATE:-/run/reshard-hosts}
subnet=${RESHARD_HOSTS_SUBNET:-10.77.0}
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")

die() { echo "hosts.sh: $*" >&2; exit 1; }
usage() {
    sed -n '/^#   hosts.sh/,/^#$/p' "$self" | sed 's/^#//' >&2
    exit 2
}

valid_set() { [[ $1 =~ ^[A-Za-z0-9_-]{1,40}$ ]] || die "bad set name '$1' (letters, digits, _ and -)"; }
valid_host() {
    # The host's name is also its switch port's name: at most 15 characters (IFNAMSIZ).
    [[ $1 =~ ^[a-z0-9][a-z0-9-]{0,14}$ ]] || die "bad host name '$1' (a-z, 0-9, -; at most 15)"
    [[ $1 != sw && $1 != br0 && $1 != lo ]] || die "host name '$1' is reserved"
}

set_dir() { echo "$state_root/$1"; }

# The init pid of HOST in SET, checked to be alive.
host_init() {
    local f
    f=$(set_dir "$1")/$2.init
    [ -f "$f" ] || die "no host '$2' in set '$1'"
    local pid
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null || die "host '$2' of set '$1' is gone (its init $pid exited)"
    echo "$pid"
}

# Sets (RATE) or removes (none) the tbf qdisc on both ends of HOST's link. The burst holds a
# whole GSO packet of the veth (64 KiB), so shaping never drops a packet for its size.
set_rate() {
    local set=$1 host=$2 rate=$3 end ns dev
    local ends=("$set.$host eth0" "$set.sw $host")
    for end in "${ends[@]}"; do
        read -r ns dev <<<"$end"
        if [ "$rate" = none ]; then
            tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
        else
            tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst 64kb latency 100ms
        fi
    done
}

# The (global) pid of the process in network namespace NS that is PID 1 of a PID namespace of
# its own: the host's init.
ns_init() {
    local p
    for p in $(ip netns pids "$1" 2>/dev/null); do
        if awk '$1 == "NSpid:" && NF == 3 && $3 == 1 { found = 1 } END { exit !found }' \
            "/proc/$p/status" 2>/dev/null; then
            echo "$p"
            return
        fi
    done
}

# The namespaces of SET, one per line.
namespaces() {
    ip netns list | awk '{print $1}' | grep -F -- "$1." | grep -E "^$1\.[a-z0-9-]+$" || true
}

destroy() {
    local set=$1 ns pids
    for _ in $(seq 1 100); do
        pids=
        for ns in $(namespaces "$set"); do
            pids+=" $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
        done
        [ -n "${pids// /}" ] || break
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
        sleep 0.05
    done
    for ns in $(namespaces "$set"); do
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$(set_dir "$set")"
}

check() {
    [ "$(id -u)" -eq 0 ] || { echo "hosts.sh: not root (network namespaces need root)"; return 1; }
    local t
    for t in ip tc unshare nsenter setpriv; do
        command -v "$t" >/dev/null 2>&1 || {
            echo "hosts.sh: $t not found (scripts/install-deps.sh: iproute2, util-linux)"
            return 1
        }
    done
    local probe="rsh-check-$$"
    local out
    if ! out=$(
        {
            ip netns add "$probe.a" &&
                ip -n "$probe.a" link add br0 type bridge &&
                ip -n "$probe.a" link add p type veth peer name q &&
                tc -n "$probe.a" qdisc add dev p root tbf rate 10mbit burst 64kb latency 100ms &&
                ip netns exec "$probe.a" unshare --ipc --pid --mount --uts --fork --mount-proc true
        } 2>&1
    ); then
        ip netns del "$probe.a" 2>/dev/null || true
        echo "hosts.sh: this machine cannot make namespaced hosts: $out"
        return 1
    fi
    ip netns del "$probe.a"
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
check)
    [ $# -eq 0 ] || usage
    check
    ;;
create)
    [ $# -ge 2 ] || usage
    set=$1
    shift
    valid_set "$set"
    why=$(check) || die "${why#hosts.sh: }"
    dir=$(set_dir "$set")
    [ ! -e "$dir" ] && [ -z "$(namespaces "$set")" ] || die "set '$set' exists; destroy it first"
    mkdir -p "$dir"
    # Whatever ends this early leaves nothing behind.
    trap 'destroy "$set"' EXIT
    ip netns add "$set.sw"
    ip -n "$set.sw" link set lo up
    ip -n "$set.sw" link add br0 type bridge
    ip -n "$set.sw" link set br0 up
    n=0
    for spec in "$@"; do
        host=${spec%%:*}
        rate=
        [ "$host" = "$spec" ] || rate=${spec#*:}
        valid_host "$host"
        [ ! -e "$dir/$host.addr" ] || die "host '$host' given twice"
        n=$((n + 1))
        [ $n -le 250 ] || die "at most 250 hosts in a set"
        ns="$set.$host"
        addr="$subnet.$n"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$set.sw" link add name "$host" type veth peer name eth0 netns "$ns"
        ip -n "$set.sw" link set dev "$host" master br0 up
        # IPv4 only: no link-local IPv6 addresses for transports to pick instead.
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.default.disable_ipv6=1 2>/dev/null || true
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        [ -z "$rate" ] || set_rate "$set" "$host" "$rate"
        # The host's init: PID 1 of its PID namespace, holding its IPC, UTS and mount
        # namespaces (/proc of its own PIDs, a private /dev/shm). bash reaps the orphans that
        # are reparented to it; when it dies, the kernel kills every process of the host.
        rm -f "$dir/$host.ready"
        setsid ip netns exec "$ns" unshare --ipc --pid --mount --uts --fork --kill-child \
            --mount-proc --propagation private \
            bash -c 'hostname "$1" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm &&
                     : >"$2" && exec bash -c "trap : TERM; while :; do sleep 3600 & wait \$!; done"' \
            init "$host" "$dir/$host.ready" </dev/null >/dev/null 2>&1 &
        launcher=$!
        init=
        for _ in $(seq 1 200); do
            if [ -e "$dir/$host.ready" ]; then
                init=$(ns_init "$ns")
                [ -n "$init" ] && break
            fi
            kill -0 "$launcher" 2>/dev/null || break
            sleep 0.02
        done
        [ -n "$init" ] || die "host '$host': its init did not start"
        echo "$init" >"$dir/$host.init"
        echo "$addr" >"$dir/$host.addr"
        echo "$host" >>"$dir/hosts"
        echo "$host $addr"
    done
    trap - EXIT
    if [ -n "${RESHARD_HOSTS_OWNER_PID:-}" ]; then
        owner=$RESHARD_HOSTS_OWNER_PID
        echo "$owner" >"$dir/owner"
        # Detached from this script's output, or whoever reads it would wait for the watcher.
        (
            while kill -0 "$owner" 2>/dev/null && [ -d "$dir" ]; do sleep 1; done
            [ ! -d "$dir" ] || "$self" destroy "$set"
        ) </dev/null >/dev/null 2>&1 &
    fi
    ;;
run)
    [ $# -ge 3 ] || usage
    set=$1 host=$2
    shift 2
    valid_set "$set"
    init=$(host_init "$set" "$host")
    # nsenter forks into the host's PID namespace and waits; the parent-death signal ends CMD
    # when nsenter is killed, so a test that kills what it started leaves nothing running.
    exec nsenter --target "$init" --net --ipc --mount --pid --uts --wd="$PWD" -- \
        setpriv --pdeathsig KILL -- "$@"
    ;;
addr)
    [ $# -eq 2 ] || usage
    valid_set "$1"
    f=$(set_dir "$1")/$2.addr
    [ -f "$f" ] || die "no host '$2' in set '$1'"
    cat "$f"
    ;;
down | up)
    [ $# -eq 2 ] || usage
    valid_set "$1"
    host_init "$1" "$2" >/dev/null
    ip -n "$1.sw" link set dev "$2" "$cmd"
    ;;
rate)
    [ $# -eq 3 ] || usage
    valid_set "$1"
    host_init "$1" "$2" >/dev/null
    set_rate "$1" "$2" "$3"
    ;;
bytes)
    [ $# -eq 2 ] || usage
    valid_set "$1"
    host_init "$1" "$2" >/dev/null
    d=/sys/class/net/$2/statistics
    ip netns exec "$1.sw" sh -c "echo \$(cat $d/rx_bytes) \$(cat $d/tx_bytes)"
    ;;
destroy)
    [ $# -eq 1 ] || usage
    valid_set "$1"
    destroy "$1"
    ;;
*)
    usage
    ;;
esac
