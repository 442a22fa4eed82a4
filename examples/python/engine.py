"""A toy inference engine rank: it serves "generation" from a dict of named parameters (vLLM
naming: qkv_proj, gate_up_proj, experts w13/w2) and, between generation calls, a weight-update
hook refits them from the trainers with reshard. A vLLM integration hooks in the same way:
hand reshard the model's named parameters once, call the hook between batches.

Two installs (python/README.md): "copy" refits the engine's own arrays in place (reshard copies the
verified step into them); "swap" copies nothing: the hook re-points each named parameter to a
read-only array over reshard's buffer of the new step (in torch: ``param.data =
torch.from_numpy(array)``), and drops the old arrays, which reshard reuses two refits later.

    python examples/python/engine.py --rendezvous etcd://127.0.0.1:2379 --rank 0 --steps 3
    python examples/python/engine.py --rendezvous etcd://127.0.0.1:2379 --rank 1 --install swap
"""

import argparse

import numpy as np

import reshard
from toy import ENGINE, MODEL


def generate(params, prompt):
    """Stand-in for a forward pass: embeds the prompt and reports a digest of the weights."""
    embed = next(v for k, v in params.items() if k.endswith("embed_tokens.weight"))
    hidden = embed[np.asarray(prompt) % embed.shape[0]].sum(axis=0)
    return float(np.abs(hidden).sum())


class WeightUpdater:
    """The engine's weight-update hook over its dict of named parameters: with
    ``install="copy"`` it refits the engine's own arrays in place; with ``install="swap"`` it
    re-points every entry to reshard's newly installed arrays."""

    def __init__(self, params, rank, rendezvous, transport, install):
        self.params = params
        # model= is the name the trainers announce under; architecture= lets the receiver
        # check the engine's arrays now, before any trainer is up. Making it never waits.
        self.receiver = reshard.Receiver(model=MODEL["name"], architecture=MODEL, layout=ENGINE,
                                         rank=rank, rendezvous=rendezvous, transport=transport,
                                         params=params if install == "copy" else None,
                                         install=install)
        # Waits for the trainers (a refit would connect by itself, within its own timeout).
        self.receiver.connect(timeout=120)

    def __call__(self, timeout=120.0):
        try:
            report = self.receiver.refit(timeout=timeout)
            if self.receiver.install == "swap":
                # Re-point every parameter; the previous step's arrays are dropped here.
                self.params.update(self.receiver.weights())
            return report
        except reshard.ReshardError as e:
            # The engine keeps serving the previous weights, untouched.
            print(f"refit failed ({type(e).__name__}, owner {e.owner}, tensor {e.tensor}): {e}")
            return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rendezvous", required=True, help="etcd://HOST:PORT")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3, help="exit after this step is installed")
    ap.add_argument("--transport", default="ucx")
    ap.add_argument("--install", default="copy", choices=["copy", "swap"])
    args = ap.parse_args()

    # The engine allocates its parameters as usual (here: zeros of the layout's shapes).
    params = {name: np.zeros(shape, dtype=reshard.numpy_dtype(dtype))
              for name, (shape, dtype) in reshard.receiver_params(MODEL, ENGINE, args.rank).items()}
    update_weights = WeightUpdater(params, args.rank, args.rendezvous, args.transport,
                                   args.install)
    step = -1
    while step < args.steps:
        report = update_weights()
        if report is None:
            continue
        step = report.step
        out = generate(params, prompt=[1, 2, 3])
        print(f"engine rank {args.rank}: step {report.step} installed, verified={report.verified}, "
              f"{report.wire_bytes / 2**20:.1f} MiB in {report.reads} reads, "
              f"refit {report.e2e_s * 1e3:.1f} ms + {report.install} {report.copy_s * 1e3:.2f} ms; "
              f"generate -> {out:.3f}", flush=True)
    update_weights.receiver.close()


if __name__ == "__main__":
    main()
