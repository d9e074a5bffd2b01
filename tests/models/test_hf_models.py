"""Engine shards and HF adapters in one process: the fused engine layout against transformers' own forward.

Tensor-parallel engine shards run on threads of this process with a small in-process TP
group; their logits must equal a Hugging Face model's on the same weights, for TP sizes that
divide and that exceed the key/value heads, with plain and grouped q/k/v views.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from refit.errors import LayoutError  # noqa: E402
from refit.layout import Replicate, Shard, StridedShard, mesh_coords_of, shard_slices  # noqa: E402
from refit.models.hf import (  # noqa: E402
    canonical_from_hf,
    dtensor_entries,
    hf_from_canonical,
    lift_placements,
    narrow_entry,
    select_entry,
)
from refit.testing.engine import (  # noqa: E402
    EngineConfig,
    EngineShard,
    ThreadTPComm,
    on_tp_threads,
    random_canonical_state,
)
from refit.testing.hf import build_model, greedy, tiny_llama_config, tiny_qwen3_moe_config  # noqa: E402

PROMPT = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 23]])


def run_shard(econf, tp, state, *, qkv="plain", new_tokens=3, **engine_kw):
    """Build a TP shard on threads, load ``state`` through its views, run forward + greedy on every rank."""
    comms = ThreadTPComm.group(tp)
    engines = [EngineShard(econf, tp_size=tp, tp_rank=r, comm=comms[r], qkv=qkv, **engine_kw) for r in range(tp)]
    for e in engines:
        e.load_canonical(state)
    out = on_tp_threads(engines, lambda e: (e.forward(PROMPT), e.generate(PROMPT, new_tokens)))
    return engines, out


CONFIGS = {
    "llama-kv2": lambda: tiny_llama_config(),
    "llama-kv1-tied": lambda: tiny_llama_config(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3moe-kv2": lambda: tiny_qwen3_moe_config(),
    "qwen3moe-kv1": lambda: tiny_qwen3_moe_config(num_key_value_heads=1, decoder_sparse_step=2),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_case(request):
    cfg = CONFIGS[request.param]()
    model = build_model(cfg, seed=3).eval()
    state = canonical_from_hf(dict(model.state_dict()), tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
    return cfg, model, state, logits, greedy(model, PROMPT, 3)


@pytest.mark.parametrize("qkv", ["plain", "grouped"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_forward_matches_transformers(model_case, tp, qkv):
    cfg, _, state, ref_logits, ref_tokens = model_case
    econf = EngineConfig.from_hf(cfg)
    _, out = run_shard(econf, tp, state, qkv=qkv)
    for logits, tokens in out:
        assert (logits - ref_logits).abs().max().item() <= 1e-5
        assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_expert_parallel_forward_matches_transformers(model_case, tp):
    """Experts split whole across the shard's workers: each expert has exactly one owner, at
    full width, and the shard's logits and tokens are transformers' own."""
    cfg, _, state, ref_logits, ref_tokens = model_case
    econf = EngineConfig.from_hf(cfg)
    if not econf.spec.num_experts:
        with pytest.raises(LayoutError, match="expert_parallel needs routed experts"):
            EngineShard(econf, tp_size=1, tp_rank=0, expert_parallel=True)
        return
    engines, out = run_shard(econf, tp, state, expert_parallel=True)
    for logits, tokens in out:
        assert (logits - ref_logits).abs().max().item() <= 1e-5
        assert torch.equal(tokens, ref_tokens)
    owners: dict[str, list[int]] = {}
    for eng in engines:
        for name, (ref, mesh, placements) in eng.destinations().items():
            if ".experts." in name:
                assert np.asarray(mesh).tolist() == [eng.rank] and list(placements) == [Replicate()]
                assert tuple(ref._local_tensor.shape) == tuple(ref.shape)  # whole, not cut by TP
                owners.setdefault(name, []).append(eng.rank)
    experts = econf.spec.num_experts
    moe_layers = sum(econf.spec.is_moe_layer(i) for i in range(econf.spec.num_layers))
    assert len(owners) == 3 * experts * moe_layers and all(len(o) == 1 for o in owners.values())
    with pytest.raises(LayoutError, match=f"expert parallelism over 3 workers does not divide the {experts} experts"):
        EngineShard(econf, tp_size=3, tp_rank=0, comm=object(), expert_parallel=True)


def test_canonical_names_are_the_spec_names_and_round_trip(model_case):
    cfg, model, state, _, _ = model_case
    spec = EngineConfig.from_hf(cfg.to_dict()).spec
    assert set(state) == {p.name for p in spec.params()}
    for p in spec.params():
        assert tuple(state[p.name].shape) == p.shape, p.name
    again = hf_from_canonical(state, model)
    for name, t in model.state_dict().items():
        if name in again:
            assert torch.equal(again[name], t), name


def test_transformers5_qwen3_moe_config_reads_as_qwen_experts():
    # transformers 5 writes num_experts under the alias num_local_experts (Mixtral's name)
    d = tiny_qwen3_moe_config().to_dict()
    spec = EngineConfig.from_hf(d).spec
    assert spec.num_experts == 4 and spec.expert_naming == "mlp" and spec.qk_norm
    assert EngineConfig.from_hf(d).num_experts_per_tok == 2


@pytest.mark.parametrize("tp,kv", [(1, 2), (2, 2), (4, 2), (4, 1), (2, 1)])
def test_fused_layout_is_vllm_order_and_views_write_in_place(tp, kv):
    cfg = tiny_qwen3_moe_config(num_key_value_heads=kv, decoder_sparse_step=2)
    econf = EngineConfig.from_hf(cfg)
    s = econf.spec
    state = random_canonical_state(s, seed=5)
    hd, nh = s.head_dim, s.num_heads
    for rank in range(tp):
        eng = EngineShard(econf, tp_size=tp, tp_rank=rank, comm=object())
        dst = eng.destinations(offset=10)
        assert set(dst) == {p.name for p in s.params()}
        storages = {t.untyped_storage().data_ptr() for t in eng.weights.values()}
        for name, (ref, mesh, _placements) in dst.items():
            assert ref._local_tensor.untyped_storage().data_ptr() in storages, f"{name} is not a view"
            assert mesh_coords_of(np.asarray(mesh), 10 + rank) is not None
        eng.load_canonical(state)
        for t in eng.weights.values():
            assert not torch.isnan(t).any(), "a fused element no view covers"
        # qkv_proj rows, head by head: this rank's q heads, then its kv head(s)
        a = "model.layers.1.self_attn"
        q, k, v = (state[f"{a}.{n}_proj.weight"] for n in "qkv")
        qh = [q[h * hd:(h + 1) * hd] for h in range(rank * nh // tp, (rank + 1) * nh // tp)]
        kv_heads = range(rank * kv // tp, (rank + 1) * kv // tp) if tp <= kv else [rank // (tp // kv)]
        want = torch.cat(qh + [k[h * hd:(h + 1) * hd] for h in kv_heads] + [v[h * hd:(h + 1) * hd] for h in kv_heads])
        assert torch.equal(eng.weights[f"{a}.qkv_proj.weight"], want)
        # dense gate_up_proj (layer 0) and experts' w13 (layer 1): [gate rows; up rows] of the rank
        i_l = s.intermediate_size // tp
        gu = eng.weights["model.layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(gu[:i_l], state["model.layers.0.mlp.gate_proj.weight"][rank * i_l:(rank + 1) * i_l])
        assert torch.equal(gu[i_l:], state["model.layers.0.mlp.up_proj.weight"][rank * i_l:(rank + 1) * i_l])
        e_l = s.moe_intermediate_size // tp
        w13 = eng.weights["model.layers.1.mlp.experts.w13_weight"]
        w2 = eng.weights["model.layers.1.mlp.experts.w2_weight"]
        for e in range(s.num_experts):
            x = f"model.layers.1.mlp.experts.{e}"
            assert torch.equal(w13[e, e_l:], state[f"{x}.up_proj.weight"][rank * e_l:(rank + 1) * e_l])
            assert torch.equal(w2[e], state[f"{x}.down_proj.weight"][:, rank * e_l:(rank + 1) * e_l])


def test_engine_rejects_layouts_it_cannot_hold():
    econf = EngineConfig.from_hf(tiny_llama_config())
    with pytest.raises(LayoutError, match="not a multiple|does not divide|exceeds"):
        EngineShard(econf, tp_size=3, tp_rank=0, comm=object())
    with pytest.raises(LayoutError, match="needs its TP group"):
        EngineShard(econf, tp_size=2, tp_rank=0)


# -- trainer-side layout helpers, on fake DTensors -------------------------------------------------

def fake_mesh(ranks, names):
    return SimpleNamespace(mesh=torch.as_tensor(ranks), mesh_dim_names=names)


def fake_dtensor(local, shape, mesh, placements):
    return SimpleNamespace(_local_tensor=local, shape=torch.Size(shape), dtype=local.dtype, device_mesh=mesh,
                           placements=placements)


def test_select_and_narrow_entry():
    mesh = np.arange(4).reshape(2, 2)
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)
    # experts on dim 0, sharded over mesh dim 0 (FSDP), replicated over tp
    for rank in range(4):
        local = full[shard_slices(full.shape, (2, 2), mesh_coords_of(mesh, rank), [Shard(0), Replicate()])]
        for e in range(4):
            view, shape, m, pl = select_entry(local, full.shape, mesh, [Shard(0), Replicate()], 0, e, rank)
            assert shape == (6, 3) and pl == (Replicate(),)
            assert m.tolist() == mesh[e // 2].tolist()
            if rank in m.tolist():
                assert torch.equal(view, full[e]) and view.data_ptr() != 0
                gate, gshape = narrow_entry(view, shape, pl, 0, 0, 3)
                assert gshape == (3, 3) and torch.equal(gate, full[e, :3])
            else:
                assert view is None
    with pytest.raises(LayoutError, match="only one plain"):
        select_entry(full, full.shape, mesh, [StridedShard(0, 2), Shard(0)], 0, 1, 0)
    with pytest.raises(LayoutError, match="narrow only an unsharded dim"):
        narrow_entry(full, full.shape, [Shard(0)], 0, 0, 1)


def test_dtensor_entries_lift_submeshes_and_split_fused_experts():
    root = fake_mesh([[0, 1], [2, 3]], ("dp", "tp"))
    E, F, H = 4, 8, 6  # experts, ffn (intermediate) size, hidden size
    gate_up = torch.randn(E, 2 * F, H)
    down = torch.randn(E, H, F)
    norm = torch.randn(H)
    q = torch.randn(16, H)
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        dp_mesh = fake_mesh([tp, tp + 2], ("dp",))  # FSDP's dp sub-mesh of this rank
        named = {
            "model.norm.weight": fake_dtensor(norm[dp * 3:(dp + 1) * 3], (H,), dp_mesh, [Shard(0)]),
            "model.layers.0.mlp.experts.gate_up_proj": fake_dtensor(gate_up[dp * 2:(dp + 1) * 2], gate_up.shape,
                                                                    dp_mesh, [Shard(0)]),
            "model.layers.0.mlp.experts.down_proj": fake_dtensor(down[dp * 2:(dp + 1) * 2], down.shape, dp_mesh,
                                                                 [Shard(0)]),
            "model.layers.0.self_attn.q_proj.weight": fake_dtensor(
                q[shard_slices(q.shape, (2, 2), (dp, tp), [StridedShard(0, 2), Shard(0)])], q.shape, root,
                [StridedShard(0, 2), Shard(0)]),
        }
        out = dtensor_entries(named, root, rank=rank, offset=5)
        ref, m, pl = out["model.norm.weight"]
        assert m.tolist() == [[5, 6], [7, 8]] and pl == (Shard(0), Replicate())
        ref, m, pl = out["model.layers.0.self_attn.q_proj.weight"]
        assert pl == (StridedShard(0, 2), Shard(0)) and tuple(ref.shape) == (16, H)
        experts = sorted({int(n.split(".")[5]) for n in out if ".experts." in n})
        assert experts == [2 * dp, 2 * dp + 1], "a rank lists only the experts it holds"
        for e in experts:
            x = f"model.layers.0.mlp.experts.{e}"
            for part, want in (("gate_proj", gate_up[e, :F]), ("up_proj", gate_up[e, F:]), ("down_proj", down[e])):
                ref, m, pl = out[f"{x}.{part}.weight"]
                assert torch.equal(ref._local_tensor, want) and tuple(ref.shape) == tuple(want.shape)
                assert m.tolist() == [5 + 2 * dp, 6 + 2 * dp] and pl == (Replicate(),)
                assert ref._local_tensor.untyped_storage().data_ptr() in (
                    named["model.layers.0.mlp.experts.gate_up_proj"]._local_tensor.untyped_storage().data_ptr(),
                    named["model.layers.0.mlp.experts.down_proj"]._local_tensor.untyped_storage().data_ptr())
    bad = fake_dtensor(norm, (H,), fake_mesh([0, 1], ("pp",)), [Shard(0)])
    with pytest.raises(LayoutError, match="not a sub-mesh"):
        lift_placements(bad, root)
