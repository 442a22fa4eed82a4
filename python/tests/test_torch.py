"""Real torch CPU tensors (only where torch is installed; scripts/install-deps.sh does not bring
it): a trainer registers its torch parameters in place, bf16 included, and rewrites them in
place for the next step; an engine refits its own torch parameters (copy install) or serves
from torch tensors over reshard's buffers (swap install)."""

import numpy as np
import pytest

import reshard
from weights import expected, tiny_model, values

torch = pytest.importorskip("torch")

TOPOLOGY = {"ep": 2, "dp": 4}
LAYOUT = {"tp": 2}
TORCH = {"f32": torch.float32, "bf16": torch.bfloat16}


def as_torch(a, dtype):
    """A torch-owned tensor holding numpy array ``a``'s bits (bf16: an ml_dtypes array)."""
    if dtype == "bf16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).clone()
    return torch.from_numpy(a).clone()


def bits(t):
    """The bytes of torch tensor ``t``."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def exact(tensors, want):
    assert set(tensors) == set(want)
    for name, t in tensors.items():
        assert bits(t) == want[name].tobytes(), f"{name} differs"


def publish_torch(model, hub, step):
    """Trainer ranks whose parameters are torch tensors, registered in place."""
    pubs = []
    for rank in range(4):
        p = reshard.Publisher(model=model["name"], architecture=model,
                              topology=TOPOLOGY, rank=rank, rendezvous=hub,
                              transport="loopback")
        params = {n: as_torch(values(n, step, off, shape, dt), dt)
                  for n, (off, shape, dt) in p.tensors.items()}
        for n, t in params.items():
            p.register(n, t)
        p.publish(step)
        pubs.append((p, params))
    return pubs


def rewrite(pubs, step):
    """The optimizer step: every torch parameter rewritten in place, then published."""
    for p, params in pubs:
        p.unready()
        for n, (off, shape, dt) in p.tensors.items():
            params[n].copy_(as_torch(values(n, step, off, shape, dt), dt))
        p.publish(step)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_trainer_to_torch_engine_in_place(hub, name, dtype):
    model = tiny_model(name, dtype=dtype)
    pubs = publish_torch(model, hub, 1)
    engine = {n: torch.zeros(shape, dtype=TORCH[d])
              for n, (shape, d) in reshard.receiver_params(model, LAYOUT, 0).items()}
    ptrs = {n: t.data_ptr() for n, t in engine.items()}
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=engine, timeout=10)
    assert rx.refit(timeout=10).step == 1
    exact(engine, expected(model, LAYOUT, 0, 1))
    rewrite(pubs, 2)
    assert rx.refit(timeout=10).step == 2
    exact(engine, expected(model, LAYOUT, 0, 2))
    assert {n: t.data_ptr() for n, t in engine.items()} == ptrs, "refit in place"
    rx.close()
    for p, _ in pubs:
        p.close()


def test_torch_swap_install_serves_typed_tensors_over_reshard_buffers(hub, name):
    model = tiny_model(name, dtype="bf16")
    pubs = publish_torch(model, hub, 1)
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", timeout=10)
    rx.refit(timeout=10)
    served = rx.weights(framework="torch")
    assert all(t.dtype == torch.bfloat16 for t in served.values())
    exact(served, expected(model, LAYOUT, 0, 1))
    arrays = rx.weights()
    assert all(served[n].data_ptr() == a.__array_interface__["data"][0]
               for n, a in arrays.items()), "the same memory, no copy"
    del arrays
    rewrite(pubs, 2)
    rx.refit(timeout=10)
    # Step 3 would land under the torch tensors still served: refused, naming them.
    rewrite(pubs, 3)
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == next(iter(served))
    exact(served, expected(model, LAYOUT, 0, 1))
    served = rx.weights(framework="torch")  # the engine re-points: step 1's tensors drop
    assert rx.refit(timeout=10).step == 3
    exact(served, expected(model, LAYOUT, 0, 2))
    exact(rx.weights(framework="torch"), expected(model, LAYOUT, 0, 3))
    rx.close()
    for p, _ in pubs:
        p.close()


def test_a_tensor_without_host_memory_is_refused_naming_it(hub, name):
    model = tiny_model(name)
    p = reshard.Publisher(model=model["name"], architecture=model,
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback")
    tname, (_, shape, _) = next(iter(p.tensors.items()))
    with pytest.raises(reshard.InvalidInput) as e:
        p.register(tname, torch.empty(shape, dtype=torch.float32, device="meta"))
    assert e.value.tensor == tname and "meta" in str(e.value)
    p.close()


def test_a_tensor_whose_storage_is_freed_is_refused_at_publish(hub, name):
    """FSDP frees a parameter's storage between uses (``untyped_storage().resize_(0)``): the
    publisher refuses the next publish, naming the tensor, before it reads a byte."""
    model = tiny_model(name)
    pubs = publish_torch(model, hub, 1)
    p, params = pubs[2]
    tname = list(params)[1]
    params[tname].untyped_storage().resize_(0)
    with pytest.raises(reshard.InvalidInput) as e:
        p.publish(2)
    assert e.value.tensor == tname and "Nothing was published" in str(e.value)
    assert p.step == 1
    for q, _ in pubs:
        q.close()


def test_an_engine_tensor_freed_or_re_pointed_is_refused_at_refit(hub, name):
    model = tiny_model(name, dtype="bf16")
    pubs = publish_torch(model, hub, 1)
    engine = {n: torch.zeros(shape, dtype=TORCH[d])
              for n, (shape, d) in reshard.receiver_params(model, LAYOUT, 0).items()}
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=engine, timeout=10)
    rx.refit(timeout=10)
    rewrite(pubs, 2)
    want = expected(model, LAYOUT, 0, 1)
    names = list(engine)
    # Storage freed in place.
    engine[names[0]].untyped_storage().resize_(0)
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == names[0] and "Nothing was written" in str(e.value)
    assert rx.live_step == 1
    exact({n: t for n, t in engine.items() if n != names[0]},
          {n: a for n, a in want.items() if n != names[0]})
    rx.close()
    # A parameter re-pointed to other memory (`param.data = ...`), with the same shape.
    engine = {n: torch.zeros(shape, dtype=TORCH[d])
              for n, (shape, d) in reshard.receiver_params(model, LAYOUT, 0).items()}
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in engine.items()}
    rx = reshard.Receiver(model=name, layout=LAYOUT, rank=0, rendezvous=hub,
                          transport="loopback", params=params, timeout=10)
    params[names[1]].data = torch.zeros_like(params[names[1]])
    with pytest.raises(reshard.InvalidInput) as e:
        rx.refit(timeout=10)
    assert e.value.tensor == names[1]
    rx.close()
    for p, _ in pubs:
        p.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_registered_tensors_live_until_close(hub, name, dtype):
    """The caller's tensor object itself is held. For a bf16 tensor nothing else would hold it:
    its bits are exported through an int16 view, another tensor object."""
    import gc
    import weakref

    model = tiny_model(name, dtype=dtype)
    p = reshard.Publisher(model=model["name"], architecture=model,
                          topology=TOPOLOGY, rank=0, rendezvous=hub,
                          transport="loopback")
    tname, (offset, shape, dtype) = next(iter(p.tensors.items()))
    t = as_torch(values(tname, 1, offset, shape, dtype), dtype)
    ref = weakref.ref(t)
    p.register(tname, t)
    del t
    gc.collect()
    assert ref() is not None, "the tensor was freed while reshard holds its address"
    p.close()
    gc.collect()
    assert ref() is None


def test_engine_tensors_over_one_storage_are_refused_naming_both(hub, name):
    model = tiny_model(name)
    pubs = publish_torch(model, hub, 1)
    specs = reshard.receiver_params(model, LAYOUT, 0)
    engine = {n: torch.zeros(shape, dtype=TORCH[d]) for n, (shape, d) in specs.items()}
    norms = [n for n in engine if n.endswith(("q_norm.weight", "k_norm.weight"))][:2]
    engine[norms[1]] = engine[norms[0]].view(engine[norms[0]].shape)  # same storage
    with pytest.raises(reshard.InvalidInput) as e:
        # architecture=: the layout is known at construction, where the overlap is refused.
        reshard.Receiver(model=name, architecture=model, layout=LAYOUT, rank=0, rendezvous=hub,
                         transport="loopback", params=engine, timeout=10)
    assert norms[0] in str(e.value) and norms[1] in str(e.value)
    for p, _ in pubs:
        p.close()
