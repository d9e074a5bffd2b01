"""Synchronizers driven in-process (``LocalWorker``: one thread and one gloo rank per worker).

The control plane without Ray: correctness of both data paths, verification, membership
changes, settling, and the errors. Real processes, real deaths and real freezes are in
``test_recovery_ray.py``.
"""

import subprocess
import sys
import threading
import time

import pytest
import torch

import refit
from refit.control import (
    NoAbsentShard,
    RefitRefused,
    RefitVerificationError,
    RefitWorkerError,
    WeightSynchronizer,
)
from refit.control.settle import settle_before_propagating
from refit.errors import PlanError
from refit.membership import NoSurvivingShards
from refit.runtime.handles import LocalWorker, WorkerDied
from refit.testing.launch import scaled
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer, engine_placement, synthetic_shapes

SYNCS = [refit.ReshardWeightSynchronizer, refit.CollectiveWeightSynchronizer]
HIDDEN = 48
STUCK_S = 120.0  # how long a frozen endpoint holds its call: far beyond every bound asserted below
SLACK_S = scaled(20.0)  # what a busy machine may add to a bound the test configured


def make_fleet(t, s, w, **engine_kw):
    """``w`` workers per shard, or a list of per-shard sizes."""
    sizes = list(w) if isinstance(w, (list, tuple)) else [w] * s
    trainers = [SyntheticTrainer(r, t, hidden=HIDDEN) for r in range(t)]
    engines = [[SyntheticEngine(i, j, n, hidden=HIDDEN, **engine_kw) for j in range(n)] for i, n in enumerate(sizes)]
    return trainers, engines


def set_step(trainers, step):
    for tr in trainers:
        tr.set_step(step)


def wrong_weights(engines, step, shards=None):
    shards = range(len(engines)) if shards is None else shards
    return {(s, w): bad for s in shards for w, e in enumerate(engines[s]) if (bad := e.check_weights(step))}


@pytest.fixture
def synced():
    made = []

    def build(cls, t=2, s=2, w=2, engine_kw=None, **kw):
        trainers, engines = make_fleet(t, s, w, **(engine_kw or {}))
        kw.setdefault("refit_timeout_s", 20.0)
        sync = cls(trainers, engines, **kw)
        made.append(sync)
        return sync, trainers, engines

    yield build
    for sync in made:
        sync.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", SYNCS, ids=["reshard", "collective"])
@pytest.mark.parametrize("topology", [(2, 2, 2), (1, 3, 1), (3, 2, 3)], ids=lambda t: f"t{t[0]}s{t[1]}w{t[2]}")
def test_weights_arrive_exactly(synced, cls, topology):
    sync, trainers, engines = synced(cls, *topology)
    assert isinstance(sync, WeightSynchronizer)
    sync.init_communicator()
    for step in (1, 2):
        set_step(trainers, step)
        res = sync.sync_weights()
        assert res.verified and not res.recovered and res.failure is None
        assert res.shards == list(range(topology[1])) and res.absent_shards == []
        assert res.bytes > 0 and res.gbps > 0
        assert [e.kind for e in res.events if e.kind != "round"] == ["check", "transfer", "verify", "commit"]
        rounds = [e.detail.split(":")[0] for e in res.events if e.kind == "round"]
        assert rounds == ["transfer", "prepare commit", "commit"]
        assert wrong_weights(engines, step) == {}
        assert {e.loads for s in engines for e in s} == {step}


