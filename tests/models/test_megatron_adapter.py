"""The Megatron-core adapter against a plain, head-by-head reference conversion (single process, no transformers).

For every layout the reference below cuts a random canonical (HF) state into the local
Megatron state of every rank, the obvious way (loops over heads, experts and ranks). The
adapter must then (1) produce the same local state with ``from_canonical``, (2) map every
rank's local state to canonical views whose contents are exactly that rank's region of the
canonical tensors, without copying, (3) give rosters that merge (every rank agrees on every
layout) and cover every canonical tensor, and (4) land, through the grouped engine views,
the same fused engine tensors as loading the canonical state directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refit.errors import LayoutError, PlanError
from refit.layout import dtype_name, intersect_regions, mesh_coords_of, shard_region, shard_slices
from refit.models.megatron import (
    MegatronLayout,
    from_grouped,
    grouped_local,
    megatron_to_canonical,
    qkv_layout,
    to_grouped,
)
from refit.models.parallel import EngineParallel, LayoutBuilder, TrainParallel
from refit.models.specs import ModelSpec
from refit.plan import RosterEntry, TensorLayout, merge_rosters
from refit.testing.engine import EngineConfig, EngineShard, ThreadTPComm, on_tp_threads, random_canonical_state
from refit.testing.megatron import MegatronTrainerEndpoint


def dense_spec(groups: int, ratio: int, *, layers: int = 3, vocab: int = 32) -> ModelSpec:
    return ModelSpec(name=f"dense-g{groups}-r{ratio}", vocab_size=vocab, hidden_size=16, num_layers=layers,
                     num_heads=groups * ratio, num_kv_heads=groups, head_dim=4, intermediate_size=16, dtype="float32")


def moe_spec(groups: int = 2, ratio: int = 2, *, freq: int = 1, layers: int = 3) -> ModelSpec:
    # Qwen3-MoE shaped: q/k norms, 4 routed experts; with freq=2 layers 0 and 2 stay dense
    return ModelSpec(name=f"moe-g{groups}-r{ratio}-f{freq}", vocab_size=32, hidden_size=16, num_layers=layers,
                     num_heads=groups * ratio, num_kv_heads=groups, head_dim=4, intermediate_size=16, qk_norm=True,
                     num_experts=4, moe_intermediate_size=8, moe_layer_freq=freq, moe_layer_offset=1,
                     dtype="float32")


# -- the plain reference conversion ------------------------------------------------------------

def _stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    out, start = [], 0
    for s in range(pp):
        n = num_layers // pp + (1 if s < num_layers % pp else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def reference_local(full, spec: ModelSpec, par: TrainParallel, rank: int, expert_layout: str) -> dict:
    """Megatron's local state of ``rank``, built head by head (TE layer-spec names)."""
    S = par.tp * par.cp * par.dp
    stage, r = divmod(rank, S)
    t, tp = r % par.tp, par.tp
    etp = par.etp or par.tp
    x, j = r % etp, (r // etp) % par.ep
    el = spec.num_experts // par.ep if spec.num_experts else 0
    G, hd, nh, H = spec.num_kv_heads, spec.head_dim, spec.num_heads, spec.hidden_size
    rq = nh // G
    out = {}
    if stage == 0:
        v = spec.vocab_size // tp
        out["embedding.word_embeddings.weight"] = full["model.embed_tokens.weight"][t * v:(t + 1) * v]
    stages = _stage_layers(spec.num_layers, par.pp)
    for local, layer in enumerate(stages[stage]):
        hf, mg = f"model.layers.{layer}", f"decoder.layers.{local}"
        wq, wk, wv = (full[f"{hf}.self_attn.{n}_proj.weight"] for n in "qkv")
        rows = []
        if tp <= G:
            for g in range(t * G // tp, (t + 1) * G // tp):
                for i in range(rq):
                    h = g * rq + i
                    rows.append(wq[h * hd:(h + 1) * hd])
                rows += [wk[g * hd:(g + 1) * hd], wv[g * hd:(g + 1) * hd]]
        else:
            share = tp // G
            g, sub = divmod(t, share)
            per = rq // share
            for i in range(per):
                h = g * rq + sub * per + i
                rows.append(wq[h * hd:(h + 1) * hd])
            rows += [wk[g * hd:(g + 1) * hd], wv[g * hd:(g + 1) * hd]]
        out[f"{mg}.self_attention.linear_qkv.weight"] = torch.cat(rows)
        out[f"{mg}.self_attention.linear_qkv.layer_norm_weight"] = full[f"{hf}.input_layernorm.weight"]
        if spec.qk_norm:
            out[f"{mg}.self_attention.q_layernorm.weight"] = full[f"{hf}.self_attn.q_norm.weight"]
            out[f"{mg}.self_attention.k_layernorm.weight"] = full[f"{hf}.self_attn.k_norm.weight"]
        c = nh * hd // tp
        out[f"{mg}.self_attention.linear_proj.weight"] = full[f"{hf}.self_attn.o_proj.weight"][:, t * c:(t + 1) * c]
        post = full[f"{hf}.post_attention_layernorm.weight"]
        if not spec.is_moe_layer(layer):
            i_l = spec.intermediate_size // tp
            out[f"{mg}.mlp.linear_fc1.layer_norm_weight"] = post
            out[f"{mg}.mlp.linear_fc1.weight"] = torch.cat([
                full[f"{hf}.mlp.gate_proj.weight"][t * i_l:(t + 1) * i_l],
                full[f"{hf}.mlp.up_proj.weight"][t * i_l:(t + 1) * i_l]])
            out[f"{mg}.mlp.linear_fc2.weight"] = full[f"{hf}.mlp.down_proj.weight"][:, t * i_l:(t + 1) * i_l]
            continue
        out[f"{mg}.pre_mlp_layernorm.weight"] = post
        out[f"{mg}.mlp.router.weight"] = full[f"{hf}.mlp.gate.weight"]
        il = spec.moe_intermediate_size // etp
        w1, w2 = [], []
        for e in range(el):
            pe = f"{hf}.mlp.experts.{j * el + e}"
            gate = full[f"{pe}.gate_proj.weight"][x * il:(x + 1) * il]
            up = full[f"{pe}.up_proj.weight"][x * il:(x + 1) * il]
            down = full[f"{pe}.down_proj.weight"][:, x * il:(x + 1) * il]
            if expert_layout == "te":
                out[f"{mg}.mlp.experts.linear_fc1.weight{e}"] = torch.cat([gate, up])
                out[f"{mg}.mlp.experts.linear_fc2.weight{e}"] = down
            else:  # GroupedMLP: weight1 is [El, H, 2*il] in memory, weight2 [El, il, H]
                w1.append(torch.cat([gate.t(), up.t()], dim=1).reshape(-1))
                w2.append(down.t().reshape(-1))
        if expert_layout == "legacy":
            out[f"{mg}.mlp.experts.weight1"] = torch.cat(w1).view(H, el * 2 * il)
            out[f"{mg}.mlp.experts.weight2"] = torch.cat(w2).view(el * il, H)
    if stage == par.pp - 1:
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"]
        v = spec.vocab_size // tp
        out["output_layer.weight"] = full["lm_head.weight"][t * v:(t + 1) * v]
    return {k: v.clone().contiguous() for k, v in out.items()}


def canonical_global(full, spec: ModelSpec, name: str, shape) -> torch.Tensor:
    t = full[name]
    return t.reshape(shape) if tuple(t.shape) != tuple(shape) else t


# -- cases --------------------------------------------------------------------------------------

DENSE = [  # (kv groups, GQA ratio, tp, pp, dp)
    (2, 1, 1, 1, 1), (2, 1, 2, 2, 1), (4, 1, 2, 1, 2),
    (2, 4, 1, 2, 1), (2, 4, 2, 1, 2), (2, 4, 4, 1, 1), (2, 4, 8, 1, 1),
    (2, 8, 2, 2, 1), (2, 8, 4, 1, 2), (2, 8, 8, 2, 1), (1, 8, 4, 1, 1), (1, 8, 2, 2, 1),
]
MOE = [  # (tp, pp, dp, ep, etp, expert_layout, moe_layer_freq)
    (2, 1, 1, 2, 1, "te", 1), (2, 1, 2, 2, 2, "te", 1), (1, 2, 2, 2, 1, "legacy", 1),
    (2, 2, 2, 4, 1, "legacy", 2), (4, 1, 1, 2, 2, "te", 2), (4, 1, 1, 2, 2, "legacy", 1),
]


def _cases():
    for g, r, tp, pp, dp in DENSE:
        yield pytest.param(dense_spec(g, r), TrainParallel(tp=tp, pp=pp, dp=dp), "te",
                           id=f"dense-g{g}-r{r}-tp{tp}-pp{pp}-dp{dp}")
    yield pytest.param(dense_spec(2, 4), TrainParallel(tp=4, cp=2), "te", id="dense-g2-r4-tp4-cp2")
    for tp, pp, dp, ep, etp, lay, freq in MOE:
        yield pytest.param(moe_spec(freq=freq), TrainParallel(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp), lay,
                           id=f"moe-tp{tp}-pp{pp}-dp{dp}-ep{ep}-etp{etp}-{lay}-f{freq}")


def _engine_tps(spec: ModelSpec) -> list[int]:
    out = []
    for tp in (1, 2, 4):
        ok = spec.num_heads % tp == 0 and (spec.num_kv_heads % tp == 0 if tp <= spec.num_kv_heads
                                           else tp % spec.num_kv_heads == 0)
        if ok and spec.intermediate_size % tp == 0 and spec.vocab_size % tp == 0 and \
                (not spec.num_experts or spec.moe_intermediate_size % tp == 0):
            out.append(tp)
    return out


@pytest.mark.parametrize("spec,par,expert_layout", list(_cases()))
def test_views_match_plain_reference_conversion(spec, par, expert_layout):
    layout = MegatronLayout(spec, par, expert_layout=expert_layout)
    full = random_canonical_state(spec, seed=7)
    names = {p.name for p in spec.params()}
    rosters, covered = {}, {n: torch.zeros(full[n].shape, dtype=torch.int64) for n in names}
    src_views = {}
    for rank in range(par.world):
        local = reference_local(full, spec, par, rank, expert_layout)
        # (1) the adapter's own converter agrees with the head-by-head one
        mine = layout.from_canonical(full, rank)
        assert sorted(mine) == sorted(local), rank
        for k in local:
            assert torch.equal(mine[k], local[k]), (rank, k)
        # (2) views: right contents, in the Megatron tensors' own storage
        entries = megatron_to_canonical(local, spec=spec, parallel=par, rank=rank, expert_layout=expert_layout)
        storages = {t.untyped_storage().data_ptr() for t in local.values()}
        for name, (ref, mesh, placements) in entries.items():
            assert name in names, name
            view = ref._local_tensor
            assert view.untyped_storage().data_ptr() in storages, f"{name} on rank {rank} is a copy"
            coords = mesh_coords_of(np.asarray(mesh), rank)
            assert coords is not None, (name, rank, mesh)
            g = canonical_global(full, spec, name, ref.shape)
            want = g[shard_slices(ref.shape, np.asarray(mesh).shape, coords, placements)]
            assert torch.equal(view, want), (name, rank, mesh, placements)
            flat = covered[name].view(g.shape) if covered[name].shape != g.shape else covered[name]
            flat[shard_slices(ref.shape, np.asarray(mesh).shape, coords, placements)] += 1
        rosters[rank] = [RosterEntry.make(n, tuple(ref.shape), dtype_name(ref.dtype), np.asarray(m).tolist(), pl, "src")
                         for n, (ref, m, pl) in entries.items()]
        src_views[rank] = entries
    # (3) every rank agrees on every layout, and every canonical element is held somewhere
    index = merge_rosters(rosters, par.world)
    assert set(index.specs) == names
    for n, c in covered.items():
        assert int(c.min()) >= 1, f"{n}: elements held by no rank"
    # (4) through grouped engine views, the engines get what a direct load gives
    _land_on_engines(spec, index, src_views, full, par.world)


def _land_on_engines(spec, index, src_views, full, world):
    """In-process golden transfer: rebuild each param from the SOURCE views, write the engine views."""
    econf = EngineConfig(spec=spec, num_experts_per_tok=2)
    rebuilt = {}
    for name, pspec in index.specs.items():
        g = torch.full(pspec.shape, float("nan"))
        whole = tuple(((0, n),) for n in pspec.shape)
        for r in pspec.src.mesh_ranks:
            ref = src_views[r][name][0]
            region = pspec.src.region(pspec.shape, r)
            for box in intersect_regions(region, whole):
                g[box.dst_slices()] = ref._local_tensor[box.src_slices()]
        assert not torch.isnan(g).any(), name
        rebuilt[name] = g
    offset = world
    for tp in _engine_tps(spec):
        for rank in range(tp):
            got = EngineShard(econf, tp_size=tp, tp_rank=rank, comm=object(), qkv="grouped")
            for name, (ref, mesh, placements) in got.destinations(offset).items():
                assert tuple(ref.shape) == tuple(index.specs[name].shape), name
                coords = mesh_coords_of(np.asarray(mesh), offset + rank)
                ref._local_tensor.copy_(rebuilt[name][shard_slices(ref.shape, np.asarray(mesh).shape, coords,
                                                                   placements)])
            want = EngineShard(econf, tp_size=tp, tp_rank=rank, comm=object(), qkv="plain")
            want.load_canonical(full)
            for k, t in want.weights.items():
                assert torch.equal(got.weights[k], t), (tp, rank, k)


def test_grouped_view_is_a_free_reshape_and_matches_qkv_layout():
    spec = dense_spec(2, 4)
    full = random_canonical_state(spec, seed=1)
    q = full["model.layers.0.self_attn.q_proj.weight"]
    gq = to_grouped("q", q, num_heads=8, num_kv_heads=2, head_dim=4)
    assert gq.shape == (2, 16, 16) and gq.data_ptr() == q.data_ptr()
    assert torch.equal(from_grouped(gq), q)
    # tp=4 > 2 groups: q is [Shard(0), Shard(1)] over a [2, 2] mesh, k/v replicated within a group
    mesh, pl = qkv_layout("q", np.arange(4), num_heads=8, num_kv_heads=2, grouped=True)
    assert mesh.shape == (2, 2) and [repr(p) for p in pl] == ["Shard(0)", "Shard(1)"]
    mesh, pl = qkv_layout("k", np.arange(4), num_heads=8, num_kv_heads=2, grouped=False)
    assert mesh.shape == (2, 2) and [repr(p) for p in pl] == ["Shard(0)", "Replicate()"]
    mesh, pl = qkv_layout("q", np.arange(4), num_heads=8, num_kv_heads=2, grouped=False)
    assert mesh.shape == (4,) and [repr(p) for p in pl] == ["Shard(0)"]
    # an engine rank's plain q rows, viewed grouped, are the rank's region of the grouped tensor
    for t in range(4):
        rows = q[t * 8:(t + 1) * 8]
        view = grouped_local(rows, num_kv_heads=2, tp=4)
        mesh, pl = qkv_layout("q", np.arange(4), num_heads=8, num_kv_heads=2, grouped=True)
        region = shard_region(gq.shape, mesh.shape, mesh_coords_of(mesh, t), pl)
        assert torch.equal(view, gq[tuple(slice(*iv[0]) for iv in region)])


def test_minimally_padded_vocabulary_maps_and_other_padding_raises():
    spec = dense_spec(2, 2, vocab=30)
    par = TrainParallel(tp=4)
    layout = MegatronLayout(spec, par)
    full = random_canonical_state(spec, seed=2)
    for rank in range(4):
        local = layout.from_canonical(full, rank)
        emb = local["embedding.word_embeddings.weight"]
        padded = torch.zeros(8, 16)
        padded[:emb.shape[0]] = emb
        local["embedding.word_embeddings.weight"] = padded
        ref, mesh, pl = layout.to_canonical(local, rank)["model.embed_tokens.weight"]
        want = full["model.embed_tokens.weight"][shard_slices((30, 16), (4,), (rank,), pl)]
        assert torch.equal(ref._local_tensor, want)
    local = layout.from_canonical(full, 0)
    local["embedding.word_embeddings.weight"] = torch.zeros(32, 16)  # padded to 128 a rank, say
    with pytest.raises(LayoutError, match="minimally padded"):
        layout.to_canonical(local, 0)


def test_bad_megatron_state_raises_clearly():
    spec, par = dense_spec(2, 4), TrainParallel(tp=2)
    layout = MegatronLayout(spec, par)
    local = layout.from_canonical(random_canonical_state(spec), 0)
    bad = dict(local)
    bad["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(10, 16)
    with pytest.raises(LayoutError, match="fused rows, expected 24"):
        layout.to_canonical(bad, 0)
    with pytest.raises(LayoutError, match="unknown Megatron parameter"):
        layout.to_canonical({**local, "decoder.layers.0.mystery.weight": torch.zeros(1)}, 0)
    assert "model.layers.0.input_layernorm.weight" in layout.to_canonical(
        {**local, "decoder.layers.0.self_attention.linear_qkv._extra_state": torch.zeros(1)}, 0)
    with pytest.raises(LayoutError, match="GroupedMLP key"):
        MegatronLayout(moe_spec(), TrainParallel(tp=1, ep=1)).to_canonical(
            {"decoder.layers.0.mlp.experts.weight1": torch.zeros(16, 64)}, 0)
    with pytest.raises(LayoutError, match="does not divide"):
        MegatronLayout(dense_spec(4, 1), TrainParallel(tp=8))


def test_grouped_source_against_plain_destination_is_a_shape_mismatch():
    spec, par = dense_spec(2, 2, layers=1), TrainParallel(tp=2)
    layout = MegatronLayout(spec, par)
    full = random_canonical_state(spec)
    rosters = {}
    for rank in range(2):
        entries = layout.to_canonical(layout.from_canonical(full, rank), rank)
        rosters[rank] = [RosterEntry.make(n, tuple(r.shape), "float32", np.asarray(m).tolist(), pl, "src")
                         for n, (r, m, pl) in entries.items()]
    engine = EngineShard(EngineConfig(spec=spec), qkv="plain")
    rosters[2] = [RosterEntry.make(n, tuple(r.shape), "float32", np.asarray(m).tolist(), pl, "dst")
                  for n, (r, m, pl) in engine.destinations(2).items()]
    with pytest.raises(PlanError, match=r"self_attn\.[qkv]_proj\.weight: global shape mismatch"):
        merge_rosters(rosters, 3)


@pytest.mark.timeout(120)
def test_synchronizer_moves_megatron_views_into_engine_views():
    """The endpoints as the control plane drives them: 4 Megatron ranks (tp2 > 1 kv head, ep2) -> 2 TP2 shards."""

    import refit
    from refit.runtime.handles import LocalWorker

    spec = moe_spec(groups=1, ratio=4, freq=2)
    par = TrainParallel(tp=2, dp=2, ep=2)
    layout = MegatronLayout(spec, par, expert_layout="legacy")
    econf = EngineConfig(spec=spec, num_experts_per_tok=2, norm_topk_prob=True)
    states = [layout.from_canonical(random_canonical_state(spec, seed=0), r) for r in range(par.world)]
    trainers = [MegatronTrainerEndpoint(layout, r, states[r]) for r in range(par.world)]
    shards = []
    for _ in range(2):
        comms = ThreadTPComm.group(2)
        shards.append([EngineShard(econf, tp_size=2, tp_rank=r, comm=comms[r], qkv="grouped") for r in range(2)])
    sync = refit.ReshardWeightSynchronizer([LocalWorker(t) for t in trainers],
                                           [[LocalWorker(e) for e in s] for s in shards], refit_timeout_s=60)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    try:
        sync.init_communicator()
        for step in range(2):
            full = random_canonical_state(spec, seed=step)
            for r, st in enumerate(states):  # an "optimizer step": new values, same tensors
                for k, t in layout.from_canonical(full, r).items():
                    st[k].copy_(t)
            result = sync.sync_weights()
            assert result.verified
            want = EngineShard(econf)
            want.load_canonical(full)
            ref = want.forward(ids)
            for shard in shards:
                out = on_tp_threads(shard, lambda e: e.forward(ids))
                for r in range(2):
                    assert torch.equal(out[r], out[0])
                    assert (out[r] - ref).abs().max().item() <= 1e-5
                    assert shard[r].version == step + 1
    finally:
        sync.shutdown()


@pytest.mark.parametrize("spec,par,expert_layout", [c for c in _cases() if "pp2" in c.id or "ep" in c.id][:6])
def test_layouts_agree_with_the_planning_model(spec, par, expert_layout):
    """``refit.models.parallel`` predicts the trainer layouts ``refit plan`` reasons about; the
    adapter's real views must hold the same regions on the same ranks (q/k/v aside: grouped)."""
    layout = MegatronLayout(spec, par, expert_layout=expert_layout)
    predicted = LayoutBuilder(spec, par, EngineParallel(tp=1))
    params = {p.name: p for p in spec.params()}
    full = random_canonical_state(spec)
    seen = set()
    for rank in range(par.world):
        for name, (ref, mesh, placements) in layout.to_canonical(layout.from_canonical(full, rank), rank).items():
            if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
                continue
            mine = TensorLayout.make(np.asarray(mesh), placements, "float32", param=name)
            want = predicted.src(params[name])
            assert set(mine.mesh_ranks) == set(want.mesh_ranks), name
            assert mine.region(ref.shape, rank) == want.region(params[name].shape, rank), (name, rank)
            seen.add(name)
    assert seen == {n for n in params if n.rsplit(".", 2)[-2] not in ("q_proj", "k_proj", "v_proj")}
