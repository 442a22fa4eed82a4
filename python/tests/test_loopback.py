"""One process, loopback transport, in-process rendezvous: trainers' numpy arrays published in
place, engines' numpy arrays refit in place, byte-exact; the typed errors and the safety rules
of the Python layer."""

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

import reshard
from weights import assert_exact, engine_arrays, expected, fill, tiny_model, trainer_arrays

TOPOLOGY = {"ep": 2, "dp": 4}
LAYOUT = {"tp": 2}


def start_publishers(model, hub, step=1):
    pubs, arrays = [], []
    for rank in range(8 // 2):
        p = reshard.Publisher(model=model["name"], architecture=model,
                              topology=TOPOLOGY, rank=rank, rendezvous=hub,
                              transport="loopback")
        a = trainer_arrays(p.tensors, step)
        for n, arr in a.items():
            p.register(n, arr)
        p.publish(step)
        pubs.append(p)
        arrays.append(a)
    return pubs, arrays


def receiver(model, hub, rank=0, params=None, timeout=10):
    """A copy-install receiver of ``model``, connected (within ``timeout``): making one never
    waits, so the errors of connecting (no publishers, arrays that do not fit) come from
    ``connect``, and a receiver that fails to connect is closed here."""
    params = engine_arrays(model, LAYOUT, rank) if params is None else params
    rx = reshard.Receiver(model=model["name"], layout=LAYOUT, rank=rank, rendezvous=hub,
                          transport="loopback", params=params, timeout=timeout)
    try:
        rx.connect()
    except BaseException:
        rx.close()
        raise
    return rx


def advance(pubs, arrays, step):
    for p, a in zip(pubs, arrays):
        p.unready()
        fill(a, p.tensors, step)
        p.publish(step)


def test_trainer_arrays_reach_engine_arrays_in_place_byte_exact(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rxs = [receiver(model, hub, rank) for rank in range(2)]
    for rank, rx in enumerate(rxs):
        held = dict(rx.params)
        report = rx.refit(timeout=10)
        assert report.step == 1 and report.verified and report.reads > 0
        assert report.checked_bytes == report.wire_bytes > 0
        assert report.wire_bytes > 0 and set(report.stages) >= {"wire", "verify", "install"}
        assert all(rx.params[k] is held[k] for k in held), "the engine's own arrays are refit"
        assert_exact(rx.params, expected(model, LAYOUT, rank, 1))
    # The trainer rewrites its arrays in place; publishing again is all it takes.
    advance(pubs, arrays, 2)
    for rank, rx in enumerate(rxs):
        report = rx.refit(timeout=10)
        assert report.step == 2 and rx.live_step == 2
        assert_exact(rx.params, expected(model, LAYOUT, rank, 2))
    for p in pubs:
        p.close()


def test_bf16_travels_as_ml_dtypes_bfloat16(hub, name):
    model = tiny_model(name, dtype="bf16")
    pubs, _ = start_publishers(model, hub)
    rx = receiver(model, hub)
    rx.refit(timeout=10)
    assert next(iter(rx.params.values())).dtype == reshard.numpy_dtype("bf16")
    assert str(next(iter(rx.params.values())).dtype) == "bfloat16"
    assert_exact(rx.params, expected(model, LAYOUT, 0, 1))
    for p in pubs:
        p.close()


def test_publisher_refuses_wrong_arrays_naming_the_tensor(hub, name):
    model = tiny_model(name)
    p = reshard.Publisher(model=model["name"], architecture=model,
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback")
    tname, (offset, shape, dtype) = next(iter(p.tensors.items()))
    with pytest.raises(reshard.InvalidInput) as e:
        p.register(tname, np.zeros(shape, dtype=np.float64))
    assert e.value.tensor == tname and e.value.kind == "invalid_input"
    with pytest.raises(reshard.InvalidInput) as e:
        p.register(tname, np.zeros((shape[0] + 1,) + shape[1:], dtype=np.float32))
    assert e.value.tensor == tname
    with pytest.raises(reshard.InvalidInput) as e:
        p.register(tname, np.zeros(shape[::-1], dtype=np.float32).T)  # not C-contiguous
    assert e.value.tensor == tname
    with pytest.raises(reshard.InvalidInput) as e:
        p.register("no.such.tensor", np.zeros(shape, dtype=np.float32))
    assert e.value.tensor == "no.such.tensor"
    assert isinstance(e.value, reshard.ReshardError)
    # Publishing with a tensor never registered names it.
    p.register(tname, np.zeros(shape, dtype=np.float32))
    with pytest.raises(reshard.InvalidInput) as e:
        p.publish(1)
    assert e.value.tensor == list(p.tensors)[1] and e.value.owner == 0
    p.close()


def test_empty_gives_a_registered_array(hub, name):
    model = tiny_model(name)
    pubs = []
    for rank in range(4):
        p = reshard.Publisher(model=model["name"], architecture=model,
                              topology=TOPOLOGY, rank=rank, rendezvous=hub,
                              transport="loopback")
        for i, (tname, (offset, shape, dtype)) in enumerate(p.tensors.items()):
            a = p.empty(tname) if i % 2 else p.empty(tname, shape, dtype)
            assert a.shape == shape and a.flags.writeable and not a.any()
            a[...] = trainer_arrays({tname: (offset, shape, dtype)}, 1)[tname]
        p.publish(1)
        pubs.append(p)
    rx = receiver(model, hub)
    rx.refit(timeout=10)
    assert_exact(rx.params, expected(model, LAYOUT, 0, 1))
    # The arrays are the registered memory: rewriting them is the next step.
    for p in pubs:
        p.close()


def test_empty_refuses_another_shape_or_dtype(hub, name):
    p = reshard.Publisher(model=name, architecture=tiny_model(name),
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback")
    tname, (offset, shape, dtype) = next(iter(p.tensors.items()))
    with pytest.raises(reshard.InvalidInput) as e:
        p.empty(tname, (1,) + shape, dtype)
    assert e.value.tensor == tname and e.value.owner == 0
    with pytest.raises(reshard.InvalidInput) as e:
        p.empty(tname, shape, np.float64)
    assert e.value.tensor == tname
    with pytest.raises(reshard.InvalidInput) as e:
        p.empty("no.such.tensor")
    assert e.value.tensor == "no.such.tensor"
    p.close()


def test_receiver_refuses_missing_and_mismatched_params_naming_them(hub, name):
    model = tiny_model(name)
    pubs, _ = start_publishers(model, hub)
    params = engine_arrays(model, LAYOUT, 0)
    first = next(iter(params))
    missing = dict(params)
    del missing[first]
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=missing)
    assert e.value.tensor == first
    wrong = dict(params)
    wrong[first] = params[first].astype(np.float64)
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=wrong)
    assert e.value.tensor == first
    wrong[first] = params[first].reshape(-1)
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=wrong)
    assert e.value.tensor == first
    ro = params[first].copy()
    ro.flags.writeable = False
    wrong[first] = ro
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=wrong)
    assert e.value.tensor == first
    extra = dict(params, **{"model.no_such.weight": np.zeros(1, np.float32)})
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=extra)
    assert e.value.tensor == "model.no_such.weight"
    for p in pubs:
        p.close()


