"""A toy trainer rank: it owns its shard of the model as numpy arrays, updates them in place
every step (a stand-in optimizer), and publishes each step with reshard. A Megatron integration
hooks in the same way: register the rank's parameter tensors once, call publish(step) after
each optimizer step.

    python examples/python/trainer.py --rendezvous etcd://127.0.0.1:2379 --rank 0 --steps 3
"""

import argparse
import signal
import sys
import time
import zlib

import numpy as np

import reshard
from toy import MODEL, TRAINER


def init(name, offset, shape, dtype):
    """Initial weights: the same on every data-parallel replica of a box, as after a broadcast."""
    seed = zlib.crc32(f"{name}{offset}".encode())
    return np.random.default_rng(seed).standard_normal(shape).astype(reshard.numpy_dtype(dtype))


def optimizer_step(params, boxes, step, lr=1e-3):
    """Updates every parameter in place with a gradient all replicas agree on (the stand-in for
    an all-reduced gradient)."""
    for name, p in params.items():
        seed = zlib.crc32(f"{name}{boxes[name]}{step}".encode())
        grad = np.random.default_rng(seed).standard_normal(p.shape).astype(p.dtype)
        p -= lr * grad  # in place: the registered memory is what receivers read


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rendezvous", required=True, help="etcd://HOST:PORT")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--transport", default="ucx")
    ap.add_argument("--step-seconds", type=float, default=2.0, help="time one 'training step' takes")
    ap.add_argument("--linger-s", type=float, default=120.0,
                    help="how long the last step stays published unless stopped (SIGTERM) earlier")
    args = ap.parse_args()
    # SIGTERM closes the publisher as leaving the `with` block does (withdrawn at once, not when
    # its lease expires).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    with reshard.Publisher(model=MODEL["name"], architecture=MODEL, topology=TRAINER,
                           rank=args.rank, rendezvous=args.rendezvous,
                           transport=args.transport) as publisher:
        boxes = {name: offset for name, (offset, _, _) in publisher.tensors.items()}
        params = {name: init(name, offset, shape, dtype)
                  for name, (offset, shape, dtype) in publisher.tensors.items()}
        for name, p in params.items():
            publisher.register(name, p)  # zero-copy: reshard reads these arrays in place
        publisher.publish(0)
        print(f"trainer rank {args.rank}: published step 0 "
              f"({sum(p.nbytes for p in params.values()) / 2**20:.1f} MiB)", flush=True)
        for step in range(1, args.steps + 1):
            time.sleep(args.step_seconds)  # forward, backward, all-reduce...
            # The reader fence: no new receiver starts reading, the ones reading finish, then
            # the arrays change in place and the step is published.
            with publisher.updating(step) as released:
                optimizer_step(params, boxes, step)
            waited = f" after waiting {released['waited_s']:.3f} s for " \
                f"{len(released['readers'])} reader(s)" if released["readers"] else ""
            print(f"trainer rank {args.rank}: published step {step}{waited}", flush=True)
        # Keep serving the last step until the engines have read it: the README's script stops
        # the trainers once both engines have installed it (a real trainer keeps running). A
        # fixed pause here lost the race on a loaded machine: the engines found no publisher.
        time.sleep(args.linger_s)


if __name__ == "__main__":
    main()
