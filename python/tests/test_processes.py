"""Across processes over ucx and nixl (TCP only, as between hosts) and cma (same host by
design) through a private etcd
(scripts/etcd.sh): trainer ranks are Python processes (publisher_proc.py) publishing their numpy
arrays in place; the engine ranks receive in this process into their own numpy arrays. A
publisher SIGKILLed between its announcement and the reads fails the refit naming it, with the
engine's arrays untouched. Each test runs both installs: copy into the engine's arrays, and swap
(the engine serves from reshard's buffers).

A missing backend runtime or etcd skips with a reason, unless RESHARD_REQUIRE_BACKENDS is set
(as .ci/run sets it), where it fails.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import reshard
from weights import assert_exact, engine_arrays, expected, tiny_model

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOPOLOGY = "ep=2,dp=2"  # two ranks, experts not replicated: every receiver reads both
LAYOUT = {"tp": 2}

# UCX restricted to TCP: the backend's own setting for ucx, UCX's variable for NIXL's UCX plugin.
TRANSPORT_ENV = {
    "ucx": {"RESHARD_BACKENDS__UCX__TLS": "tcp"},
    "nixl": {"UCX_TLS": "tcp"},
    "cma": {},  # same host by design: process_vm_readv from the publisher's process
}


def required(transport):
    want = os.environ.get("RESHARD_REQUIRE_BACKENDS", "")
    return want == "all" or transport in want.split(",")


class Cluster:
    """Publisher processes of one model; killed at the end whatever happened."""

    def __init__(self, etcd, transport, name):
        self.etcd, self.transport = etcd, transport
        self.model = tiny_model(name)
        self.env = dict(os.environ, **TRANSPORT_ENV[transport])
        self.env["PYTHONPATH"] = str(HERE)
        self.procs = {}

    def start(self, rank):
        p = subprocess.Popen(
            [sys.executable, str(HERE / "publisher_proc.py"), self.etcd, json.dumps(self.model),
             TOPOLOGY, str(rank), self.transport],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env, cwd=ROOT)
        self.procs[rank] = p
        return p

    def expect(self, rank, line):
        got = self.procs[rank].stdout.readline().strip()
        assert got == line, f"publisher {rank} said {got!r}, expected {line!r}"

    def tell(self, rank, line):
        self.procs[rank].stdin.write(line + "\n")
        self.procs[rank].stdin.flush()

    def receiver(self, rank, params=None, timeout=60, install="copy"):
        if install == "copy" and params is None:
            params = engine_arrays(self.model, LAYOUT, rank)
        os.environ.update(TRANSPORT_ENV[self.transport])
        rx = reshard.Receiver(model=self.model["name"], layout=LAYOUT, rank=rank,
                              rendezvous=self.etcd, transport=self.transport, params=params,
                              timeout=timeout, install=install)
        # Connected here, so a wrong engine array is refused where the receiver is made.
        try:
            rx.connect()
        except BaseException:
            rx.close()
            raise
        return rx

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


# Every transport built into the package that reaches other processes, from its registry (a
# backend whose runtime is missing here is kept: `available` skips it loudly, or fails it when
# RESHARD_REQUIRE_BACKENDS names it).
CROSS_PROCESS = [t["transport"] for t in reshard.transports()
                 if t["cross_process"] or not t["usable"]]


def available(transport):
    """Probes the backend by making an endpoint in this process."""
    try:
        reshard.publisher_tensors(tiny_model("probe"), TOPOLOGY, 0)
        hub = reshard.InProcessHub()
        probe = f"probe-{transport}"
        reshard.Publisher(model=probe, architecture=tiny_model(probe), topology=TOPOLOGY,
                          rank=0, rendezvous=hub, transport=transport).close()
        return True
    except reshard.Unavailable as e:
        if required(transport):
            raise
        pytest.skip(f"SKIPPED: {transport} runtime not installed: {e}")


@pytest.mark.parametrize("transport", CROSS_PROCESS)
def test_publisher_processes_to_engine_arrays_through_etcd_byte_exact(etcd, transport, name):
    available(transport)
    c = Cluster(etcd, transport, name)
    try:
        for r in range(2):
            c.start(r)
        for r in range(2):
            c.expect(r, "published 1")
        # Engine rank 0 installs by copy into its own arrays, rank 1 by swap (serving from
        # reshard's buffers).
        rxs = [c.receiver(0), c.receiver(1, install="swap")]
        # The engine hands a wrong array: refused before anything moves, naming the tensor.
        params = engine_arrays(c.model, LAYOUT, 0)
        first = next(iter(params))
        params[first] = params[first].astype("float64")
        with pytest.raises(reshard.InvalidInput) as e:
            c.receiver(0, params=params)
        assert e.value.tensor == first
        for step in (1, 2):
            if step > 1:
                for r in range(2):
                    c.tell(r, f"advance {step}")
                for r in range(2):
                    c.expect(r, f"published {step}")
            for t, rx in enumerate(rxs):
                report = rx.refit(timeout=60)
                assert report.step == step and report.verified and report.wire_bytes > 0
                assert report.install == rx.install
                assert_exact(rx.weights(), expected(c.model, LAYOUT, t, step))
        for rx in rxs:
            rx.close()
        for r in range(2):
            c.tell(r, "exit")
        for r in range(2):
            assert c.procs[r].wait(timeout=30) == 0
    finally:
        c.close()


@pytest.mark.parametrize("transport", CROSS_PROCESS)
def test_dead_publisher_fails_the_refit_naming_it_arrays_untouched(etcd, transport, name):
    available(transport)
    c = Cluster(etcd, transport, name)
    try:
        for r in range(2):
            c.start(r)
        for r in range(2):
            c.expect(r, "published 1")
        rx = c.receiver(0)
        rx.refit(timeout=60)
        before = {k: v.copy() for k, v in rx.params.items()}
        swap = c.receiver(0, install="swap")
        swap.refit(timeout=60)
        served = swap.weights()
        # Rank 1 announces step 2 and dies before anyone reads it; its record stays until its
        # lease expires, so once rank 0 is at step 2 too the receiver reads from a dead process.
        c.tell(1, "advance 2")
        c.expect(1, "published 2")
        c.procs[1].send_signal(signal.SIGKILL)
        c.procs[1].wait()
        c.tell(0, "advance 2")
        c.expect(0, "published 2")
        with pytest.raises(reshard.ReshardError) as e:
            rx.refit(timeout=60)
        err = e.value
        print(f"dead publisher over {transport}: {type(err).__name__}: {err}")
        assert isinstance(err, DEAD_PUBLISHER), f"{type(err).__name__}: {err}"
        assert err.owner == 1 and err.kind in ("transport", "timeout")
        assert err.tensor is not None, "the failed read is named by its tensor"
        assert err.backend == transport
        start, end = err.byte_range
        assert 0 <= start < end, "the byte range of the failed read is named"
        assert rx.live_step == 1
        assert_exact(rx.params, before)
        # The swap-install engine fails the same way and keeps serving step 1's arrays.
        with pytest.raises(DEAD_PUBLISHER) as e:
            swap.refit(timeout=60)
        assert e.value.owner == 1 and e.value.byte_range is not None
        assert swap.live_step == 1
        assert_exact(served, before)
        assert_exact(swap.weights(), before)
        rx.close()
        swap.close()
    finally:
        c.close()


# What a read from a SIGKILLed publisher raises: how the transport notices decides the kind.
# UCX over TCP reports the dead peer as UCS_ERR_ENDPOINT_TIMEOUT (reshard.Timeout) or a reset
# connection (reshard.Transport); NIXL reports a failed transfer, cma a gone process (both
# reshard.Transport).
DEAD_PUBLISHER = (reshard.Transport, reshard.Timeout)


def test_empty_is_backed_by_ucx_memory(name):
    """On UCX, Publisher.empty hands out memory UCX allocated (mapped for its peers), and the
    numpy array is a view of it, not a copy."""
    available("ucx")
    p = reshard.Publisher(model=name, architecture=tiny_model(name), topology=TOPOLOGY, rank=0,
                          rendezvous=reshard.InProcessHub(), transport="ucx")
    tname = next(iter(p.tensors))
    a = p.empty(tname)
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    owner = base.obj if isinstance(base, memoryview) else base
    assert isinstance(owner, reshard._reshard.TransportBuffer), type(owner)
    assert owner.transport_memory
    assert len(owner) == a.nbytes and a.flags.writeable
    p.close()
