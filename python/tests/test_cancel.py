"""``refit_async`` cancellation at the two edges of a refit, made deterministic by an executor
that holds the refit's worker back at a chosen point: a cancel that arrives before the refit
starts is never lost (the refit does nothing, the task is cancelled, the weights stay), and a
cancel that arrives after the install finished returns the install's report (the weights
changed, so the caller learns their step). A cancel in the middle is test_loopback.py's
test_refit_async_and_its_cancellation."""

import asyncio
import concurrent.futures
import threading

import pytest

import reshard
from test_loopback import LAYOUT, advance, receiver, start_publishers
from weights import assert_exact, expected, tiny_model


class HeldExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each job only once ``start`` is set, and returns its result only once ``finish``
    is set; ``started_job`` is set when a job was submitted, ``ran`` once it has run."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.start, self.finish = threading.Event(), threading.Event()
        self.started_job, self.ran = threading.Event(), threading.Event()
        self.args = None

    def submit(self, fn, /, *args, **kwargs):
        self.args = args
        self.started_job.set()

        def held():
            assert self.start.wait(30), "the test never let the job start"
            try:
                return fn(*args, **kwargs)
            finally:
                self.ran.set()
                assert self.finish.wait(30), "the test never let the job finish"

        return super().submit(held)


async def until(predicate):
    """Yields to the event loop until ``predicate()`` holds (a bounded number of times)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    pytest.fail("never happened")


@pytest.fixture
def at_step_2_ready(hub, name):
    """A receiver at step 1 and trainers ready at step 2: any refit that runs installs step 2."""
    model = tiny_model(name)
    pubs, arrays = start_publishers(model, hub)
    rx = receiver(model, hub)
    assert rx.refit(timeout=10).step == 1
    advance(pubs, arrays, 2)
    yield model, rx
    rx.close()
    for p in pubs:
        p.close()


def test_a_cancel_before_the_refit_starts_is_never_lost(at_step_2_ready):
    model, rx = at_step_2_ready
    step1 = {k: v.copy() for k, v in rx.params.items()}
    pool = HeldExecutor()

    async def main():
        asyncio.get_running_loop().set_default_executor(pool)
        task = asyncio.ensure_future(rx.refit_async(timeout=10))
        await until(pool.started_job.is_set)
        task.cancel()
        # The task has seen its cancellation and passed it on, before the refit starts.
        await until(lambda: pool.args[-1].cancelled)
        pool.start.set()
        pool.finish.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.ran.is_set()

    asyncio.run(main())
    assert rx.live_step == 1, "the cancelled refit ran"
    assert_exact(rx.params, step1)
    # Step 2 was there all along: the next refit installs it.
    assert rx.refit(timeout=10).step == 2
    assert_exact(rx.params, expected(model, LAYOUT, 0, 2))


def test_a_cancel_after_the_install_finished_returns_the_report(at_step_2_ready):
    model, rx = at_step_2_ready
    pool = HeldExecutor()

    async def main():
        asyncio.get_running_loop().set_default_executor(pool)
        task = asyncio.ensure_future(rx.refit_async(timeout=10))
        pool.start.set()
        await until(pool.ran.is_set)  # the refit has installed; its result is held back
        task.cancel()
        await until(lambda: pool.args[-1].cancelled)
        pool.finish.set()
        report = await task
        assert task.cancelling() == 0, "the swallowed cancellation is withdrawn"
        return report

    report = asyncio.run(main())
    assert isinstance(report, reshard.RefitReport) and report.step == 2
    assert rx.live_step == 2
    assert_exact(rx.params, expected(model, LAYOUT, 0, 2))


def test_a_cancelled_token_stops_a_native_refit_before_it_does_anything(at_step_2_ready):
    model, rx = at_step_2_ready
    token = reshard._reshard.CancelToken()
    assert not token.cancelled
    token.cancel()
    with pytest.raises(reshard.Aborted) as e:
        rx._native.refit(10, token)
    assert "before it started" in str(e.value)
    assert rx.live_step == 1
    # A token belongs to one call: the next refit, without it, is not affected.
    assert rx.refit(timeout=10).step == 2
