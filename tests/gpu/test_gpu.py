"""The NCCL communicator and the streamed transport on two GPUs (skipped without them).

Run on the lent 2-GPU machine by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import comm_jobs

from refit import Replicate as R
from refit import Shard as S
from refit.comm.group import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

CASES = [  # both ranks send and receive (NCCL deadlocks here unless sends and receives are grouped)
    {"shape": [64, 48], "seed": 1, "src_mesh": [0, 1], "src_pl": [S(0)], "dst_mesh": [1, 0], "dst_pl": [S(1)],
     "src_dtype": "float32", "dst_dtype": "bfloat16"},
    {"shape": [33, 7], "seed": 2, "src_mesh": [0], "src_pl": [R()], "dst_mesh": [0, 1], "dst_pl": [R()],
     "src_dtype": "bfloat16", "dst_dtype": "float32"},
    {"shape": [1024, 512], "seed": 3, "src_mesh": [0, 1], "src_pl": [S(1)], "dst_mesh": [0, 1], "dst_pl": [S(0)],
     "src_dtype": "float32", "dst_dtype": "float32"},
    {"shape": [9], "seed": 4, "src_mesh": [1], "src_pl": [R()], "dst_mesh": [0], "dst_pl": [R()],
     "src_dtype": "float64", "dst_dtype": "float64"},
]


@pytest.fixture(scope="module")
def fleet():
    from refit.testing.launch import DeviceFleet

    with DeviceFleet(2, init_timeout_s=60) as f:
        yield f


def test_nccl_roundtrip(fleet):
    out = fleet.run(comm_jobs.nccl_roundtrip, timeout_s=120)
    assert [o["broadcast"] for o in out] == [1000.0, 1000.0]
    assert [o["ring"] for o in out] == [11.0, 10.0]
    assert out[1]["p2p"] == [3.0] * 5


@pytest.mark.parametrize("budget", [4 << 10, 1 << 20])
def test_streamed_plan_on_nccl(fleet, budget):
    """Casts, traffic both ways, local copies, strided destinations; arena small enough to wrap.
    50 refits with fresh data each time: exact every time, staging and allocations flat."""
    cfg = {"device": "cuda", "bucket_bytes": 256, "iters": 50, "strided_dst": ["f", "a"],
           "staging_budget_bytes": budget, "group_bytes": 2 << 10}
    out = fleet.run(comm_jobs.reshard_model, cfg, timeout_s=300)
    for o in out:
        assert all(o["ok"]), (o["rank"], o["ok"])
        assert all(s["groups"] > 0 for s in o["stats"]), "the NCCL path is the streamed one"
        assert all(s["peak_staging"] <= s["capacity"] <= budget for s in o["stats"])
        allocs = [s["alloc"] for s in o["stats"]]
        assert allocs[-1] == allocs[1], f"GPU memory grew over refits: {allocs[:3]} .. {allocs[-3:]}"


def test_sources_made_on_the_pack_stream_during_the_refit_land_exact_over_nccl(fleet):
    """Source tensors made window by window on the pack stream (as FP8 copies are) hold NaN until
    made: every element lands exact, with checksums summed from them on the unpack stream."""
    cfg = {"device": "cuda", "bucket_bytes": 256, "iters": 3, "strided_dst": ["f"], "staging_budget_bytes": 8 << 10,
           "group_bytes": 2 << 10, "produced": ["a", "d", "e", "f", "g"], "verify": True}
    out = fleet.run(comm_jobs.reshard_model, cfg, timeout_s=300)
    for o in out:
        assert o["ok"] == [True, True, True], o["rank"]
        assert all(p["left"] == [] for p in o["productions"])
    sent = {(o["rank"], p, i): v for o in out for (p, i), v in o["stats"][-1]["sums_sent"].items()}
    got = {(p, o["rank"], i): v for o in out for (p, i), v in o["stats"][-1]["sums_received"].items()}
    assert sent and sent == got


def test_xferdtensor_nccl_matches_golden(fleet):
    out = fleet.run(comm_jobs.xfer_cuda, CASES, timeout_s=120)
    for r, res in enumerate(out):
        for case, got in zip(CASES, res):
            want = True if r in case["dst_mesh"] else None
            assert got == {"xferdtensor": want, "xferdtensor_golden": want}, (r, case)


def test_torch_default_group_nccl(fleet):
    out = fleet.run(comm_jobs.torch_group_nccl, free_port(), CASES, timeout_s=180)
    for r, res in enumerate(out):
        for case, got in zip(CASES, res):
            assert got["ok"] is (True if r in case["dst_mesh"] else None), (r, case, got)


def test_init_deadline_when_a_peer_never_arrives(fleet):
    out = fleet.run_per_rank([(comm_jobs.init_alone, (free_port(), 5.0)), (comm_jobs.idle, ())], timeout_s=120)
    res = out[0]
    assert res["type"] == "TransportError", res
    assert "rank(s) [1] never arrived" in res["error"], res
    assert 4.5 <= res["elapsed"] < 15.0, res


def test_abort_releases_a_blocked_recv(fleet):
    try:
        out = fleet.run(comm_jobs.blocked_recv_released_by_abort, timeout_s=60)
        res = out[1]
        assert res["error"] in ("NcclAborted", "GroupAborted"), res
        assert res["release_s"] < 1.0, res
        assert res["kernel_ended_after_abort"], "ncclCommAbort ended the blocked recv kernel"
        print(f"\nabort released a blocked NCCL recv in {res['release_s'] * 1e3:.1f} ms "
              f"(abort() returned after {res['abort_call_s'] * 1e3:.1f} ms)")
    finally:
        fleet.rebuild()


def test_abort_of_parent_releases_a_rank_blocked_on_a_split_child(fleet):
    try:
        out = fleet.run(comm_jobs.split_child_abort, timeout_s=60)
        res = out[1]
        assert res["child_world"] == 2
        assert res["error"] in ("NcclAborted", "GroupAborted") and res["child_aborted"], res
        assert res["release_s"] < 1.0, res
    finally:
        fleet.rebuild()


def test_vllm_peer_protocol(fleet):
    fleet.rebuild(peer="vllm")  # warm-up by all-reduce, pickled id published for vLLM ranks
    try:
        out = fleet.run(comm_jobs.nccl_roundtrip, timeout_s=120)
        assert [o["ring"] for o in out] == [11.0, 10.0]
        assert fleet.run(comm_jobs.vllm_key, timeout_s=30)[0] == {"same": True}
    finally:
        fleet.rebuild(peer="nemo")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls", ["ReshardWeightSynchronizer", "CollectiveWeightSynchronizer"])
def test_synchronizer_picks_nccl_and_refits_exactly(cls):
    """Trainer on GPU 0, one engine on GPU 1, driven in-process: the backend follows the tensors."""
    import refit
    from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

    trainers = [SyntheticTrainer(0, 1, hidden=64, device="cuda:0")]
    engines = [[SyntheticEngine(0, 0, 1, hidden=64, device="cuda:1")]]
    sync = getattr(refit, cls)(trainers, engines, refit_timeout_s=60.0)
    try:
        for step in (1, 2, 3):
            trainers[0].set_step(step)
            result = sync.sync_weights()
            assert result.verified and result.shards == [0]
            assert engines[0][0].check_weights(step) == []
        assert engines[0][0].refit_status()["backend"] == "nccl"
    finally:
        sync.shutdown()


@pytest.mark.timeout(120)
def test_two_ranks_on_one_gpu_are_refused_naming_them():
    import refit
    from refit.errors import PlanError
    from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

    trainers = [SyntheticTrainer(0, 1, hidden=64, device="cuda:0")]
    engines = [[SyntheticEngine(s, 0, 1, hidden=64, device="cuda:1")] for s in range(2)]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0)
    try:
        with pytest.raises(PlanError, match="shard 0 worker 0 .* and shard 1 worker 0 .* are both on GPU 1"):
            sync.init_communicator()
    finally:
        sync.shutdown()


@pytest.mark.timeout(180)
def test_nixl_synchronizer_on_gpus_loses_a_shard_and_readmits_it():
    """NIXL lets ranks share a GPU (CUDA IPC between processes; here threads): trainer on GPU 0,
    three one-worker shards on GPU 1. A rebuild re-registers the trainer's buffers, so every
    engine must reload a peer agent it already knows with new metadata (NIXL refuses to load
    an agent twice: it has to be dropped first)."""
    import refit
    from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer
    from refit.transport.nixl import nixl_available

    if not nixl_available():
        pytest.skip("NIXL is not installed")
    trainers = [SyntheticTrainer(0, 1, hidden=64, device="cuda:0")]
    engines = [[SyntheticEngine(s, 0, 1, hidden=64, device="cuda:1")] for s in range(3)]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=60.0, transport="nixl")
    try:
        trainers[0].set_step(1)
        assert sync.sync_weights().verified
        sync.engine_workers[1][0].kill()
        trainers[0].set_step(2)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0, 2]
        assert all(engines[s][0].check_weights(2) == [] for s in (0, 2))
        fresh = [SyntheticEngine(1, 0, 1, hidden=64, device="cuda:1")]
        sync.replace_shard(1, fresh)
        engines[1] = fresh
        trainers[0].set_step(3)
        res = sync.sync_weights()
        assert res.verified and res.rebuilt and res.shards == [0, 1, 2]
        assert all(engines[s][0].check_weights(3) == [] for s in range(3))
    finally:
        sync.shutdown()
