"""Fixtures of the controller tests."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.fixture
def closing():
    """Process worker handles the test appends; each is resumed (it may be SIGSTOPped) and closed after it."""
    handles: list = []
    yield handles
    for h in handles:
        try:
            os.kill(h.process.pid, signal.SIGCONT)
        except OSError:
            pass
        h.close()
