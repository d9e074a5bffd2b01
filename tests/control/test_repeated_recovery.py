"""Recovery that repeats: the retried transfer loses another worker, and the sync recovers again.

Real processes (``ProcessWorker``), real SIGKILLs, real gloo. Each victim kills itself inside
the transfer it was armed for (``helpers.doomed``), so the second death lands inside the
RETRIED transfer whatever the rebuild before it cost. Deadlines are scaled by how long this
run's first build and sync took, so a loaded machine stretches them instead of failing them.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

import refit
from refit.control import EveryShardLost, NoSurvivingShards, RecoveryDeadlineExceeded
from refit.runtime.handles import ProcessWorker
from refit.testing.launch import scaled
from refit.testing.synthetic import SyntheticTrainer

HIDDEN = 32
CALL_S = scaled(120.0)  # bound on a plain call into a worker (set_step, check_weights)
SLACK_S = scaled(20.0)  # what a busy machine may add to a bound the sync was configured with


class Phases:
    """The sync's phases as they start (its ``on_phase``)."""

    def __init__(self):
        self.seen: list[str] = []

    def __call__(self, phase: str) -> None:
        self.seen.append(phase)

    def count(self, phase: str) -> int:
        return self.seen.count(phase)


def start_fleet(sizes):
    """One trainer rank and ``DoomedEngine`` workers for shards of ``sizes``, spawned side by side."""
    from helpers.doomed import DoomedEngine

    with cf.ThreadPoolExecutor(4) as pool:
        trainer = pool.submit(ProcessWorker, SyntheticTrainer, 0, 1, hidden=HIDDEN, name="trainer rank 0")
        engines = [[pool.submit(ProcessWorker, DoomedEngine, s, w, n, hidden=HIDDEN, name=f"shard {s} worker {w}")
                    for w in range(n)] for s, n in enumerate(sizes)]
        return trainer.result(), [[f.result() for f in shard] for shard in engines]


def first_sync(sizes, closing, units):
    """A fleet, a synchronizer whose deadline is ``units`` times this run's start-up, after one verified sync.

    The start-up (the first build and transfer) is what a rebuild and a retried transfer each
    cost at most on this machine now.
    """
    trainer, engines = start_fleet(sizes)
    closing += [trainer, *(w for s in engines for w in s)]
    trainer.call("set_step", 1).result(CALL_S)
    probe = refit.ReshardWeightSynchronizer([trainer], engines, refit_timeout_s=120.0)
    try:
        t0 = time.monotonic()
        assert probe.sync_weights().verified
        unit = time.monotonic() - t0
    finally:
        probe.shutdown()
    sync = refit.ReshardWeightSynchronizer([trainer], engines, refit_timeout_s=max(6.0, units * unit),
                                           grace_s=max(3.0, 3 * unit), ping_timeout_s=max(2.0, 2 * unit))
    return trainer, engines, sync


def wrong(engines, step, shards):
    return {(s, w): bad for s in shards for w, e in enumerate(engines[s])
            if (bad := e.call("check_weights", step).result(CALL_S))}


@pytest.mark.timeout(600)
def test_each_retried_transfer_that_loses_another_worker_recovers_again_and_verifies_over_the_rest(closing):
    """Shards 1, 2 and 3 each lose their worker in the first, the second and the third transfer
    of one sync: three recoveries, each over one shard fewer, and shard 0 (TP2) verifies."""
    trainer, engines, sync = first_sync((2, 1, 1, 1), closing, units=12)  # room for three rounds
    try:
        for nth, shard in enumerate((1, 2, 3), start=1):
            engines[shard][0].call("die_in_transfer", nth).result(CALL_S)
        phases = sync.on_phase = Phases()
        trainer.call("set_step", 2).result(CALL_S)
        res = sync.sync_weights()
        assert res.verified and res.recovered and res.recoveries == 3, res
        assert res.shards == [0] and res.absent_shards == [1, 2, 3], res
        assert res.lost == ["shard 1 worker 0", "shard 2 worker 0", "shard 3 worker 0"], res.lost
        assert phases.count("transfer") == 4 and phases.count("recover") == 3, phases.seen
        assert all(engines[s][0].is_dead() for s in (1, 2, 3))
        assert wrong(engines, 2, [0]) == {}
    finally:
        sync.shutdown()


@pytest.mark.timeout(600)
def test_losing_every_shard_one_transfer_after_another_raises_no_surviving_shards_naming_all(closing):
    """Shard 0 loses a worker in the first transfer, shard 1 its only one in the retried
    transfer: nothing is left, and the error names both (message and ``died``)."""
    trainer, engines, sync = first_sync((2, 1), closing, units=12)
    try:
        engines[0][1].call("die_in_transfer", 1).result(CALL_S)
        engines[1][0].call("die_in_transfer", 2).result(CALL_S)
        phases = sync.on_phase = Phases()
        trainer.call("set_step", 2).result(CALL_S)
        t0 = time.monotonic()
        with pytest.raises(NoSurvivingShards, match="all 2 generation shards are gone") as info:
            sync.sync_weights()
        elapsed = time.monotonic() - t0
        err = info.value
        assert isinstance(err, EveryShardLost), type(err)
        assert err.died == ["shard 0 worker 1", "shard 1 worker 0"], err.died
        assert "shard 0 worker 1" in str(err) and "shard 1 worker 0" in str(err), str(err)
        assert phases.count("transfer") == 2 and phases.count("recover") == 2, phases.seen
        assert elapsed < sync.refit_timeout_s + sync.settle_budget_s() + SLACK_S, elapsed
    finally:
        sync.shutdown()


@pytest.mark.timeout(600)
def test_a_loss_after_the_deadline_raises_naming_every_worker_lost_in_the_sync(closing):
    """Shard 1 dies in the first transfer; the retried transfer waits on shard 2's worker until
    every watchdog fired, and it dies just after: the deadline has passed, so no further round
    begins, and the error names both dead workers, not only the last."""
    trainer, engines, sync = first_sync((2, 1, 1), closing, units=4)  # the stalled worker outlasts it anyway
    try:
        engines[1][0].call("die_in_transfer", 1).result(CALL_S)
        engines[2][0].call("die_in_transfer", 2, sync.grace_s / 4).result(CALL_S)
        phases = sync.on_phase = Phases()
        trainer.call("set_step", 2).result(CALL_S)
        t0 = time.monotonic()
        with pytest.raises(RecoveryDeadlineExceeded) as info:
            sync.sync_weights()
        elapsed = time.monotonic() - t0
        err = info.value
        assert err.died == ["shard 1 worker 0", "shard 2 worker 0"], (err.died, str(err))
        assert "shard 1 worker 0" in str(err) and "shard 2 worker 0" in str(err), str(err)
        assert "deadline passed" in str(err), str(err)
        assert phases.count("transfer") == 2 and phases.count("recover") == 2, phases.seen
        assert sync.refit_timeout_s < elapsed < sync.refit_timeout_s + sync.settle_budget_s() + SLACK_S, elapsed
        # the survivors are whole again at the next sync, over shard 0 alone
        trainer.call("set_step", 3).result(CALL_S)
        res = sync.sync_weights()
        assert res.verified and res.shards == [0] and wrong(engines, 3, [0]) == {}
    finally:
        sync.shutdown()
