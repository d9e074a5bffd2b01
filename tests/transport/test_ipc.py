"""The one-node IPC transport on real processes: host shared memory here, CUDA IPC in tests/gpu.

The same plans and cases as the NIXL tests, moved by the receivers pulling from their
sources' memory: every destination gets exactly its slice, no collective runs after the
handshake, a dead or frozen peer is named within the deadline, and nothing grows over
many refits.
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest
from helpers import nixl_jobs as J
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit import Replicate, Shard
from refit.testing.launch import scaled

WORLD = 4
_membership = functools.partial(J.relay_membership, transport="ipc")
_refit = J.refit_ranks
DEADLINE_S = scaled(30.0)  # far above how long noticing a dead peer takes on a busy machine
_epochs = itertools.count(1)


@pytest.fixture(scope="module")
def procs():
    with J.Procs(WORLD) as P:
        yield P


@pytest.mark.timeout(120)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(J.transfer_cases(WORLD))
def test_ipc_reshard_matches_expected(procs, case):
    """Every destination gets exactly its slice, twice in a row (in-place and replaced
    sources), after one handshake; what a source sent is what its receiver got."""
    procs.ok(J.setup, case, next(_epochs), exchange="group", transport="ipc")
    for step in (0, 1):
        results = procs.ok(J.refit_step, step, replace_src=bool(step))
        J.check_refits(results)
        for r, res in results.items():
            for (peer, idx), value in res["sent"].items():
                assert results[peer]["received"][(r, idx)] == value


def _engines_case(src_mesh, engines, shape=(16, 12), twin=False):
    """A trainer layout and one engine per entry of ``engines``; ``twin`` adds a second
    param like ``w``: replicas take contiguous windows, so the twins come from different ones."""
    S, R = Shard, Replicate
    twins = [{"name": "w_twin", "shape": shape, "seed": 14, "src_mesh": src_mesh, "src_pl": [R()],
              "src_dtype": "float32", "dsts": [{"mesh": e, "pl": [S(0)], "dtype": "float32"} for e in engines]}]
    return {"bucket_bytes": 96, "params": (twins if twin else []) + [
        {"name": "w", "shape": shape, "seed": 11, "src_mesh": src_mesh, "src_pl": [R()], "src_dtype": "float32",
         "dsts": [{"mesh": e, "pl": [S(0)], "dtype": "bfloat16" if i % 2 else "float32"}
                  for i, e in enumerate(engines)]},
        {"name": "v", "shape": (40,), "seed": 12, "src_mesh": src_mesh, "src_pl": [R()], "src_dtype": "float32",
         "dsts": [{"mesh": e, "pl": [R()], "dtype": "float32"} for e in engines]},
    ]}


def _resources(group):
    t = J._S["transport"]
    from refit.transport.ipc import pid_namespace

    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"refit-ipc-{pid_namespace()}-{os.getpid()}-")]
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "mapped": t.mapped_regions, "segments": len(mine)}


@pytest.mark.timeout(120)
def test_fifty_refits_grow_nothing(procs):
    """Handles are exchanged once: over 50 refits no rank opens a file, a mapping or a segment, and
    threads do not grow with refits.

    One thread may appear once: torch starts pool threads lazily, and on a busy machine one
    came up after the warm-up (6 -> 7 on rank 0). A leak grows by one a refit, 45 here.
    """
    case = _engines_case([0], [[1], [2, 3]])
    _membership(procs, case, list(range(WORLD)), next(_epochs))
    for step in range(5):
        _refit(procs, step, list(range(WORLD)))
    before = procs.ok(_resources)
    for step in range(5, 51):
        _refit(procs, step, list(range(WORLD)))
    after = procs.ok(_resources)
    for r in before:
        threads = after[r].pop("threads") - before[r].pop("threads")
        assert threads <= 1, (r, threads)
    assert after == before
    assert before[1]["mapped"] == 1 and before[0]["mapped"] == 0  # an engine maps its source's segment once


def _stale_roster(group, what):
    t = J._S["transport"]
    e = t.local_roster_entry()
    try:
        if what == "other node":
            import dataclasses

            peer = {r: dataclasses.replace(v, node="elsewhere/boot") for r, v in J._S["roster"].items()
                    if r != group.rank}
            t.update_membership({group.rank: e, **peer}, t.epoch + 1)
        elif what == "lacks peer":
            t.update_membership({group.rank: e}, t.epoch + 1)
        elif what == "old epoch":
            t.update_membership(J._S["roster"], t.epoch)
    except Exception as err:
        return type(err).__name__, str(err)
    return None


def _keep_roster(group, roster):
    J._S["roster"] = roster
    return True


@pytest.mark.timeout(60)
def test_handshake_errors_name_the_ranks(procs):
    """A peer on another node, a roster without a peer of the plan and a reused epoch are
    refused before any byte moves, naming the ranks; the next good roster works."""
    case = _engines_case([0], [[1]])
    infos = _membership(procs, case, [0, 1], next(_epochs))
    procs.ok(_keep_roster, {r: i["entry"] for r, i in infos.items()}, ranks=[0, 1])
    got = procs.ok(_stale_roster, "other node", ranks=[1])[1]
    assert got[0] == "IpcHandshakeError" and "rank(s) 0 (elsewhere/boot) run on another node" in got[1], got
    got = procs.ok(_stale_roster, "lacks peer", ranks=[0])[0]
    assert got[0] == "IpcHandshakeError" and "lacks rank(s) [1]" in got[1], got
    got = procs.ok(_stale_roster, "old epoch", ranks=[0])[0]
    assert got[0] == "IpcHandshakeError" and "needs a new epoch" in got[1], got
    _membership(procs, case, [0, 1], next(_epochs))
    _refit(procs, 0, [0, 1])


@pytest.mark.timeout(120)
def test_frozen_peer_is_named_at_the_deadline(procs):
    """A receiver that stays alive but never reads: its source raises at its deadline naming
    it; the other receiver got its weights; the next refit over everyone works again."""
    case = _engines_case([0], [[1], [2]])
    members = [0, 1, 2]
    _membership(procs, case, members, next(_epochs))
    _refit(procs, 0, members)
    res = procs.call(J.refit_step, 1, ranks=members, timeout_s=60,
                     per_rank={0: {"timeout_s": 3.0}, 1: {"timeout_s": 30.0}, 2: {"fault": "freeze", "freeze_s": 3.5}})
    src = res[0][1]
    assert src["error"] == "RefitAborted" and "no 'done' from receiver rank(s) 2" in src["message"], src
    assert 3.0 <= src["elapsed"] < 30.0
    assert res[1][1]["error"] is None and res[1][1]["all_ok"]
    _membership(procs, case, members, next(_epochs))
    _refit(procs, 2, members)


def _abort(group):
    J._S["transport"].abort()
    return True


@pytest.mark.timeout(120)
def test_a_source_that_gave_up_is_mapped_again_under_the_same_entry(procs):
    """A source aborts its refit (it lives on, with the same exports): its receiver stops
    waiting at once and closes its mappings; the next membership, with the very same
    entries, maps it afresh and the refit works."""
    case = _engines_case([0], [[1]])
    infos = _membership(procs, case, [0, 1], next(_epochs))
    _refit(procs, 0, [0, 1])
    procs.ok(_abort, ranks=[0])
    res = procs.ok(J.refit_step, 1, ranks=[1], timeout_s=30.0)[1]
    assert res["error"] == "RefitAborted" and "aborted its refit" in res["message"], res
    assert res["elapsed"] < 30.0
    assert procs.ok(_resources, ranks=[1])[1]["mapped"] == 0
    roster = {r: i["entry"] for r, i in infos.items()}
    assert procs.ok(J.install, roster, next(_epochs), ranks=[0, 1])
    _refit(procs, 2, [0, 1])
    assert procs.ok(_resources, ranks=[1])[1]["mapped"] == 1


@pytest.mark.timeout(2 * 3 * DEADLINE_S + 60)
def test_dead_receiver_then_dead_source(procs):
    """A receiver and then a source die mid-refit: the survivors raise at once naming the
    dead rank (not at the deadline), its mappings are closed, and the refit over the new
    membership verifies. (Runs last: it kills two of the module's processes.)"""
    P = procs
    e = next(_epochs)
    case = _engines_case([0], [[1], [2], [3]])
    _membership(P, case, [0, 1, 2, 3], e)
    _refit(P, 0, [0, 1, 2, 3])
    res = J.refit_losing(P, 1, [0, 1, 2, 3], 2, DEADLINE_S)
    assert "exited" in J.aborted_naming(res, 0, 2, DEADLINE_S)["message"]
    for r in (1, 3):
        assert res[r][1]["error"] is None and res[r][1]["all_ok"], res[r]
    _membership(P, case, [0, 1, 3], e + 1)
    _refit(P, 2, [0, 1, 3])
    # two trainer replicas: engine 3 reads from both; the second dies mid-refit
    case = _engines_case([0, 1], [[3]], shape=(24, 16), twin=True)
    infos = _membership(P, case, [0, 1, 3], e + 2)
    assert infos[3]["peers"] == [0, 1]
    _refit(P, 3, [0, 1, 3])
    assert P.ok(_resources, ranks=[3])[3]["mapped"] == 2
    res = J.refit_losing(P, 4, [0, 1, 3], 1, DEADLINE_S)
    J.aborted_naming(res, 3, 1, DEADLINE_S)
    assert P.ok(_resources, ranks=[3])[3]["mapped"] == 1  # the dead source's segment is unmapped
    assert res[0][1]["error"] is None
    _membership(P, _engines_case([0], [[3]], shape=(24, 16), twin=True), [0, 3], e + 3)
    _refit(P, 5, [0, 3])


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["float32", "bfloat16"]), st.sampled_from(["float32", "bfloat16"]), st.integers(0, 1),
       st.sampled_from([64, 1 << 20]))
