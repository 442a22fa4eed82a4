"""The engine tests run only where vLLM is installed: .deps/vllm-venv (scripts/install-vllm.sh,
run by scripts/test-vllm.sh). The main suite's virtualenv (.deps/venv) has no vLLM, and its
pytest of python/tests, like wheel-check.sh's --collect-only of a fresh install, must not
collect them: there this folder's test modules are ignored, not failed."""

import importlib.util
import os
import sys


def _vllm_installed():
    # This folder is itself named `vllm`, and pytest puts python/tests on sys.path: without the
    # real package, `vllm` is found as a namespace package of this folder (no origin file).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


collect_ignore_glob = [] if _vllm_installed() else ["test_*.py"]

# The modules beside the tests (tiny_models, engine_driver) import by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest

# What the engine tests measured, printed after the run: engine starts, refit apply vs stage vs
# reload from disk, tokens generated during a stage (the figures of BENCHMARKS.md).
MEASURED = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def measured(pytestconfig):
    """A list the tests append lines of measurements to; printed in the terminal summary."""
    return pytestconfig.stash.setdefault(MEASURED, [])


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(MEASURED, [])
    if lines:
        terminalreporter.section("vLLM engine timings")
        for line in lines:
            terminalreporter.write_line(line)
