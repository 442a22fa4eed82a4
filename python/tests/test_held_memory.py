"""The arrays reshard holds (python/README.md, "The arrays reshard holds"): each stays alive while
reshard holds its address, is checked to be still where it was registered before every publish
and every refit (a resized array or a re-pointed exporter is refused naming it, and nothing is
published or written), and engine parameters sharing memory are refused when the receiver is
made. numpy and DLPack-only exporters here; torch tensors in test_torch.py."""

import gc
import threading
import weakref

import numpy as np
import pytest

import reshard
from test_loopback import LAYOUT, TOPOLOGY, DLPackOnly, advance, receiver, start_publishers
from weights import assert_exact, engine_arrays, expected, tiny_model, trainer_arrays


class Movable(DLPackOnly):
    """A DLPack-only exporter (as a torch tensor is) whose memory can be swapped for another
    array's, as `param.data = other` re-points a torch parameter."""

    def __init__(self, array, on_export=None):
        super().__init__(array)
        self.on_export = on_export

    def __dlpack__(self, **kwargs):
        if self.on_export is not None:
            self.on_export()
        return super().__dlpack__(**kwargs)


def resize_in_place(a):
    """Grows numpy array ``a`` in place as numpy allows with ``refcheck=False`` even while its
    buffer is exported: its memory is reallocated and the old one freed, so ``a`` holds new
    memory. Returns (old address, new address)."""
    old = a.__array_interface__["data"][0]
    a.resize(a.size * 64, refcheck=False)
    return old, a.__array_interface__["data"][0]


