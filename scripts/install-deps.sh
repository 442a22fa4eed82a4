#!/usr/bin/env bash
# Installs what reshard needs on a fresh Debian machine. Idempotent: it only installs what is
# missing, so running it twice is cheap.
#
# Needed today: a C toolchain and pkg-config (for crates that build C code). The Rust toolchain
# itself is pinned in rust-toolchain.toml and comes from rustup.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)

if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "install-deps: cargo not found; install Rust with rustup (https://rustup.rs)" >&2
    exit 1
fi
# rust-toolchain.toml pins the toolchain by version. Where rustup cannot download (closed
# networks) but its stable toolchain is that version, link it under the pinned name.
pinned=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$(dirname "$0")/../rust-toolchain.toml")
if command -v rustup >/dev/null 2>&1 && ! rustup toolchain list | grep -q "^$pinned"; then
    if rustc +stable --version 2>/dev/null | grep -q "^rustc $pinned "; then
        rustup toolchain link "$pinned" "$(rustc +stable --print sysroot)"
    else
        rustup toolchain install "$pinned" --profile minimal --component rustfmt,clippy
    fi
fi
echo "install-deps: system dependencies present"
