"""A killed ProcessWorker takes the processes it started with it (an engine's core and workers would be orphaned)."""

from __future__ import annotations

import os
import time

from helpers.vllm_jobs import ChildSpawner

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
