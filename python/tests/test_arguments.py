"""Arguments that once reached a Rust panic: a timeout of NaN or below zero is InvalidInput
naming the argument, ``inf`` (or any huge value) means no timeout, a lease TTL that is not a
finite number of seconds is InvalidInput; and a panic that still happens inside reshard is
raised as ``reshard.Panic``, an ``Exception`` (PyO3's PanicException is not one)."""

import asyncio
import math
import time

import pytest

import reshard
from test_loopback import LAYOUT, TOPOLOGY, advance, receiver, start_publishers
from weights import assert_exact, expected, tiny_model

BAD = [math.nan, -1.0, -math.inf, -1e-9]
HUGE = [math.inf, 1e300, 2.0**64, 3.2e9]


def refused(call, arg):
    """``call()`` raises InvalidInput naming ``arg``, and nothing that is not an Exception."""
    try:
        call()
    except reshard.InvalidInput as e:
        assert arg in str(e), e
        assert e.kind == "invalid_input"
        return
    except Exception as e:  # noqa: BLE001 - the wrong class is the failure reported
        pytest.fail(f"{type(e).__name__}: {e}")
    pytest.fail("accepted")


@pytest.mark.parametrize("bad", BAD)
def test_bad_timeouts_are_invalid_input_naming_the_argument(hub, name, bad):
    model = tiny_model(name)
    pubs, _ = start_publishers(model, hub)
    refused(lambda: receiver(model, hub, timeout=bad), "timeout")
    rx = receiver(model, hub)
    refused(lambda: rx.refit(timeout=bad), "timeout")
    refused(lambda: rx.wait_for_step(1, timeout=bad), "timeout")
    refused(lambda: asyncio.run(rx.refit_async(timeout=bad)), "timeout")
    assert rx.live_step is None, "nothing was done"
    assert rx.refit(timeout=10).step == 1
    rx.close()
    for p in pubs:
        p.close()


@pytest.mark.parametrize("huge", HUGE)
def test_inf_and_huge_timeouts_mean_no_timeout(hub, name, huge):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub, timeout=huge)
    assert rx.refit(timeout=huge).step == 1
    assert rx.wait_for_step(1, timeout=huge) is None

    # A refit with no limit waits for the next step: it returns once the trainers publish
    # step 2 (on another thread, while the refit runs or before it starts).
    async def main():
        task = asyncio.ensure_future(rx.refit_async(timeout=huge))
        await asyncio.sleep(0)
        await asyncio.to_thread(advance, pubs, arrays, 2)
        return await task

    assert asyncio.run(main()).step == 2
    assert_exact(rx.params, expected(model, LAYOUT, 0, 2))
    rx.close()
    for p in pubs:
        p.close()


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, 1e300, -math.inf])
def test_a_lease_ttl_that_is_not_finite_and_positive_is_invalid_input(hub, name, bad):
    refused(lambda: reshard.Publisher(model=name, architecture=tiny_model(name),
                                      topology=TOPOLOGY, rank=0,
                                      rendezvous=hub, transport="loopback", lease_ttl=bad),
            "lease_ttl")


def test_short_lease_ttls_are_still_accepted(hub, name):
    for ttl in (0.0, 0.5, 1.0, 3600.0):
        reshard.Publisher(model=name, architecture=tiny_model(name),
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback", lease_ttl=ttl).close()


def test_a_panic_is_a_reshard_error_of_its_own_class():
    # PyO3's PanicException derives from BaseException; reshard.Panic is an Exception, and an
    # Internal error (a bug), so `except Exception` and `except reshard.ReshardError` catch it.
    assert issubclass(reshard.Panic, reshard.Internal)
    assert issubclass(reshard.Panic, reshard.ReshardError)
    assert issubclass(reshard.Panic, Exception)
    assert "Panic" in reshard.__all__


def test_errors_are_also_the_standard_python_classes(hub, name):
    """Code that knows nothing of reshard catches its errors the standard way: a timeout as
    ``TimeoutError``, a bad argument as ``ValueError``; an object busy in another thread is
    ``reshard.Busy`` and a closed one ``reshard.Closed``, neither an invalid value."""
    for cls, std in [(reshard.Timeout, TimeoutError), (reshard.Transport, ConnectionError),
                     (reshard.InvalidInput, ValueError), (reshard.Layout, ValueError),
                     (reshard.Config, ValueError)]:
        assert issubclass(cls, reshard.ReshardError) and issubclass(cls, std), cls
    for cls in (reshard.Busy, reshard.Closed):
        assert issubclass(cls, reshard.ReshardError) and not issubclass(cls, ValueError), cls
    model = tiny_model(name)
    with pytest.raises(TimeoutError) as e:
        receiver(model, hub, timeout=0.3)
    assert isinstance(e.value, reshard.Timeout) and e.value.kind == "timeout", e.value
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub)
    with pytest.raises(ValueError) as e:
        rx.refit(timeout=math.nan)
    assert isinstance(e.value, reshard.InvalidInput) and "timeout" in str(e.value)
    assert rx.refit(timeout=10).step == 1

    # A refit waiting for step 2 in another thread holds the receiver: a second call is Busy.
    async def main():
        task = asyncio.ensure_future(rx.refit_async(timeout=30))
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, "the receiver was never busy"
            await asyncio.sleep(0.05)
            if task.done():
                # One of our calls below held the receiver first: the task was the busy one.
                assert isinstance(task.exception(), reshard.Busy), task.exception()
                task = asyncio.ensure_future(rx.refit_async(timeout=30))
                continue
            try:
                rx.refit(timeout=0.05)
            except reshard.Busy as busy:
                assert busy.kind == "busy" and busy.retryable, busy
                break
            except reshard.Timeout:
                continue  # this call came first (it waited for step 2 in vain)
        advance(pubs, arrays, 2)
        return await task

    assert asyncio.run(main()).step == 2
    assert_exact(rx.params, expected(model, LAYOUT, 0, 2))
    rx.close()
    for p in pubs:
        p.close()


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, 1e300, -math.inf])
def test_a_lease_ttl_that_is_not_finite_and_positive_is_invalid_input(hub, name, bad):
    refused(lambda: reshard.Publisher(model=name, architecture=tiny_model(name),
                                      topology=TOPOLOGY, rank=0,
                                      rendezvous=hub, transport="loopback", lease_ttl=bad),
            "lease_ttl")


