#!/usr/bin/env bash
# A private etcd for tests, CI and the multi-process run of docs/cli.md: on 127.0.0.1, free ports,
# data dirs of its own, never the packaged service (etcd-server, from scripts/install-deps.sh).
# One member, or a real Raft cluster of N members on this machine (docs/deployment.md, "An etcd
# cluster"), so leader elections and a lost member can be rehearsed.
#
#   scripts/etcd.sh start DIR   starts one etcd with its data in DIR/data, waits until it
#                               answers, prints its client endpoint (etcd://127.0.0.1:PORT) and
#                               writes it to DIR/endpoint and the pid to DIR/pid
#   scripts/etcd.sh start-cluster DIR [N]
#                               starts an N-member cluster (default 3); member i (0..N-1) has
#                               its data, log, pid and ports in DIR/member-i/; waits until every
#                               member is healthy (a leader elected), then prints the endpoint
#                               list etcd://127.0.0.1:P0,127.0.0.1:P1,... (member i is the i-th)
#                               and writes it to DIR/endpoint
#   scripts/etcd.sh stop DIR    stops it, one member or every member of a cluster (SIGTERM,
#                               then SIGKILL after 5 s), and removes the data
#   scripts/etcd.sh leader DIR  prints the index of the cluster's current leader, waiting (up
#                               to 15 s) until a live member is leader
#   scripts/etcd.sh kill-member DIR i     SIGKILLs member i (a crash: no goodbye to its peers)
#   scripts/etcd.sh stop-member DIR i     stops member i (SIGTERM, then SIGKILL after 5 s)
#   scripts/etcd.sh restart-member DIR i  starts a stopped or killed member i again on its data
#                               and ports, and waits until it is healthy (it rejoins the cluster)
#
# Leader and health come from etcd's own HTTP endpoints (/health and the JSON gateway's
# /v3/maintenance/status), so no etcdctl is needed.
# ETCD_PORT sets the client port of a single member (default: a free one); other ports are free
# ones. ETCD_OWNER_PID ties etcd to a process: once that process is gone, a watcher stops etcd
# (every member of a cluster, restarted ones included) and removes its data, or all of DIR when
# this script created it (a test binary whose etcd lives in a static never runs a destructor,
# so nobody else would).
# ETCD_HOST sets the address etcd listens and advertises on (default 127.0.0.1), e.g. an
# emulated host's address from scripts/hosts.sh when this runs on that host.
set -euo pipefail

usage() {
    echo "usage: $0 start|stop|leader DIR | start-cluster DIR [N] | kill-member|stop-member|restart-member DIR i" >&2
    exit 2
}
[ $# -ge 2 ] || usage
cmd=$1
dir=$2

host=${ETCD_HOST:-127.0.0.1}

# N free ports on $host, one a line: all bound at once, so no two are the same.
free_ports() {
    python3 - "$1" "$host" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind((sys.argv[2], 0))
for s in socks:
    print(s.getsockname()[1])
EOF
}

need_etcd() {
    if ! command -v etcd >/dev/null 2>&1; then
        echo "etcd.sh: etcd not found; run scripts/install-deps.sh (Debian package etcd-server)" >&2
        exit 1
    fi
}

# Whether the etcd at client URL $1 says it is healthy: /health answers true once the member
# has a leader (for a single member: once it elected itself).
healthy() {
    python3 - "$1" <<'EOF' 2>/dev/null
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=1) as r:
    sys.exit(0 if json.load(r).get("health") == "true" else 1)
EOF
}

# Whether pid $1 runs: a killed member is reaped by init, not by this script (its parent was
# an earlier run), so until then it is a zombie that still answers kill -0.
alive() {
    kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]
}

# Stops pid $1: SIGTERM, then SIGKILL after 5 s.
stop_pid() {
    local pid=$1
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        alive "$pid" || return 0
        sleep 0.05
    done
    kill -9 "$pid" 2>/dev/null || true
}

# The number of members of the cluster in DIR, or nothing when DIR holds no cluster.
members() { cat "$dir/members" 2>/dev/null || true; }

member_dir() {
    local n
    n=$(members)
    if [ -z "$n" ]; then
        echo "etcd.sh: $dir holds no cluster (scripts/etcd.sh start-cluster DIR)" >&2
        exit 1
    fi
    case "$1" in
    '' | *[!0-9]*) echo "etcd.sh: member index $1 is not a number" >&2; exit 2 ;;
    esac
    if [ "$1" -ge "$n" ]; then
        echo "etcd.sh: the cluster in $dir has members 0..$((n - 1)), not $1" >&2
        exit 2
    fi
    echo "$dir/member-$1"
}

