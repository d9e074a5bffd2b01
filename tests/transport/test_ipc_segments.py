"""Who removes an IPC rank's ``/dev/shm`` segments, on real processes.

A host source stages its receivers' weights in a segment, in plain form. Its owner removes
it at close and at exit; a SIGKILLed owner cannot, so the next plan built on the host (an
``IpcExecutor`` made, as at every controller build) removes it; a segment whose owner runs,
or whose pid was reused by a running process of another start time, is judged by pid and
start time together.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import uuid

import pytest
from helpers import nixl_jobs as J
from helpers.ipc_owner import Owner

from refit import Replicate, Shard
from refit.transport.ipc import (
    SHM_DIR,
    IpcChannel,
    list_segments,
    pid_namespace,
    process_start_time,
    sweep_stale_segments,
)

_membership = functools.partial(J.relay_membership, transport="ipc")
_epochs = itertools.count(1)


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _case(src_mesh, engines, shape=(16, 12)):
    return {"bucket_bytes": 96, "params": [
        {"name": "w", "shape": shape, "seed": 11, "src_mesh": src_mesh, "src_pl": [Replicate()],
         "src_dtype": "float32", "dsts": [{"mesh": e, "pl": [Shard(0)], "dtype": "float32"} for e in engines]}]}


def _build_executor(group):
    """What an endpoint does at a controller's build: a new executor for its plan, on its transport."""
    from refit.transport.factory import make_executor

    executor = make_executor(J._S["plan"], group, transport="ipc", ipc=J._S["transport"])
    executor.prepare(J._S["src"], J._S["dst"])
    return type(executor).__name__


def _names(group):
    t = J._S["transport"]
    return [t._control.name] + [r[1] for r in t._regions.values() if r[0] == "shm"]


@pytest.mark.timeout(180)
def test_a_sigkilled_sources_segments_go_at_the_next_build_and_the_living_keep_theirs():
    with J.Procs(3) as procs:
        case = _case([0], [[1], [2]])
        _membership(procs, case, [0, 1, 2], next(_epochs))
        J.refit_ranks(procs, 0, [0, 1, 2])
        names = procs.ok(_names)
        assert len(names[0]) == 2, names  # the source's control words and its staged weights
        procs._procs[0].kill()  # SIGKILL: no close, no exit hook
        procs._procs[0].join(30)
        procs.dead.add(0)
        assert all(_exists(n) for n in names[0]), "nothing removed a SIGKILLed rank's segments yet"
        assert {s.name for s in list_segments() if s.stale} >= set(names[0])
        assert procs.ok(_build_executor, ranks=[1])[1] == "IpcExecutor"
        assert not any(_exists(n) for n in names[0]), [n for n in names[0] if _exists(n)]
        assert all(_exists(n) for r in (1, 2) for n in names[r])  # the living keep theirs


def _craft(pid: int, started: int, namespace: str | None = None) -> str:
    name = f"refit-ipc-{namespace or pid_namespace()}-{pid}-{started}-{uuid.uuid4().hex[:12]}-staging"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    return name


def test_a_reused_pid_does_not_keep_a_dead_owners_segments():
    """A pid that runs, but started at another time than the segment's owner, is a reused pid:
    the segment is stale. The same pid and start time keep it; another pid namespace keeps it
    (its processes cannot be seen); a file not named as refit names them is never touched."""
    me, started = os.getpid(), process_start_time(os.getpid())
    assert started
    reused, running = _craft(me, started + 1), _craft(me, started)
    elsewhere = _craft(me, started + 1, namespace="1")
    foreign = f"refit-ipc-not-ours-{uuid.uuid4().hex[:8]}"
    open(os.path.join(SHM_DIR, foreign), "w").close()
    try:
        state = {s.name: s.owner for s in list_segments()}
        assert (state[reused], state[running], state[elsewhere]) == ("replaced", "running", "elsewhere")
        assert foreign not in state
        removed, failed = sweep_stale_segments(dry_run=True)
        assert reused in {s.name for s in removed} and _exists(reused)
        removed, failed = sweep_stale_segments()
        assert reused in {s.name for s in removed} and not failed
        assert not _exists(reused)
        assert _exists(running) and _exists(elsewhere) and _exists(foreign)
    finally:
        for n in (reused, running, elsewhere, foreign):
            if _exists(n):
                os.unlink(os.path.join(SHM_DIR, n))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_an_owner_that_exits_removes_the_segments_it_left_open(mode):
    """A normal exit, and one on an uncaught exception, with the transport and the staged
    weights never closed: the exit hook removes both."""
    owner = Owner(mode)
    try:
        code = owner.finish()
        assert code == (1 if mode == "raise" else 0), owner.proc.stderr.read()
        assert not any(_exists(n) for n in owner.segments), [n for n in owner.segments if _exists(n)]
    finally:
        owner.close()


@pytest.mark.timeout(120)
def test_a_forked_child_that_exits_leaves_its_parents_segments():
    """A forked child inherits the exit hook and the transport object; neither may remove or
    mark gone what its parent still uses."""
    owner = Owner("fork")
    try:
        owner.say()
        after = json.loads(owner.proc.stdout.readline())["after_fork"]
        assert after == [True, True]
        assert owner.finish() == 0
        assert not any(_exists(n) for n in owner.segments)
    finally:
        owner.close()


@pytest.mark.timeout(120)
def test_a_new_transport_removes_the_segments_of_a_sigkilled_owner():
    owner = Owner("exit")
    try:
        owner.kill()
        assert all(_exists(n) for n in owner.segments)
        t = IpcChannel(0)
        try:
            assert not any(_exists(n) for n in owner.segments)
        finally:
            t.close()
    finally:
        owner.close()