def test_short_lease_ttls_are_still_accepted(hub, name):
    for ttl in (0.0, 0.5, 1.0, 3600.0):
        reshard.Publisher(model=name, architecture=tiny_model(name),
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback", lease_ttl=ttl).close()


def test_a_panic_is_a_reshard_error_of_its_own_class():
    # PyO3's PanicException derives from BaseException; reshard.Panic is an Exception, and an
    # Internal error (a bug), so `except Exception` and `except reshard.ReshardError` catch it.
    assert issubclass(reshard.Panic, reshard.Internal)
    assert issubclass(reshard.Panic, reshard.ReshardError)
    assert issubclass(reshard.Panic, Exception)
    assert "Panic" in reshard.__all__


def test_errors_are_also_the_standard_python_classes(hub, name):
    """Code that knows nothing of reshard catches its errors the standard way: a timeout as
    ``TimeoutError``, a bad argument as ``ValueError``; an object busy in another thread is
    ``reshard.Busy`` and a closed one ``reshard.Closed``, neither an invalid value."""
    for cls, std in [(reshard.Timeout, TimeoutError), (reshard.Transport, ConnectionError),
                     (reshard.InvalidInput, ValueError), (reshard.Layout, ValueError),
                     (reshard.Config, ValueError)]:
        assert issubclass(cls, reshard.ReshardError) and issubclass(cls, std), cls
    for cls in (reshard.Busy, reshard.Closed):
        assert issubclass(cls, reshard.ReshardError) and not issubclass(cls, ValueError), cls
    model = tiny_model(name)
    with pytest.raises(TimeoutError) as e:
        receiver(model, hub, timeout=0.3)
    assert isinstance(e.value, reshard.Timeout) and e.value.kind == "timeout", e.value
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub)
    with pytest.raises(ValueError) as e:
        rx.refit(timeout=math.nan)
    assert isinstance(e.value, reshard.InvalidInput) and "timeout" in str(e.value)
    assert rx.refit(timeout=10).step == 1

    # A refit waiting for step 2 in another thread holds the receiver: a second call is Busy.
    async def main():
        task = asyncio.ensure_future(rx.refit_async(timeout=30))
        for _ in range(200):
            await asyncio.sleep(0.01)
            try:
                rx.refit(timeout=0.1)
            except reshard.Busy as busy:
                assert busy.kind == "busy" and busy.retryable, busy
                break
        else:
            pytest.fail("a refit running in another thread never made the receiver busy")
        advance(pubs, arrays, 2)
        return await task

    assert asyncio.run(main()).step == 2
    rx.close()
    with pytest.raises(reshard.Closed):
        rx.refit(timeout=1)
    for p in pubs:
        p.close()


def test_an_array_larger_than_memory_is_refused_naming_the_tensor(hub, name):
    """Issue 42: the allocation aborted the process instead of raising."""
    m = tiny_model(name)
    m["vocab"] = 1 << 33  # embeddings of terabytes
    with reshard.Publisher(model=m["name"], architecture=m, topology={"tp": 1}, rank=0,
                           rendezvous=hub, transport="loopback") as pub:
        embed = next(t for t in pub.tensors if "embed" in t)
        with pytest.raises(reshard.InvalidInput, match="embed"):
            pub.empty(embed)
