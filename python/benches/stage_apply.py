"""What apply and rollback cost (python/README.md, "Stage, apply, roll back"), per install: the
rig of rig.py (publishers and receiver rank 0 in this process, in-process
rendezvous), a copy-install and a swap-install receiver side by side. Each round the publishers
advance; each receiver stages the new step (timed, not the subject), applies it, re-points (swap:
weights(), dropping the previous step's arrays first, as an engine does), then rolls back to the
step it served before (step 0, the warm-up's) and re-points again; the next round stages over
the bank rolled back from.

Per round and receiver:
- apply_rust_s:    the receiver's own apply (stages["install"]: a pointer swap in Rust);
- apply_s:         the whole apply in native code: the swap plus, in copy install, the copy
                   into the engine's arrays (RefitReport.apply_s);
- apply_python_s:  Receiver.apply as Python sees it;
- rollback_rust_s: the receiver's swap back (RollbackReport.install_s);
- rollback_s:      the swap back plus the copy (copy install);
- rollback_python_s: Receiver.rollback as Python sees it.

    python python/benches/stage_apply.py --transport loopback --rounds 20 --json
"""

import argparse
import json
import statistics

from rig import Rig, add_arguments


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    rig = Rig(args, ("copy", "swap"))
    rxs, param_bytes = rig.rxs, rig.param_bytes
    served = {}
    rows = {install: [] for install in rxs}
    for step in range(1, args.rounds + 1):
        rig.publish(step)
        for install, rx in rxs.items():
            before = rx.live_step
            staged = rx.stage(timeout=60)
            assert staged.step == step and rx.live_step == before
            served.pop(install, None)
            a = rx.apply(staged)
            served[install] = rx.weights()
            assert a.step == step and a.verified
            served.pop(install, None)
            b = rx.rollback()
            served[install] = rx.weights()
            assert b.step == before and rx.live_step == before
            served.pop(install, None)  # the next stage lands in the bank of `step`
            rows[install].append((a, b))
    med = statistics.median
    for install, got in rows.items():
        out = {
            "transport": args.transport,
            "install": install,
            "model": f"{args.preset} layers={args.layers} experts={args.experts} "
                     f"vocab={args.vocab}",
            "param_bytes": param_bytes,
            "rounds": args.rounds,
        }
        for key, values in [
            ("apply_rust_s", [a.stages["install"] for a, _ in got]),
            ("apply_s", [a.apply_s for a, _ in got]),
            ("apply_python_s", [a.python_s for a, _ in got]),
            ("rollback_rust_s", [b.install_s for _, b in got]),
            ("rollback_s", [b.install_s + b.copy_s for _, b in got]),
            ("rollback_python_s", [b.python_s for _, b in got]),
        ]:
            out[f"median_{key}"] = med(values)
            out[f"max_{key}"] = max(values)
        if args.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:>26}: {v * 1e3:.4f} ms" if k.endswith("_s") else f"{k:>26}: {v}")
    served.clear()
    rig.close()


if __name__ == "__main__":
    main()
