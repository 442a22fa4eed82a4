"""What apply and rollback cost (python/README.md, "Stage, apply, roll back"), per install: the
rig of refit_overhead.py (publishers and receiver rank 0 in this process, in-process
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
import time

import numpy as np

import reshard


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="loopback")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--publishers", default="ep=2,dp=2")
    ap.add_argument("--receivers", default="tp=2")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = reshard.model_config(args.preset, layers=args.layers, experts=args.experts,
                                 vocab=args.vocab, name=f"bench-{time.time_ns()}")
    hub = reshard.InProcessHub()
    world = 1
    for pair in args.publishers.split(","):
        world *= int(pair.split("=")[1]) if pair.split("=")[0] != "ep" else 1
    pubs = []
    for rank in range(world):
        p = reshard.Publisher(model=model["name"], architecture=model,
                              topology=args.publishers, rank=rank, rendezvous=hub,
                              transport=args.transport)
        for name in p.tensors:
            a = p.empty(name)
            a.reshape(-1)[:] = np.arange(a.size, dtype=np.int64).astype(a.dtype)
        p.publish(0)
        pubs.append(p)
    specs = reshard.receiver_params(model, args.receivers, 0)
    param_bytes = sum(int(np.prod(shape)) * reshard.numpy_dtype(dtype).itemsize
                      for shape, dtype in specs.values())
    rxs = {}
    for install in ("copy", "swap"):
        params = None if install == "swap" else {
            name: np.zeros(shape, dtype=reshard.numpy_dtype(dtype))
            for name, (shape, dtype) in specs.items()}
        rxs[install] = reshard.Receiver(model=model["name"], layout=args.receivers, rank=0,
                                        rendezvous=hub, transport=args.transport, params=params,
                                        install=install, timeout=60)
        rxs[install].refit(timeout=60)  # warm-up: plan, registrations, descriptors
    served = {}
    rows = {install: [] for install in rxs}
    for step in range(1, args.rounds + 1):
        for p in pubs:
            p.publish(step)
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
    for rx in rxs.values():
        rx.close()
    for p in pubs:
        p.close()


if __name__ == "__main__":
    main()
