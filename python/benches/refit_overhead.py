"""What the Python layer adds to a refit, measured against the Rust path on the same rig, in the
same call: publishers and one receiver in this process (in-process rendezvous), a warm-up refit
and then --updates measured refits, each of a new step (the publishers re-digest and advance).

Per refit, from the report of Receiver.refit:
- rust_s:   Subscriber::next_step in Rust (discovery + the refit: the Rust path, what
            `reshard receive` does per step);
- copy_s:   the verified weights copied into the engine's arrays (the price of never landing
            in them; 0 in swap install);
- python_s: Receiver.refit as Python sees it;
- weights_s: Receiver.weights() after the refit, what a swap-install engine calls to re-point
            its parameters (read-only numpy arrays over reshard's buffers).
overhead = python_s - rust_s - copy_s is the binding itself: argument conversion, GIL release
and re-acquisition, the Ctrl-C polling loop, the report dict and dataclass.

--install both runs a copy-install and a swap-install receiver of the same rank side by side,
refitting every step in turn, so their costs are compared within one run.

    python python/benches/refit_overhead.py --transport loopback --updates 20 --install both
"""

import argparse
import json
import statistics
import time

from rig import Rig, add_arguments


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--install", default="copy", choices=["copy", "swap", "both"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    installs = ["copy", "swap"] if args.install == "both" else [args.install]
    rig = Rig(args, installs)
    rxs, param_bytes = rig.rxs, rig.param_bytes
    served = {}  # what each engine serves from, re-pointed after every refit
    rows = {install: [] for install in installs}
    for step in range(1, args.updates + 1):
        rig.publish(step)
        for install, rx in rxs.items():
            served.pop(install, None)  # the engine drops the old arrays before it refits
            r = rx.refit(timeout=60)
            t = time.perf_counter()
            served[install] = rx.weights()
            weights_s = time.perf_counter() - t
            assert r.step == step and r.verified and r.install == install
            rows[install].append((r, weights_s))
    med = lambda xs: statistics.median(xs)
    for install, got in rows.items():
        rs = [r for r, _ in got]
        out = {
            "transport": args.transport,
            "install": install,
            "model": f"{args.preset} layers={args.layers} experts={args.experts} "
                     f"vocab={args.vocab}",
            "publishers": args.publishers,
            "receivers": args.receivers,
            "updates": args.updates,
            "param_bytes": param_bytes,
            "wire_bytes": rs[-1].wire_bytes,
            "median_e2e_s": med([r.e2e_s for r in rs]),
            "median_rust_s": med([r.rust_s for r in rs]),
            "median_copy_s": med([r.copy_s for r in rs]),
            "median_weights_s": med([w for _, w in got]),
            "median_python_s": med([r.python_s for r in rs]),
            "median_overhead_s": med([r.python_s - r.rust_s - r.copy_s for r in rs]),
            "max_overhead_s": max(r.python_s - r.rust_s - r.copy_s for r in rs),
        }
        out["overhead_fraction"] = out["median_overhead_s"] / out["median_rust_s"]
        out["copy_fraction"] = out["median_copy_s"] / out["median_rust_s"]
        if args.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:>20}: {v * 1e3:.3f} ms" if k.endswith("_s") else f"{k:>20}: {v}")
    served.clear()
    rig.close()


if __name__ == "__main__":
    main()
