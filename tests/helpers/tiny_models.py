"""Tiny model specs with every sharding kind of the real ones (MLA and MoE, GQA), for cheap
whole-model planning tests."""

from __future__ import annotations

from refit.models.specs import ModelSpec


def tiny_moe(**kw) -> ModelSpec:
    base = dict(name="tiny-mla-moe", vocab_size=24, hidden_size=8, num_layers=3, num_heads=4, num_kv_heads=4,
                head_dim=2, intermediate_size=12, num_experts=8, moe_intermediate_size=4, num_shared_experts=1,
                first_dense_layers=1, router_bias=True, q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=2,
                qk_rope_head_dim=2, v_head_dim=2, num_mtp_layers=1)
    base.update(kw)
    return ModelSpec(**base)


def tiny_gqa(**kw) -> ModelSpec:
    base = dict(name="tiny-gqa", vocab_size=20, hidden_size=8, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=2, intermediate_size=12, qk_norm=True)
    base.update(kw)
    return ModelSpec(**base)


MODELS_AND_LAYOUTS = [
    (tiny_moe(), "tp=2,pp=2,ep=2,etp=1", "tp=2,dp=2,ep=4"),
    (tiny_moe(), "tp=2,pp=1,dp=2,ep=4,etp=1", "tp=4"),
    (tiny_moe(), "tp=2,pp=2,dp=2,ep=2", "tp=1,dp=2,ep=2"),
    (tiny_moe(num_layers=5), "tp=2,pp=2,dp=2,ep=2,etp=1", "tp=4,dp=2,ep=8"),
    (tiny_gqa(), "tp=2,pp=2,cp=2", "tp=4,dp=2"),  # tp > kv heads on the engine
]
