"""Torn engine weights: a refit that fails after bytes landed leaves no engine that looks whole.

Real processes (``ProcessWorker``), gloo, real SIGKILL and SIGSTOP, no sleeps: a trainer rank
kills itself as it packs a send bucket, an engine stops itself as its transfer starts. The
reference engine (``refit.testing.engine``) is the one that serves here.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers.torn_jobs import (
    CALL_S,
    LLAMA,
    FreezingEngine,
    ReferenceTrainer,
    ServingEngine,
    canonical_state,
    start,
    start_reference_fleet,
)

import refit
from refit.control import NoAbsentShard, RefitWorkerError
from refit.errors import InconsistentWeights
from refit.testing.engine import EngineConfig, EngineShard
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
ALL_ENGINE_WORKERS = ["shard 0 worker 0", "shard 0 worker 1", "shard 1 worker 0"]


def reference_logits(step: int) -> torch.Tensor:
    engine = EngineShard(EngineConfig.from_hf(LLAMA))
    engine.load_canonical(canonical_state(step))
    return engine.forward(torch.tensor([PROMPT]))


def serve(shard: list) -> list:
    """Every worker of the shard runs the forward (its TP collectives need all of them): each result or error."""
    pending = [w.call("logits", PROMPT, 1) for w in shard]
    out = []
    for p in pending:
        try:
            out.append(p.result(CALL_S)["logits"])
        except Exception as e:  # the test looks at what each worker said
            out.append(e)
    return out


def states(engines) -> dict[str, dict]:
    return {f"shard {s} worker {w}": h.call("refit_weights_state").result(CALL_S)
            for s, shard in enumerate(engines) for w, h in enumerate(shard)}


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_transfer_leaves_every_engine_worker_torn_named_and_refusing(closing):
    """Shard 0 (TP2) and shard 1 (TP1) of the reference engine, 2 trainer ranks. Trainer rank 1
    dies as it packs its first bucket of the second refit, while rank 0 sends all of its own:
    the engines hold some bytes of step 2 and the rest of step 1."""
    trainers, engines = start_reference_fleet(ServingEngine)
    closing += [*trainers, *engines[0], *engines[1]]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0, grace_s=5.0, ping_timeout_s=5.0)
    try:
        for t in trainers:
            t.call("set_step", 1).result(CALL_S)
        assert sync.sync_weights().verified
        step1 = reference_logits(1)
        for shard in engines:
            for logits in serve(shard):
                assert torch.allclose(logits, step1, atol=1e-5)
        before = [w.call("fused").result(CALL_S) for shard in engines for w in shard]

        for t in trainers:
            t.call("set_step", 2).result(CALL_S)
        trainers[1].call("die_at_bucket", 0).result(CALL_S)
        with pytest.raises(RefitWorkerError) as info:
            sync.sync_weights()
        err = info.value
        assert "trainer rank 1" in str(err)
        assert err.inconsistent == ALL_ENGINE_WORKERS
        assert ("engine weights now inconsistent on: shard 0 worker 0, shard 0 worker 1, shard 1 worker 0 "
                "(they refuse to serve until a refit completes)") in str(err)
        assert sync.inconsistent_workers() == ALL_ENGINE_WORKERS
        for label, state in states(engines).items():
            assert not state["consistent"] and state["commits"] == 1, (label, state)
            assert "refit transfer" in state["reason"], (label, state)
        for shard in engines:
            for answer in serve(shard):
                assert isinstance(answer, InconsistentWeights), answer
                assert "refusing to serve" in str(answer)
        # bytes of step 2 that trainer rank 0 holds landed: the weights are neither step's
        after = [w.call("fused").result(CALL_S) for shard in engines for w in shard]
        changed = [n for old, new in zip(before, after) for n in old if not torch.equal(old[n], new[n])]
        assert changed, "no byte of the failed refit landed: the test no longer tears anything"
    finally:
        sync.shutdown()

    # repaired: a new trainer rank 1 and a synchronizer over the same engines
    trainers[1] = start(ReferenceTrainer, 1, 2, name="trainer rank 1 (restarted)")
    closing.append(trainers[1])
    for t in trainers:
        t.call("set_step", 2).result(CALL_S)
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0, grace_s=5.0, ping_timeout_s=5.0)
    try:
        assert sync.sync_weights().verified
        assert sync.inconsistent_workers() == []
        for label, state in states(engines).items():
            assert state["consistent"] and state["reason"] is None and state["commits"] == 2, (label, state)
        step2 = reference_logits(2)
        for shard in engines:
            for logits in serve(shard):
                assert torch.allclose(logits, step2, atol=1e-5)
    finally:
        sync.shutdown()


@pytest.mark.timeout(300)
def test_a_frozen_shard_names_the_healthy_workers_it_left_torn(closing):
    """Shard 1's only worker stops itself as its transfer starts; the refit fails with
    ``NoAbsentShard`` (it is alive), and the error names shard 0's workers, whose transfer
    started too, beside the frozen one. Once it runs again, a refit makes them all whole."""
    trainers = [start(SyntheticTrainer, r, 2, hidden=32, name=f"trainer rank {r}") for r in range(2)]
    engines = [[start(FreezingEngine, s, w, n, hidden=32, name=f"shard {s} worker {w}") for w in range(n)]
               for s, n in enumerate((2, 1))]
    closing += [*trainers, *engines[0], *engines[1]]
    frozen = engines[1][0]
    # deadlines only a frozen worker reaches, even with the two cores shared by seven processes
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=10.0, grace_s=3.0, ping_timeout_s=6.0,
                                           connect_timeout_s=60.0)
    try:
        for t in trainers:
            t.call("set_step", 1).result(CALL_S)
        assert sync.sync_weights().verified
        for t in trainers:
            t.call("set_step", 2).result(CALL_S)
        frozen.call("freeze_next_transfer").result(CALL_S)
        with pytest.raises(NoAbsentShard) as info:
            sync.sync_weights()
        err = info.value
        assert "shard 1 worker 0" in err.timed_out, err
        assert err.inconsistent == ALL_ENGINE_WORKERS, err
        assert "engine weights now inconsistent on: shard 0 worker 0, shard 0 worker 1, shard 1 worker 0" in str(err)
        for w in engines[0]:  # the healthy shard says so itself
            state = w.call("refit_weights_state").result(CALL_S)
            assert not state["consistent"] and "epoch" in state["reason"], state

        os.kill(frozen.process.pid, signal.SIGCONT)
        for t in trainers:
            t.call("set_step", 3).result(CALL_S)
        res = sync.sync_weights()
        assert res.verified and res.shards == [0, 1], res
        assert sync.inconsistent_workers() == []
        assert all(s["consistent"] for s in states(engines).values())
        for w in [*engines[0], *engines[1]]:
            assert w.call("check_weights", 3).result(CALL_S) == []
    finally:
        sync.shutdown()


# -- in-process (LocalWorker): the other ways a refit ends after bytes landed ---------------------

class WatchedEngine(SyntheticEngine):
    """Records what the endpoint tells the engine, and can fail its load of verified weights."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.told: list[str] = []
        self.broken = False

    def on_weights_inconsistent(self, reason: str) -> None:
        self.told.append(reason)

    def on_weights_loaded(self) -> None:
        if self.broken:
            raise RuntimeError("the engine could not take the new weights")
        super().on_weights_loaded()


