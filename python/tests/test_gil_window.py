"""A check and the access it guards happen under one hold of the GIL (issue 42): a receiver's copy
install checks the engine's arrays, then copies into them; a publisher checks its arrays, then
digests them. Both checks once ran with the GIL held and the access after it with the GIL
released, so a Python thread could resize an array in between and the access touched freed
memory.

Each case runs in a child process (a read or write of unmapped memory kills it). A thread waits
to shrink a large array (``resize(1, refcheck=False)``: glibc gives the tail of its mapping
back) and is let go by the array's own export during the check. With the GIL held from check
to access, the shrink comes after the access: the child exits 0, the step is installed or
published, and the next one is refused naming the array. With the GIL released in between, the
shrink lands during the access and the child dies."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import reshard
from weights import tiny_model

LAYOUT = {"tp": 2}
# A 64 MiB embedding (its TP2 shard 32 MiB): copying or digesting it takes milliseconds, the
# shrinking thread wakes in microseconds.
VOCAB = 1 << 17


class Tripwire:
    """An array that exports only ``__dlpack__`` (as a torch tensor does; reshard then asks it
    again at every check) whose numpy array is shrunk by a waiting thread once ``arm``ed and
    exported again."""

    def __init__(self, array):
        self.array = array
        self.armed = False
        self.go = threading.Event()
        self.shrunk = threading.Event()
        threading.Thread(target=self._shrink, daemon=True).start()

    def _shrink(self):
        self.go.wait()
        self.array.resize(1, refcheck=False)
        self.shrunk.set()

    def __dlpack__(self, **kwargs):
        if self.armed:
            self.armed = False
            self.go.set()
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def model(name):
    # f32: a dtype DLPack carries (numpy's bf16 is ml_dtypes', which it does not).
    return {**tiny_model(name, dtype="f32"), "vocab": VOCAB}


def write(arrays, step):
    for i, a in enumerate(arrays.values()):
        a.reshape(-1)[:] = (np.arange(a.size) * 3 + step * 7 + i) % 65521


def publishers(m, hub, wrap=None):
    """EP2/DP2 publishers (ranks 0 and 1 of 2 hold every byte) of ``m`` at step 1; ``wrap`` is given rank 0's arrays to register in
    their place. Returns the publishers and their arrays."""
    pubs, arrays = [], []
    for rank in range(2):
        p = reshard.Publisher(model=m["name"], architecture=m, topology="ep=2,dp=2", rank=rank,
                              rendezvous=hub, transport="loopback")
        mine = {n: np.zeros(s, dtype=reshard.numpy_dtype(d)) for n, (_, s, d) in p.tensors.items()}
        write(mine, 1)
        shown = wrap(mine) if wrap is not None and rank == 0 else mine
        for n, a in shown.items():
            p.register(n, a)
        p.publish(1)
        pubs.append(p)
        arrays.append(mine)
    return pubs, arrays


def largest(arrays):
    return max(arrays, key=lambda n: arrays[n].nbytes)


def child_receiver(name):
    m = model(name)
    hub = reshard.InProcessHub()
    pubs, arrays = publishers(m, hub)
    engine = {n: np.zeros(s, dtype=reshard.numpy_dtype(d))
              for n, (s, d) in reshard.receiver_params(m, LAYOUT, 0).items()}
    big = largest(engine)
    wire = Tripwire(engine[big])
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params={**engine, big: wire}, timeout=60)
    assert rx.refit(timeout=60).step == 1
    for p, mine in zip(pubs, arrays):
        p.unready()
        write(mine, 2)
        p.publish(2)
    staged = rx.stage(timeout=60)
    wire.armed = True
    assert rx.apply(staged).step == 2
    assert wire.shrunk.wait(30), "the shrinking thread never ran"
    for p, mine in zip(pubs, arrays):
        p.unready()
        write(mine, 3)
        p.publish(3)
    try:
        rx.refit(timeout=60)
        raise AssertionError("a refit into the shrunk array was not refused")
    except reshard.InvalidInput as e:
        assert e.tensor == big, e
    assert rx.live_step == 2
    print("ok", big)


def child_publisher(name):
    m = model(name)
    hub = reshard.InProcessHub()
    held = {}

    def wrap(mine):
        big = largest(mine)
        held["big"], held["wire"] = big, Tripwire(mine[big])
        return {**mine, big: held["wire"]}

    pubs, arrays = publishers(m, hub, wrap)
    big, wire = held["big"], held["wire"]
    p, mine = pubs[0], arrays[0]
    p.unready()
    write(mine, 2)
    wire.armed = True
    p.publish(2)
    assert wire.shrunk.wait(30), "the shrinking thread never ran"
    assert p.step == 2
    try:
        p.publish(3)
        raise AssertionError("a publish of the shrunk array was not refused")
    except reshard.InvalidInput as e:
        assert e.tensor == big, e
    assert p.step == 2
    print("ok", big)


@pytest.mark.parametrize("side", ["receiver", "publisher"])
def test_an_array_shrunk_right_after_its_check_is_never_touched_freed(name, side):
    # One copy thread, so the shrinking thread has a core of its own on a 2-core machine.
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), side, name],
                          cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.startswith("ok"), (
        f"the {side} child exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    {"receiver": child_receiver, "publisher": child_publisher}[sys.argv[1]](sys.argv[2])