# The address a cluster's members listen on: ETCD_HOST as it was at start-cluster.
chost() { cat "$dir/host" 2>/dev/null || echo "$host"; }

# Starts member $1 of the cluster in DIR from the ports and peer list written at start-cluster
# (on an existing data dir etcd ignores the --initial-* flags and rejoins with what it has).
run_member() {
    local m=$dir/member-$1 client peer
    client=$(cat "$m/client-port")
    peer=$(cat "$m/peer-port")
    etcd --name "m$1" --data-dir "$m/data" \
        --listen-client-urls "http://$(chost):$client" --advertise-client-urls "http://$(chost):$client" \
        --listen-peer-urls "http://$(chost):$peer" --initial-advertise-peer-urls "http://$(chost):$peer" \
        --initial-cluster "$(cat "$dir/initial-cluster")" --initial-cluster-token "$(cat "$dir/token")" \
        --initial-cluster-state new \
        --log-level warn --logger zap >>"$m/etcd.log" 2>&1 &
    echo "$!" >"$m/pid"
}

# Waits up to 15 s until member $1 is healthy; on failure prints its log and exits.
wait_member() {
    local m=$dir/member-$1 pid url
    pid=$(cat "$m/pid")
    url="http://$(chost):$(cat "$m/client-port")"
    for _ in $(seq 1 300); do
        if ! alive "$pid"; then
            echo "etcd.sh: etcd member $1 exited at start; its log:" >&2
            cat "$m/etcd.log" >&2
            return 1
        fi
        if healthy "$url"; then return 0; fi
        sleep 0.05
    done
    echo "etcd.sh: etcd member $1 did not become healthy in 15 s; its log:" >&2
    cat "$m/etcd.log" >&2
    return 1
}

# Every pid this script started in DIR (the single member's, or each member's).
all_pids() {
    cat "$dir/pid" "$dir"/member-*/pid 2>/dev/null || true
}

# Detached from this script's output, or whoever reads it would wait for the watcher.
# While the owner lives and DIR still holds what was started (stop removes the marker $1),
# it waits; then it stops every pid recorded in DIR at that moment, so a member restarted
# since start-cluster is stopped as well.
watch_owner() {
    local owner=$1 marker=$2 created=$3
    (
        while kill -0 "$owner" 2>/dev/null && [ -e "$marker" ]; do sleep 1; done
        if [ -e "$marker" ]; then
            for pid in $(all_pids); do kill "$pid" 2>/dev/null || true; done
            sleep 5
            for pid in $(all_pids); do kill -9 "$pid" 2>/dev/null || true; done
            rm -rf "$dir/data" "$dir"/member-*/data
        fi
        if [ -n "$created" ]; then rm -rf "$dir"; fi
    ) </dev/null >/dev/null 2>&1 &
}

case "$cmd" in
start)
    [ $# -eq 2 ] || usage
    need_etcd
    created=
    [ -d "$dir" ] || created=1
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    client=${ETCD_PORT:-$(free_ports 1)}
    peer=$(free_ports 1)
    url="http://$host:$client"
    etcd --name reshard-test --data-dir "$dir/data" \
        --listen-client-urls "$url" --advertise-client-urls "$url" \
        --listen-peer-urls "http://$host:$peer" --initial-advertise-peer-urls "http://$host:$peer" \
        --initial-cluster "reshard-test=http://$host:$peer" \
        --log-level warn --logger zap >"$dir/etcd.log" 2>&1 &
    pid=$!
    echo "$pid" >"$dir/pid"
    ok=
    for _ in $(seq 1 200); do
        if ! alive "$pid"; then
            echo "etcd.sh: etcd exited at start; its log:" >&2
            cat "$dir/etcd.log" >&2
            exit 1
        fi
        if healthy "$url"; then ok=1; break; fi
        sleep 0.05
    done
    if [ -z "$ok" ]; then
        echo "etcd.sh: etcd did not become healthy in 10 s; its log:" >&2
        cat "$dir/etcd.log" >&2
        kill -9 "$pid" 2>/dev/null || true
        exit 1
    fi
    if [ -n "${ETCD_OWNER_PID:-}" ]; then
        watch_owner "$ETCD_OWNER_PID" "$dir/pid" "$created"
    fi
    echo "etcd://$host:$client" >"$dir/endpoint"
    cat "$dir/endpoint"
    ;;
start-cluster)
    [ $# -le 3 ] || usage
    n=${3:-3}
    case "$n" in
    '' | *[!0-9]* | 0) echo "etcd.sh: a cluster needs a member count of at least 1, not $n" >&2; exit 2 ;;
    esac
    need_etcd
    created=
    [ -d "$dir" ] || created=1
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ -n "$(members)" ] || [ -e "$dir/pid" ]; then
        echo "etcd.sh: $dir already holds an etcd; scripts/etcd.sh stop $dir first" >&2
        exit 1
    fi
    mapfile -t ports < <(free_ports $((2 * n)))
    echo "$host" >"$dir/host"
    peers=()
    clients=()
    for i in $(seq 0 $((n - 1))); do
        m=$dir/member-$i
        rm -rf "$m"
        mkdir -p "$m"
        echo "${ports[$((2 * i))]}" >"$m/client-port"
        echo "${ports[$((2 * i + 1))]}" >"$m/peer-port"
        peers+=("m$i=http://$(chost):${ports[$((2 * i + 1))]}")
        clients+=("$(chost):${ports[$((2 * i))]}")
    done
    (IFS=,; echo "${peers[*]}") >"$dir/initial-cluster"
    # A token of its own, so members of another cluster on this machine never join this one.
    echo "reshard-$$-$RANDOM" >"$dir/token"
    echo "$n" >"$dir/members"
    for i in $(seq 0 $((n - 1))); do run_member "$i"; done
    for i in $(seq 0 $((n - 1))); do
        if ! wait_member "$i"; then
            for pid in $(all_pids); do kill -9 "$pid" 2>/dev/null || true; done
            rm -f "$dir/members"
            exit 1
        fi
    done
    if [ -n "${ETCD_OWNER_PID:-}" ]; then
        watch_owner "$ETCD_OWNER_PID" "$dir/members" "$created"
    fi
    (IFS=,; echo "etcd://${clients[*]}") >"$dir/endpoint"
    cat "$dir/endpoint"
    ;;