@pytest.mark.timeout(60)
def test_reshard_moves_fewer_bytes_than_the_broadcast_baseline(synced):
    moved = {}
    for cls in SYNCS:
        sync, trainers, _ = synced(cls, 2, 3, 2)
        set_step(trainers, 7)
        moved[cls.mode] = sync.sync_weights().bytes  # builds on first use
    # every engine element exactly once per replica that holds it: bf16, 3 shards of 2 workers
    wire = sum(torch.Size(shape).numel() * (2 if isinstance(engine_placement(name), refit.Replicate) else 1)
               for name, shape in synthetic_shapes(HIDDEN).items()) * 2 * 3
    assert moved["reshard"] == wire
    assert moved["broadcast"] > 2 * moved["reshard"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", SYNCS, ids=["reshard", "collective"])
def test_corrupted_byte_fails_verification_and_names_the_shard(synced, cls):
    sync, trainers, engines = synced(cls, 2, 2, 2)
    sync.init_communicator()
    shard1_rank = 2 + 2 * 1  # trainers 0..1, then shard 0 (ranks 2, 3), shard 1 (ranks 4, 5)
    trainers[0].refit_inject_fault(peer=shard1_rank, byte=5)
    set_step(trainers, 3)
    with pytest.raises(RefitVerificationError) as info:
        sync.sync_weights()
    err = info.value
    expected = [1] if cls.mode == "reshard" else [0, 1]  # a broadcast reaches every shard
    assert err.shards == expected
    assert "shard 1 worker 0" in str(err) and "trainer rank 0" in str(err)
    assert any(name in str(err) for name in synthetic_shapes(HIDDEN))
    assert all(e.loads == 0 for s in engines for e in s)  # never told the weights loaded
    set_step(trainers, 4)
    assert sync.sync_weights().verified  # the fault was one-shot; the communicator is fine
    assert wrong_weights(engines, 4) == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", SYNCS, ids=["reshard", "collective"])
def test_dead_shard_is_excluded_then_readmitted(synced, cls):
    sync, trainers, engines = synced(cls, 1, 3, 2)
    sync.init_communicator()
    assert sync.membership.world_size == 7 and not sync.is_stale
    sync.engine_workers[1][1].kill()
    assert sync.is_stale
    set_step(trainers, 1)
    res = sync.sync_weights()
    assert res.verified and res.rebuilt and res.shards == [0, 2] and res.absent_shards == [1]
    assert sync.membership.shard_prefixes == {0: 0, 2: 2} and sync.membership.world_size == 5
    assert wrong_weights(engines, 1, shards=[0, 2]) == {}

    fresh = [SyntheticEngine(1, w, 2, hidden=HIDDEN) for w in range(2)]
    sync.replace_shard(1, fresh)
    engines[1] = fresh
    assert sync.is_stale
    set_step(trainers, 2)
    res = sync.sync_weights()
    assert res.verified and res.rebuilt and res.shards == [0, 1, 2]
    assert wrong_weights(engines, 2) == {}
    set_step(trainers, 3)
    res = sync.sync_weights()
    assert not res.rebuilt and wrong_weights(engines, 3) == {}


@pytest.mark.timeout(60)
def test_replacing_a_live_shard_rebuilds_even_though_membership_is_unchanged(synced):
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 1, 2, 1)
    sync.init_communicator()
    fresh = [SyntheticEngine(0, 0, 1, hidden=HIDDEN)]
    sync.replace_shard(0, fresh)
    set_step(trainers, 5)
    res = sync.sync_weights()
    assert res.rebuilt and res.verified and fresh[0].check_weights(5) == []
    assert engines[0][0].refit_ping()  # the old worker was torn down, not broken
    assert engines[0][0].refit_status()["backend"] is None


@pytest.mark.timeout(60)
def test_every_shard_gone_raises_no_surviving_shards(synced):
    sync, trainers, _ = synced(refit.ReshardWeightSynchronizer, 1, 2, 1)
    sync.init_communicator()
    for shard in sync.engine_workers:
        shard[0].kill()
    with pytest.raises(NoSurvivingShards, match="all 2 generation shards are gone"):
        sync.sync_weights()
    with pytest.raises(NoSurvivingShards):
        sync.reconcile_communicator([0, 1], force=True)


@pytest.mark.timeout(60)
def test_dead_trainer_is_reported_not_excluded(synced):
    sync, _, _ = synced(refit.ReshardWeightSynchronizer, 2, 2, 1)
    sync.init_communicator()
    sync.trainer_workers[1].kill()
    with pytest.raises(RefitWorkerError, match=r"trainer rank\(s\) \[1\] are dead; trainers are never excluded"):
        sync.sync_weights()


@pytest.mark.timeout(60)
def test_reconcile_follows_should_rebuild(synced):
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 1, 3, 1)
    sync.init_communicator()
    built = sync.membership
    assert sync.reconcile_communicator([], force=False) is False
    assert sync.reconcile_communicator([], force=True) is False  # a frozen rank: nothing to exclude
    assert sync.membership is built
    assert sync.reconcile_communicator([2], force=False) is True
    assert sync.membership.surviving_shards == [0, 1]
    assert sync.reconcile_communicator([2], force=True) is True  # forced: the communicator is gone
    assert sync.reconcile_communicator([], force=False) is True  # shard 2 re-admitted
    assert sync.membership.surviving_shards == [0, 1, 2]
    set_step(trainers, 9)
    assert sync.sync_weights().verified and wrong_weights(engines, 9) == {}


