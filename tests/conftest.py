"""Fixtures shared across the test folders.

This file's folder is put on ``sys.path`` by pytest (rootdir conftest, "prepend" import mode), which is
what makes ``helpers`` importable from every test folder and, through the path a spawned process
inherits, from every ``LocalFleet`` worker that unpickles a job from ``helpers.*``.
"""

from __future__ import annotations

import pytest

from refit.testing.launch import LocalFleet


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
