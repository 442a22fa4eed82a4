#!/usr/bin/env bash
# Installs what reshard needs on a fresh Debian machine: everything the README's two commands
# use, nothing by hand. Idempotent and cheap the second time: each Debian package is checked by
# its exact name with dpkg-query (never by a file glob that another package could satisfy), and
# apt runs only when one is missing.
#
# - build-essential and pkg-config: crates that compile C/C++ (nixl-sys compiles its stubs);
# - libclang-dev: bindgen in nixl-sys's build script (it runs even with the stub API), which
#   needs libclang itself and clang's builtin headers (libclang-common-*-dev, pulled in);
# - libucx0: the UCP runtime backends/ucx opens at run time (libucp.so.0); the crate's bindings
#   are checked in (backends/ucx/src/raw/bindings.rs), so no UCX headers are needed to build;
#   ucx-utils: ucx_info, named by the ucx backend's errors for diagnosing transports;
# - python3, pip and python3-venv: the Python package (python/) is built with maturin and
#   tested with pytest and numpy inside the git-ignored virtualenv .deps/venv (Debian's python
#   refuses pip installs outside one); the same pip fetches the NIXL runtime, the PyPI wheel nixl-cu12, unpacked (no CUDA
#   needed for host memory) into the git-ignored folder .deps/nixl for backends/nixl.
#   RESHARD_NIXL_HOME overrides the folder.
# - procps: `kill`, with which the conformance suite stops and kills publisher processes.
# - protobuf-compiler and libprotobuf-dev: protoc and the well-known .proto files it imports,
#   which the etcd-client crate's build script compiles etcd's gRPC definitions with
#   (rendezvous/ talks to etcd);
# - etcd-server: the etcd that publishers and receivers meet through (rendezvous/);
#   tests and CI start their own on 127.0.0.1 with a temporary data dir (scripts/etcd.sh),
#   never the packaged service.
# - iproute2 (ip, tc) and util-linux (unshare, nsenter, setpriv): scripts/hosts.sh, the emulated
#   hosts and links of cli/tests/hosts.rs (network, PID and IPC namespaces, veth, tbf).
# The Rust toolchain is pinned in rust-toolchain.toml; see the end of this script.
#
# Runs as root, or through sudo when it is there; without either it names the packages to
# install and stops.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

apt_packages=(build-essential pkg-config libclang-dev libucx0 ucx-utils python3 python3-venv procps
              protobuf-compiler libprotobuf-dev etcd-server iproute2 util-linux)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# A Python whose pip works: the first python3 on PATH when `-m pip` runs there (a pyenv or venv
# python brings its own), else Debian's python3 with python3-pip.
python=python3
if ! python3 -m pip --version >/dev/null 2>&1; then
    python=/usr/bin/python3
    apt_packages+=(python3-pip)
fi

need=()
for p in "${apt_packages[@]}"; do
    installed "$p" || need+=("$p")
done

if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        as_root=()
    elif command -v sudo >/dev/null 2>&1; then
        as_root=(sudo)
    else
        echo "install-deps: not root and no sudo; install these Debian packages, then run me again:" >&2
        echo "    apt-get install ${need[*]}" >&2
        exit 1
    fi
    echo "install-deps: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${as_root[@]}" apt-get update -qq
    "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    for p in "${need[@]}"; do
        if ! installed "$p"; then
            echo "install-deps: apt-get did not install $p" >&2
            exit 1
        fi
    done
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "install-deps: cargo not found; install Rust with rustup (https://rustup.rs)" >&2
    exit 1
fi
# rust-toolchain.toml pins the toolchain by version. Where rustup cannot download (closed
# networks) but its stable toolchain is that version, link it under the pinned name; otherwise
# let rustup install it. Without rustup (a distribution's cargo) the file is not read and the
# installed toolchain is used as it is.
pinned=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$root/rust-toolchain.toml")
if command -v rustup >/dev/null 2>&1 && ! rustup toolchain list | grep -q "^$pinned"; then
    if rustc +stable --version 2>/dev/null | grep -q "^rustc $pinned "; then
        rustup toolchain link "$pinned" "$(rustc +stable --print sysroot)"
    else
        rustup toolchain install "$pinned" --profile minimal --component rustfmt,clippy
    fi
fi

# NIXL runtime: pinned wheel, installed without its Python dependencies (only its shared
# libraries are used). --target keeps it out of every Python environment (and out of the
# reach of Debian's externally-managed-environment rule).
nixl_version=1.5.1
nixl_home=${RESHARD_NIXL_HOME:-$root/.deps/nixl}
nixl_capi=$nixl_home/.nixl_cu12.mesonpy.libs/libnixl_capi.so
if [ ! -e "$nixl_capi" ]; then
    echo "install-deps: installing nixl-cu12==$nixl_version into $nixl_home"
    rm -rf "$nixl_home"
    PIP_ROOT_USER_ACTION=ignore "$python" -m pip install -q --disable-pip-version-check --no-deps \
        --target "$nixl_home" "nixl-cu12==$nixl_version"
fi
for f in "$nixl_capi" "$nixl_home/.nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so"; do
    if [ ! -e "$f" ]; then
        echo "install-deps: the NIXL wheel in $nixl_home has no $(basename "$f")" >&2
        exit 1
    fi
done
# The Python package's build and test tools, in a virtualenv of the same python: maturin (the
# PEP 517 backend of python/pyproject.toml), numpy (the arrays the bindings register), ml_dtypes
# (the package's numpy dtypes of bf16 and the 8-bit floats, a dependency of it), pytest,
# and Hugging Face's safetensors (python/tests/hf_models.py writes the test checkpoints with it,
# as transformers does: `safetensors.numpy.save_file`, and `serialize_file` with a `TensorSpec`
# for bf16, which numpy has no dtype for). The check imports exactly what the tests use.
venv=$root/.deps/venv
if [ ! -x "$venv/bin/python" ]; then
    echo "install-deps: creating the virtualenv $venv"
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import maturin, numpy, ml_dtypes, pytest' >/dev/null 2>&1; then
    echo "install-deps: installing maturin, numpy, ml_dtypes and pytest into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" numpy \
        "ml_dtypes>=0.4" pytest
fi
# TensorSpec (the typed argument of serialize_file) is safetensors 0.8's API.
if ! "$venv/bin/python" -c 'from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file, load_file' >/dev/null 2>&1; then
    echo "install-deps: installing safetensors into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "safetensors>=0.8,<0.9"
fi
echo "install-deps: system dependencies present (NIXL runtime in $nixl_home, Python tools in $venv)"