class StuckEngine(SyntheticEngine):
    """An engine that stops answering in the middle of a transfer, until released."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.stuck = threading.Event()
        self.release = threading.Event()

    def on_refit_start(self):
        if self.stuck.is_set():
            self.release.wait(STUCK_S)


# The rebuilds' rendezvous: without it, a build waits only the transfer's short deadline, and a
# rebuild on a loaded machine (every rank arrived, gloo still connecting) failed at 5 s.
CONNECT_S = 60.0


def with_frozen_shard_1(synced, shards: int):
    """A synchronizer over ``shards`` one-worker shards with deadlines of a few seconds, shard 1 a
    ``StuckEngine``, its communicator built: the synchronizer, trainers, engines and the stuck engine."""
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 1, shards, 1, refit_timeout_s=5.0, grace_s=3.0,
                                     ping_timeout_s=3.0, connect_timeout_s=CONNECT_S)
    frozen = StuckEngine(1, 0, 1, hidden=HIDDEN)
    sync.replace_shard(1, [frozen])
    engines[1] = [frozen]
    sync.init_communicator()
    return sync, trainers, engines, frozen


def timed_no_absent_shard(sync) -> tuple[NoAbsentShard, float]:
    """The ``NoAbsentShard`` the next sync raises, and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(NoAbsentShard) as info:
        sync.sync_weights()
    return info.value, time.monotonic() - t0


@pytest.mark.timeout(4 * STUCK_S)
def test_frozen_rank_raises_no_absent_shard_in_bounded_time(synced):
    """The bound is what the sync was configured with (the transfer's deadline, the settle, the probe)
    plus slack for a busy machine; the frozen rank would hold the sync for STUCK_S, far beyond it.
    Deadlines of a few seconds: with a one-second deadline, healthy ranks on a loaded machine time
    out too and the failure is no longer the frozen rank's."""
    sync, trainers, engines, frozen = with_frozen_shard_1(synced, 2)
    frozen.stuck.set()
    set_step(trainers, 1)
    err, elapsed = timed_no_absent_shard(sync)
    bound = sync.refit_timeout_s + sync.settle_budget_s() + sync.ping_timeout_s + SLACK_S
    assert elapsed < bound < STUCK_S, (elapsed, bound)
    msg = str(err)
    assert "no generation shard could be identified as absent" in msg and "shard 1 worker 0" in msg
    assert err.timed_out == ["shard 1 worker 0"]
    frozen.stuck.clear()
    frozen.release.set()
    set_step(trainers, 2)
    res = sync.sync_weights()  # the communicator is rebuilt over the same fleet
    assert res.verified and res.rebuilt and res.shards == [0, 1]
    assert wrong_weights(engines, 2) == {}


@pytest.mark.timeout(4 * STUCK_S)
def test_frozen_rank_with_another_shard_already_out_raises_no_absent_shard_in_bounded_time(synced):
    """A shard already left out is no news: only the failed round's shards count as newly absent.

    Counting the shard an earlier build had excluded as absent again rebuilt the same
    membership, waited for the frozen rank a second time and ended in a different error after
    twice the bound. The bound is the deadline plus the settle budget plus the probe, with a
    slack far below what a second wait costs.
    """
    sync, trainers, engines, frozen = with_frozen_shard_1(synced, 3)
    sync._engines[2][0].kill()  # shard 2 is gone: the next sync rebuilds over shards 0 and 1
    set_step(trainers, 1)
    res = sync.sync_weights()
    assert res.verified and res.shards == [0, 1] and wrong_weights(engines, 1, [0, 1]) == {}
    frozen.stuck.set()
    set_step(trainers, 2)
    err, elapsed = timed_no_absent_shard(sync)
    bound = sync.refit_timeout_s + sync.settle_budget_s() + sync.ping_timeout_s
    assert elapsed < bound + 4.0, (elapsed, bound)
    assert err.timed_out == ["shard 1 worker 0"] and "shard 1 worker 0" in str(err)
    frozen.stuck.clear()
    frozen.release.set()


class FailingLoadEngine(SyntheticEngine):
    """An engine whose load of verified weights fails while ``broken`` is set (a bug, a full device)."""

    broken = False

    def on_weights_loaded(self):
        if self.broken:
            raise RuntimeError("the engine could not load the new weights")
        super().on_weights_loaded()


