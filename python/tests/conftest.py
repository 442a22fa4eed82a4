"""Shared fixtures: a fresh in-process rendezvous, and a unique model name per test (one
process shares one loopback fabric, where endpoint names must not collide); Python's own
Ctrl-C handler for every test; a private etcd per module; the `reshard` CLI of this checkout."""

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def etcd():
    """A private etcd on 127.0.0.1 (scripts/etcd.sh) for the tests of one module: its endpoint
    ``etcd://HOST:PORT``. Skipped where etcd is missing, unless RESHARD_REQUIRE_BACKENDS is set
    (as .ci/run sets it), where it fails."""
    tmp = tempfile.mkdtemp(prefix="reshard-etcd-")
    script = ROOT / "scripts" / "etcd.sh"
    try:
        out = subprocess.run(["bash", str(script), "start", tmp], check=True,
                             capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        if os.environ.get("RESHARD_REQUIRE_BACKENDS"):
            raise
        pytest.skip(f"SKIPPED: no etcd (scripts/install-deps.sh installs it): {e}")
    yield out.strip().splitlines()[-1]
    subprocess.run(["bash", str(script), "stop", tmp], check=False)
    shutil.rmtree(tmp, ignore_errors=True)


def reshard_binary():
    """The `reshard` CLI of this checkout (scripts/test.sh builds it before pytest runs)."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "release" / "reshard"
    if not exe.exists():
        subprocess.run(["cargo", "build", "--release", "-p", "reshard-cli"], cwd=ROOT,
                       check=True)
    return str(exe)
