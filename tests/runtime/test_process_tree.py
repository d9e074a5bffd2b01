"""A killed ProcessWorker takes the processes it started with it (an engine's core and workers would be orphaned)."""

from __future__ import annotations

import os
import time

from helpers.vllm_jobs import ChildSpawner

from refit.runtime.handles import ProcessWorker


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_kill_takes_the_children_along():
    worker = ProcessWorker(ChildSpawner, name="spawner", daemon=False)
    child = worker.call("refit_ping").result(60)["child"]
    assert _alive(child)
    worker.kill()
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    worker.close()
    assert not os.path.exists(f"/proc/{worker.process.pid}/stat") or not _alive(worker.process.pid)


def test_close_takes_the_children_along():
    worker = ProcessWorker(ChildSpawner, name="spawner", daemon=False)
    child = worker.call("refit_ping").result(60)["child"]
    worker.close()
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
