"""``ReshardWeightSynchronizer`` over the one-sided transports (NIXL, IPC), driven in-process.

The controller relays the ranks' roster entries at every build; transfers then make no
collective call. Membership changes renumber the ranks, and the same transports (NIXL
agents, IPC segments) follow. On the host, IPC engines read the trainers' shared-memory
segments; the GPU tests run the same synchronizer with CUDA IPC, a process per rank.
"""

from __future__ import annotations

import pytest

import refit
from refit.comm.group import StatelessProcessGroup
from refit.control import RefitVerificationError
from refit.errors import RefitError
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer
from refit.transport.nixl import nixl_available

HIDDEN = 48
NAME = {"nixl": "nixl_agent", "ipc": "ipc_name"}  # refit_status() key of the transport's name
TRANSPORTS = [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")),
              "ipc"]


def make(t, s, w, transport="ipc", **kw):
    trainers = [SyntheticTrainer(r, t, hidden=HIDDEN) for r in range(t)]
    engines = [[SyntheticEngine(i, j, w, hidden=HIDDEN) for j in range(w)] for i in range(s)]
    kw.setdefault("refit_timeout_s", 20.0)
    return refit.ReshardWeightSynchronizer(trainers, engines, transport=transport, **kw), trainers, engines


def wrong(engines, step, shards=None):
    shards = range(len(engines)) if shards is None else shards
    return {(s, w): bad for s in shards for w, e in enumerate(engines[s]) if (bad := e.check_weights(step))}


def step(trainers, n):
    for t in trainers:
        t.set_step(n)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_moves_verifies_follows_membership_and_makes_no_collective(monkeypatch, transport):
    sync, trainers, engines = make(2, 3, 2, transport)
    try:
        sync.init_communicator()
        calls = []
        for name in ("all_gather_object", "broadcast_object", "broadcast", "barrier", "isend", "irecv", "p2p_group"):
            orig = getattr(StatelessProcessGroup, name)
            monkeypatch.setattr(StatelessProcessGroup, name,
                                lambda self, *a, _n=name, _o=orig, **k: (calls.append(_n), _o(self, *a, **k))[1])
        for n in (1, 2):
            step(trainers, n)
            res = sync.sync_weights()
            assert res.verified and not res.rebuilt and wrong(engines, n) == {}
        assert calls == []  # the transfers: NIXL notifications and WRITEs, or IPC control words and copies
        monkeypatch.undo()
        # a shard dies: the rebuild renumbers the ranks; transports stay, plans and rosters follow
        names = {id(e): e.refit_status()[NAME[transport]] for s in engines for e in s}
        sync.engine_workers[1][0].kill()
        step(trainers, 3)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0, 2] and wrong(engines, 3, [0, 2]) == {}
        assert engines[2][1].refit_status()["one_sided_rank"] == 2 + 2 + 1  # was 2 + 4 + 1
        assert engines[2][1].refit_status()[NAME[transport]] == names[id(engines[2][1])]
        # the shard comes back (fresh workers, fresh agents or segments) and joins at the next sync
        fresh = [SyntheticEngine(1, w, 2, hidden=HIDDEN) for w in range(2)]
        sync.replace_shard(1, fresh)
        engines[1] = fresh
        step(trainers, 4)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0, 1, 2] and wrong(engines, 4) == {}
        # a flipped byte is caught by the per-bucket checksums, naming the shard
        sync.trainer_workers[0].call("refit_inject_fault", peer=None, byte=3).result(10)
        step(trainers, 5)
        with pytest.raises(RefitVerificationError, match="shard"):
            sync.sync_weights()
    finally:
        sync.shutdown()
    assert all(e.refit_status()[NAME[transport]] is None for s in engines for e in s)  # shutdown closed them


def test_one_sided_transports_only_for_the_reshard_path():
    trainers = [SyntheticTrainer(0, 1, hidden=HIDDEN)]
    engines = [[SyntheticEngine(0, 0, 1, hidden=HIDDEN)]]
    for transport in ("nixl", "ipc", "auto"):
        with pytest.raises(RefitError, match="ReshardWeightSynchronizer"):
            refit.CollectiveWeightSynchronizer(trainers, engines, transport=transport)
    with pytest.raises(RefitError, match="transport must be"):
        refit.ReshardWeightSynchronizer(trainers, engines, transport="ucx")
    with pytest.raises(RefitError, match="across_nodes='nixl' chooses how transport='auto' crosses nodes"):
        refit.ReshardWeightSynchronizer(trainers, engines, transport="ipc", across_nodes="nixl")


ACROSS = ["communicator",
          pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"))]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("across", ACROSS)
def test_auto_moves_pairs_inside_a_node_over_ipc_and_the_rest_across(across):
    """Two "nodes" (the endpoints say so): trainer rank 1 and shard 2 on the second. Every pair
    inside a node moves over IPC and every pair across over gloo or NIXL, at once, in one
    refit; the weights are exact, also after a shard is lost."""
    sync, trainers, engines = make(2, 3, 1, transport="auto", across_nodes=across)
    elsewhere = [trainers[1], engines[2][0]]
    for e in elsewhere:
        e.refit_device = (lambda orig: lambda: {**orig(), "node": "second-node"})(e.refit_device)
    try:
        for n in (1, 2):
            step(trainers, n)
            res = sync.sync_weights()
            assert res.verified and wrong(engines, n) == {}
        executors = {e: e._refit_state().executor for e in [*trainers, *(s[0] for s in engines)]}
        assert {ex.transport for ex in executors.values()} == {"split"}
        first, second = executors[trainers[0]], executors[trainers[1]]
        # trainer 0 reaches shards 0 and 1 over IPC and shard 2 over gloo; trainer 1 the other way round
        assert first.last["near"].bytes_sent > 0 and first.last["far"].bytes_sent > 0
        assert second.last["near"].bytes_sent > 0 and second.last["far"].bytes_sent > 0
        assert executors[engines[2][0]].last["near"].bytes_received > 0
        assert {type(ex.far).__name__ for ex in executors.values()} == \
            {"NixlExecutor" if across == "nixl" else "RoundsExecutor"}
        assert sync.trainer_workers[0].call("refit_status").result(10)["backend"] == "gloo"
        sync.engine_workers[1][0].kill()
        step(trainers, 3)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0, 2] and wrong(engines, 3, [0, 2]) == {}
    finally:
        sync.shutdown()
