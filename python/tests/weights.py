"""What the tests' trainers write and what the engines must then hold.

Every element of every tensor is a function of the tensor's name, the step and the element's
global coordinates, so data-parallel replicas hold identical bytes (as a trainer's do) and the
value any receiver parameter must hold follows from the layout's copies alone, without the
planner, the transport or the re-slice code under test.
"""

import zlib

import numpy as np

import reshard


def tiny_model(name, dtype="f32", experts=8):
    """A two-layer MoE small enough for a test (the shape of reshard_testkit's tiny_moe)."""
    return {
        "name": name,
        "layers": 2,
        "hidden": 128,
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 16,
        "intermediate": 0,
        "moe": {"experts": experts, "expert_intermediate": 96},
        "vocab": 256,
        "tied_embeddings": False,
        "qk_norm": True,
        "dtype": dtype,
    }


def values(tensor, step, offset, shape, dtype):
    """The box ``offset``/``shape`` of ``tensor`` at ``step``, as the trainer writes it."""
    coords = np.indices(shape, dtype=np.int64)
    linear = np.zeros(shape, dtype=np.int64)
    for d in range(len(shape)):
        linear = linear * 1009 + coords[d] + offset[d]
    seed = zlib.crc32(tensor.encode()) % 4096
    v = (linear * 7 + seed + step * 131) % 65521
    dt = reshard.numpy_dtype(dtype)
    raw = reshard.numpy_dtype(dtype, raw=True)
    if raw != dt:
        # bf16 and 8-bit floats (ml_dtypes): these bits, whatever float they make.
        return v.astype(raw).view(dt)
    if dt.kind == "f":
        return (v / 64.0).astype(dt)
    return v.astype(dt)


def fill(arrays, tensors, step):
    """Writes step ``step`` into a trainer's ``arrays`` in place."""
    for name, (offset, shape, dtype) in tensors.items():
        arrays[name][...] = values(name, step, offset, shape, dtype)


def trainer_arrays(tensors, step):
    """Fresh arrays for a rank's ``tensors``, holding step ``step``."""
    return {
        name: np.ascontiguousarray(values(name, step, offset, shape, dtype))
        for name, (offset, shape, dtype) in tensors.items()
    }


def engine_arrays(model, layout, rank):
    """Zeroed engine parameters of receiver rank ``rank``."""
    return {
        name: np.zeros(shape, dtype=reshard.numpy_dtype(dtype))
        for name, (shape, dtype) in reshard.receiver_params(model, layout, rank).items()
    }


def expected(model, layout, rank, step):
    """What every parameter of receiver rank ``rank`` must hold after a refit to ``step``."""
    import json

    from reshard import _reshard

    specs = reshard.receiver_params(model, layout, rank)
    pairs = ",".join(f"{k}={v}" for k, v in layout.items())
    out = {}
    copies = _reshard.receiver_copies(json.dumps(model), pairs, rank)
    for param, cps in copies:
        shape, dtype = specs[param]
        # Raw bits for bf16 and the 8-bit floats: as_strided cannot make ml_dtypes views.
        dt = reshard.numpy_dtype(dtype, raw=True)
        flat = np.zeros(int(np.prod(shape)), dtype=dt)
        for tensor, offset, extent, dst_offset, strides in cps:
            base = flat[dst_offset // dt.itemsize :]
            view = np.lib.stride_tricks.as_strided(
                base, shape=extent, strides=[s * dt.itemsize for s in strides]
            )
            view[...] = values(tensor, step, offset, extent, dtype).view(dt)
        out[param] = flat.reshape(shape).view(reshard.numpy_dtype(dtype))
    return out


def assert_exact(params, want):
    """Every array of ``params`` equals ``want`` bit for bit."""
    assert set(params) == set(want)
    for name, array in params.items():
        assert array.tobytes() == want[name].tobytes(), f"{name} differs"