stop)
    [ $# -eq 2 ] || usage
    if [ -f "$dir/pid" ]; then
        stop_pid "$(cat "$dir/pid")"
        rm -f "$dir/pid"
    fi
    n=$(members)
    if [ -n "$n" ]; then
        for i in $(seq 0 $((n - 1))); do
            m=$dir/member-$i
            if [ -f "$m/pid" ]; then stop_pid "$(cat "$m/pid")"; fi
            rm -rf "$m"
        done
        rm -f "$dir/initial-cluster" "$dir/token" "$dir/host"
        # The marker last: the owner watcher, if any, then sees the cluster stopped and leaves
        # (removing DIR if it was created for it), never while pid files are still read here.
        rm -f "$dir/members"
    fi
    rm -rf "$dir/data"
    ;;
leader)
    [ $# -eq 2 ] || usage
    n=$(members)
    if [ -z "$n" ]; then
        echo "etcd.sh: $dir holds no cluster (scripts/etcd.sh start-cluster DIR)" >&2
        exit 1
    fi
    urls=()
    for i in $(seq 0 $((n - 1))); do urls+=("http://$(chost):$(cat "$dir/member-$i/client-port")"); done
    # The leader is the member that reports itself as leader (member_id == leader in its
    # /v3/maintenance/status); a killed one answers nothing, so the index printed is a live one.
    python3 - "${urls[@]}" <<'EOF'
import json, sys, time, urllib.request
deadline = time.monotonic() + 15
while True:
    for i, url in enumerate(sys.argv[1:]):
        try:
            req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=1) as r:
                s = json.load(r)
        except Exception:
            continue
        if s.get("leader") and s.get("header", {}).get("member_id") == s["leader"]:
            print(i)
            sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit("etcd.sh: no live member of the cluster is leader after 15 s")
    time.sleep(0.1)
EOF
    ;;
kill-member)
    [ $# -eq 3 ] || usage
    m=$(member_dir "$3")
    pid=$(cat "$m/pid")
    kill -9 "$pid" 2>/dev/null || true
    # Wait until it is gone (or a zombie), so the caller sees it dead.
    for _ in $(seq 1 100); do
        alive "$pid" || break
        sleep 0.05
    done
    ;;
stop-member)
    [ $# -eq 3 ] || usage
    m=$(member_dir "$3")
    stop_pid "$(cat "$m/pid")"
    ;;
restart-member)
    [ $# -eq 3 ] || usage
    need_etcd
    m=$(member_dir "$3")
    pid=$(cat "$m/pid")
    if alive "$pid"; then
        echo "etcd.sh: member $3 is running (pid $pid); kill-member or stop-member it first" >&2
        exit 1
    fi
    dir=$(cd "$dir" && pwd)
    run_member "$3"
    wait_member "$3"
    ;;
*)
    usage
    ;;
esac