def test_gpu_path_block_checksums_agree_end_to_end_and_catch_a_flip(src_dtype, dst_dtype, dim, bucket_bytes):
    """The checksums the GPU path takes (block by block where the tensors lie, strided or cast
    blocks through scratch) run here on host tensors: what a source sums equals what its
    receiver sums after a correct transfer, bucket by bucket, and a flipped bit is caught."""
    import numpy as np
    import torch
    from helpers.layouts import full_tensor, local_slice, rosters_for

    from refit.plan import build_rank_plan, merge_rosters
    from refit.transport.buckets import ChecksumLedger, pack_bucket, unpack_bucket
    from refit.transport.ipc import IpcChannel, IpcExecutor

    S = Shard
    params = [("w", (12, 10), (np.array([0, 1]), [S(0)], src_dtype), [(np.array([2, 3]), [S(dim)], dst_dtype)]),
              ("b", (7,), (np.array([0]), [Replicate()], src_dtype), [(np.array([2, 3]), [Replicate()], dst_dtype)])]
    index = merge_rosters(rosters_for(params, 4), 4)
    plans = {r: build_rank_plan(index, r, bucket_bytes=bucket_bytes) for r in range(4)}
    full = {n: full_tensor(shape, 3) for n, shape, *_ in params}
    src = {r: {n: v for n, shape, (m, pl, dt), _ in params
               if (v := local_slice(full[n].to(getattr(torch, dt)), m, pl, r)) is not None} for r in range(4)}
    dst = {r: {n: torch.zeros_like(v) for n, shape, _, dsts in params for m, pl, dt in dsts
               if (v := local_slice(full[n].to(getattr(torch, dt)), m, pl, r)) is not None} for r in range(4)}
    with IpcChannel(0, device="cpu") as channel:
        ex = IpcExecutor(plans[0], channel)
        ex.device = torch.device("cpu")

        def sums(r, side):  # what rank r's end of the refit reports, as the GPU path takes it
            ledger = ChecksumLedger()
            for b in plans[r].sends if side == "src" else plans[r].recvs:
                ex._sum(ledger, b, (src if side == "src" else dst)[r], side)
            return ledger.settle()[0 if side == "src" else 1]

        for r in (0, 1):  # a correct transfer
            for b in plans[r].sends:
                buf = torch.empty(b.nbytes, dtype=torch.uint8)
                unpack_bucket(next(x for x in plans[b.peer].recvs if x.peer == r and x.index == b.index),
                              pack_bucket(b, src[r], buf), dst[b.peer])
        received = {r: sums(r, "dst") for r in (2, 3)}
        pairs = 0
        for r in (0, 1):
            for (peer, idx), value in sums(r, "src").items():
                assert received[peer][(r, idx)] == value
                pairs += 1
        assert pairs == sum(len(plans[r].sends) for r in (0, 1)) > 0
        b = plans[2].recvs[0]
        dst[2][b.ops[0].name].reshape(-1)[:1].view(torch.uint8)[0] ^= 1
        assert sums(2, "dst")[(b.peer, b.index)] != received[2][(b.peer, b.index)]



