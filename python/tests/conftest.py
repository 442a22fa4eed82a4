"""Shared fixtures: a fresh in-process rendezvous, and a unique model name per test (one
process shares one loopback fabric, where endpoint names must not collide)."""

import uuid

import pytest

import reshard


@pytest.fixture
def hub():
    return reshard.InProcessHub()


@pytest.fixture
def name():
    return f"tiny-{uuid.uuid4().hex[:8]}"
