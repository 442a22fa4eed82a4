"""Stage, apply, roll back (python/README.md, "Stage, apply, roll back"): a step staged while the
engine serves another leaves the engine's weights bit for bit as they were, throughout; applying
it makes it the engine's weights bit for bit; a rollback brings the previous step back bit for
bit with every publisher closed. Handles and rollbacks that cannot be honoured raise typed
errors and change nothing. "Bit for bit" is against the values the trainers' arrays were filled
with (weights.py), in both installs."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

import reshard
from test_loopback import LAYOUT, advance, start_publishers
from weights import assert_exact, engine_arrays, expected, tiny_model


def make_receiver(model, hub, install, rank=0):
    params = engine_arrays(model, LAYOUT, rank) if install == "copy" else None
    return reshard.Receiver(model=model["name"], layout=LAYOUT, rank=rank, rendezvous=hub,
                            transport="loopback", params=params, install=install, timeout=10)


@pytest.mark.parametrize("install", ["copy", "swap"])
def test_stage_while_serving_apply_then_roll_back_with_every_publisher_closed(hub, name, install):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    one, two = expected(model, LAYOUT, 0, 1), expected(model, LAYOUT, 0, 2)
    rx = make_receiver(model, hub, install)
    assert rx.refit(timeout=10).step == 1
    serving = rx.weights()
    assert_exact(serving, one)

    advance(pubs, arrays, 2)
    # The engine keeps reading its weights while the stage runs on another thread (the GIL is
    # released while it moves and verifies).
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(rx.stage, timeout=10)
        looks = 0
        while not future.done() or looks == 0:
            assert_exact(serving, one)
            looks += 1
        staged = future.result()
    assert staged.step == 2 and rx.staged_step == 2 and rx.live_step == 1
    assert_exact(serving, one)
    assert_exact(rx.weights(), one)

    report = rx.apply(staged)
    assert report.step == 2 and report.verified and report.install == install
    assert report.apply_s > 0 and report.newer_step is None
    assert rx.live_step == 2 and rx.staged_step is None
    assert_exact(rx.weights(), two)
    if install == "copy":
        assert_exact(serving, two)  # the engine's own arrays

    for p in pubs:
        p.close()
    back = rx.rollback()
    assert (back.step, back.rolled_back_from, back.install) == (1, 2, install)
    assert rx.live_step == 1
    assert_exact(rx.weights(), one)
    with pytest.raises(reshard.NoRollback) as e:
        rx.rollback()
    assert e.value.reason == "no_previous" and isinstance(e.value, reshard.InvalidInput)
    assert_exact(rx.weights(), one)
    rx.close()


def test_refused_handles_and_rollbacks_change_nothing(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    one, two = expected(model, LAYOUT, 0, 1), expected(model, LAYOUT, 0, 2)
    rx = make_receiver(model, hub, "copy")
    other = make_receiver(model, hub, "copy")

    first = rx.stage(timeout=10)
    with pytest.raises(reshard.NoRollback) as e:
        rx.rollback()
    assert e.value.reason == "no_previous"
    with pytest.raises(reshard.NotApplicable) as e:
        rx.apply(other.stage(timeout=10))
    assert e.value.reason == "other_receiver"
    assert rx.live_step is None
    rx.apply(first)
    with pytest.raises(reshard.NotApplicable) as e:
        rx.apply(first)
    assert e.value.reason == "applied"
    assert_exact(rx.weights(), one)

    # A new stage replaces the staged step; the old handle is refused.
    advance(pubs, arrays, 2)
    a = rx.stage(timeout=10)
    b = rx.stage(step=2, timeout=10)
    with pytest.raises(reshard.NotApplicable) as e:
        rx.apply(a)
    assert e.value.reason == "replaced"
    assert rx.live_step == 1 and rx.staged_step == 2
    assert_exact(rx.weights(), one)

    rx.apply(b)
    assert_exact(rx.weights(), two)
    advance(pubs, arrays, 3)
    c = rx.stage(timeout=10)
    with pytest.raises(reshard.NoRollback) as e:
        rx.rollback()
    assert e.value.reason == "overwritten"
    assert rx.live_step == 2
    assert_exact(rx.weights(), two)
    assert rx.apply(c).step == 3

    # Pinned steps: a step nobody reaches times out naming who lacks it (overall timeout).
    with pytest.raises(reshard.Timeout) as e:
        rx.stage(step=4, timeout=0.3)
    assert "lacking step 4" in str(e.value) and "rank 0 has step 3" in str(e.value)
    with pytest.raises(reshard.InvalidInput) as e:
        rx.stage(step=2, timeout=10)
    assert "allow_older" in str(e.value)
    for p in pubs:
        p.close()
    pubs, arrays = start_publishers(model, hub, step=2)  # the trainers restart from step 2
    back = rx.stage(step=2, timeout=10, allow_older=True)
    assert rx.apply(back).step == 2
    assert_exact(rx.weights(), two)
    for p in pubs:
        p.close()


def test_async_twins(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rx = make_receiver(model, hub, "swap")

    async def main():
        r1 = await rx.refit_async(timeout=10)
        advance(pubs, arrays, 2)
        staged = await rx.stage_async(timeout=10)
        assert rx.live_step == 1 and staged.step == 2
        r2 = await rx.apply_async(staged)
        back = await rx.rollback_async()
        return r1.step, r2.step, back.step

    assert asyncio.run(main()) == (1, 2, 1)
    assert_exact(rx.weights(), expected(model, LAYOUT, 0, 1))
    for p in pubs:
        p.close()