def test_a_watchdog_deadline_alone_ends_a_wait_naming_the_silent_source():
    """Endpoints give the transport no deadline of its own (the refit watchdog hands it one):
    a receiver whose source never publishes raises RefitAborted at that deadline, naming it."""
    import time

    import numpy as np
    import torch
    from helpers.layouts import rosters_for

    from refit.errors import RefitAborted
    from refit.plan import build_rank_plan, merge_rosters
    from refit.transport.ipc import IpcChannel, IpcExecutor

    params = [("w", (8, 4), (np.array([0]), [Replicate()], "float32"), [(np.array([1]), [Replicate()], "float32")])]
    index = merge_rosters(rosters_for(params, 2), 2)
    plans = [build_rank_plan(index, r) for r in range(2)]
    tensors = [({"w": torch.ones(8, 4)}, {}), ({}, {"w": torch.zeros(8, 4)})]
    with IpcChannel(0, timeout_s=None) as source, IpcChannel(1, timeout_s=None) as receiver:
        executors = [IpcExecutor(plan, ch) for ch, plan in zip((source, receiver), plans)]
        for ex, (src, dst) in zip(executors, tensors):
            ex.prepare(src, dst)
        roster = {0: source.local_roster_entry(), 1: receiver.local_roster_entry()}
        for ch in (source, receiver):
            ch.update_membership(roster, 1)
        receiver.set_deadline(time.monotonic() + 0.3)
        with pytest.raises(RefitAborted, match=r"its deadline passed .*no data from source rank\(s\) 0"):
            executors[1].run()
