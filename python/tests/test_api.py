"""The API's promises (issue 28, item 4): making a receiver never waits, it connects explicitly
or in its first refit within that call's timeout; ``model=`` is the rendezvous name on both
sides (the architecture is ``architecture=``, the old ``model=<dict>`` still works with a
DeprecationWarning); bf16 and 8-bit floats are ml_dtypes arrays both ways; ``wait_for_step``'s
timeout is one deadline for the whole call.

The few bounds on time here are there to turn a hang into a failure, with seconds of slack
for a noisy machine: each guards a wait that would otherwise be minutes or forever."""

import asyncio
import threading
import time
import warnings

import ml_dtypes
import numpy as np
import pytest

import reshard
from weights import assert_exact, engine_arrays, expected, tiny_model, trainer_arrays

TOPOLOGY = {"ep": 2, "dp": 4}
LAYOUT = {"tp": 2}
# Slack on every bound below: what a loaded two-core machine may add to a wait.
SLACK = 5.0


def start_publishers(model, hub, step=1):
    """Every rank of TOPOLOGY, published at ``step``, named by ``model=`` (the new spelling)."""
    pubs = []
    for rank in range(8 // 2):
        p = reshard.Publisher(model=model["name"], architecture=model, topology=TOPOLOGY,
                              rank=rank, rendezvous=hub, transport="loopback")
        for n, arr in trainer_arrays(p.tensors, step).items():
            p.register(n, arr)
        p.publish(step)
        pubs.append(p)
    return pubs


def in_thread(call, bound):
    """Runs ``call()`` in a thread; ``(finished, seconds, result, error)`` after at most
    ``bound`` seconds (the thread is left to finish on its own when it has not)."""
    out = {}

    def run():
        try:
            out["result"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    return not t.is_alive(), time.monotonic() - t0, out.get("result"), out.get("error")


def test_making_a_receiver_never_waits_and_connect_is_explicit(hub, name):
    model = tiny_model(name)
    # No publisher exists: a constructor that waited for them would wait its default 300 s.
    done, _, rx, err = in_thread(
        lambda: reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                                 transport="loopback", params=engine_arrays(model, LAYOUT, 0)),
        SLACK)
    assert done and err is None, f"Receiver() waited for publishers ({err!r})"
    assert not rx.connected and rx.live_step is None
    # What needs the publishers raises a typed error and never connects on its own.
    with pytest.raises(reshard.NotConnected) as e:
        rx.architecture
    assert e.value.kind == "not_connected" and "connect" in str(e.value)
    with pytest.raises(reshard.NotConnected):
        rx.rollback()
    # connect() with nobody there: a Timeout, and still unconnected (a later call retries).
    with pytest.raises(reshard.Timeout):
        rx.connect(timeout=0.2)
    assert not rx.connected
    pubs = start_publishers(model, hub)
    rx.connect(timeout=10)
    assert rx.connected and rx.live_step is None
    arch = rx.architecture
    assert arch["name"] == name and arch["layers"] == model["layers"]
    rx.connect(timeout=0)  # connected already: nothing to wait for
    assert rx.refit(timeout=10).step == 1
    assert_exact(rx.params, expected(model, LAYOUT, 0, 1))
    for p in pubs:
        p.close()
    rx.close()
    with pytest.raises(reshard.Closed):
        rx.connect(timeout=1)


def test_the_first_refit_connects_within_its_own_timeout(hub, name):
    model = tiny_model(name)
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap")
    # Nobody publishes: the refit's own timeout bounds its connect, not the constructor's 300 s.
    done, took, _, err = in_thread(lambda: rx.refit(timeout=0.5), 0.5 + SLACK)
    assert done, f"refit(timeout=0.5) still waiting after {took:.1f} s"
    assert isinstance(err, reshard.Timeout) and isinstance(err, TimeoutError), err
    assert not rx.connected
    done, took, _, err = in_thread(lambda: rx.stage(timeout=0.5), 0.5 + SLACK)
    assert done and isinstance(err, reshard.Timeout), err
    pubs = start_publishers(model, hub)
    report = rx.refit(timeout=10)
    assert rx.connected and report.step == 1 and report.verified
    assert_exact(rx.weights(), expected(model, LAYOUT, 0, 1))
    for p in pubs:
        p.close()
    rx.close()


def test_connect_async_connects(hub, name):
    model = tiny_model(name)
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap", timeout=10)
    pubs = start_publishers(model, hub)
    asyncio.run(rx.connect_async())
    assert rx.connected and rx.architecture["name"] == name
    for p in pubs:
        p.close()
    rx.close()


def test_architecture_checks_the_engine_arrays_before_any_publisher(hub, name):
    model = tiny_model(name)
    params = engine_arrays(model, LAYOUT, 0)
    pname, good = next(iter(params.items()))
    bad = dict(params, **{pname: np.zeros(good.shape[:-1] + (good.shape[-1] + 1,), good.dtype)})
    # With architecture=, a wrong array fails at construction, naming it.
    with pytest.raises(reshard.InvalidInput) as e:
        reshard.Receiver(model=name, architecture=model, layout=LAYOUT, rank=0, rendezvous=hub,
                         transport="loopback", params=bad)
    assert e.value.tensor == pname
    # Without it the layout is known only from the publishers: the same array fails at connect.
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=bad)
    pubs = start_publishers(model, hub)
    with pytest.raises(reshard.InvalidInput) as e:
        rx.connect(timeout=10)
    assert e.value.tensor == pname and not rx.connected
    rx.close()
    # Publishers whose model gives other parameters than architecture= said: Config at connect.
    other = dict(model, layers=model["layers"] + 1)
    rx = reshard.Receiver(model=name, architecture=other, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap")
    with pytest.raises(reshard.Config) as e:
        rx.connect(timeout=10)
    assert "architecture" in str(e.value) and not rx.connected
    rx.close()
    # The matching architecture connects and refits.
    rx = reshard.Receiver(model=name, architecture=model, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=engine_arrays(model, LAYOUT, 0))
    assert rx.refit(timeout=10).step == 1
    assert_exact(rx.params, expected(model, LAYOUT, 0, 1))
    for p in pubs:
        p.close()
    rx.close()


def test_model_is_the_rendezvous_name_on_both_sides(hub, name):
    model = tiny_model(name)
    # The new spelling: the name announced is model=, whatever name the architecture carries.
    other = f"{name}-b"
    renamed = dict(model, name="some-other-name")
    named = []
    for rank in range(4):
        p = reshard.Publisher(model=other, architecture=renamed, topology=TOPOLOGY, rank=rank,
                              rendezvous=hub, transport="loopback")
        assert p.model == other
        for n, arr in trainer_arrays(p.tensors, 1).items():
            p.register(n, arr)
        p.publish(1)
        named.append(p)
    rx = reshard.Receiver(model=other, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap")
    rx.connect(timeout=10)
    assert rx.architecture["name"] == other
    rx.close()
    for p in named:
        p.close()
    # A preset name as architecture=.
    p = reshard.Publisher(model=name, architecture="qwen3-30b-a3b", topology=TOPOLOGY, rank=0,
                          rendezvous=hub, transport="loopback")
    assert p.model == name and p.tensors
    p.close()
    # model= alone is the name of the preset it must then be.
    with pytest.raises(reshard.Config) as e:
        reshard.Publisher(model=name, topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback")
    assert "architecture=" in str(e.value)
    # The old spelling on both sides: still works, with a DeprecationWarning each.
    pubs = []
    for rank in range(4):
        with pytest.warns(DeprecationWarning, match="architecture="):
            p = reshard.Publisher(model=model, topology=TOPOLOGY, rank=rank, rendezvous=hub,
                                  transport="loopback")
        assert p.model == name
        for n, arr in trainer_arrays(p.tensors, 1).items():
            p.register(n, arr)
        p.publish(1)
        pubs.append(p)
    with pytest.warns(DeprecationWarning, match="model= is the name"):
        old = reshard.Receiver(model=model, layout=LAYOUT, rank=0, rendezvous=hub,
                               transport="loopback", params=engine_arrays(model, LAYOUT, 0))
    assert old.model == name
    assert old.refit(timeout=10).step == 1
    assert_exact(old.params, expected(model, LAYOUT, 0, 1))
    old.close()
    # The new spelling warns about nothing, and meets the old-spelling publishers by name.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        rx = reshard.Receiver(model=name, layout=LAYOUT, rank=1, rendezvous=hub,
                              transport="loopback", params=engine_arrays(model, LAYOUT, 1))
    assert rx.refit(timeout=10).step == 1
    rx.close()
    # Both at once is ambiguous: refused, naming both keywords.
    with pytest.warns(DeprecationWarning), pytest.raises(reshard.InvalidInput) as e:
        reshard.Publisher(model=model, architecture=model, topology=TOPOLOGY, rank=0,
                          rendezvous=hub, transport="loopback")
    assert "architecture=" in str(e.value) and "model=" in str(e.value)
    for p in pubs:
        p.close()


ML = {"bf16": ml_dtypes.bfloat16, "f8_e4m3": ml_dtypes.float8_e4m3fn,
      "f8_e5m2": ml_dtypes.float8_e5m2}
RAW = {"bf16": np.uint16, "f8_e4m3": np.uint8, "f8_e5m2": np.uint8}


@pytest.mark.parametrize("dtype", sorted(ML))
def test_bf16_and_fp8_are_ml_dtypes_both_ways(hub, name, dtype):
    model = tiny_model(name, dtype=dtype)
    assert reshard.numpy_dtype(dtype) == np.dtype(ML[dtype])
    assert reshard.numpy_dtype(dtype, raw=True) == np.dtype(RAW[dtype])
    pubs = []
    for rank in range(4):
        p = reshard.Publisher(model=name, architecture=model, topology=TOPOLOGY, rank=rank,
                              rendezvous=hub, transport="loopback")
        arrays = trainer_arrays(p.tensors, 1)
        for i, (n, arr) in enumerate(arrays.items()):
            assert arr.dtype == ML[dtype]
            if rank == 0 and i == 0:
                # Raw bits are still accepted: the same memory viewed as unsigned integers.
                p.register(n, arr.view(RAW[dtype]))
            elif rank == 1 and i == 0:
                # empty() gives the ml_dtypes array; dtype=<raw> its bits instead.
                e = p.empty(n)
                assert e.dtype == ML[dtype]
                e.view(RAW[dtype])[...] = arr.view(RAW[dtype])
            else:
                p.register(n, arr)
        p.publish(1)
        pubs.append(p)
    # Copy install into ml_dtypes arrays.
    params = engine_arrays(model, LAYOUT, 0)
    assert all(a.dtype == ML[dtype] for a in params.values())
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=params)
    rx.refit(timeout=10)
    want = expected(model, LAYOUT, 0, 1)
    assert all(rx.params[k] is params[k] for k in params)
    assert_exact(rx.params, want)
    # Copy install into raw-bit arrays still works (the old way).
    raw_params = {k: np.zeros(a.shape, RAW[dtype]) for k, a in params.items()}
    raw_rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                              transport="loopback", params=raw_params)
    raw_rx.refit(timeout=10)
    assert_exact(raw_rx.params, want)
    # Swap install lends ml_dtypes arrays; .view(<raw>) gives their bits, zero-copy.
    swap = reshard.Receiver(model=name, layout=LAYOUT, rank=1, rendezvous=hub,
                            transport="loopback", install="swap")
    swap.refit(timeout=10)
    w = swap.weights()
    assert all(a.dtype == ML[dtype] for a in w.values())
    assert_exact(w, expected(model, LAYOUT, 1, 1))
    a = next(iter(w.values()))
    bits = a.view(RAW[dtype])
    assert bits.dtype == RAW[dtype] and bits.tobytes() == a.tobytes()
    assert np.shares_memory(bits, a)
    for r in (rx, raw_rx, swap):
        r.close()
    for p in pubs:
        p.close()


