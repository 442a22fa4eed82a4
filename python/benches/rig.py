"""The rig both Python benches measure on: publishers of a synthetic model and receivers of rank
0, all in this process over an in-process rendezvous (refit_overhead.py, stage_apply.py)."""

import time

import numpy as np

import reshard


def add_arguments(ap):
    """The rig's flags: transport, model and both topologies."""
    ap.add_argument("--transport", default="loopback")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--publishers", default="ep=2,dp=2")
    ap.add_argument("--receivers", default="tp=2")


class Rig:
    """Publishers that published step 0, and one receiver of rank 0 per install mode, each
    warmed up by a first refit (plan, registrations, descriptors)."""

    def __init__(self, args, installs):
        self.model = reshard.model_config(args.preset, layers=args.layers,
                                          experts=args.experts, vocab=args.vocab,
                                          name=f"bench-{time.time_ns()}")
        hub = reshard.InProcessHub()
        world = 1
        for pair in args.publishers.split(","):
            key, value = pair.split("=")
            # Experts are spread within the data-parallel ranks, not over more of them.
            world *= int(value) if key != "ep" else 1
        self.pubs = []
        for rank in range(world):
            p = reshard.Publisher(model=self.model["name"], architecture=self.model,
                                  topology=args.publishers, rank=rank, rendezvous=hub,
                                  transport=args.transport)
            for name in p.tensors:
                a = p.empty(name)
                a.reshape(-1)[:] = np.arange(a.size, dtype=np.int64).astype(a.dtype)
            p.publish(0)
            self.pubs.append(p)
        specs = reshard.receiver_params(self.model, args.receivers, 0)
        self.param_bytes = sum(int(np.prod(shape)) * reshard.numpy_dtype(dtype).itemsize
                               for shape, dtype in specs.values())
        self.rxs = {}
        for install in installs:
            params = None if install == "swap" else {
                name: np.zeros(shape, dtype=reshard.numpy_dtype(dtype))
                for name, (shape, dtype) in specs.items()}
            self.rxs[install] = reshard.Receiver(
                model=self.model["name"], layout=args.receivers, rank=0, rendezvous=hub,
                transport=args.transport, params=params, install=install, timeout=60)
            self.rxs[install].refit(timeout=60)

    def publish(self, step):
        """Every publisher publishes `step`."""
        for p in self.pubs:
            p.publish(step)

    def close(self):
        """Receivers first, then publishers."""
        for rx in self.rxs.values():
            rx.close()
        for p in self.pubs:
            p.close()
