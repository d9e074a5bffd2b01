"""Staged refits: engines keep generating while the next weights land, and switch between two steps.

Real processes (``ProcessWorker``) and gloo for the serving engines, no sleeps: each engine runs
the reference engine's serving loop on a thread of its own while the controller's calls arrive,
and the tests wait for requests to complete, not for time to pass. Every token a loop produced
is checked against a reference engine holding the weights of the version it says it ran under.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import torch
from helpers.staged_jobs import StagedEngine
from helpers.torn_jobs import CALL_S, LLAMA, ReferenceTrainer, canonical_state, start, start_reference_fleet

import refit
from refit.control import NoAbsentShard, RefitWorkerError
from refit.errors import InconsistentWeights, RefitError
from refit.testing.engine import EngineConfig, EngineShard
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NEW_TOKENS = 3
_REFERENCE: dict[int, EngineShard] = {}


def reference(step: int) -> EngineShard:
    if step not in _REFERENCE:
        engine = EngineShard(EngineConfig.from_hf(LLAMA))
        engine.load_canonical(canonical_state(step))
        _REFERENCE[step] = engine
    return _REFERENCE[step]


def reference_tokens(versions: list[int]) -> list[int]:
    """Greedy tokens on ``PROMPT`` when token ``i`` is produced under the weights of ``versions[i]``."""
    ids = torch.tensor([PROMPT])
    for v in versions:
        nxt = reference(v).forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(PROMPT):].tolist()


def wait_requests(workers, more_than: dict, timeout_s: float = CALL_S) -> dict:
    """Wait until every worker's serving loop completed more requests than ``more_than`` says."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {w: w.call("serving_requests").result(CALL_S) for w in workers}
        if all(now[w] > more_than.get(w, 0) for w in workers):
            return now
        assert time.monotonic() < deadline, f"serving stalled: {now}"
        time.sleep(0.05)  # polling a condition of another process


def check_served(log: dict, allowed: set[int]) -> list[dict]:
    assert log["error"] is None, log["error"]
    for req in log["requests"]:
        assert set(req["versions"]) <= allowed, req
        assert req["versions"] == sorted(req["versions"]), req  # a version never goes back
        assert req["tokens"] == reference_tokens(req["versions"]), req
    return log["requests"]


@pytest.mark.timeout(300)
def test_engines_generate_through_staged_refits_and_a_failed_refit_leaves_version_n_serving(closing):
    """Shard 0 (TP2) and shard 1 (TP1) of the reference engine serve in a loop from before the
    first refit (they refuse until a version is committed) through two refits and one whose
    trainer rank dies mid-transfer: nothing torn, version 2 goes on serving, and the TP2 shard's
    workers produce every token under the same version."""
    trainers, engines = start_reference_fleet(StagedEngine)
    workers = [*engines[0], *engines[1]]
    closing += [*trainers, *workers]
    for w in workers:
        w.call("start_serving", PROMPT, NEW_TOKENS).result(CALL_S)
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0, grace_s=5.0, ping_timeout_s=5.0)
    try:
        for w in workers:
            state = w.call("refit_weights_state").result(CALL_S)
            assert state["version"] is None and state["staged"] and state["consistent"], state
        counts: dict = {}
        for step in (1, 2):
            for t in trainers:
                t.call("set_step", step).result(CALL_S)
            res = sync.sync_weights(version=step)
            assert res.verified and res.version == step
            counts = wait_requests(workers, counts)
        for w in workers:
            state = w.call("refit_weights_state").result(CALL_S)
            assert state["version"] == 2 and state["switch"]["mode"] == "swap", state

        for t in trainers:
            t.call("set_step", 3).result(CALL_S)
        trainers[1].call("die_at_bucket", 0).result(CALL_S)
        with pytest.raises(RefitWorkerError) as info:
            sync.sync_weights()
        assert "trainer rank 1" in str(info.value)
        assert info.value.inconsistent == [] and sync.inconsistent_workers() == []
        for w in workers:
            state = w.call("refit_weights_state").result(CALL_S)
            assert state["consistent"] and state["version"] == 2 and state["commits"] == 2, state
        wait_requests(workers, counts)  # and they go on serving version 2
        logs = [w.call("stop_serving").result(CALL_S) for w in workers]
    finally:
        sync.shutdown()
    assert logs[0]["refused"] > 0  # before the first refit
    served = [check_served(log, {1, 2}) for log in logs]
    # a TP2 shard's workers: same tokens, same version at every token
    assert [(r["tokens"], r["versions"]) for r in served[0]] == [(r["tokens"], r["versions"]) for r in served[1]]
    for requests in served:
        assert requests[-1]["versions"] == [2] * NEW_TOKENS
        assert any(r["versions"] == [1] * NEW_TOKENS for r in requests)


