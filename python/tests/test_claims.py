"""Reading claims die with the refit that holds them (issue 42, item 1; docs/deployment.md, "The
reader fence"), on a real etcd (scripts/etcd.sh) with a trainer in this process:

- an engine's ``refit_async`` cancelled while its claim is held (its reads under way): the
  cancel drops the refit outside any async runtime, so nothing there can delete the claim, and
  the engine lives on. The trainer's next ``updating()`` must open within the claim lease's TTL
  (it opens in milliseconds: the claim's keeper revokes the lease);
- a `reshard receive` process SIGKILLed while its claim is held: nothing runs in it any more,
  and the trainer's next ``updating()`` opens once the claim's lease has expired.

Before claims had a lease of their own, the first left a claim under the receiver connection's
lease, which the living engine renewed for ever: every later ``updating()`` raised ``Timeout``
and never ran its body.

Whether a cancel lands while the claim is held is a race the test cannot force from outside, so
it tries again (a new step each time) until one did: the trainer saw the claim before the
cancel, and the refit did not install.
"""

import asyncio
import subprocess
import time

import numpy as np
import pytest

import reshard
from conftest import reshard_binary
from weights import tiny_model, values

# The lease TTL of a Python receiver's claims (the etcd rendezvous' default).
RECEIVER_TTL_S = 10.0
# The lease TTL given to the `reshard receive` process below.
PROCESS_TTL_S = 3
LAYOUT = {"tp": 2}
TRIES = 8


def model(name):
    """About 200 MiB (as test_fence.py's), so a refit's reads take long enough to be cut."""
    m = tiny_model(name, experts=8)
    m.update(layers=4, hidden=1024, head_dim=64, heads=16, kv_heads=8)
    m["moe"]["expert_intermediate"] = 768
    return m


def trainer(etcd, m):
    """Trainer rank 0 (TP1) over cma at step 1: the publisher and its arrays."""
    pub = reshard.Publisher(model=m["name"], architecture=m, topology={"tp": 1}, rank=0,
                            rendezvous=etcd, transport="cma", lease_ttl=3.0)
    arrays = {}
    for tensor, (offset, shape, dtype) in pub.tensors.items():
        arrays[tensor] = np.ascontiguousarray(values(tensor, 1, offset, shape, dtype))
        pub.register(tensor, arrays[tensor])
    pub.publish(1)
    return pub, arrays


def readers(pub):
    """The readers holding the trainer's memory now, as the fence's Timeout names them ("" when
    none): one look at the claims, no waiting."""
    try:
        pub.wait_released(timeout=0)
        return ""
    except reshard.Timeout as e:
        return str(e)


def advance(pub, arrays, step, timeout=5):
    """Rewrites the arrays for ``step`` inside ``updating`` and publishes it; the seconds the
    fence took to open and what it waited for."""
    start = time.monotonic()
    with pub.updating(step, timeout=timeout) as released:
        opened_s = time.monotonic() - start
        for a in arrays.values():
            a += 1
    return opened_s, released


def test_a_cancelled_refit_async_leaves_no_claim_behind(etcd, name):
    m = model(name)
    pub, arrays = trainer(etcd, m)
    rx = reshard.Receiver(model=m["name"], layout=LAYOUT, rank=0, rendezvous=etcd,
                          transport="cma", timeout=60)
    try:
        assert rx.refit(timeout=60).step == 1

        async def cancel_while_claimed():
            """One refit, cancelled as soon as the trainer sees its claim; whether it was cut
            (True) or had finished first (False)."""
            task = asyncio.ensure_future(rx.refit_async(timeout=60))
            seen = ""
            while not task.done() and not seen:
                seen = readers(pub)
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return bool(seen)
            return False

        step = 1
        for attempt in range(TRIES):
            step += 1
            advance(pub, arrays, step)
            if asyncio.run(cancel_while_claimed()):
                break
            # The refit won the race: the engine is at `step`; try the next one.
        else:
            pytest.fail(f"no cancel landed while a claim was held in {TRIES} refits")
        # The engine lives on, its weights those of the step before; its claim must not.
        assert rx.live_step == step - 1, (rx.live_step, step)
        opened_s, released = advance(pub, arrays, step + 1, timeout=RECEIVER_TTL_S + 2)
        print(f"cancelled refit (try {attempt + 1}): the fence opened after {opened_s:.3f} s "
              f"(claim lease TTL {RECEIVER_TTL_S} s); readers waited for: {released['readers']}")
        assert opened_s < RECEIVER_TTL_S + 1
        # And the engine, untouched, installs the newest step.
        assert rx.refit(timeout=60).step == step + 1
    finally:
        rx.close()
        pub.close()


