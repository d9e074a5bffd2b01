"""End to end on 7 processes: trainers -> engine shards of other layouts; logits must match after every refit.

Ranks 0-3 train (an HF model under TP2 x FSDP2 dp2 with real DTensors, or a Megatron-core
layout tp/pp/ep), ranks 4-5 are an engine shard of TP2 and rank 6 one of TP1, each holding
fused ``qkv_proj`` / ``gate_up_proj`` / ``w13`` tensors that the refit writes into through
views. After the initial refit and after every optimizer step, every engine's logits on a
fixed prompt must equal the trainer's reference (an HF forward of the ``full_tensor()``
weights) within 1e-5 in fp32, and its greedy tokens must be the same.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.model_checks import Topology, megatron_check_worker, refit_check_worker  # noqa: E402

from refit.models.hf import hf_from_canonical  # noqa: E402
from refit.models.parallel import TrainParallel  # noqa: E402
from refit.testing.engine import EngineConfig, random_canonical_state  # noqa: E402
from refit.testing.hf import build_model, greedy, tiny_llama_config, tiny_qwen3_moe_config  # noqa: E402

PROMPT = [3, 17, 42, 5, 99, 1, 64, 23]
STEPS = 2
NEW_TOKENS = 4
TOL = 1e-5


pytestmark = pytest.mark.slow


FLEET_SIZE = 7
FLEET_KILL_ON_CLOSE = True  # nothing to flush; a graceful close waits ~10 s for gloo teardown


def engine_reports(results, topo):
    """step -> shard -> report of the shard's TP rank 0."""
    out: dict[int, dict[int, dict]] = {}
    for k in range(len(topo.engine_tps)):
        for rep in results[topo.engine_offset(k)]:
            out.setdefault(rep["step"], {})[k] = rep
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_moe-engine-ep"])
def test_hf_trainer_tp_fsdp2_refit_matches_on_every_engine(fleet, family):
    """``-engine-ep``: the TP2 engine shard holds its experts under expert parallelism (two whole
    experts per worker) while the trainer cuts every expert by TP: a reshard between the two."""
    cfg = tiny_llama_config() if family == "llama" else tiny_qwen3_moe_config()
    topo = Topology.make(engine_tps=(2, 1), dp=2, tp=2)
    results = fleet.run(refit_check_worker, topo, cfg.to_dict(), steps=STEPS, prompt=PROMPT, new_tokens=NEW_TOKENS,
                        engine_ep=family.endswith("engine-ep"), timeout_s=240)
    trainer = {r["step"]: r for r in results[0]}
    placements = trainer[0]["placements"]
    # real DTensors: FSDP2 over TP gives _StridedShard on column-parallel weights
    assert "_StridedShard" in placements["model.layers.0.self_attn.q_proj.weight"]
    assert "Shard(dim=1)" in placements["model.layers.0.self_attn.o_proj.weight"]
    assert all(trainer[s]["loss"] > 0 for s in range(1, STEPS + 1))
    for s in range(1, STEPS + 1):  # the optimizer really moved the weights
        assert (trainer[s]["logits"] - trainer[s - 1]["logits"]).abs().max().item() > 1e-4
    engines = engine_reports(results, topo)
    for step in range(STEPS + 1):
        ref = trainer[step]
        for shard, rep in engines[step].items():
            diff = (rep["logits"] - ref["logits"]).abs().max().item()
            assert diff <= TOL, f"{family} step {step} shard {shard}: max abs diff {diff}"
            assert torch.equal(rep["tokens"], ref["tokens"]), (family, step, shard)
            assert rep["version"] == step + 1
    for rank in range(topo.trainer_world, topo.world):
        assert all(r["refit"]["bytes_received"] > 0 for r in results[rank])


MEGATRON = {
    # kv heads 1 < tp 2: the query group is replicated over TP on both sides; pp 2 local layer numbers
    "llama-tp2-pp2-mqa": (dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8), TrainParallel(tp=2, pp=2),
                          "te"),
    # experts under EP 2 (GroupedMLP weight1/weight2), TP 2 over one kv head, dp 2
    "qwen3moe-tp2-dp2-ep2-legacy": (dict(num_key_value_heads=1), TrainParallel(tp=2, dp=2, ep=2), "legacy"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(MEGATRON))
def test_megatron_layout_refit_matches_transformers(fleet, case):
    overrides, par, expert_layout = MEGATRON[case]
    cfg = tiny_llama_config(**overrides) if case.startswith("llama") else tiny_qwen3_moe_config(**overrides)
    topo = Topology.make(engine_tps=(2, 1), trainer_world=par.world)
    results = fleet.run(megatron_check_worker, topo, cfg.to_dict(), par, steps=STEPS, prompt=PROMPT,
                        new_tokens=NEW_TOKENS, expert_layout=expert_layout, timeout_s=240)
    spec = EngineConfig.from_hf(cfg).spec
    model = build_model(cfg).eval()
    ids = torch.tensor([PROMPT])
    engines = engine_reports(results, topo)
    for step in range(STEPS + 1):
        model.load_state_dict(hf_from_canonical(random_canonical_state(spec, seed=step), model))
        with torch.no_grad():
            ref = model(input_ids=ids).logits
        tokens = greedy(model, ids, NEW_TOKENS)
        for shard, rep in engines[step].items():
            diff = (rep["logits"] - ref).abs().max().item()
            assert diff <= TOL, f"{case} step {step} shard {shard}: max abs diff {diff}"
            assert torch.equal(rep["tokens"], tokens), (case, step, shard)