@pytest.mark.timeout(300)
def test_a_death_between_transfer_and_switch_switches_no_one_and_a_readmitted_engine_waits_for_the_version(closing):
    """Shard 1 dies as it is asked to prepare the commit, after every transfer landed. No worker
    switches in that attempt (shard 0 goes from version 1 straight to 2, one switch each, over
    the recovered membership), and the restarted shard 1 refuses to serve until the next refit
    brings it to the current version. When it dies during staging, shard 0 alone switches."""
    with cf.ThreadPoolExecutor(4) as pool:
        trainer = pool.submit(start, ReferenceTrainer, 0, 1, name="trainer rank 0")
        engines = [[pool.submit(start, StagedEngine, s, 0, 1, config=LLAMA, name=f"shard {s} worker 0")]
                   for s in range(2)]
        fresh = pool.submit(start, StagedEngine, 1, 0, 1, config=LLAMA, name="shard 1 worker 0 (restarted)")
        trainer, engines, fresh = trainer.result(), [[f.result() for f in s] for s in engines], fresh.result()
    closing += [trainer, engines[0][0], engines[1][0], fresh]
    serving = engines[0][0]
    serving.call("start_serving", PROMPT, NEW_TOKENS).result(CALL_S)
    sync = refit.ReshardWeightSynchronizer([trainer], engines, refit_timeout_s=30.0, grace_s=5.0, ping_timeout_s=5.0)
    try:
        trainer.call("set_step", 1).result(CALL_S)
        assert sync.sync_weights().version == 1
        counts = wait_requests([serving], {})
        engines[1][0].call("die_at_prepare").result(CALL_S)
        trainer.call("set_step", 2).result(CALL_S)
        res = sync.sync_weights()
        assert res.recovered and res.shards == [0] and res.version == 2 and "prepare commit" in res.failure, res
        assert [s["version"] for s in serving.call("refit_switches").result(CALL_S)] == [1, 2]
        wait_requests([serving], counts)

        with pytest.raises(InconsistentWeights, match="before a refit brought this worker"):
            fresh.call("logits", PROMPT, 1).result(CALL_S)
        sync.replace_shard(1, [fresh])
        trainer.call("set_step", 3).result(CALL_S)
        res = sync.sync_weights()
        assert res.shards == [0, 1] and res.version == 3
        out = fresh.call("logits", PROMPT, NEW_TOKENS).result(CALL_S)
        assert out["weights_version"] == 3 and out["tokens"][0].tolist() == reference_tokens([3] * NEW_TOKENS)

        # the restarted shard dies during staging: the survivor alone switches, once
        fresh.call("die_at_transfer").result(CALL_S)
        trainer.call("set_step", 4).result(CALL_S)
        res = sync.sync_weights()
        assert res.recovered and res.shards == [0] and res.version == 4 and res.inconsistent == [], res
        assert [s["version"] for s in serving.call("refit_switches").result(CALL_S)] == [1, 2, 3, 4]
        log = serving.call("stop_serving").result(CALL_S)
    finally:
        sync.shutdown()
    check_served(log, {1, 2, 3, 4})


# -- in-process (LocalWorker): copy mode, a bounded device budget, failures before the switch -----

class PickyEngine(SyntheticEngine):
    """A staged synthetic engine that can refuse to prepare the commit while staying alive."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.refit_configure_staging(True, device_fraction=0.125)
        self.refuse = False

    def _refit_prepare(self, epoch: int) -> None:
        if self.refuse:
            raise RefitError("staged weights went missing")
        super()._refit_prepare(epoch)


@pytest.mark.timeout(120)
def test_copy_staging_with_an_eighth_on_device_switches_whole_or_not_at_all():
    trainers = [SyntheticTrainer(r, 2, hidden=32) for r in range(2)]
    engines = [[PickyEngine(s, w, n, hidden=32) for w in range(n)] for s, n in enumerate([2, 1])]
    everyone = [e for shard in engines for e in shard]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=20.0)

    def set_step(step):
        for t in trainers:
            t.set_step(step)

    try:
        for step in (1, 2):
            set_step(step)
            assert sync.sync_weights().version == step
        for e in everyone:
            assert e.check_weights(2) == [] and e.refit_switches()[-1]["mode"] == "copy"
            assert len(e._refit_state().weights.staging_buffers) == len(e.params)  # one staging copy per tensor, kept

        trainers[0].refit_inject_fault(peer=4, byte=3)  # corrupts what shard 1 receives
        set_step(3)
        with pytest.raises(refit.RefitVerificationError) as info:
            sync.sync_weights()
        assert info.value.inconsistent == []
        engines[0][1].refuse = True  # alive, so nothing can be excluded: every shard stays on 2
        set_step(4)
        with pytest.raises(NoAbsentShard, match="prepare commit"):
            sync.sync_weights()
        for e in everyone:
            state = e.refit_weights_state()
            assert state["consistent"] and state["version"] == 2 and e.check_weights(2) == [], state
            e.check_weights_consistent()

        engines[0][1].refuse = False
        set_step(5)
        assert sync.sync_weights().version == 3
        assert all(e.check_weights(5) == [] for e in everyone)
    finally:
        sync.shutdown()
    # a new synchronizer over the same engines: versions only grow
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=20.0)
    try:
        assert sync.sync_weights().version == 4
        assert {e.weights_version for e in everyone} == {4}
    finally:
        sync.shutdown()