@pytest.mark.timeout(120)
def test_an_engine_that_cannot_take_its_weights_is_named_and_left_out_until_replaced(synced):
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 1, 2, 1)
    failing = FailingLoadEngine(1, 0, 1, hidden=HIDDEN)
    sync.replace_shard(1, [failing])
    engines[1] = [failing]
    sync.init_communicator()
    failing.broken = True
    set_step(trainers, 1)
    res = sync.sync_weights()
    assert res.recovered and res.shards == [0] and res.absent_shards == [1]
    assert "shard 1 worker 0" in res.failure and "could not load" in res.failure
    assert sync.quarantined_shards == [1] and wrong_weights(engines, 1, shards=[0]) == {}
    set_step(trainers, 2)
    res = sync.sync_weights()  # still left out, though its worker answers
    assert not res.recovered and res.shards == [0] and wrong_weights(engines, 2, shards=[0]) == {}
    fresh = [SyntheticEngine(1, 0, 1, hidden=HIDDEN)]
    sync.replace_shard(1, fresh)
    engines[1] = fresh
    assert sync.quarantined_shards == []
    set_step(trainers, 3)
    res = sync.sync_weights()
    assert res.rebuilt and res.shards == [0, 1] and wrong_weights(engines, 3) == {}


class Straggler:
    """An endpoint whose calls finish only when the test opens their gate."""

    def __init__(self):
        self.late_gate = threading.Event()
        self.stuck_gate = threading.Event()

    def late_failure(self):
        self.late_gate.wait(STUCK_S)
        raise RuntimeError("straggler's own version of the failure")

    def stuck(self):
        self.stuck_gate.wait(STUCK_S)


@pytest.mark.timeout(4 * STUCK_S)
def test_settle_waits_for_stragglers_swallows_errors_and_is_bounded():
    """Only lower bounds on the clock: a busy machine can make any wait longer, never shorter. The
    upper bounds are the gates' own timeouts (STUCK_S), far beyond any budget given here."""
    straggler = Straggler()
    late = LocalWorker(straggler, "late").call("late_failure")
    t0 = time.monotonic()
    threading.Timer(0.2, straggler.late_gate.set).start()
    assert settle_before_propagating([late], STUCK_S / 2, "test") == []
    elapsed = time.monotonic() - t0
    assert late.done() and elapsed >= 0.2, elapsed  # waited for it, and did not raise its error
    assert elapsed < STUCK_S / 2, elapsed  # returned when it finished, not at the end of the budget

    stuck = LocalWorker(straggler, "stuck").call("stuck")
    t0 = time.monotonic()
    budget_s = 0.3
    assert settle_before_propagating([stuck], budget_s, "test") == [stuck]
    elapsed = time.monotonic() - t0
    assert budget_s <= elapsed < STUCK_S, elapsed  # bounded by the budget, not by the straggler
    assert not stuck.done()
    straggler.stuck_gate.set()


@pytest.mark.timeout(60)
def test_local_worker_death_surfaces_as_worker_died():
    w = LocalWorker(SyntheticEngine(0, 0, 1, hidden=HIDDEN), "shard 0 worker 0")
    assert w.call("refit_ping").result(60)["pid"]
    w.kill()
    with pytest.raises(WorkerDied):
        w.call("refit_ping").result(60)
    w.close()


class WideMeshEngine(SyntheticEngine):
    def refit_destinations(self):
        out = dict(super().refit_destinations())
        name = "norm.weight"
        t, shape, _, placements = out[name]
        out[name] = (t, shape, [0, 1, 2], placements)
        return out