def test_publisher_empty_gives_raw_bits_when_asked(hub, name):
    model = tiny_model(name, dtype="bf16")
    p = reshard.Publisher(model=name, architecture=model, topology=TOPOLOGY, rank=0,
                          rendezvous=hub, transport="loopback")
    names = list(p.tensors)
    assert p.empty(names[0]).dtype == ml_dtypes.bfloat16
    assert p.empty(names[1], dtype=np.uint16).dtype == np.uint16
    assert p.empty(names[2], dtype="bf16").dtype == ml_dtypes.bfloat16
    with pytest.raises(reshard.InvalidInput) as e:
        p.empty(names[3], dtype=np.float32)
    assert e.value.tensor == names[3]
    p.close()


def test_wait_for_step_has_one_deadline_however_many_steps_arrive(hub, name):
    """A publisher that keeps advancing, never to the step wanted: every refit installs a newer
    step at once, so a timeout restarted by each refit would never run out."""
    model = tiny_model(name)
    pubs = []
    arrays = []
    for rank in range(4):
        p = reshard.Publisher(model=name, architecture=model, topology=TOPOLOGY, rank=rank,
                              rendezvous=hub, transport="loopback")
        a = trainer_arrays(p.tensors, 1)
        for n, arr in a.items():
            p.register(n, arr)
        p.publish(1)
        pubs.append(p)
        arrays.append(a)
    stop = threading.Event()
    published = [1]

    def advance():
        step = 1
        while not stop.is_set():
            time.sleep(0.2)
            step += 1
            for p in pubs:
                p.publish(step)
            published.append(step)

    trainer = threading.Thread(target=advance, daemon=True)
    trainer.start()
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap")
    timeout = 2.0
    try:
        done, took, _, err = in_thread(lambda: rx.wait_for_step(10**9, timeout=timeout),
                                       timeout + SLACK)
    finally:
        stop.set()
        trainer.join()
    assert done, f"wait_for_step(timeout={timeout}) still waiting after {took:.1f} s"
    assert isinstance(err, reshard.Timeout) and isinstance(err, TimeoutError), err
    assert "1000000000" in str(err) and err.retryable
    # It did refit meanwhile: the publisher's steps were installed as they came.
    assert rx.live_step is not None and rx.live_step > 1, (rx.live_step, published)
    # A step reached in time returns its report; one live already returns None.
    live = rx.live_step
    assert rx.wait_for_step(live, timeout=0) is None
    rx.close()
    for p in pubs:
        p.close()
    # Bad timeouts are refused up front, naming the argument.
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap")
    for bad in (-1.0, float("nan")):
        with pytest.raises(reshard.InvalidInput, match="timeout"):
            rx.wait_for_step(5, timeout=bad)
    rx.close()


