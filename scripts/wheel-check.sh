#!/usr/bin/env bash
# The Python package as a user installs it (python/README.md, "Installing"): built as a wheel
# (maturin), installed with its `nixl` extra into a fresh virtualenv, then used from a shell that
# has no cargo, no Rust toolchain and no build tree on its PATH or in its environment:
#   1. python/README.md's example (the block after "The examples in `examples/python/`", minus
#      its install line, run with the fresh virtualenv's python);
#   2. a nixl transport made from the installed package, which must load the NIXL runtime from
#      the nixl-cu12 package installed in that virtualenv (read off /proc/self/maps), never from
#      this checkout's .deps/nixl.
# Usage: scripts/wheel-check.sh [WHEEL] (default: build one). Needs scripts/install-deps.sh
# (maturin in .deps/venv) and network access or pip's cache for numpy, ml_dtypes and nixl-cu12, as a user's
# install does.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${RESHARD_PYTHON:-$root/.deps/venv/bin/python}
work=$(mktemp -d /tmp/reshard-wheel.XXXXXX)
example_pid=
# The example runs in a session of its own (setsid), so whatever it started is one process group,
# killed here if it fails part-way: its engines would otherwise retry discovery forever.
trap '[ -z "$example_pid" ] || kill -KILL -- "-$example_pid" 2>/dev/null || true
      scripts/etcd.sh stop "$work/etcd" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

wheel=${1:-}
if [ -z "$wheel" ]; then
    echo "== wheel: build"
    PATH="$(dirname "$python"):$PATH" maturin build --release --quiet -m python/Cargo.toml \
        --out "$work/dist"
    wheel=$(ls "$work"/dist/reshard-*.whl)
fi
echo "== wheel: $(basename "$wheel") into a fresh virtualenv"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel[nixl]"

# A user's shell: the system PATH only, nothing of cargo or of this checkout's environment.
clean=(env -i HOME="$HOME" LANG=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin UCX_TLS=tcp)
if "${clean[@]}" bash -c 'command -v cargo || command -v rustc'; then
    echo "wheel-check: cargo or rustc is on the system PATH; the check would not prove it needs none" >&2
    exit 1
fi

echo "== wheel: python/README.md's example, from the installed package"
example=$("$python" - "$work/venv/bin/python" "$work/etcd" <<'EOF'
import re, sys
text = open("python/README.md").read()
at = text.index("The examples in `examples/python/`")
block = re.search(r"```sh\n(.*?)```", text[at:], re.S).group(1).splitlines()
assert block[0].startswith("scripts/install-deps.sh"), block[0]
# Its own etcd directory, not the README's fixed one, which another run may be using.
print("\n".join(block[1:]).replace(".deps/venv/bin/python", sys.argv[1])
      .replace("/tmp/reshard-example", sys.argv[2]))
EOF
)
setsid -w "${clean[@]}" bash -euo pipefail -c "$example" >"$work/example.out" &
example_pid=$!
wait "$example_pid"
out=$(cat "$work/example.out")
echo "$out" | grep -E "^engine rank" || true
for rank in 0 1; do
    grep -q "engine rank $rank: step 3 installed, verified=True" <<<"$out" ||
        { echo "wheel-check: engine rank $rank did not install step 3 verified:" >&2; echo "$out" >&2; exit 1; }
done

echo "== wheel: the NIXL runtime comes from the virtualenv's nixl-cu12"
"${clean[@]}" "$work/venv/bin/python" - "$work/venv" <<'EOF'
import sys
import reshard

venv = sys.argv[1]
model = reshard.model_config("qwen3-30b-a3b", layers=1, experts=2, vocab=64, dtype="f32")
# Making the publisher makes its transport, which loads the runtime.
with reshard.Publisher(model="wheel-check", architecture=model, topology={"tp": 1}, rank=0,
                       rendezvous=reshard.InProcessHub(), transport="nixl"):
    maps = open("/proc/self/maps").read().splitlines()
    libs = sorted({line.split()[-1] for line in maps if line.endswith("libnixl_capi.so")})
assert libs, "no libnixl_capi.so mapped after making a nixl transport"
for lib in libs:
    assert lib.startswith(venv + "/"), f"NIXL runtime loaded from {lib}, not from {venv}"
print(f"NIXL runtime: {libs[0]}")
EOF

# The `test` extra brings what python/tests imports beyond the package (a fresh
# `pip install reshard[test]` once lacked safetensors, and pytest failed at collection): every
# test module is collected with the fresh virtualenv's python.
echo "== wheel: the test extra collects every test module"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel[test]"
"${clean[@]}" "$work/venv/bin/python" -m pytest -q --collect-only -p no:cacheprovider \
    "$root/python/tests" >"$work/collect.out" 2>&1 ||
    { echo "wheel-check: pytest could not collect python/tests in a fresh [test] install:" >&2
      tail -n 30 "$work/collect.out" >&2; exit 1; }
tail -n 1 "$work/collect.out"

echo "wheel-check: the wheel installs without cargo, runs the python/README.md example, finds NIXL in its venv;" \
    "its test extra collects python/tests"
