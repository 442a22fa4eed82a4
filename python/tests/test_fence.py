"""The reader fence (docs/deployment.md, "The reader fence"; issue 28): a trainer that rewrites
its registered arrays in place the moment ``Publisher.updating`` lets it, step after step,
against two engine ranks (`reshard receive` processes over cma, through a private etcd) that
refit continuously. No receiver ever reads memory while it is rewritten: zero failed refits,
every install verified, both receivers reach the last step. The fence must actually have held
someone for the test to mean anything: the trainer counts the steps where it waited for a
reader.

Made to open at once (a temporary mutation of ``wait_released``), the same run shows failed
refits: receivers that were reading when the arrays changed fail their digest checks.
"""

import json
import os
import queue
import subprocess
import threading
import time

import numpy as np
import pytest

import reshard
from conftest import reshard_binary
from weights import tiny_model, values

STEPS = 20
LAYOUT = "tp=2"


def model(name):
    """Large enough that a receiver's reads take longer than the trainer's pause between steps
    (so without the fence, reads and rewrites overlap), small enough for CI: about 200 MiB."""
    m = tiny_model(name, experts=8)
    m.update(layers=4, hidden=1024, head_dim=64, heads=16, kv_heads=8)
    m["moe"]["expert_intermediate"] = 768
    return m


class Receiver:
    """One `reshard receive --json` process; its lines are read by a thread into a queue."""

    def __init__(self, etcd, name, rank):
        self.rank = rank
        self.proc = subprocess.Popen(
            [reshard_binary(), "receive", "--rendezvous", etcd, "--model", name,
             "--receivers", LAYOUT, "--rank", str(rank), "--transport", "cma", "--json",
             "--timeout-s", "120", "--lease-ttl-s", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def until_step(self, step, timeout):
        """Every line up to the one that installed ``step``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"receiver rank {self.rank} did not install step {step} within {timeout} s; "
                    f"its lines: {self.seen}; stderr: {self.stop()}") from None
            self.seen.append(line)
            if line.get("step") == step:
                return

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return self.proc.stderr.read()[-2000:]


def test_a_trainer_rewriting_at_fence_open_never_tears_a_receivers_read(etcd, name):
    m = model(name)
    with reshard.Publisher(model=m["name"], architecture=m, topology={"tp": 1}, rank=0,
                           rendezvous=etcd, transport="cma", lease_ttl=3.0) as pub:
        arrays = {}
        for tensor, (offset, shape, dtype) in pub.tensors.items():
            arrays[tensor] = np.ascontiguousarray(values(tensor, 1, offset, shape, dtype))
            pub.register(tensor, arrays[tensor])
        pub.publish(1)
        receivers = [Receiver(etcd, m["name"], r) for r in range(2)]
        try:
            for r in receivers:
                r.until_step(1, 120)
            rng = np.random.default_rng(28)
            held = 0
            for step in range(2, STEPS + 2):
                # The "training" between two publishes: shorter than a receiver's refit, so a
                # receiver is often still reading when the trainer wants to rewrite.
                time.sleep(rng.uniform(0.0, 0.05))
                with pub.updating(step, timeout=60) as released:
                    held += bool(released["readers"])
                    for a in arrays.values():
                        a += 1  # in place, at once: the registered memory receivers read
            for r in receivers:
                r.until_step(STEPS + 1, 60)
        finally:
            stderr = [r.stop() for r in receivers]
    for r, err in zip(receivers, stderr):
        failed = [line for line in r.seen if not line.get("verified")]
        installed = [line["step"] for line in r.seen if line.get("verified")]
        assert not failed, f"receiver rank {r.rank} failed refits: {failed}; stderr: {err}"
        assert installed[-1] == STEPS + 1 and len(installed) >= 3, installed
        assert all(line["checked_bytes"] == line["wire_bytes"] for line in r.seen), r.seen
    # The race was there to be won: the trainer found a receiver reading and waited.
    assert held >= 1, "the fence never held the trainer: the test raced nothing"


def test_updating_publishes_after_its_body_and_nothing_when_the_body_raises(hub, name):
    m = tiny_model(name)
    with reshard.Publisher(model=m["name"], architecture=m, topology={"tp": 1}, rank=0,
                           rendezvous=hub, transport="loopback") as pub:
        for tensor in pub.tensors:
            pub.empty(tensor)
        # Before the first publish nobody can be reading: the fence is open at once.
        assert pub.wait_released(timeout=0)["readers"] == []
        pub.publish(1)
        with pub.updating(2, timeout=5) as released:
            assert released["readers"] == []
        assert pub.step == 2
        with pytest.raises(RuntimeError, match="optimizer blew up"):
            with pub.updating(3, timeout=5):
                raise RuntimeError("optimizer blew up")
        assert pub.step == 2