def test_failed_refit_leaves_engine_arrays_untouched(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub)
    rx.refit(timeout=10)
    before = {k: v.copy() for k, v in rx.params.items()}
    # Step 2 is announced, then a trainer rewrites one array behind the digests' back (as a
    # racing rewrite would): the receiver must refuse it and keep step 1.
    advance(pubs, arrays, 2)
    for a in arrays:
        for arr in a.values():
            arr.reshape(-1)[0] += 1
    with pytest.raises(reshard.Verification) as e:
        rx.refit(timeout=10)
    assert e.value.tensor is not None and e.value.kind == "verification"
    assert rx.live_step == 1
    assert_exact(rx.params, before)
    # Once the trainer publishes consistent bytes again, the next refit installs them.
    advance(pubs, arrays, 3)
    assert rx.refit(timeout=10).step == 3
    assert_exact(rx.params, expected(model, LAYOUT, 0, 3))
    for p in pubs:
        p.close()


def test_gil_is_released_while_refit_waits(hub, name):
    model = tiny_model(name)
    pubs, _ = start_publishers(model, hub)
    rx = receiver(model, hub)
    rx.refit(timeout=10)
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    with pytest.raises(reshard.Timeout):
        rx.refit(timeout=0.5)
    stop.set()
    t.join()
    assert len(ticks) > 50, "another Python thread ran while refit waited"
    for p in pubs:
        p.close()


def test_ctrl_c_cancels_a_refit_and_the_next_one_works(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub)
    rx.refit(timeout=10)
    before = {k: v.copy() for k, v in rx.params.items()}
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rx.refit(timeout=30)
    assert time.monotonic() - t0 < 5
    assert_exact(rx.params, before)
    advance(pubs, arrays, 2)
    assert rx.refit(timeout=10).step == 2
    assert_exact(rx.params, expected(model, LAYOUT, 0, 2))
    for p in pubs:
        p.close()


def test_refit_async_and_its_cancellation(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub)

    async def main():
        report = await rx.refit_async(timeout=10)
        assert report.step == 1
        task = asyncio.ensure_future(rx.refit_async(timeout=30))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert rx.live_step == 1
    advance(pubs, arrays, 3)
    assert rx.wait_for_step(3, timeout=10).step == 3
    assert rx.wait_for_step(2) is None
    assert_exact(rx.params, expected(model, LAYOUT, 0, 3))
    for p in pubs:
        p.close()


def test_context_managers_withdraw_and_release(hub, name):
    model = tiny_model(name)
    pubs, _ = start_publishers(model, hub)
    with receiver(model, hub) as rx:
        rx.refit(timeout=10)
    with pytest.raises(reshard.Closed) as e:
        rx.refit(timeout=1)
    assert e.value.kind == "closed" and not e.value.retryable
    assert not isinstance(e.value, reshard.InvalidInput)
    for p in pubs:
        with p:
            pass
    with pytest.raises(reshard.Timeout):
        receiver(model, hub, timeout=0.3)


class DLPackOnly:
    """An array that exports only __dlpack__ (as a torch CPU tensor does), not the buffer
    protocol: torch is not installed here, so a numpy array stands behind it."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_dlpack_only_arrays_are_published_and_refit_in_place(hub, name):
    model = tiny_model(name)
    pubs = []
    for rank in range(4):
        p = reshard.Publisher(model=model["name"], architecture=model,
                              topology=TOPOLOGY, rank=rank, rendezvous=hub,
                              transport="loopback")
        for n, arr in trainer_arrays(p.tensors, 1).items():
            with pytest.raises(TypeError):
                memoryview(DLPackOnly(arr))
            p.register(n, DLPackOnly(arr))
        p.publish(1)
        pubs.append(p)
    engine = engine_arrays(model, LAYOUT, 0)
    rx = receiver(model, hub, params={k: DLPackOnly(v) for k, v in engine.items()})
    rx.refit(timeout=10)
    assert_exact(engine, expected(model, LAYOUT, 0, 1))
    for p in pubs:
        p.close()
