#!/usr/bin/env bash
# Installs what reshard needs on a fresh Debian machine. Idempotent: it only installs what is
# missing, so running it twice is cheap.
#
# - a C toolchain and pkg-config (for crates that build C code);
# - UCX (Debian's libucx-dev 1.13, plus ucx-utils for ucx_info/ucx_perftest) and libclang for
#   bindgen, used by backends/ucx;
# - the NIXL runtime: the PyPI wheel nixl-cu12, unpacked (no CUDA needed for DRAM) into the
#   git-ignored folder .deps/nixl, used by backends/nixl. RESHARD_NIXL_HOME overrides the folder.
# The Rust toolchain itself is pinned in rust-toolchain.toml and comes from rustup.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
[ -e /usr/include/ucp/api/ucp.h ] || need+=(libucx-dev)
command -v ucx_info >/dev/null 2>&1 || need+=(ucx-utils)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-pip)

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
# NIXL runtime: pinned wheel, installed without its Python dependencies (only its shared
# libraries are used).
nixl_version=1.5.1
nixl_home=${RESHARD_NIXL_HOME:-$root/.deps/nixl}
if [ ! -e "$nixl_home/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]; then
    rm -rf "$nixl_home"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-deps --target "$nixl_home" \
        "nixl-cu12==$nixl_version"
fi
if [ ! -e "$nixl_home/.nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so" ]; then
    echo "install-deps: the NIXL wheel in $nixl_home has no UCX plugin" >&2
    exit 1
fi
echo "install-deps: system dependencies present (NIXL runtime in $nixl_home)"
