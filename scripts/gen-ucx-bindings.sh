#!/usr/bin/env bash
# Regenerates backends/ucx/src/raw/{ucp_bindings,status_names}.rs from the installed UCX headers
# with the generator in backends/ucx/bindgen (bindgen over <ucp/api/ucp.h>, a short allowlist).
#
#   scripts/gen-ucx-bindings.sh           # rewrite the checked-in files
#   scripts/gen-ucx-bindings.sh --check   # fail if they differ from what the headers give
#
# Needs what building never does: the UCX headers (libucx-dev, or UCX_HOME=/prefix) and
# libclang (libclang-dev). The backend itself builds without either: see backends/ucx/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/backends/ucx/src/raw
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cargo run --quiet --release --manifest-path "$root/backends/ucx/bindgen/Cargo.toml" \
    --target-dir "$root/target/ucx-bindgen" -- "$out"
rustfmt --edition 2021 "$out"/*.rs
if [ "${1:-}" = "--check" ]; then
    status=0
    for f in ucp_bindings.rs status_names.rs; do
        if ! diff -u "$dest/$f" "$out/$f"; then
            echo "gen-ucx-bindings: $dest/$f is not what the installed UCX headers give" >&2
            status=1
        fi
    done
    exit $status
fi
cp "$out"/ucp_bindings.rs "$out"/status_names.rs "$dest/"
echo "gen-ucx-bindings: wrote $dest/ucp_bindings.rs and status_names.rs"