def kill_while_claimed(etcd, m, pub, arrays, procs):
    """Starts `reshard receive` processes (appended to ``procs``), each killed the moment the
    trainer sees its claim, until one died holding it (a new step each time the refit won the
    race). Returns the step the trainer is at, the readers it saw, and the try that did it."""
    step = 1
    for attempt in range(TRIES):
        proc = subprocess.Popen(
            [reshard_binary(), "receive", "--rendezvous", etcd, "--model", m["name"],
             "--receivers", "tp=2", "--rank", "0", "--transport", "cma", "--json",
             "--timeout-s", "60", "--lease-ttl-s", str(PROCESS_TTL_S)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        # Its first refit (step `step`): killed the moment the trainer sees its claim.
        seen = ""
        deadline = time.monotonic() + 60
        while not seen and proc.poll() is None and time.monotonic() < deadline:
            seen = readers(pub)
        proc.kill()
        proc.wait()
        # Held still once the process is gone (it was killed before it released), or the
        # refit won the race: then try again with the next step.
        seen = seen and readers(pub)
        if seen:
            return step, seen, attempt
        step += 1
        advance(pub, arrays, step)
    pytest.fail(f"never saw a receiver's claim in {TRIES} tries")


def stop_all(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_receiver_holds_the_fence_no_longer_than_its_lease(etcd, name):
    m = model(name)
    pub, arrays = trainer(etcd, m)
    procs = []
    try:
        step, seen, attempt = kill_while_claimed(etcd, m, pub, arrays, procs)
        assert "receiver rank 0" in seen, seen
        opened_s, released = advance(pub, arrays, step + 1, timeout=PROCESS_TTL_S + 5)
        print(f"killed receiver (try {attempt + 1}): the fence opened after {opened_s:.3f} s "
              f"(its lease TTL {PROCESS_TTL_S} s); readers waited for: {released['readers']}")
        # It was waited for (the claim outlived its process), and no longer than its lease.
        assert released["readers"], released
        assert opened_s < PROCESS_TTL_S + 2, opened_s
    finally:
        stop_all(procs)
        pub.close()


def test_an_updating_whose_fence_wait_times_out_leaves_the_rank_ready_at_its_step(etcd, name):
    """Issue 43: ``updating()`` marks the rank not ready, then waits for readers; when that
    wait timed out, the body did not run and nothing was published, but the rank stayed not
    ready, so no receiver could refit from it at any step until the trainer's next publish.
    Now the step it had is marked ready again (its arrays were not touched)."""
    m = model(name)
    pub, arrays = trainer(etcd, m)
    procs = []
    rx = None
    try:
        step, seen, _ = kill_while_claimed(etcd, m, pub, arrays, procs)
        ran = False
        with pytest.raises(reshard.Timeout):
            with pub.updating(step + 1, timeout=0.2):
                ran = True
        assert not ran, "the body ran although the fence never opened"
        assert pub.step == step
        # A fresh engine rank refits from the trainer at the step it still has.
        rx = reshard.Receiver(model=m["name"], layout=LAYOUT, rank=1, rendezvous=etcd,
                              transport="cma", timeout=30)
        report = rx.refit(timeout=30)
        assert report.step == step and report.verified
    finally:
        if rx is not None:
            rx.close()
        stop_all(procs)
        pub.close()