class GreedyEngine(SyntheticEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.extra = torch.zeros(4)

    def refit_destinations(self):
        return {**super().refit_destinations(), "lm_head.weight": (self.extra, (4,), [0], [refit.Replicate()])}


@pytest.mark.timeout(60)
def test_errors_name_the_shard_rank_and_param(synced):
    sync, _, _ = synced(refit.ReshardWeightSynchronizer, 1, 2, 1)
    sync.replace_shard(1, [WideMeshEngine(1, 0, 1, hidden=HIDDEN)])
    with pytest.raises(RefitWorkerError) as info:
        sync.init_communicator()
    msg = str(info.value)
    assert info.value.phase == "connect"
    assert "shard 1 worker 0" in msg and "norm.weight" in msg and "names worker(s) [1, 2]" in msg

    sync2, _, _ = synced(refit.ReshardWeightSynchronizer, 1, 2, 1)
    sync2.replace_shard(0, [GreedyEngine(0, 0, 1, hidden=HIDDEN)])
    with pytest.raises(PlanError) as info:
        sync2.init_communicator()
    msg = str(info.value)
    assert "lm_head.weight" in msg and "no source rank holds it" in msg and "1=shard 0 worker 0" in msg


def test_import_refit_does_not_import_ray():
    code = "import refit, sys; assert 'ray' not in sys.modules; print(refit.ReshardWeightSynchronizer.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("ReshardWeightSynchronizer", "CollectiveWeightSynchronizer", "RefitAbortWatchdog", "RefitAborted"):
        assert hasattr(refit, name)


@pytest.mark.timeout(60)
def test_backend_follows_the_tensors_and_nccl_over_host_tensors_is_refused_before_any_connect(synced):
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 1, 2, 1)
    sync.init_communicator()
    assert all(e.refit_status()["backend"] == "gloo" for shard in engines for e in shard)

    forced, _, _ = synced(refit.ReshardWeightSynchronizer, 1, 2, 1, backend="nccl")
    with pytest.raises(PlanError) as info:
        forced.init_communicator()
    msg = str(info.value)
    assert "backend='nccl'" in msg and "on cpu: trainer rank 0 (rank 0)" in msg and "shard 1 worker 0 (rank 2)" in msg
    with pytest.raises(refit.errors.RefitError, match="backend must be"):
        refit.ReshardWeightSynchronizer(*make_fleet(1, 1, 1), backend="mpi")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls", SYNCS, ids=["reshard", "collective"])
@pytest.mark.parametrize("lost", [1, 2], ids=["lose-tp2", "lose-tp1"])
def test_shards_of_different_sizes_refit_lose_one_and_readmit_it(synced, cls, lost):
    """Two shards of TP2 and one of TP1: each gets its own layout; losing either kind of
    shard repacks the survivors by their own sizes, and the restarted shard comes back."""
    sizes = [2, 2, 1]
    sync, trainers, engines = synced(cls, 2, 3, sizes)
    set_step(trainers, 1)
    res = sync.sync_weights()
    assert res.verified and res.shards == [0, 1, 2] and sync.membership.world_size == 2 + 5
    assert wrong_weights(engines, 1) == {}

    sync.engine_workers[lost][0].kill()
    set_step(trainers, 2)
    res = sync.sync_weights()
    survivors = [s for s in range(3) if s != lost]
    assert res.verified and res.rebuilt and res.shards == survivors and res.absent_shards == [lost]
    assert sync.membership.world_size == 2 + sum(sizes[s] for s in survivors)
    assert wrong_weights(engines, 2, shards=survivors) == {}

    with pytest.raises(refit.errors.RefitError, match=f"shard {lost} needs {sizes[lost]} worker"):
        sync.replace_shard(lost, [SyntheticEngine(lost, w, 3, hidden=HIDDEN) for w in range(3)])
    fresh = [SyntheticEngine(lost, w, sizes[lost], hidden=HIDDEN) for w in range(sizes[lost])]
    sync.replace_shard(lost, fresh)
    engines[lost] = fresh
    set_step(trainers, 3)
    res = sync.sync_weights()
    assert res.verified and res.rebuilt and res.shards == [0, 1, 2]
    assert wrong_weights(engines, 3) == {}


@pytest.mark.timeout(90)
def test_an_engine_tensor_that_changed_shape_heads_the_error_not_a_trainer(synced):
    """An engine swaps in a tensor of another shape between syncs: its trainers' peers fail too, but
    the sync's error is the engine's own refusal, naming it, the param and both shapes."""
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 2, 2, 1)
    set_step(trainers, 1)
    assert sync.sync_weights().verified
    engines[1][0].params["norm.weight"] = torch.zeros(HIDDEN // 2, dtype=torch.bfloat16)
    set_step(trainers, 2)
    with pytest.raises(RefitRefused) as info:
        sync.sync_weights()
    err = info.value
    assert not isinstance(err, NoAbsentShard) and err.phase == "transfer"
    head = str(err).split(". A configuration error")[0]
    assert head.startswith("refit transfer refused by shard 1 worker 0: PlanError: shard 1 worker 0 (rank 3): "
                           f"norm.weight changed local shape from [{HIDDEN}] to [{HIDDEN // 2}]"), str(err)
    assert "trainer rank" not in head
    assert err.failures["shard 1 worker 0"].startswith("PlanError: ")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["communicator", "ipc"])
