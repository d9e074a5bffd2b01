"""Megatron-core layouts under canonical Hugging Face names, as views (no gather, no copy).

A Megatron-core trainer rank holds TP-local shards of fused tensors with Megatron names, only
for the layers of its pipeline stage and only for the experts of its expert-parallel rank.
``megatron_to_canonical`` (or ``MegatronLayout.to_canonical``) turns that local state dict into
``{canonical_name: (DTensorRef, mesh, placements)}``, the format the resharder and the trainer
endpoints take (``refit.testing.megatron.MegatronTrainerEndpoint`` serves one rank): every local
tensor is a view of the Megatron parameter (its storage), so a refit reads the trainer's memory in place.

Conventions (documented here once; ``refit.models.fused`` follows them)
-----------------------------------------------------------------------------------------

Names. Canonical names are the Hugging Face checkpoint names of ``refit.models.specs``
(``model.layers.{L}.self_attn.q_proj.weight``, ``model.layers.{L}.mlp.experts.{E}.gate_proj.weight``,
...), with global layer and global expert numbers.

Ranks. A mesh is an array of ranks of refit's communicator: ``offset + trainer rank``. Trainer
ranks follow Megatron's default order ``tp-cp-ep-dp-pp`` as ``refit.models.parallel`` does:
pipeline stage ``s`` owns ranks ``s*S .. s*S+S-1`` (``S = tp*cp*dp``), laid out as a
``[dp, cp, tp]`` mesh (tp fastest) for dense tensors; routed experts use the expert
decomposition of the same ranks, ``etp`` fastest, then ``ep``, then ``edp``: expert-parallel
rank ``j`` holds global experts ``j*E/ep .. (j+1)*E/ep - 1`` (local expert ``i`` is global
expert ``j*E/ep + i``), on the ``[edp, etp]`` mesh ``s*S + x + etp*(j + ep*d)``.

Pipeline. Layers are split over stages as ``TrainParallel.stage_layers`` does (as evenly as
possible, earlier stages taking the remainder): local layer ``i`` of stage ``s`` is global layer
``stage_layers[s].start + i`` (``s*layers_per_stage + i`` when they divide). The embedding
lives on the first stage, the final norm and the output layer on the last.

Fused QKV, grouped view. Megatron's ``linear_qkv`` holds, for every query group ``g`` of the
rank, ``[q rows of the r = heads/groups heads of g; k rows of g; v rows of g]``
(``r*hd + hd + hd`` rows). The q rows of a rank are therefore not one contiguous block, but
they are one strided view, so q/k/v are exposed in a *grouped* canonical shape:

    q_proj.weight  [G, r*hd, hidden]    (= HF q_proj.weight [heads*hd, hidden].reshape(G, r*hd, hidden))
    k_proj.weight  [G, hd, hidden]      (= HF k_proj.weight.reshape(G, hd, hidden)); v_proj alike
    biases         [G, r*hd] / [G, hd]

The reshape of a full HF tensor into this shape is free (``to_grouped``), and a vLLM-style
engine's q/k/v row blocks are contiguous views in it too, so an engine that receives from a
Megatron trainer exposes its fused ``qkv_proj`` in the same grouped shape
(``FusedLayout(..., qkv="grouped")``). A param's global shape is part of its identity in a
plan: a grouped source against a plain destination is reported as a shape mismatch.

TP over query groups. When ``tp <= G`` (``tp`` divides ``G``), rank ``t`` holds groups
``t*G/tp ..``: mesh ``[tp]``, ``Shard(0)``. When ``tp > G`` (``G`` divides ``tp``), the
``k = tp/G`` consecutive ranks ``g*k .. g*k+k-1`` share query group ``g``: each holds the whole
k/v of ``g`` (replicated) and its ``1/k`` of the group's q heads. The tp mesh dim is then split
into ``[G, k]``: q is ``[Shard(0), Shard(1)]`` and k/v ``[Shard(0), Replicate()]``, so a refit
sends each kv head once per replica. (Megatron-core itself asks ``G % tp == 0``; the ``tp > G``
layout is the same extension vLLM uses, and what the plain HF layouts use too: see ``qkv_layout``.)

Fused gate/up. ``linear_fc1`` holds ``[gate rows of the rank; up rows of the rank]``
(``2 * I/tp`` rows): gate and up are row-slice views, ``Shard(0)`` over tp.

Experts. ``expert_layout="te"`` (``TEGroupedMLP``): ``mlp.experts.linear_fc1.weight{i}``
``[2*Ie/etp, hidden]`` and ``linear_fc2.weight{i}`` ``[hidden, Ie/etp]`` per local expert.
``expert_layout="legacy"`` (``GroupedMLP``): ``mlp.experts.weight1`` ``[hidden, El*2*Ie/etp]``
read as ``[El, hidden, 2*Ie/etp]`` and ``weight2`` ``[El*Ie/etp, hidden]`` read as
``[El, Ie/etp, hidden]``; the canonical ``[Ie, hidden]`` gate/up and ``[hidden, Ie]`` down are
transposed strided views of those.

Vocabulary. The embedding and output layer are vocab-parallel (``Shard(0)``). Megatron pads the
vocabulary; the canonical view of a rank is the un-padded rows it holds, which is a ``Shard(0)``
chunk only when the padding is the minimal one (``ceil(V/tp)`` rows a rank); otherwise the
adapter raises ``LayoutError`` (un-pad the vocabulary, or pad it minimally).

Norms, q/k layernorms and the router are replicated over the stage's ranks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit.errors import LayoutError
from refit.layout import DTensorRef, Placement, Replicate, Shard, chunk_bounds
from refit.models.parallel import TrainParallel, squeeze_mesh
from refit.models.specs import ModelSpec

__all__ = [
    "Entry",
    "MegatronLayout",
    "check_qkv_tp",
    "from_grouped",
    "grouped_local",
    "grouped_shape",
    "megatron_to_canonical",
    "qkv_layout",
    "to_grouped",
]

Entry = tuple[DTensorRef, np.ndarray, tuple[Placement, ...]]

_EXPERT_LAYOUTS = ("te", "legacy")


# -- the grouped q/k/v convention --------------------------------------------------------------

def check_qkv_tp(num_heads: int, num_kv_heads: int, tp: int, *, who: str = "layout") -> None:
    """Raise unless ``tp`` can cut ``num_heads`` query heads in ``num_kv_heads`` groups."""
    if num_heads % num_kv_heads:
        raise LayoutError(f"{who}: {num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    if num_heads % tp:
        raise LayoutError(f"{who}: tp={tp} does not divide the {num_heads} query heads")
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise LayoutError(f"{who}: tp={tp} does not divide the {num_kv_heads} key/value heads")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise LayoutError(f"{who}: tp={tp} exceeds the {num_kv_heads} key/value heads without being a multiple "
                          "of them; ranks can only share whole heads")


def qkv_layout(which: str, tp_ranks: Any, *, num_heads: int, num_kv_heads: int, grouped: bool,
               outer_placements: Sequence[Placement] = ()) -> tuple[np.ndarray, tuple[Placement, ...]]:
    """Mesh and placements of q/k/v over a TP mesh dim, plain HF shape or grouped.

    ``tp_ranks`` is an array whose LAST dim is tensor parallelism (outer dims, e.g. ``[dp, cp]``,
    get ``outer_placements``). Plain q is ``Shard(0)`` over tp. k/v (both conventions) and
    grouped q are ``Shard(0)`` over tp when ``tp <= kv heads``; beyond that the tp dim splits
    into ``[kv_heads, tp // kv_heads]`` with ``[Shard(0), Replicate()]`` for k/v and
    ``[Shard(0), Shard(1)]`` for grouped q.
    """
    if which not in ("q", "k", "v"):
        raise ValueError(f"which must be 'q', 'k' or 'v', got {which!r}")
    ranks = np.asarray(tp_ranks)
    outer, tp = ranks.shape[:-1], ranks.shape[-1]
    if len(outer_placements) != len(outer):
        raise LayoutError(f"qkv_layout: {len(outer_placements)} outer placement(s) for outer mesh dims {outer}")
    check_qkv_tp(num_heads, num_kv_heads, tp)
    outer_placements = tuple(outer_placements)
    if tp <= num_kv_heads or (which == "q" and not grouped):
        return ranks, outer_placements + (Shard(0),)
    k = tp // num_kv_heads
    mesh = ranks.reshape(*outer, num_kv_heads, k)
    inner = (Shard(0), Shard(1)) if which == "q" else (Shard(0), Replicate())
    return mesh, outer_placements + inner


def grouped_shape(which: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                  trailing: Sequence[int]) -> tuple[int, ...]:
    """Global grouped shape: ``[G, r*hd, *trailing]`` for q, ``[G, hd, *trailing]`` for k/v."""
    rows = (num_heads // num_kv_heads) * head_dim if which == "q" else head_dim
    return (num_kv_heads, rows, *trailing)


def to_grouped(which: str, full: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A plain HF q/k/v weight or bias (``[n*hd, ...]``) as the grouped view (no copy)."""
    return full.view(grouped_shape(which, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   trailing=full.shape[1:]))


def from_grouped(grouped: torch.Tensor) -> torch.Tensor:
    """The plain HF shape of a grouped q/k/v tensor."""
    return grouped.reshape(grouped.shape[0] * grouped.shape[1], *grouped.shape[2:])


def grouped_local(local_plain: torch.Tensor, *, num_kv_heads: int, tp: int) -> torch.Tensor:
    """A TP rank's plain q/k/v rows (contiguous heads, vLLM order) as its grouped local view."""
    groups = max(num_kv_heads // tp, 1)
    return local_plain.view(groups, local_plain.shape[0] // groups, *local_plain.shape[1:])


# -- Megatron layout ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Coords:
    """Where one trainer rank sits: pipeline stage, dense (dp, cp, tp), expert (edp, ep, etp)."""

    stage: int
    dp: int
    cp: int
    tp: int
    edp: int
    ep: int
    etp: int


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")


class MegatronLayout:
    """Maps one Megatron-core trainer rank's local state dict to canonical views, and back.

    ``spec`` gives the model's shapes (``refit.models.specs``), ``parallel`` the Megatron
    decomposition (``TrainParallel``: tp, pp, dp, cp, ep, etp). See the module docstring for
    every convention.
    """

    def __init__(self, spec: ModelSpec, parallel: TrainParallel, *, expert_layout: str = "te"):
        if expert_layout not in _EXPERT_LAYOUTS:
            raise LayoutError(f"expert_layout must be one of {_EXPERT_LAYOUTS}, got {expert_layout!r}")
        if spec.mla:
            raise LayoutError(f"{spec.name}: multi-head latent attention is not mapped by the Megatron adapter yet")
        parallel.check(spec)
        check_qkv_tp(spec.num_heads, spec.num_kv_heads, parallel.tp, who=f"megatron {parallel.describe()}")
        self.spec, self.parallel, self.expert_layout = spec, parallel, expert_layout
        self.stages = parallel.stage_layers(spec.num_stored_layers)
        self.experts_per_rank = spec.num_experts // parallel.ep if spec.num_experts else 0

    # -- ranks -----------------------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        p = self.parallel
        if not 0 <= rank < p.world:
            raise LayoutError(f"rank {rank} outside the {p.world} trainer ranks of {p.describe()}")
        stage, r = divmod(rank, p.stage_size)
        etp = p.expert_tp
        return Coords(stage=stage, dp=r // (p.tp * p.cp), cp=(r // p.tp) % p.cp, tp=r % p.tp,
                      edp=r // (etp * p.ep), ep=(r // etp) % p.ep, etp=r % etp)

    def stage_mesh(self, stage: int, offset: int = 0) -> np.ndarray:
        """The ``[dp, cp, tp]`` mesh of one stage's ranks."""
        p = self.parallel
        base = offset + stage * p.stage_size
        return np.arange(base, base + p.stage_size).reshape(p.dp, p.cp, p.tp)

    def expert_mesh(self, stage: int, ep_rank: int, offset: int = 0) -> np.ndarray:
        """The ``[edp, etp]`` mesh of the ranks holding expert-parallel rank ``ep_rank``'s experts."""
        p = self.parallel
        base = offset + stage * p.stage_size
        etp = p.expert_tp
        return np.array([[base + x + etp * (ep_rank + p.ep * d) for x in range(etp)] for d in range(p.edp)])

    def global_layer(self, stage: int, local: int) -> int:
        layers = self.stages[stage]
        if not 0 <= local < len(layers):
            raise LayoutError(f"local layer {local} outside the {len(layers)} layers of pipeline stage {stage}")
        return layers.start + local

    def global_expert(self, ep_rank: int, local: int) -> int:
        if not 0 <= local < self.experts_per_rank:
            raise LayoutError(f"local expert {local} outside the {self.experts_per_rank} experts of an EP rank")
        return ep_rank * self.experts_per_rank + local

    # -- Megatron -> canonical (views) ---------------------------------------------------------
    def to_canonical(self, state: Mapping[str, torch.Tensor], rank: int, *, offset: int = 0) -> dict[str, Entry]:
        """``{canonical_name: (DTensorRef view, mesh, placements)}`` for one rank's local state.

        Keys ending in ``_extra_state`` are skipped; any other unknown key raises.
        """
        c = self.coords(rank)
        s = self.spec
        out: dict[str, Entry] = {}
        dense = self.stage_mesh(c.stage, offset)
        rep = (Replicate(), Replicate(), Replicate())
        tp_col = (Replicate(), Replicate(), Shard(0))
        tp_row = (Replicate(), Replicate(), Shard(1))

        def put(name: str, local: torch.Tensor, shape, mesh: np.ndarray, placements) -> None:
            mesh_shape, placements = squeeze_mesh(mesh.shape, tuple(placements))
            out[name] = (DTensorRef(local, shape), mesh.reshape(mesh_shape), placements)

        last = len(self.stages) - 1
        for key in sorted(state):
            t = state[key]
            if key.endswith("_extra_state"):
                continue
            if key == "embedding.word_embeddings.weight":
                if c.stage == 0:
                    put("model.embed_tokens.weight", self._vocab_view(t, c.tp, key), (s.vocab_size, s.hidden_size),
                        dense, tp_col)
                continue
            if key == "output_layer.weight":
                if c.stage == last and not s.tie_word_embeddings:
                    put("lm_head.weight", self._vocab_view(t, c.tp, key), (s.vocab_size, s.hidden_size), dense, tp_col)
                continue
            if key == "decoder.final_layernorm.weight":
                put("model.norm.weight", t, tuple(t.shape), dense, rep)
                continue
            m = _LAYER.match(key)
            if m is None:
                raise LayoutError(f"rank {rank}: unknown Megatron parameter {key!r}")
            layer = self.global_layer(c.stage, int(m.group(1)))
            rest = m.group(2)
            p = f"model.layers.{layer}"
            a = f"{p}.self_attn"
            if rest == "self_attention.linear_qkv.layer_norm_weight" or rest == "input_layernorm.weight":
                put(f"{p}.input_layernorm.weight", t, tuple(t.shape), dense, rep)
            elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                for which, view in zip("qkv", self._split_qkv(t, key)):
                    shape = grouped_shape(which, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                                          head_dim=s.head_dim, trailing=tuple(t.shape[1:]))
                    mesh, places = qkv_layout(which, dense, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                                              grouped=True, outer_placements=(Replicate(), Replicate()))
                    put(f"{a}.{which}_proj.{kind}", view, shape, mesh, places)
            elif rest == "self_attention.q_layernorm.weight":
                put(f"{a}.q_norm.weight", t, tuple(t.shape), dense, rep)
            elif rest == "self_attention.k_layernorm.weight":
                put(f"{a}.k_norm.weight", t, tuple(t.shape), dense, rep)
            elif rest == "self_attention.linear_proj.weight":
                put(f"{a}.o_proj.weight", t, (s.hidden_size, s.num_heads * s.head_dim), dense, tp_row)
            elif rest in ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight",
                          "post_attention_layernorm.weight"):
                put(f"{p}.post_attention_layernorm.weight", t, tuple(t.shape), dense, rep)
            elif rest == "mlp.linear_fc1.weight":
                inter = s.intermediate_size
                gate, up = self._split_gate_up(t, inter // self.parallel.tp, key)
                put(f"{p}.mlp.gate_proj.weight", gate, (inter, s.hidden_size), dense, tp_col)
                put(f"{p}.mlp.up_proj.weight", up, (inter, s.hidden_size), dense, tp_col)
            elif rest == "mlp.linear_fc2.weight":
                put(f"{p}.mlp.down_proj.weight", t, (s.hidden_size, s.intermediate_size), dense, tp_row)
            elif rest == "mlp.router.weight":
                put(f"{p}.mlp.gate.weight", t, (s.num_experts, s.hidden_size), dense, rep)
            elif rest.startswith("mlp.experts."):
                for e, (gate, up, down) in self._experts(rest, t, state, m.group(1), rank).items():
                    g = self.global_expert(c.ep, e)
                    x = f"{p}.mlp.experts.{g}"
                    emesh = self.expert_mesh(c.stage, c.ep, offset)
                    ie = s.moe_intermediate_size
                    if gate is not None:
                        put(f"{x}.gate_proj.weight", gate, (ie, s.hidden_size), emesh, (Replicate(), Shard(0)))
                        put(f"{x}.up_proj.weight", up, (ie, s.hidden_size), emesh, (Replicate(), Shard(0)))
                    if down is not None:
                        put(f"{x}.down_proj.weight", down, (s.hidden_size, ie), emesh, (Replicate(), Shard(1)))
            else:
                raise LayoutError(f"rank {rank}: unknown Megatron parameter {key!r}")
        return out

    def _vocab_view(self, t: torch.Tensor, tp_rank: int, key: str) -> torch.Tensor:
        v, tp = self.spec.vocab_size, self.parallel.tp
        start, stop = chunk_bounds(v, tp, tp_rank)
        if t.shape[0] == stop - start:
            return t
        if t.shape[0] == math.ceil(v / tp) and t.shape[0] >= stop - start:
            return t[: stop - start]
        raise LayoutError(f"{key}: {t.shape[0]} rows a rank for a vocabulary of {v} over tp={tp}; only an "
                          f"un-padded or minimally padded ({math.ceil(v / tp)} rows a rank) vocabulary maps to "
                          "canonical shards")

    def _split_qkv(self, t: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, tp = self.spec, self.parallel.tp
        g, hd = s.num_kv_heads, s.head_dim
        r = s.num_heads // g
        groups = max(g // tp, 1)
        q_rows = r * hd * g // tp if tp > g else r * hd
        want = groups * (q_rows + 2 * hd)
        if t.shape[0] != want:
            raise LayoutError(f"{key}: {t.shape[0]} fused rows, expected {want} ({groups} query group(s) of "
                              f"{q_rows} q + {hd} k + {hd} v rows at tp={tp})")
        fused = t.view(groups, q_rows + 2 * hd, *t.shape[1:])
        return fused[:, :q_rows], fused[:, q_rows:q_rows + hd], fused[:, q_rows + hd:]

    @staticmethod
    def _split_gate_up(t: torch.Tensor, rows: int, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if t.shape[0] != 2 * rows:
            raise LayoutError(f"{key}: {t.shape[0]} rows, expected [gate; up] of {rows} rows each")
        return t[:rows], t[rows:]

    def _experts(self, rest: str, t: torch.Tensor, state, layer_key: str, rank: int) -> dict[int, tuple]:
        """Local expert -> (gate view, up view, down view); views missing from this key are None."""
        s = self.spec
        ie_local = s.moe_intermediate_size // self.parallel.expert_tp
        h = s.hidden_size
        m = _TE_EXPERT.match(rest)
        if m is not None:
            if self.expert_layout != "te":
                raise LayoutError(f"rank {rank}: {rest!r} is a TEGroupedMLP key but "
                                  f"expert_layout={self.expert_layout!r}")
            e = int(m.group(2))
            if m.group(1) == "1":
                gate, up = self._split_gate_up(t, ie_local, f"decoder.layers.{layer_key}.{rest}")
                return {e: (gate, up, None)}
            if tuple(t.shape) != (h, ie_local):
                raise LayoutError(f"decoder.layers.{layer_key}.{rest}: shape {list(t.shape)}, expected {[h, ie_local]}")
            return {e: (None, None, t)}
        if rest in ("mlp.experts.weight1", "mlp.experts.weight2"):
            if self.expert_layout != "legacy":
                raise LayoutError(f"rank {rank}: {rest!r} is a GroupedMLP key but expert_layout={self.expert_layout!r}")
            el = self.experts_per_rank
            if rest.endswith("weight1"):
                if tuple(t.shape) != (h, el * 2 * ie_local):
                    raise LayoutError(f"decoder.layers.{layer_key}.{rest}: shape {list(t.shape)}, expected "
                                      f"{[h, el * 2 * ie_local]}")
                w1 = t.view(el, h, 2 * ie_local)
                return {e: (w1[e, :, :ie_local].t(), w1[e, :, ie_local:].t(), None) for e in range(el)}
            if tuple(t.shape) != (el * ie_local, h):
                raise LayoutError(f"decoder.layers.{layer_key}.{rest}: shape {list(t.shape)}, expected "
                                  f"{[el * ie_local, h]}")
            w2 = t.view(el, ie_local, h)
            return {e: (None, None, w2[e].t()) for e in range(el)}
        raise LayoutError(f"rank {rank}: unknown Megatron parameter 'decoder.layers.{layer_key}.{rest}'")

    # -- canonical -> Megatron (the plain reference conversion; copies) -------------------------
    def from_canonical(self, full: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """The local Megatron state dict of ``rank``, cut from full canonical (plain HF) tensors.

        This is the straightforward converter (slicing and concatenation, new tensors), for
        building a Megatron-shaped trainer from a Hugging Face state and for testing the views.
        """
        c = self.coords(rank)
        s, p = self.spec, self.parallel
        tp, t_ = p.tp, c.tp
        out: dict[str, torch.Tensor] = {}

        def rows(x: torch.Tensor, n: int, i: int) -> torch.Tensor:
            a, b = chunk_bounds(x.shape[0], n, i)
            return x[a:b]

        def cols(x: torch.Tensor, n: int, i: int) -> torch.Tensor:
            a, b = chunk_bounds(x.shape[1], n, i)
            return x[:, a:b]

        last = len(self.stages) - 1
        if c.stage == 0:
            out["embedding.word_embeddings.weight"] = rows(full["model.embed_tokens.weight"], tp, t_).clone()
        g, hd = s.num_kv_heads, s.head_dim
        r = s.num_heads // g
        for local, layer in enumerate(self.stages[c.stage]):
            if layer >= s.num_layers:
                raise LayoutError(f"{s.name}: MTP layers are not mapped by the Megatron adapter yet")
            src = f"model.layers.{layer}"
            dst = f"decoder.layers.{local}"
            out[f"{dst}.self_attention.linear_qkv.layer_norm_weight"] = full[f"{src}.input_layernorm.weight"].clone()
            kinds = ["weight"] + (["bias"] if s.attention_bias else [])
            for kind in kinds:
                q, k, v = (to_grouped(w, full[f"{src}.self_attn.{w}_proj.{kind}"], num_heads=s.num_heads,
                                      num_kv_heads=g, head_dim=hd) for w in "qkv")
                parts = []
                if tp <= g:
                    for grp in range(t_ * (g // tp), (t_ + 1) * (g // tp)):
                        parts += [q[grp], k[grp], v[grp]]
                else:
                    share = tp // g
                    grp, sub = divmod(t_, share)
                    qr = r * hd // share
                    parts += [q[grp, sub * qr:(sub + 1) * qr], k[grp], v[grp]]
                out[f"{dst}.self_attention.linear_qkv.{kind}"] = torch.cat(parts, 0)
            if s.qk_norm:
                out[f"{dst}.self_attention.q_layernorm.weight"] = full[f"{src}.self_attn.q_norm.weight"].clone()
                out[f"{dst}.self_attention.k_layernorm.weight"] = full[f"{src}.self_attn.k_norm.weight"].clone()
            o_proj = full[f"{src}.self_attn.o_proj.weight"]
            out[f"{dst}.self_attention.linear_proj.weight"] = cols(o_proj, tp, t_).clone()
            post = full[f"{src}.post_attention_layernorm.weight"].clone()
            if not s.is_moe_layer(layer):
                out[f"{dst}.mlp.linear_fc1.layer_norm_weight"] = post
                out[f"{dst}.mlp.linear_fc1.weight"] = torch.cat(
                    [rows(full[f"{src}.mlp.{n}_proj.weight"], tp, t_) for n in ("gate", "up")])
                out[f"{dst}.mlp.linear_fc2.weight"] = cols(full[f"{src}.mlp.down_proj.weight"], tp, t_).clone()
                continue
            out[f"{dst}.pre_mlp_layernorm.weight"] = post
            out[f"{dst}.mlp.router.weight"] = full[f"{src}.mlp.gate.weight"].clone()
            etp, x = p.expert_tp, c.etp
            fc1s, fc2s = [], []
            for e in range(self.experts_per_rank):
                ge = self.global_expert(c.ep, e)
                pe = f"{src}.mlp.experts.{ge}"
                fc1 = torch.cat([rows(full[f"{pe}.{n}_proj.weight"], etp, x) for n in ("gate", "up")])
                fc2 = cols(full[f"{pe}.down_proj.weight"], etp, x)
                if self.expert_layout == "te":
                    out[f"{dst}.mlp.experts.linear_fc1.weight{e}"] = fc1
                    out[f"{dst}.mlp.experts.linear_fc2.weight{e}"] = fc2.clone()
                else:
                    fc1s.append(fc1.t())
                    fc2s.append(fc2.t())
            if self.expert_layout == "legacy":
                w1 = torch.stack(fc1s).contiguous()  # [El, H, 2*Ie/etp]
                w2 = torch.stack(fc2s).contiguous()  # [El, Ie/etp, H]
                out[f"{dst}.mlp.experts.weight1"] = w1.view(s.hidden_size, -1)
                out[f"{dst}.mlp.experts.weight2"] = w2.view(-1, s.hidden_size)
        if c.stage == last:
            out["decoder.final_layernorm.weight"] = full["model.norm.weight"].clone()
            if not s.tie_word_embeddings:
                out["output_layer.weight"] = rows(full["lm_head.weight"], tp, t_).clone()
        return out


def megatron_to_canonical(state: Mapping[str, torch.Tensor], *, spec: ModelSpec, parallel: TrainParallel, rank: int,
                          offset: int = 0, expert_layout: str = "te") -> dict[str, Entry]:
    """One Megatron-core rank's local state dict as canonical views: see ``MegatronLayout.to_canonical``."""
    return MegatronLayout(spec, parallel, expert_layout=expert_layout).to_canonical(state, rank, offset=offset)
