#!/usr/bin/env bash
# Runs the in-flight safety tests (every `quiescent_after_*` / `quiescence_*` test of every
# backend: the conformance suite's and the backend's own) under
# AddressSanitizer, so a backend that frees, unmaps or reuses memory a read still touches fails
# loudly instead of corrupting silently (docs/in-flight-safety.md).
#
#   scripts/asan-quiescence.sh                 # every backend under backends/
#   scripts/asan-quiescence.sh loopback        # just the named backends
#
# AddressSanitizer needs nightly-only rustc flags; this toolchain is stable, so RUSTC_BOOTSTRAP=1
# unlocks them for this build only (as scripts/fuzz-smoke.sh does). The standard library is not
# rebuilt with the sanitizer (hence the ABI-mismatch allowance): heap and stack accesses of
# reshard's own code and its crates are checked, and ASan's allocator replaces malloc for the
# whole process, so a use-after-free by UCX or NIXL of memory reshard released is caught too.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

backends=("$@")
if [[ ${#backends[@]} -eq 0 ]]; then
    # Every backend crate (a new one is checked without editing this script).
    for manifest in backends/*/Cargo.toml; do
        backends+=("$(basename "$(dirname "$manifest")")")
    done
fi
target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Zsanitizer=address -Cunsafe-allow-abi-mismatch=sanitizer"
# Leak checking is off: UCX and NIXL keep process-lifetime allocations by design.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
# UCX's memory hooks (UCM) patch malloc and mmap, which ASan intercepts too; with both, the first
# UCX context jumps into nowhere (SEGV at a non-executable PC). Without UCM, UCX only loses its
# registration cache invalidation on free/munmap, which reshard does not rely on (it deregisters
# before it frees).
export UCX_MEM_EVENTS=no
# One cargo invocation for every backend: their shared dependencies are built once, with one
# feature set, instead of again per backend (which took minutes of CI time).
packages=()
for b in "${backends[@]}"; do
    packages+=(-p "reshard-backend-$b")
done
echo "== AddressSanitizer: in-flight safety tests of ${backends[*]}"
cargo test --release --target "$target" --target-dir target/asan "${packages[@]}" --tests -- quiesc