@pytest.mark.parametrize("how", ["new tensor", "new storage"])
def test_a_trainer_that_replaces_its_tensors_between_syncs_sends_the_new_ones(synced, how, transport):
    """A trainer may replace a parameter between steps, by a new tensor or by new storage under the
    same tensor (``.data``): the transfer rebinds to it, and the engines get its values, not those of
    the storage the plan was bound to (kept alive here, holding the step before). IPC peers read
    the storage a source exported, so there new storage must be exported again too."""
    kw = {"transport": "ipc"} if transport == "ipc" else {}
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 2, 2, 1, **kw)
    set_step(trainers, 1)
    assert sync.sync_weights().verified
    kept = []
    for tr in trainers:
        for name, t in list(tr.params.items()):
            kept.append(t.data)
            if how == "new tensor":
                tr.params[name] = t.clone()
            else:
                t.data = t.data.clone()
    set_step(trainers, 2)
    assert sync.sync_weights().verified
    assert wrong_weights(engines, 2) == {}


@pytest.mark.timeout(60)
def test_an_integer_engine_for_float_params_is_refused_by_name_before_any_byte_moves(synced):
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 2, 1, 2, engine_kw={"dtype": "int8"})
    set_step(trainers, 1)
    with pytest.raises(PlanError) as info:
        sync.sync_weights()
    msg = str(info.value)
    assert "the source is float32 on rank(s) [0, 1] but the destination is int8 on rank(s)" in msg, msg
    assert "floating point to integer truncates the fraction and wraps" in msg, msg
    assert "0=trainer rank 0" in msg and "2=shard 0 worker 0" in msg, msg
    assert all(e.loads == 0 and not e.params["norm.weight"].any() for e in engines[0])


@pytest.mark.timeout(90)
def test_trainer_values_beyond_the_engine_dtype_are_reported_and_strict_casts_refuses_them(synced):
    sync, trainers, engines = synced(refit.ReshardWeightSynchronizer, 2, 1, 2, engine_kw={"dtype": "float16"})
    set_step(trainers, 1)
    res = sync.sync_weights()
    assert res.verified and res.cast_overflows == []
    set_step(trainers, 2)
    for tr in trainers:  # norm.weight is replicated on the trainers: both hold the big value
        tr.params["norm.weight"][3] = 1e5
    with pytest.warns(refit.errors.CastOverflowWarning, match="norm.weight"):
        res = sync.sync_weights()
    assert res.verified and res.cast_overflows, res
    for line in res.cast_overflows:
        assert line.startswith(("trainer rank 0: norm.weight: rank 0's", "trainer rank 1: norm.weight: rank 1's"))
        assert "float32 source holds magnitudes up to 100000, beyond the float16 destination" in line, line
    assert all(torch.isinf(e.params["norm.weight"][3]) for e in engines[0])  # cast as torch would

    loads = [e.loads for e in engines[0]]
    set_step(trainers, 3)
    for tr in trainers:
        tr.params["norm.weight"][3] = 1e5
    with pytest.raises(PlanError) as info:
        sync.sync_weights(strict_casts=True)
    msg = str(info.value)
    assert msg.startswith("strict_casts: trainer values do not fit their engines' dtype, so nothing was moved")
    assert "trainer rank 0: norm.weight" in msg and "trainer rank 1: norm.weight" in msg, msg
    assert [e.loads for e in engines[0]] == loads
    assert wrong_weights(engines, 2) == {(0, 0): ["norm.weight"], (0, 1): ["norm.weight"]}  # still step 2's
    set_step(trainers, 4)
    res = sync.sync_weights(strict_casts=True)
    assert res.verified and res.cast_overflows == [] and wrong_weights(engines, 4) == {}
    assert "casts" in [e.kind for e in res.events]


@pytest.mark.parametrize("kw, names", [
    ({"refit_timeout_s": float("inf")}, "refit_timeout_s must be a finite number of seconds > 0 or None, got inf"),
    ({"connect_timeout_s": float("nan")}, "connect_timeout_s must be a finite number of seconds > 0 or None"),
    ({"ping_timeout_s": 0}, "ping_timeout_s must be a finite number of seconds > 0, got 0"),
    ({"grace_s": None}, "grace_s must be a finite number of seconds > 0, got None"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a positive number of bytes, got 0"),
], ids=["refit-inf", "connect-nan", "ping-0", "grace-none", "bucket-0"])
def test_settings_are_checked_at_construction_by_name(kw, names):
    with pytest.raises(refit.errors.RefitError) as info:
        refit.ReshardWeightSynchronizer(*make_fleet(1, 1, 1), **kw)
    assert names in str(info.value)
