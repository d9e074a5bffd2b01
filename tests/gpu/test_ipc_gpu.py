"""The IPC transport with CUDA IPC: ranks in processes of their own sharing the GPUs (one is enough).

Run on the lent GPU machine by ``scripts/gpu_ipc.sh``. The same cases and harness as the
host-memory tests (``tests/transport/test_ipc.py``), with every tensor on a GPU: engines
copy straight out of the trainer's mapped allocations, under torch's caching allocator
and with expandable segments.
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest
import torch
from helpers import nixl_jobs as J

from refit import Replicate as R
from refit import Shard as S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORLD = 4
_membership = functools.partial(J.relay_membership, transport="ipc", device="cuda")
DEADLINE_S = 30.0
_epochs = itertools.count(1)

CASES = [
    # a TP2 trainer to a TP2 engine of another split, cast on the way, and a replicated bias
    {"world": WORLD, "bucket_bytes": 1 << 20, "params": [
        {"name": "w", "shape": (64, 48), "seed": 1, "src_mesh": [0, 1], "src_pl": [S(0)], "src_dtype": "float32",
         "dst_mesh": [2, 3], "dst_pl": [S(1)], "dst_dtype": "bfloat16"},
        {"name": "b", "shape": (33,), "seed": 2, "src_mesh": [0, 1], "src_pl": [R()], "src_dtype": "bfloat16",
         "dst_mesh": [[2], [3]], "dst_pl": [R(), R()], "dst_dtype": "bfloat16"},
    ]},
    # 2-d meshes, strided blocks both ways, small buckets, traffic in both directions
    {"world": WORLD, "bucket_bytes": 96, "params": [
        {"name": "x", "shape": (12, 10, 6), "seed": 3, "src_mesh": [[0, 1], [2, 3]], "src_pl": [S(0), S(2)],
         "src_dtype": "float32", "dst_mesh": [[3, 2], [1, 0]], "dst_pl": [S(1), R()], "dst_dtype": "float32"},
        {"name": "y", "shape": (1024, 512), "seed": 4, "src_mesh": [3], "src_pl": [R()], "src_dtype": "bfloat16",
         "dst_mesh": [0, 1, 2], "dst_pl": [S(1)], "dst_dtype": "float32"},
    ]},
]


@pytest.fixture(scope="module", params=["caching", "expandable"])
def procs(request):
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if request.param == "expandable" else {}
    with J.environment(**conf):
        P = J.Procs(WORLD)
    with P:
        P.allocator = request.param
        yield P


def _resources(group):
    t = J._S["transport"]
    dev = J._S["device"]
    torch.cuda.synchronize(dev)
    return {"fds": len(os.listdir("/proc/self/fd")), "mapped": t.mapped_regions,
            "allocated": torch.cuda.memory_allocated(dev)}


def _allocator(group):
    return torch.cuda.memory._get_current_allocator().__class__.__name__, os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_cuda_ipc_refits_exactly_with_ranks_sharing_gpus(procs, case):
    """Every destination gets exactly its slice, three times, with checksums of what was
    sent equal to what arrived; then 50 more refits grow neither mappings, descriptors nor
    GPU memory."""
    members = list(range(WORLD))
    _membership(procs, case, members, next(_epochs))
    for step in range(3):
        results = procs.ok(J.refit_step, step, replace_src=False)
        J.check_refits(results)
        for r, res in results.items():
            for (peer, idx), value in res["sent"].items():
                assert results[peer]["received"][(r, idx)] == value
    before = procs.ok(_resources)
    for step in range(3, 53):
        J.check_refits(procs.ok(J.refit_step, step, replace_src=False))
    assert procs.ok(_resources) == before


@pytest.mark.timeout(240)
def test_restarted_engine_gets_fresh_handles(procs):
    """An engine whose transport is replaced (a restart: new name, new pid-less segments) is
    mapped afresh by the next membership; the trainer's mappings of the others stay."""
    case = CASES[0]
    members = list(range(WORLD))
    a = _membership(procs, case, members, next(_epochs))
    J.check_refits(procs.ok(J.refit_step, 0, replace_src=False))
    procs.ok(J.close, ranks=[3])
    b = _membership(procs, case, members, next(_epochs))
    assert b[3]["agent"] != a[3]["agent"] and b[2]["agent"] == a[2]["agent"]
    J.check_refits(procs.ok(J.refit_step, 1, replace_src=False))


@pytest.mark.timeout(2 * 3 * DEADLINE_S + 60)
def test_dead_engine_is_named_and_its_mappings_closed(procs):
    """An engine dies mid-refit: the trainer raises at once naming it, the other engine got
    its weights, and the refit over the survivors works. (Runs last in each module instance.)"""
    if procs.allocator != "expandable":
        pytest.skip("kills a rank: run once, on the second module instance")
    S_, R_ = S, R
    case = {"world": WORLD, "bucket_bytes": 1 << 20, "params": [
        {"name": "w", "shape": (256, 128), "seed": 5, "src_mesh": [0], "src_pl": [R_()], "src_dtype": "bfloat16",
         "dsts": [{"mesh": [1], "pl": [S_(0)], "dtype": "bfloat16"}, {"mesh": [2, 3], "pl": [S_(1)],
                                                                       "dtype": "bfloat16"}]},
    ]}
    _membership(procs, case, list(range(WORLD)), next(_epochs))
    J.check_refits(procs.ok(J.refit_step, 0, replace_src=False))
    res = J.refit_losing(procs, 1, [0, 1, 2, 3], 1, DEADLINE_S, replace_src=False)
    assert "exited" in J.aborted_naming(res, 0, 1, DEADLINE_S)["message"]
    for r in (2, 3):
        assert res[r][1]["error"] is None and res[r][1]["all_ok"], res[r]
    case["params"][0]["dsts"] = case["params"][0]["dsts"][1:]
    _membership(procs, case, [0, 2, 3], next(_epochs))
    J.check_refits(procs.ok(J.refit_step, 2, ranks=[0, 2, 3], replace_src=False))