def test_a_refit_that_connects_spends_one_deadline_on_both(hub, name):
    """Publishers that appear late in a refit's timeout, never at the step it pins: connecting
    took most of the timeout, so the stage gets only what is left, not a fresh timeout."""
    model = tiny_model(name)
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", install="swap")
    timeout, late = 8.0, 7.0
    pubs = []
    timer = threading.Timer(late, lambda: pubs.extend(start_publishers(model, hub)))
    timer.start()
    try:
        done, took, _, err = in_thread(lambda: rx.refit(timeout=timeout, step=5),
                                       timeout + SLACK)
    finally:
        timer.join()
    assert done, f"refit(timeout={timeout}) still waiting after {took:.1f} s"
    assert isinstance(err, reshard.Timeout), err
    assert rx.connected, "the publishers came in time to connect"
    rx.close()
    for p in pubs:
        p.close()


def test_an_unreachable_etcd_fails_at_connect_not_where_receivers_and_publishers_are_made():
    """Nothing listens on port 1: a receiver and a publisher are still made (they reach etcd
    only when they connect: explicitly, or at the first refit / publish), and fail there,
    typed."""
    url = "etcd://127.0.0.1:1"
    rx = reshard.Receiver(model="nobody", layout=LAYOUT, rank=0, rendezvous=url,
                          transport="loopback", install="swap")
    assert not rx.connected
    with pytest.raises(reshard.Transport) as e:
        rx.connect(timeout=10)
    assert isinstance(e.value, ConnectionError) and "etcd" in str(e.value)
    assert not rx.connected
    with pytest.raises(reshard.Transport):
        rx.refit(timeout=10)
    rx.close()
    # A publisher is made without reaching etcd either: `connect()` (or the first publish)
    # fails, typed, and the publisher stays usable for a later try.
    pub = reshard.Publisher(model="nobody", architecture=tiny_model("nobody"),
                            topology=TOPOLOGY, rank=0, rendezvous=url, transport="loopback")
    with pytest.raises(reshard.Transport) as e:
        pub.connect(timeout=10)
    assert isinstance(e.value, ConnectionError) and "etcd" in str(e.value)
    for tensor in pub.tensors:
        pub.empty(tensor)
    with pytest.raises(reshard.Transport):
        pub.publish(1)
    assert pub.step is None
    pub.close()
    # A rendezvous that is no etcd URL is refused where it was written, by both.
    for make in (lambda: reshard.Receiver(model="x", layout=LAYOUT, rank=0,
                                          rendezvous="http://127.0.0.1:2379",
                                          transport="loopback", install="swap"),
                 lambda: reshard.Publisher(model="x", architecture=tiny_model("x"),
                                           topology=TOPOLOGY, rank=0,
                                           rendezvous="http://127.0.0.1:2379",
                                           transport="loopback")):
        with pytest.raises(reshard.Config):
            make()


