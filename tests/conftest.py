"""Fixtures shared across the test folders.

This file's folder is put on ``sys.path`` by pytest (rootdir conftest, "prepend" import mode), which is
what makes ``helpers`` importable from every test folder and, through the path a spawned process
inherits, from every ``LocalFleet`` worker that unpickles a job from ``helpers.*``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from refit.testing.launch import LOAD_FACTOR_ENV, LocalFleet

# a fresh interpreter importing torch on an idle two-core CI machine; a run that takes longer is
# that much busier, and its start-up deadlines and hang guards grow by as much
IDLE_STARTUP_S = 2.5


def _startup_s() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=600)
    return time.monotonic() - t0


def pytest_configure(config):
    """Measure this run's start-up once; every process the suite spawns inherits the factor."""
    if LOAD_FACTOR_ENV not in os.environ:
        startup = _startup_s()
        os.environ[LOAD_FACTOR_ENV] = f"{max(1.0, startup / IDLE_STARTUP_S):.2f}"
        config.refit_startup_s = startup
    config.refit_load_factor = float(os.environ[LOAD_FACTOR_ENV])


def pytest_report_header(config):
    startup = getattr(config, "refit_startup_s", None)
    measured = f"a torch interpreter started in {startup:.1f}s; " if startup is not None else ""
    return f"refit: {measured}start-up deadlines and hang guards scaled by {config.refit_load_factor:.2f}"


def pytest_collection_modifyitems(config, items):
    """Scale every test's hang guard (its ``timeout`` mark, or the suite's default) by the load factor."""
    factor = config.refit_load_factor
    if factor <= 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        base = (mark.args[0] if mark.args else mark.kwargs.get("timeout", default)) if mark else default
        if base:
            item.add_marker(pytest.mark.timeout(float(base) * factor), append=False)


@pytest.fixture(scope="module")
def fleet(request):
    """One ``LocalFleet`` of the module's ``FLEET_SIZE`` ranks, shared by the module's tests.

    Starting spawned workers dominates a small machine, so a module starts its fleet once. A module
    that sets ``FLEET_KILL_ON_CLOSE = True`` has nothing to flush at the end and skips gloo's graceful
    teardown (about 10 s).
    """
    size = getattr(request.module, "FLEET_SIZE", None)
    if size is None:
        raise pytest.UsageError(f"{request.module.__name__} uses the fleet fixture but sets no FLEET_SIZE")
    f = LocalFleet(size)
    try:
        yield f
    finally:
        f.close(kill=getattr(request.module, "FLEET_KILL_ON_CLOSE", False))
