"""ProcessWorker: endpoints in processes of their own, driven by the synchronizer without Ray."""

from __future__ import annotations

import os
import signal
import time

import pytest

import refit
from refit.errors import PlanError
from refit.runtime.handles import ProcessWorker, WorkerDied
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

HIDDEN = 32


def fleet(trainers: int, shards: int, workers: int):
    ts = [ProcessWorker(SyntheticTrainer, r, trainers, hidden=HIDDEN, name=f"trainer {r}") for r in range(trainers)]
    es = [[ProcessWorker(SyntheticEngine, s, w, workers, hidden=HIDDEN, name=f"shard {s} worker {w}")
           for w in range(workers)] for s in range(shards)]
    return ts, es


def close(*handles):
    for h in handles:
        h.close()


def set_step(trainers, n):
    for t in trainers:
        t.call("set_step", n).result(60)


def wrong(engines, n, shards):
    return {(s, w): bad for s in shards for w, e in enumerate(engines[s])
            if (bad := e.call("check_weights", n).result(60))}


@pytest.mark.timeout(240)
def test_sync_over_processes_verifies_then_recovers_from_a_sigkilled_engine():
    trainers, engines = fleet(2, 2, 2)
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0, grace_s=10.0)
    try:
        sync.init_communicator()
        for n in (1, 2):
            set_step(trainers, n)
            res = sync.sync_weights()
            assert res.verified and wrong(engines, n, [0, 1]) == {}
        os.kill(engines[1][0].process.pid, signal.SIGKILL)
        engines[1][0].process.join(30)
        assert engines[1][0].is_dead()
        with pytest.raises(WorkerDied):
            engines[1][0].call("refit_ping").result(5)
        set_step(trainers, 3)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0]
        assert wrong(engines, 3, [0]) == {}
    finally:
        sync.shutdown()
        close(*trainers, *(w for s in engines for w in s))


@pytest.mark.timeout(120)
def test_an_error_in_the_worker_process_reaches_the_caller_with_its_type():
    worker = ProcessWorker(SyntheticTrainer, 0, 1, hidden=HIDDEN)
    try:
        with pytest.raises(refit.RefitError, match="no refit communicator"):
            worker.call("refit_transfer", 0, timeout_s=1.0).result(60)
        with pytest.raises(AttributeError):
            worker.call("no_such_method").result(60)
        assert worker.call("set_step", 4).result(60) == 4  # the worker lives on after its errors
    finally:
        worker.close()
    assert worker.is_dead()
    with pytest.raises(WorkerDied):
        worker.call("refit_ping").result(5)


def test_a_bad_layout_in_a_worker_process_is_refused_before_any_transfer():
    trainers = [ProcessWorker(SyntheticTrainer, 0, 1, hidden=HIDDEN)]
    engines = [[ProcessWorker(SyntheticEngine, 0, 0, 1, hidden=HIDDEN + 2)]]  # shapes the trainer does not hold
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0)
    try:
        with pytest.raises((PlanError, refit.RefitError)):
            sync.init_communicator()
    finally:
        sync.shutdown()
        close(*trainers, *engines[0])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("after_s", [0.0, 0.05])
def test_a_worker_dying_inside_a_rebuilds_rendezvous_is_excluded_and_the_rebuild_retried(after_s):
    """A re-admitted worker dies a moment into the rendezvous of the rebuild that re-admits it.

    Gloo waits five times its timeout for a peer to connect in, so survivors left to it would
    sit in refit_connect for 5 x the connect timeout, and the controller would give up on all
    of them and blame every healthy worker. They are released within the connect timeout: the
    dead one is named, its shard excluded and the build retried over the rest, and the sync verifies.
    """
    from helpers.dying import DyingEngine

    timeout_s, grace_s, ping_s = 4.0, 2.0, 2.0
    trainers, engines = fleet(2, 2, 1)
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=timeout_s, grace_s=grace_s,
                                           ping_timeout_s=ping_s)
    victim = ProcessWorker(DyingEngine, 1, 0, 1, hidden=HIDDEN, name="shard 1 worker 0 (dying)")
    try:
        sync.init_communicator()
        set_step(trainers, 1)
        assert sync.sync_weights().verified
        sync.replace_shard(1, [victim])
        victim.call("die_in_next_connect", after_s).result(60)
        set_step(trainers, 2)
        t0 = time.monotonic()
        res = sync.sync_weights()
        elapsed = time.monotonic() - t0
        assert victim.is_dead()
        assert res.verified and res.shards == [0] and wrong(engines, 2, [0]) == {}
        # one connect timeout for the survivors, the settle's grace, a probe, a rebuild: not 5 x the timeout
        assert elapsed < timeout_s + grace_s + ping_s + 5.0, elapsed
        assert "shard 1 worker 0" in (res.failure or ""), res.failure
    finally:
        sync.shutdown()
        close(*trainers, *(w for s in engines for w in s), victim)