def local_fleet(sizes):
    trainers = [SyntheticTrainer(r, 2, hidden=32) for r in range(2)]
    engines = [[WatchedEngine(s, w, n, hidden=32) for w in range(n)] for s, n in enumerate(sizes)]
    return trainers, engines


def set_step(trainers, step):
    for t in trainers:
        t.set_step(step)


@pytest.mark.timeout(120)
def test_bytes_that_fail_verification_leave_the_engines_torn_and_named_until_the_next_refit():
    """The reshard path writes straight into the engines' tensors and checks afterwards: a bad
    checksum means every engine worker holds uncommitted bytes, not only the one that got the bad ones."""
    trainers, engines = local_fleet([2, 1])
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=20.0)
    try:
        set_step(trainers, 1)
        assert sync.sync_weights().verified
        trainers[0].refit_inject_fault(peer=2 + 2, byte=3)  # shard 1 worker 0 is rank 4
        set_step(trainers, 2)
        with pytest.raises(refit.RefitVerificationError) as info:
            sync.sync_weights()
        assert info.value.shards == [1] and info.value.inconsistent == ALL_ENGINE_WORKERS
        assert "engine weights now inconsistent on: shard 0 worker 0, shard 0 worker 1, shard 1 worker 0" in str(
            info.value)
        for shard in engines:
            for e in shard:
                # told as each transfer started writing: the first refit's, then this one's
                assert e.told == ["a refit transfer (epoch 1) is writing into the live weights"] * 2
                assert e.refit_weights_state()["epoch"] == 1 and e.refit_weights_state()["commits"] == 1
                with pytest.raises(InconsistentWeights, match="refusing to serve torn weights"):
                    e.check_weights_consistent()
        set_step(trainers, 3)
        res = sync.sync_weights()
        assert res.verified and not res.inconsistent and sync.inconsistent_workers() == []
        for shard in engines:
            for e in shard:
                e.check_weights_consistent()
                assert e.check_weights(3) == [] and e.refit_weights_state()["commits"] == 2
    finally:
        sync.shutdown()


@pytest.mark.timeout(120)
def test_an_engine_whose_load_fails_stays_torn_and_the_recovered_sync_names_it():
    trainers, engines = local_fleet([1, 1])
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=20.0)
    try:
        engines[1][0].broken = True
        set_step(trainers, 1)
        res = sync.sync_weights()
        assert res.recovered and res.shards == [0] and sync.quarantined_shards == [1]
        assert res.inconsistent == ["shard 1 worker 0"]
        state = engines[1][0].refit_weights_state()
        assert not state["consistent"] and "could not take the new weights" in state["reason"]
        assert engines[1][0].told[-1] == state["reason"]
        assert engines[0][0].refit_weights_state()["consistent"]
    finally:
        sync.shutdown()
