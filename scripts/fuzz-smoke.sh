#!/usr/bin/env bash
# Fuzz smoke test: builds every cargo-fuzz target in fuzz/ and runs each for a short time,
# failing on the first crash, panic, leak, timeout or allocation over the limits below.
#
#   scripts/fuzz-smoke.sh              # every target, FUZZ_SECONDS (default 20) each
#   scripts/fuzz-smoke.sh decode_table # just the named targets
#
# cargo-fuzz needs nightly-only rustc flags; this toolchain is stable, so RUSTC_BOOTSTRAP=1
# unlocks them (for this build only: the fuzz crate is its own workspace with its own target
# dir, and the root workspace excludes it). Working corpora go to fuzz/work/ (git-ignored);
# the small seeds and regression inputs in fuzz/corpus/<target>/ are read, never written.
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.2
SECONDS_PER_TARGET=${FUZZ_SECONDS:-20}

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"

if [[ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi

export RUSTC_BOOTSTRAP=1
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    # Every target fuzz/Cargo.toml declares: a new one is smoked without editing this script.
    mapfile -t targets < <(cargo fuzz list)
fi

# -O -a: release with debug assertions and overflow checks (-O alone turns them off, so an
# arithmetic overflow in a decoder would wrap silently), AddressSanitizer on. `run` takes the
# same flags, or it would rebuild without them.
cargo fuzz build -O -a

# One target's smoke run, its outcome left in work/<target>.status for the summary below.
smoke() {
    local t=$1 log="work/$1.log"
    mkdir -p "work/$t" "corpus/$t"
    # Allocation limits: decoders must bound allocations by the input size, so a single
    # malloc above 512 MiB or a process above 2 GiB is a failure, not a slow run.
    if cargo fuzz run -O -a "$t" "work/$t" "corpus/$t" -- \
        -max_total_time="$SECONDS_PER_TARGET" \
        -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 \
        -print_final_stats=1 >"$log" 2>&1; then
        echo ok >"work/$t.status"
    else
        echo failed >"work/$t.status"
    fi
}

# Each libFuzzer process runs on one core: as many targets run at once as there are cores
# (FUZZ_JOBS), which halves this phase on CI's two.
jobs_max=${FUZZ_JOBS:-$(nproc)}
for t in "${targets[@]}"; do
    while (($(jobs -rp | wc -l) >= jobs_max)); do
        wait -n || true
    done
    rm -f "work/$t.status"
    echo "== fuzz $t for ${SECONDS_PER_TARGET}s"
    smoke "$t" &
done
wait
for t in "${targets[@]}"; do
    log="work/$t.log"
    if [[ "$(cat "work/$t.status" 2>/dev/null)" != ok ]]; then
        tail -n 80 "$log" >&2
        echo "FAILED: fuzz target $t; the input is under fuzz/artifacts/$t/, the log in fuzz/$log" >&2
        exit 1
    fi
    echo "== $t"
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$log" || true
done
echo "fuzz smoke: ${#targets[@]} targets, ${SECONDS_PER_TARGET}s each, no crash"
