"""Model shapes, config.json reading, layout strings, and the index built from them."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers.tiny_models import tiny_gqa, tiny_moe

from refit import LayoutError, Replicate, Shard
from refit.models import (
    MODELS,
    build_index,
    build_rosters,
    get_model,
    load_hf_config,
    parse_engine,
    parse_train,
)
from refit.models.parallel import LayoutBuilder, node_map
from refit.plan import merge_rosters


@pytest.mark.parametrize("name, params, tensors", [
    ("llama3-8b", 8_030_261_248, 291),
    ("llama3-70b", 70_553_706_496, 723),
    ("qwen3-235b-a22b", 235_093_634_560, 36_945),
    ("deepseek-v3", 684_489_845_504, 46_183),  # 671B + the 14B multi-token-prediction layer
    ("kimi-k2", 1_026_408_232_448, 69_975),
])
def test_builtin_models_have_their_published_sizes(name, params, tensors):
    m = MODELS[name]
    assert m.num_params == params
    assert m.num_tensors == tensors


def test_deepseek_and_kimi_tensors():
    k = get_model("Kimi-K2")
    names = {p.name: p for p in k.params()}
    assert names["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)  # first layer dense
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in names
    assert names["model.layers.1.mlp.experts.383.down_proj.weight"].shape == (7168, 2048)
    assert names["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2048, 7168)
    assert names["model.layers.60.self_attn.q_b_proj.weight"].shape == (64 * 192, 1536)
    assert names["model.layers.60.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert names["model.layers.60.self_attn.kv_b_proj.weight"].shape == (64 * 256, 512)
    assert names["model.layers.60.mlp.gate.e_score_correction_bias"].shape == (384,)
    assert names["lm_head.weight"].shape == (163840, 7168)
    d = {p.name: p for p in get_model("deepseek-v3").params()}
    assert d["model.layers.61.eh_proj.weight"].shape == (7168, 14336)  # the MTP layer
    assert d["model.layers.61.mlp.experts.255.gate_proj.weight"].kind == "ecol"
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" not in d  # first three layers dense
    q = {p.name: p for p in get_model("qwen3-235b-a22b").params()}
    assert q["model.layers.93.self_attn.k_proj.weight"].shape == (512, 4096)
    assert q["model.layers.93.self_attn.k_proj.weight"].heads == 4
    assert q["model.layers.0.self_attn.q_norm.weight"].shape == (128,)


KIMI_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
    "topk_method": "noaux_tc", "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
}
QWEN_CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("cfg, builtin", [(KIMI_CONFIG, "kimi-k2"), (QWEN_CONFIG, "qwen3-235b-a22b"),
                                          (LLAMA_CONFIG, "llama3-70b")])
def test_config_json_matches_builtin(cfg, builtin, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    for spec in (load_hf_config(path), get_model(str(tmp_path))):
        assert [(p.name, p.shape, p.kind) for p in spec.params()] == \
               [(p.name, p.shape, p.kind) for p in MODELS[builtin].params()]


def test_config_json_text_config_and_missing_keys():
    wrapped = {"model_type": "kimi_k25", "text_config": KIMI_CONFIG}
    assert load_hf_config(wrapped).num_params == MODELS["kimi-k2"].num_params
    with pytest.raises(Exception, match="vocab_size"):
        load_hf_config({k: v for k, v in LLAMA_CONFIG.items() if k != "vocab_size"})
    with pytest.raises(Exception, match="unknown model"):
        get_model("no-such-model")


def test_layout_strings():
    t = parse_train("tp=8,pp=8,ep=32,etp=1", world=256)
    assert (t.tp, t.pp, t.dp, t.cp, t.ep, t.expert_tp, t.edp) == (8, 8, 4, 1, 32, 1, 1)
    assert parse_train("tp=4,pp=2,ep=4").expert_tp == 4  # Megatron's default: etp = tp
    e = parse_engine("tp=8,ep=128", world=128)
    assert (e.tp, e.dp, e.ep, e.world) == (8, 16, 128, 128)
    for bad, msg in [("tp=8,xx=2", "unknown key 'xx'"), ("tp=eight", "must be an integer"), ("tp8", "key=value"),
                     ("tp=0", "at least 1")]:
        with pytest.raises(LayoutError, match=msg):
            parse_train(bad)
    with pytest.raises(LayoutError, match="not a multiple"):
        parse_train("tp=8,pp=3", world=256)
    with pytest.raises(LayoutError, match="spans 64 ranks, not 256"):
        parse_train("tp=8,pp=8,dp=1", world=256)
    with pytest.raises(LayoutError, match="must divide the 384 experts"):
        build_index(MODELS["kimi-k2"], parse_train("tp=8,pp=8,ep=256,etp=1", world=2048), parse_engine("tp=8"))
    with pytest.raises(LayoutError, match="key/value heads"):
        build_index(MODELS["llama3-8b"], parse_train("tp=1"), parse_engine("tp=3"))


@pytest.mark.parametrize("model, train, engine", [
    (tiny_moe(), "tp=2,pp=2,ep=2,etp=1", "tp=2,dp=2,ep=4"),
    (tiny_moe(), "tp=2,pp=1,dp=2,ep=4,etp=1", "tp=4"),
    (tiny_moe(), "tp=2,pp=2,dp=2,ep=2", "tp=1,dp=2,ep=2"),
    (tiny_gqa(), "tp=2,pp=2,cp=2", "tp=4,dp=2"),  # tp > kv heads on the engine
])
def test_index_equals_merged_rosters(model, train, engine):
    t, e = parse_train(train), parse_engine(engine)
    direct = build_index(model, t, e)
    merged = merge_rosters(build_rosters(model, t, e), t.world + e.world)
    assert direct.world_size == merged.world_size
    assert direct.specs == merged.specs
    assert direct.by_rank == merged.by_rank
    assert direct.digest == merged.digest


def test_megatron_rank_order_and_expert_placement():
    m = tiny_moe(num_layers=4, num_mtp_layers=0)
    t = parse_train("tp=2,pp=2,dp=2,ep=2,etp=1")  # stage = 4 ranks: etp=1, ep=2, edp=2
    b = LayoutBuilder(m, t, parse_engine("tp=2,dp=2,ep=4"))
    ps = {p.name: p for p in m.params()}
    # dense: stage ranks as a [dp, tp] mesh, tp fastest
    q = b.src(ps["model.layers.0.self_attn.q_b_proj.weight"])
    assert q.mesh_ranks == (0, 1, 2, 3) and q.mesh_shape == (2, 2) and q.placements == (Replicate(), Shard(0))
    o = b.src(ps["model.layers.3.self_attn.o_proj.weight"])  # layer 3 sits on stage 1
    assert o.mesh_ranks == (4, 5, 6, 7) and o.placements == (Replicate(), Shard(1))
    assert b.src(ps["model.embed_tokens.weight"]).mesh_ranks == (0, 1, 2, 3)
    assert b.src(ps["lm_head.weight"]).mesh_ranks == (4, 5, 6, 7)
    # expert 5 of 8 on ep=2 -> EP rank 1: ranks 1 and 3 of the stage (edp replicas)
    x = b.src(ps["model.layers.3.mlp.experts.5.down_proj.weight"])
    assert x.mesh_ranks == (5, 7) and x.placements == (Replicate(),)
    # engine: ep=4 over 4 ranks (offset 8): expert 5 -> rank 8 + 5 // 2
    (d,) = b.dsts(ps["model.layers.3.mlp.experts.5.down_proj.weight"])
    assert d.mesh_ranks == (10,)
    dense = b.dsts(ps["model.layers.3.self_attn.o_proj.weight"])
    assert [lay.mesh_ranks for lay in dense] == [(8, 9), (10, 11)]


def test_kv_heads_shared_by_ranks_when_tp_exceeds_them():
    m = tiny_gqa()  # 2 kv heads of dim 2
    b = LayoutBuilder(m, parse_train("tp=2"), parse_engine("tp=4"))
    k = next(p for p in m.params() if p.name.endswith("layers.0.self_attn.k_proj.weight"))
    (lay,) = b.dsts(k)
    assert lay.mesh_shape == (2, 2) and lay.placements == (Shard(0), Replicate())
    regions = [lay.region(k.shape, r) for r in lay.mesh_ranks]
    assert regions[0] == regions[1] != regions[2] == regions[3]  # ranks 0,1 share head 0; 2,3 head 1
    assert regions[0][0] == ((0, 2),)


def test_uneven_pipeline_split_and_nodes():
    t = parse_train("pp=8")
    sizes = [len(r) for r in t.stage_layers(61)]
    assert sizes == [8, 8, 8, 8, 8, 7, 7, 7]
    assert node_map(12, 12, 20, 8) == [0] * 8 + [1] * 4 + [2] * 8  # engine starts on a fresh node


def test_dtypes_and_engine_offset():
    m = tiny_gqa()
    ix = build_index(m, parse_train("tp=2"), parse_engine("tp=2"), engine_dtype="float32", engine_offset=4)
    spec = ix.specs["model.embed_tokens.weight"]
    assert spec.src.dtype == "bfloat16" and spec.dsts[0].dtype == "float32"
    assert spec.dsts[0].mesh_ranks == (4, 5) and ix.world_size == 6
    assert 2 not in ix.by_rank and 3 not in ix.by_rank


def test_layers_override_keeps_shapes():
    m = dataclasses.replace(MODELS["kimi-k2"], num_layers=3)
    # embedding, norm, head; a dense layer (9 attention + 3 MLP); two MoE layers (9 attention,
    # router weight and bias, 384 x 3 experts, 3 shared-expert tensors)
    assert m.num_tensors == 3 + 12 + 2 * (9 + 2 + 384 * 3 + 3)
