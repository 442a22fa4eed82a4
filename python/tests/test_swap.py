"""Swap install (python/README.md): the engine serves from read-only arrays over reshard's own
buffers, so a refit copies nothing; the arrays of a step stay valid and unchanged until the refit
after the next one, and a refit that would land in buffers the engine still holds arrays of is
refused before anything is written."""

import asyncio
import gc

import numpy as np
import pytest

import reshard
from test_loopback import LAYOUT, advance, start_publishers
from weights import assert_exact, expected, tiny_model


@pytest.fixture
def trainers(hub, name):
    """Four loopback publisher ranks of a tiny model at step 1, closed after the test:
    ``(model, publishers, their arrays)``."""
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    yield model, pubs, arrays
    for p in pubs:
        p.close()


def swap_receiver(model, hub, rank=0):
    return reshard.Receiver(model=model["name"], layout=LAYOUT, rank=rank, rendezvous=hub,
                            transport="loopback", timeout=10)


def addresses(weights):
    return {k: v.__array_interface__["data"][0] for k, v in weights.items()}


def test_swap_serves_reshard_buffers_zero_copy_and_guards_held_arrays(hub, trainers):
    model, pubs, arrays = trainers
    rx = swap_receiver(model, hub)
    assert rx.install == "swap" and rx.params is None
    with pytest.raises(reshard.InvalidInput):
        rx.weights()  # nothing installed yet

    r1 = rx.refit(timeout=10)
    assert r1.step == 1 and r1.install == "swap" and r1.copy_s == 0.0
    w1 = rx.weights()
    assert list(w1) == list(reshard.receiver_params(model, LAYOUT, 0))
    assert_exact(w1, expected(model, LAYOUT, 0, 1))
    first = next(iter(w1))
    assert not w1[first].flags.writeable
    with pytest.raises(ValueError):
        w1[first].reshape(-1)[0] = 1
    # Zero-copy: every call hands out views of the same buffers.
    assert addresses(rx.weights()) == addresses(w1)
    bank_a = addresses(w1)

    # The engine keeps serving step 1 while step 2 lands in the other buffers.
    advance(pubs, arrays, 2)
    assert rx.refit(timeout=10).step == 2
    w2 = rx.weights()
    assert set(addresses(w2).values()).isdisjoint(bank_a.values())
    assert_exact(w1, expected(model, LAYOUT, 0, 1))
    assert_exact(w2, expected(model, LAYOUT, 0, 2))

    # Step 3 would land in step 1's buffers, which the engine still holds: refused, naming them,
    # before anything is written.
    advance(pubs, arrays, 3)
    with pytest.raises(reshard.Busy) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == first and "step 1" in str(e.value)
    assert e.value.kind == "busy" and not isinstance(e.value, ValueError)
    assert rx.live_step == 2
    assert_exact(w1, expected(model, LAYOUT, 0, 1))
    assert_exact(w2, expected(model, LAYOUT, 0, 2))
    # One held array is enough to refuse; once the engine re-points, the refit goes through
    # into the same buffers (no allocation) and step 2's arrays stay as they were.
    kept = w1[first]
    del w1
    with pytest.raises(reshard.Busy) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == first and "1 array(s)" in str(e.value)
    del kept
    assert rx.refit(timeout=10).step == 3
    w3 = rx.weights()
    assert addresses(w3) == bank_a
    assert_exact(w3, expected(model, LAYOUT, 0, 3))
    assert_exact(w2, expected(model, LAYOUT, 0, 2))


def test_swap_failed_refit_leaves_the_served_arrays_and_weights_untouched(hub, trainers):
    model, pubs, arrays = trainers
    rx = swap_receiver(model, hub)
    rx.refit(timeout=10)
    served = rx.weights()
    advance(pubs, arrays, 2)
    for a in arrays:
        for arr in a.values():
            arr.reshape(-1)[0] += 1  # rewritten behind the digests' back
    with pytest.raises(reshard.Verification):
        rx.refit(timeout=10)
    assert rx.live_step == 1
    assert_exact(served, expected(model, LAYOUT, 0, 1))
    assert_exact(rx.weights(), expected(model, LAYOUT, 0, 1))
    assert addresses(rx.weights()) == addresses(served)
    # The failed refit wrote into the other buffers; the next one lands there and installs.
    advance(pubs, arrays, 3)
    assert rx.refit(timeout=10).step == 3
    assert_exact(rx.weights(), expected(model, LAYOUT, 0, 3))
    assert_exact(served, expected(model, LAYOUT, 0, 1))


def test_swap_engine_serves_while_refit_async_runs(hub, trainers):
    model, pubs, arrays = trainers
    rx = swap_receiver(model, hub)
    steps = {n: {k: v.tobytes() for k, v in expected(model, LAYOUT, 0, n).items()} for n in (1, 2)}

    async def main():
        await rx.refit_async(timeout=10)
        served = rx.weights()
        # The refit starts before the trainers publish step 2, so it is surely running (waiting
        # for the step) while the engine serves, reads weights() and live_step.
        task = asyncio.ensure_future(rx.refit_async(timeout=10))
        await asyncio.sleep(0.2)
        assert not task.done()
        assert rx.live_step == 1
        assert_exact(rx.weights(), expected(model, LAYOUT, 0, 1))
        advance(pubs, arrays, 2)
        reads = 0
        while not task.done():
            # "Generation" on the live arrays, and a fresh weights() call, while the refit runs:
            # a fresh call sees step 1 or, once installed, step 2, never a mix.
            assert_exact(served, expected(model, LAYOUT, 0, 1))
            fresh = {k: v.tobytes() for k, v in rx.weights().items()}
            assert fresh in (steps[1], steps[2])
            assert rx.live_step in (1, 2)  # readable while the refit runs, not "busy"
            reads += 1
            await asyncio.sleep(0)
        assert (await task).step == 2
        assert reads >= 1
        assert_exact(served, expected(model, LAYOUT, 0, 1))
        return rx.weights()

    assert_exact(asyncio.run(main()), expected(model, LAYOUT, 0, 2))


def test_swap_arrays_outlive_the_receiver(hub, trainers):
    model, _, _ = trainers
    rx = swap_receiver(model, hub)
    rx.refit(timeout=10)
    served = rx.weights()
    rx.close()
    del rx
    gc.collect()
    # Each array keeps its own buffer: nothing was freed under it.
    assert_exact(served, expected(model, LAYOUT, 0, 1))


def test_install_mode_must_match_params(hub, name, trainers):
    model, _, _ = trainers
    params = {n: np.zeros(s, dtype=reshard.numpy_dtype(d))
              for n, (s, d) in reshard.receiver_params(model, LAYOUT, 0).items()}
    common = dict(model=name, layout=LAYOUT, rank=0, rendezvous=hub, transport="loopback",
                  timeout=10)
    with pytest.raises(reshard.InvalidInput, match="takes no params"):
        reshard.Receiver(params=params, install="swap", **common)
    with pytest.raises(reshard.InvalidInput, match="pass them as params"):
        reshard.Receiver(install="copy", **common)
    with pytest.raises(reshard.InvalidInput, match="not \"move\""):
        reshard.Receiver(install="move", **common)
    rx = reshard.Receiver(params=params, **common)
    assert rx.install == "copy" and rx.weights() is rx.params
