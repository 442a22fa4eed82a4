#!/usr/bin/env bash
# A private etcd for tests, CI and the README's multi-process run: on 127.0.0.1, free ports,
# a data dir of its own, never the packaged service (etcd-server, from scripts/install-deps.sh).
#
#   scripts/etcd.sh start DIR   starts etcd with its data in DIR/data, waits until it answers,
#                               prints its client endpoint (etcd://127.0.0.1:PORT) and writes
#                               it to DIR/endpoint and the pid to DIR/pid
#   scripts/etcd.sh stop DIR    stops it (SIGTERM, then SIGKILL after 5 s) and removes DIR/data
#
# ETCD_PORT sets the client port (default: a free one); the peer port is a free one.
# ETCD_HOST sets the address etcd listens and advertises on (default 127.0.0.1), e.g. an
# emulated host's address from scripts/hosts.sh when this runs on that host.
# ETCD_OWNER_PID ties etcd to a process: once that process is gone, a watcher stops etcd and
# removes DIR/data, or all of DIR when this script created it (a test binary whose etcd lives
# in a static never runs a destructor, so nobody else would).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
dir=$2

host=${ETCD_HOST:-127.0.0.1}

free_port() {
    python3 -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$host"
}

case "$cmd" in
start)
    if ! command -v etcd >/dev/null 2>&1; then
        echo "etcd.sh: etcd not found; run scripts/install-deps.sh (Debian package etcd-server)" >&2
        exit 1
    fi
    created=
    [ -d "$dir" ] || created=1
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    client=${ETCD_PORT:-$(free_port)}
    peer=$(free_port)
    url="http://$host:$client"
    etcd --name reshard-test --data-dir "$dir/data" \
        --listen-client-urls "$url" --advertise-client-urls "$url" \
        --listen-peer-urls "http://$host:$peer" --initial-advertise-peer-urls "http://$host:$peer" \
        --initial-cluster "reshard-test=http://$host:$peer" \
        --log-level warn --logger zap >"$dir/etcd.log" 2>&1 &
    pid=$!
    echo "$pid" >"$dir/pid"
    healthy=
    for _ in $(seq 1 200); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "etcd.sh: etcd exited at start; its log:" >&2
            cat "$dir/etcd.log" >&2
            exit 1
        fi
        # /health answers once the member has elected itself leader.
        if python3 - "$url" <<'EOF' 2>/dev/null; then healthy=1; break; fi
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=1) as r:
    sys.exit(0 if json.load(r).get("health") == "true" else 1)
EOF
        sleep 0.05
    done
    if [ -z "$healthy" ]; then
        echo "etcd.sh: etcd did not become healthy in 10 s; its log:" >&2
        cat "$dir/etcd.log" >&2
        kill -9 "$pid" 2>/dev/null || true
        exit 1
    fi
    if [ -n "${ETCD_OWNER_PID:-}" ]; then
        owner=$ETCD_OWNER_PID
        # Detached from this script's output, or whoever reads it would wait for the watcher.
        (
            while kill -0 "$owner" 2>/dev/null && kill -0 "$pid" 2>/dev/null; do sleep 1; done
            if kill -0 "$pid" 2>/dev/null; then
                kill "$pid" 2>/dev/null || true
                sleep 5
                kill -9 "$pid" 2>/dev/null || true
                rm -rf "$dir/data"
            fi
            if [ -n "$created" ]; then rm -rf "$dir"; fi
        ) </dev/null >/dev/null 2>&1 &
    fi
    echo "etcd://$host:$client" >"$dir/endpoint"
    cat "$dir/endpoint"
    ;;
stop)
    if [ -f "$dir/pid" ]; then
        pid=$(cat "$dir/pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$dir/pid"
    fi
    rm -rf "$dir/data"
    ;;
*)
    usage
    ;;
esac