def test_transports_come_from_the_registry_with_their_own_word_on_processes():
    rows = reshard.transports()
    names = [r["transport"] for r in rows]
    # loopback is the registry's first (the default); its "network" is this process.
    assert names[0] == "loopback" and rows[0]["usable"] and not rows[0]["cross_process"]
    assert len(set(names)) == len(names) and len(names) >= 2, names
    for r in rows:
        assert r["usable"] == (r["reason"] is None), r
        if r["usable"] and r["transport"] != "loopback":
            # Every other built-in backend reaches other processes: test_processes runs them.
            assert r["cross_process"], r


def test_step_and_timeout_are_keyword_only(hub, name):
    """Issue 43: ``stage(step, timeout)`` and ``refit(timeout, *, step)`` took their arguments in
    different orders, so ``rx.stage(60)`` waited for step 60. Every ``timeout``, and every
    optional ``step``, is keyword-only now: a positional one is a TypeError before anything
    waits."""
    model = tiny_model(name)
    pubs = start_publishers(model, hub)
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=engine_arrays(model, LAYOUT, 0))
    calls = [lambda: rx.stage(60), lambda: rx.stage(None, 5), lambda: rx.refit(5),
             lambda: rx.connect(5), lambda: rx.wait_for_step(1, 5),
             lambda: asyncio.run(rx.refit_async(5)), lambda: asyncio.run(rx.stage_async(1)),
             lambda: asyncio.run(rx.connect_async(5)), lambda: pubs[0].connect(5),
             lambda: pubs[0].wait_released(5), lambda: pubs[0].updating(2, 5).__enter__()]
    for call in calls:
        t0 = time.monotonic()
        with pytest.raises(TypeError):
            call()
        assert time.monotonic() - t0 < SLACK
    assert rx.live_step is None and rx.staged_step is None
    assert all(p.step == 1 for p in pubs)
    assert rx.refit(timeout=10, step=1).step == 1
    rx.close()
    for p in pubs:
        p.close()


def test_the_package_says_its_version():
    from importlib.metadata import version

    assert reshard.__version__ == version("reshard")
    assert reshard.__version__.count(".") >= 2


def test_ready_marks_the_announced_step_ready_again_unchanged(hub, name):
    model = tiny_model(name)
    pubs = start_publishers(model, hub)
    engine = engine_arrays(model, LAYOUT, 0)
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=engine)
    for p in pubs:
        p.unready()
    with pytest.raises(reshard.Timeout):
        rx.refit(timeout=0.5)
    assert rx.live_step is None
    for p in pubs:
        p.ready()
    assert all(p.step == 1 for p in pubs)
    report = rx.refit(timeout=10)
    assert report.step == 1 and report.verified
    assert_exact(engine, expected(model, LAYOUT, 0, 1))
    rx.close()
    for p in pubs:
        p.close()
