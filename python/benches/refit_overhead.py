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
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--install", default="copy", choices=["copy", "swap", "both"])
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
        for name, (offset, shape, dtype) in p.tensors.items():
            a = p.empty(name)
            a.reshape(-1)[:] = np.arange(a.size, dtype=np.int64).astype(a.dtype)
        p.publish(0)
        pubs.append(p)
    installs = ["copy", "swap"] if args.install == "both" else [args.install]
    specs = reshard.receiver_params(model, args.receivers, 0)
    param_bytes = sum(int(np.prod(shape)) * reshard.numpy_dtype(dtype).itemsize
                      for shape, dtype in specs.values())
    rxs = {}
    for install in installs:
        params = None if install == "swap" else {
            name: np.zeros(shape, dtype=reshard.numpy_dtype(dtype))
            for name, (shape, dtype) in specs.items()}
        rxs[install] = reshard.Receiver(model=model["name"], layout=args.receivers, rank=0,
                                        rendezvous=hub, transport=args.transport, params=params,
                                        install=install, timeout=60)
        rxs[install].refit(timeout=60)  # warm-up: plan, registrations, descriptors
    served = {}  # what each engine serves from, re-pointed after every refit
    rows = {install: [] for install in installs}
    for step in range(1, args.updates + 1):
        for p in pubs:
            p.publish(step)
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
    for rx in rxs.values():
        rx.close()
    for p in pubs:
        p.close()


if __name__ == "__main__":
    main()
