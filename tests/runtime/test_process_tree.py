"""A killed ProcessWorker takes the processes it started with it (an engine's core and workers would be orphaned)."""

from __future__ import annotations

import os
import re
import time

import pytest
from helpers.vllm_jobs import ChildSpawner, FailingSpawner

from refit.runtime.handles import ProcessWorker, pid_alive


def test_kill_takes_the_children_along():
    worker = ProcessWorker(ChildSpawner, name="spawner", daemon=False)
    child = worker.call("refit_ping").result(60)["child"]
    assert pid_alive(child)
    worker.kill()
    deadline = time.monotonic() + 30
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)
    worker.close()
    assert not os.path.exists(f"/proc/{worker.process.pid}/stat") or not pid_alive(worker.process.pid)


def test_close_takes_the_children_along():
    worker = ProcessWorker(ChildSpawner, name="spawner", daemon=False)
    child = worker.call("refit_ping").result(60)["child"]
    worker.close()
    deadline = time.monotonic() + 30
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)


def test_an_endpoint_that_fails_to_build_is_reported_at_once_and_its_children_end():
    """Not after the start timeout: the child would otherwise wait on its non-daemon children before exiting."""
    with pytest.raises(RuntimeError, match="did not attach") as info:
        ProcessWorker(FailingSpawner, name="failing", daemon=False, start_timeout_s=300)
    core = int(re.search(r"pid (\d+)", str(info.value)).group(1))
    deadline = time.monotonic() + 30
    while pid_alive(core) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(core)