def test_a_trainer_array_resized_after_register_is_refused_at_publish(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    p, mine = pubs[1], arrays[1]
    tname = list(mine)[2]
    old, new = resize_in_place(mine[tname])
    assert old != new
    with pytest.raises(reshard.InvalidInput) as e:
        p.publish(2)
    assert e.value.tensor == tname, e.value
    assert f"{old:#x}" in str(e.value) and "Nothing was published" in str(e.value)
    assert p.step == 1
    # Step 1's memory is gone too: its announcement was marked not ready, so no receiver
    # starts a read of it (a receiver finds no complete ready set).
    with pytest.raises(reshard.Timeout):
        receiver(model, hub, timeout=0.5)
    for q in pubs:
        q.close()


def test_an_engine_array_resized_after_the_receiver_is_made_is_refused_at_refit(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    engine = engine_arrays(model, LAYOUT, 0)
    rx = receiver(model, hub, params=engine)
    rx.refit(timeout=10)
    advance(pubs, arrays, 2)
    tname = list(engine)[3]
    resize_in_place(engine[tname])
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == tname and "Nothing was written" in str(e.value)
    assert "not copied" not in str(e.value), "refused before the refit, not after it"
    assert rx.live_step == 1
    want = expected(model, LAYOUT, 0, 1)
    for n, a in engine.items():
        if n != tname:
            assert a.tobytes() == want[n].tobytes(), f"{n} was written"
    rx.close()
    for p in pubs:
        p.close()


def test_an_engine_array_made_read_only_is_refused_at_refit(hub, name):
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    engine = engine_arrays(model, LAYOUT, 0)
    rx = receiver(model, hub, params=engine)
    rx.refit(timeout=10)
    advance(pubs, arrays, 2)
    tname = list(engine)[0]
    engine[tname].flags.writeable = False
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == tname and "read-only" in str(e.value), e.value
    assert rx.live_step == 1
    engine[tname].flags.writeable = True
    assert rx.refit(timeout=10).step == 2
    assert_exact(engine, expected(model, LAYOUT, 0, 2))
    rx.close()
    for p in pubs:
        p.close()


def test_a_dlpack_exporter_re_pointed_is_refused_at_publish_and_at_refit(hub, name):
    model = tiny_model(name)
    pubs, held = [], []
    for rank in range(4):
        p = reshard.Publisher(model=model["name"], architecture=model,
                              topology=TOPOLOGY, rank=rank, rendezvous=hub,
                              transport="loopback")
        mine = {n: Movable(a) for n, a in trainer_arrays(p.tensors, 1).items()}
        for n, m in mine.items():
            p.register(n, m)
        p.publish(1)
        pubs.append(p)
        held.append(mine)
    engine = {n: Movable(a) for n, a in engine_arrays(model, LAYOUT, 0).items()}
    rx = receiver(model, hub, params=engine)
    rx.refit(timeout=10)
    assert_exact({n: m.array for n, m in engine.items()}, expected(model, LAYOUT, 0, 1))

    # The trainer re-points one tensor to other memory: its publish is refused.
    tname = list(held[0])[1]
    held[0][tname].array = held[0][tname].array.copy()
    with pytest.raises(reshard.InvalidInput) as e:
        pubs[0].publish(2)
    assert e.value.tensor == tname and "Nothing was published" in str(e.value)
    assert pubs[0].step == 1

    # The engine re-points one parameter: the refit is refused before anything is written.
    for p in pubs[1:]:
        p.close()
    pubs[0].close()
    pname = list(engine)[1]
    old = engine[pname].array
    engine[pname].array = np.zeros_like(old)
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == pname and "Nothing was written" in str(e.value)
    assert rx.live_step == 1
    rx.close()


def test_an_engine_parameter_moved_while_the_refit_runs_is_not_written(hub, name):
    """The move lands after the check before the refit (the engine runs while the refit waits
    with the GIL released): the check before the copy refuses it, and no parameter is
    written. Deterministic: the trainer publishes step 2 only after the move."""
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    plain = engine_arrays(model, LAYOUT, 0)
    pname = list(plain)[2]
    checked = threading.Event()
    engine = dict(plain)
    engine[pname] = Movable(plain[pname])
    rx = receiver(model, hub, params=engine)
    rx.refit(timeout=10)
    step1 = {n: a.copy() for n, a in plain.items()}

    def engine_moves_then_trainer_publishes():
        checked.wait(10)
        engine[pname].array = np.zeros_like(plain[pname])
        advance(pubs, arrays, 2)

    # The next fresh export of the parameter is the check before the refit.
    engine[pname].on_export = checked.set
    t = threading.Thread(target=engine_moves_then_trainer_publishes)
    t.start()
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    t.join()
    assert checked.is_set()
    assert e.value.tensor == pname
    assert "step 2 was received and verified but not copied" in str(e.value), e.value
    assert "hold step 1" in str(e.value)
    assert rx.live_step == 1
    assert_exact(plain, step1)
    rx.close()
    for p in pubs:
        p.close()


def test_registered_objects_live_until_close(hub, name):
    """reshard holds the caller's own object, not only a view of its memory: a DLPack-only
    exporter (a torch tensor, say) dropped by the caller stays alive until close."""
    model = tiny_model(name)
    p = reshard.Publisher(model=model["name"], architecture=model,
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback")
    tname, (offset, shape, dtype) = next(iter(p.tensors.items()))
    obj = Movable(trainer_arrays({tname: (offset, shape, dtype)}, 1)[tname])
    ref = weakref.ref(obj)
    p.register(tname, obj)
    del obj
    gc.collect()
    assert ref() is not None, "the registered object was freed while reshard holds it"
    p.close()
    gc.collect()
    assert ref() is None, "close releases it"


def test_engine_parameters_sharing_memory_are_refused_naming_both(hub, name):
    model = tiny_model(name)
    pubs, _ = start_publishers(model, hub)
    specs = reshard.receiver_params(model, LAYOUT, 0)
    sizes = {n: int(np.prod(s)) * reshard.numpy_dtype(d).itemsize for n, (s, d) in specs.items()}

    def carved(overlap):
        """Every parameter carved from one flat buffer, in engine order, each starting
        ``overlap`` bytes before the previous one ends."""
        flat = np.zeros(sum(sizes.values()), dtype=np.uint8)
        out, at = {}, 0
        for n, (shape, dtype) in specs.items():
            at = max(at - overlap, 0)
            out[n] = flat[at:at + sizes[n]].view(reshard.numpy_dtype(dtype)).reshape(shape)
            at += sizes[n]
        return out

    # Adjacent parameters of one buffer (a common engine layout) share no byte: accepted.
    flat = carved(0)
    rx = receiver(model, hub, params=flat)
    rx.refit(timeout=10)
    assert_exact(flat, expected(model, LAYOUT, 0, 1))
    rx.close()

    names = list(specs)
    # One element of overlap between the first two parameters.
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=carved(4))
    assert names[0] in str(e.value) and names[1] in str(e.value)
    assert e.value.tensor in names[:2]
    # The same array for two parameters of one shape (q_norm and k_norm).
    norms = [n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))][:2]
    assert len(norms) == 2 and specs[norms[0]] == specs[norms[1]]
    params = engine_arrays(model, LAYOUT, 0)
    params[norms[1]] = params[norms[0]]
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=params)
    assert norms[0] in str(e.value) and norms[1] in str(e.value)
    # A parameter inside a bigger one, not adjacent in address order to its end.
    params = engine_arrays(model, LAYOUT, 0)
    big = max(names, key=lambda n: sizes[n])
    small = min((n for n in names if n != big), key=lambda n: sizes[n])
    shape, dtype = specs[small]
    inner = params[big].reshape(-1).view(np.uint8)[sizes[big] // 2:][:sizes[small]]
    params[small] = inner.view(reshard.numpy_dtype(dtype)).reshape(shape)
    with pytest.raises(reshard.InvalidInput) as e:
        receiver(model, hub, params=params)
    assert big in str(e.value) and small in str(e.value)
    for p in pubs:
        p.close()