@pytest.mark.timeout(180)
def test_ipc_synchronizer_in_one_process_shares_the_gpu():
    """Endpoints on threads of one process (``LocalWorker``): the IPC transport reads a peer of
    its own process directly (CUDA will not open a process's own handles). A shard dies and
    comes back."""
    import refit
    from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

    trainers = [SyntheticTrainer(r, 2, hidden=64, device="cuda:0") for r in range(2)]
    engines = [[SyntheticEngine(s, 0, 1, hidden=64, device="cuda:0")] for s in range(3)]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=60.0, transport="ipc")
    try:
        for t in trainers:
            t.set_step(1)
        assert sync.sync_weights().verified
        sync.engine_workers[1][0].kill()
        for t in trainers:
            t.set_step(2)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0, 2]
        assert all(engines[s][0].check_weights(2) == [] for s in (0, 2))
        fresh = [SyntheticEngine(1, 0, 1, hidden=64, device="cuda:0")]
        sync.replace_shard(1, fresh)
        engines[1] = fresh
        for t in trainers:
            t.set_step(3)
        res = sync.sync_weights()
        assert res.verified and res.shards == [0, 1, 2]
        assert all(engines[s][0].check_weights(3) == [] for s in range(3))
    finally:
        sync.shutdown()


@pytest.mark.timeout(300)
def test_ipc_synchronizer_with_a_process_per_rank():
    """The colocated layout frameworks run: a TP2 trainer and two TP1 engines, each rank a
    process of its own, all on GPU 0; CUDA IPC between the processes; an engine process is
    killed and the sync recovers over the other."""
    import refit
    from refit.runtime.handles import ProcessWorker
    from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

    trainers = [ProcessWorker(SyntheticTrainer, r, 2, hidden=64, device="cuda:0") for r in range(2)]
    engines = [[ProcessWorker(SyntheticEngine, s, 0, 1, hidden=64, device="cuda:0")] for s in range(2)]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=60.0, transport="ipc")
    try:
        for step in (1, 2):
            for t in trainers:
                t.call("set_step", step).result(30)
            res = sync.sync_weights()
            assert res.verified and res.shards == [0, 1]
            assert all(e[0].call("check_weights", step).result(30) == [] for e in engines)
        engines[1][0].kill()
        for t in trainers:
            t.call("set_step", 3).result(30)
        res = sync.sync_weights()
        assert res.verified and res.shards == [0]
        assert engines[0][0].call("check_weights", 3).result(30) == []
    finally:
        sync.shutdown()
        for w in [*trainers, *(e for s in engines for e in s)]:
            w.close()


FUSABLE = {"world": WORLD, "bucket_bytes": 1 << 16, "params": [
    # no casts, so the senders take the fused path too: strided destinations with runs shorter
    # than a checksum row (384 B) and longer (4 KiB), and a contiguous one
    {"name": "w", "shape": (256, 192), "seed": 6, "src_mesh": [0, 1], "src_pl": [S(0)], "src_dtype": "bfloat16",
     "dst_mesh": [2, 3], "dst_pl": [S(1)], "dst_dtype": "bfloat16"},
    {"name": "u", "shape": (96, 4096), "seed": 7, "src_mesh": [0, 1], "src_pl": [S(1)], "src_dtype": "bfloat16",
     "dst_mesh": [2, 3], "dst_pl": [S(0)], "dst_dtype": "bfloat16"},
    {"name": "v", "shape": (3, 1000), "seed": 8, "src_mesh": [2], "src_pl": [R()], "src_dtype": "float32",
     "dst_mesh": [0, 1], "dst_pl": [S(0)], "dst_dtype": "float32"},
]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [FUSABLE, CASES[1]], ids=["no casts", "casts and 2-d meshes"])
def test_fused_and_eager_checksums_are_equal_bit_for_bit(procs, case):
    """The same refits with every rank on the eager path (``REFIT_FUSED=0``): each rank sent and
    received exactly the checksums of the fused run (a fused end and an eager end agree)."""
    if procs.allocator != "caching":
        pytest.skip("one allocator is enough")
    members = list(range(WORLD))
    _membership(procs, case, members, next(_epochs))
    fused = {step: procs.ok(J.refit_step, step, replace_src=False) for step in (0, 1)}
    with J.environment(REFIT_FUSED="0"):
        eager_procs = J.Procs(WORLD)
    with eager_procs:
        _membership(eager_procs, case, members, next(_epochs))
        eager = {step: eager_procs.ok(J.refit_step, step, replace_src=False) for step in (0, 1)}
    for step in (0, 1):
        J.check_refits(fused[step])
        J.check_refits(eager[step])
        for r in members:
            assert fused[step][r]["sent"] == eager[step][r]["sent"], (step, r)
            assert fused[step][r]["received"] == eager[step][r]["received"], (step, r)
