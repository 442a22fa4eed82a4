"""Shared fixtures: a fresh in-process rendezvous, and a unique model name per test (one
process shares one loopback fabric, where endpoint names must not collide); Python's own
Ctrl-C handler for every test."""

import signal
import uuid

import pytest

import reshard


@pytest.fixture
def hub():
    return reshard.InProcessHub()


@pytest.fixture
def name():
    return f"tiny-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Python's KeyboardInterrupt handler for SIGINT, whatever this process inherited.

    A process started with SIGINT ignored (a background job of a non-interactive shell, as CI
    may start the suite) keeps it ignored, and Python then installs no handler: the tests that
    send themselves SIGINT to check that Ctrl-C cancels a refit need the handler a terminal
    user has.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
