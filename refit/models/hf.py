"""Hugging Face ``transformers`` state dicts and DTensor layouts under canonical names, as views.

What refit sees. ``dtensor_entries`` maps a model's DTensor parameters (TP via
``parallelize_module`` and/or FSDP2 via ``fully_shard``) to
``{canonical_name: (DTensorRef, mesh, placements)}``:

* the mesh is the trainer's whole device mesh of ranks (``DeviceMesh.mesh``, which are ranks
  of the trainer's torch default group) plus ``offset``: the ranks of the refit
  communicator. A param that lives on a sub-mesh (FSDP-only params sit on the ``dp`` sub-mesh)
  is lifted to the whole mesh with ``Replicate()`` on the dims it does not use, so every rank
  reports the same layout for a param;
* the local tensor is the DTensor's own ``_local_tensor`` (FSDP2 keeps it in place across
  steps), so a refit reads the trainer's memory without a gather;
* transformers 5 holds a Qwen3-MoE layer's experts fused, ``mlp.experts.gate_up_proj``
  ``[E, 2*Ie, hidden]`` and ``mlp.experts.down_proj`` ``[E, hidden, Ie]``; they are exposed
  as the canonical per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` views. An expert
  lives on the FSDP rank whose chunk holds it, so its mesh is that rank's row of the mesh
  (replicated over tp), and ranks that do not hold it do not list it.

``canonical_from_hf`` / ``hf_from_canonical`` do the same renaming for full (unsharded) state
dicts. A reference trainer that produces such DTensors is ``refit.testing.hf.HFTrainer``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from refit.errors import LayoutError
from refit.layout import (
    DTensorRef,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    chunk_bounds,
    mesh_coords_of,
    normalize_placements,
)
from refit.models.megatron import Entry

__all__ = ["canonical_from_hf", "dtensor_entries", "hf_from_canonical", "lift_placements", "narrow_entry",
           "select_entry"]

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")

# -- canonical names ---------------------------------------------------------------------------

def canonical_from_hf(state: Mapping[str, torch.Tensor], *,
                      tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """A full HF state dict under canonical names: fused transformers-5 experts split into per-expert views.

    With tied embeddings the head is the embedding and has no canonical name of its own.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def hf_from_canonical(canonical: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict for ``model.load_state_dict`` from canonical tensors (experts re-fused as the model holds them)."""
    out: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        if name == "lm_head.weight" and name not in canonical and model.config.tie_word_embeddings:
            out[name] = canonical["model.embed_tokens.weight"]
            continue
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = canonical[name]
            continue
        prefix, kind = m.groups()
        n = 0
        while f"{prefix}.{n}.down_proj.weight" in canonical:
            n += 1
        if kind == "gate_up_proj":
            out[name] = torch.stack([torch.cat([canonical[f"{prefix}.{e}.gate_proj.weight"],
                                                canonical[f"{prefix}.{e}.up_proj.weight"]]) for e in range(n)])
        else:
            out[name] = torch.stack([canonical[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    return out


# -- DTensor layouts as refit entries ------------------------------------------------------------

def lift_placements(dtensor: Any, root_mesh: Any) -> tuple[Placement, ...]:
    """The placements of ``dtensor`` on the whole ``root_mesh`` (Replicate on dims its mesh lacks)."""
    sub = dtensor.device_mesh
    placements = normalize_placements(dtensor.placements)
    names, rnames = sub.mesh_dim_names, root_mesh.mesh_dim_names
    if tuple(sub.mesh.shape) == tuple(root_mesh.mesh.shape) and (names == rnames or names is None):
        if not torch.equal(sub.mesh, root_mesh.mesh):
            raise LayoutError(f"a DTensor's mesh {sub.mesh.tolist()} is not the trainer mesh {root_mesh.mesh.tolist()}")
        return placements
    if names is None or rnames is None or [n for n in rnames if n in names] != list(names):
        raise LayoutError(f"a DTensor on mesh dims {names} is not a sub-mesh of the trainer mesh dims {rnames}")
    return tuple(placements[names.index(n)] if n in names else Replicate() for n in rnames)


def _shift(p: Placement, dim: int) -> Placement:
    if isinstance(p, Shard) and p.dim > dim:
        return Shard(p.dim - 1)
    if isinstance(p, StridedShard) and p.dim > dim:
        return StridedShard(p.dim - 1, p.split_factor)
    return p


def select_entry(local: torch.Tensor | None, shape: Sequence[int], mesh: np.ndarray, placements: Sequence[Placement],
                 dim: int, index: int, rank: int) -> tuple[torch.Tensor | None, tuple[int, ...], np.ndarray,
                                                        tuple[Placement, ...]]:
    """Index ``index`` of tensor dim ``dim`` of a sharded tensor, as a layout of its own.

    ``dim`` may be sharded by at most one mesh dim, with plain ``Shard``: the index then lives
    on one slice of the mesh, which becomes the new mesh (that mesh dim dropped). Returns
    ``(local view or None when this rank does not hold it, shape, mesh, placements)``.
    """
    mesh = np.asarray(mesh)
    placements = normalize_placements(placements)
    on_dim = [i for i, p in enumerate(placements) if isinstance(p, (Shard, StridedShard)) and p.dim == dim]
    if len(on_dim) > 1 or any(isinstance(placements[i], StridedShard) for i in on_dim):
        raise LayoutError(f"select_entry: dim {dim} is split by {[placements[i] for i in on_dim]}; only one plain "
                          "Shard can be selected through")
    new_shape = tuple(int(s) for i, s in enumerate(shape) if i != dim)
    coords = mesh_coords_of(mesh, rank)
    if not on_dim:
        view = local.select(dim, index) if (local is not None and coords is not None) else None
        return view, new_shape, mesh, tuple(_shift(p, dim) for p in placements)
    md = on_dim[0]
    owner, start = None, 0
    for c in range(mesh.shape[md]):
        a, b = chunk_bounds(int(shape[dim]), mesh.shape[md], c)
        if a <= index < b:
            owner, start = c, a
            break
    if owner is None:
        raise LayoutError(f"select_entry: index {index} outside dim {dim} of size {shape[dim]}")
    sub = np.take(mesh, owner, axis=md)
    rest = tuple(_shift(p, dim) for i, p in enumerate(placements) if i != md)
    if sub.ndim == 0:
        sub, rest = sub.reshape(1), (Replicate(),)
    held = local is not None and coords is not None and coords[md] == owner
    return (local.select(dim, index - start) if held else None), new_shape, sub, rest


def narrow_entry(local: torch.Tensor | None, shape: Sequence[int], placements: Sequence[Placement], dim: int,
                 start: int, length: int) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """Rows ``start .. start+length`` of an UNSHARDED dim, as a view: ``(local view, new shape)``."""
    for p in normalize_placements(placements):
        if isinstance(p, (Shard, StridedShard)) and p.dim == dim:
            raise LayoutError(f"narrow_entry: dim {dim} is sharded ({p!r}); narrow only an unsharded dim")
    new_shape = tuple(length if i == dim else int(s) for i, s in enumerate(shape))
    return (local.narrow(dim, start, length) if local is not None else None), new_shape


def dtensor_entries(named: Mapping[str, Any], root_mesh: Any, *, rank: int | None = None,
                    offset: int = 0) -> dict[str, Entry]:
    """``{canonical_name: (DTensorRef, mesh, placements)}`` for a model's DTensor parameters.

    ``named`` maps HF parameter names to DTensors (``model.named_parameters()``); ``root_mesh``
    is the trainer's ``DeviceMesh``; ``rank`` this process's rank in it (default: the torch
    default group's rank). Only what this rank holds is listed.
    """
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank()
    ranks = root_mesh.mesh.cpu().numpy()
    out: dict[str, Entry] = {}
    for name, dt in named.items():
        if not hasattr(dt, "_local_tensor"):
            raise LayoutError(f"{name}: expected a DTensor, got {type(dt).__name__}")
        local, shape = dt._local_tensor, tuple(int(s) for s in dt.shape)
        placements = lift_placements(dt, root_mesh)
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = (DTensorRef(local, shape, dtype=dt.dtype), ranks + offset, placements)
            continue
        prefix, kind = m.groups()
        for e in range(shape[0]):
            view, eshape, emesh, eplace = select_entry(local, shape, ranks, placements, 0, e, rank)
            if kind == "down_proj":
                parts = {"down_proj": (view, eshape)}
            else:
                half = eshape[0] // 2
                parts = {"gate_proj": narrow_entry(view, eshape, eplace, 0, 0, half),
                         "up_proj": narrow_entry(view, eshape, eplace, 0, half, half)}
            if view is None:
                continue
            for part, (v, s) in parts.items():
                out[f"{prefix}.{e}.{part}.weight"] = (DTensorRef(v, s, dtype=dt.dtype), emesh + offset, eplace)
    return out

