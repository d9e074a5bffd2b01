"""Rosters and the merged parameter index: what every rank holds or needs, checked against each other.

Every rank contributes roster entries (what it holds as a source, what it needs as a
destination); ``merge_rosters`` checks them against each other and merges them into one
spec per param, and every rank plans from that same index. ``check_local_shapes`` holds a
rank's actual local tensors to the index, so a wrong tensor fails with its param and layout
named before any byte moves instead of as a size mismatch inside a transfer.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from refit.errors import LayoutError, PlanError
from refit.layout import (
    Placement,
    Region,
    Replicate,
    dtype_from_name,
    dtype_name,
    normalize_mesh,
    normalize_placements,
    region_numel,
    region_overlap_numel,
    region_shape,
    shard_region,
    validate_layout,
)
from refit.plan.buckets import wire_dtype

_MESH_COORDS: dict[tuple[int, ...], list[tuple[int, ...]]] = {}


def _mesh_coords(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Coordinates of every flat mesh index, row-major (shared by every mesh of one shape)."""
    got = _MESH_COORDS.get(mesh_shape)
    if got is None:
        got = _MESH_COORDS[mesh_shape] = list(itertools.product(*[range(n) for n in mesh_shape]))
    return got


@dataclass(frozen=True, eq=True)
class TensorLayout:
    """One side's layout of one param: a mesh of ranks, a placement per mesh dim, a dtype."""

    mesh_ranks: tuple[int, ...]  # row-major
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    dtype: str

    @classmethod
    def make(cls, mesh: Any, placements: Any, dtype: Any, *, param: str = "tensor") -> TensorLayout:
        arr = normalize_mesh(mesh, param=f"{param}: mesh")
        dt = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype).removeprefix("torch.")
        dtype_from_name(dt)
        return cls(
            tuple(int(r) for r in arr.reshape(-1)),
            tuple(int(s) for s in arr.shape),
            normalize_placements(placements, param=f"{param}: placements"),
            dt,
        )

    @cached_property
    def _hash(self) -> int:
        return hash((self.mesh_ranks, self.mesh_shape, self.placements, self.dtype))

    def __hash__(self) -> int:  # layouts key the planner's caches: hash the rank tuple once
        return self._hash

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        return dict(zip(self.mesh_ranks, _mesh_coords(self.mesh_shape)))

    @cached_property
    def _flat(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.mesh_ranks)}

    def coords(self, rank: int) -> tuple[int, ...] | None:
        return self._coords.get(rank)

    def position(self, rank: int) -> int | None:
        """``rank``'s flat (row-major) index in this mesh, or None when it is not in the mesh."""
        return self._flat.get(rank)

    def rank_at(self, coords: Sequence[int]) -> int:
        i = 0
        for c, n in zip(coords, self.mesh_shape):
            if not 0 <= c < n:
                raise IndexError(f"mesh coords {tuple(coords)} outside mesh shape {self.mesh_shape}")
            i = i * n + c
        return self.mesh_ranks[i]

    def flat_index(self, rank: int) -> int:
        return self._flat[rank]

    def region(self, shape: Sequence[int], rank: int) -> Region:
        return shard_region(shape, self.mesh_shape, self._coords[rank], self.placements)

    @cached_property
    def sharding_dims(self) -> tuple[int, ...]:
        return tuple(m for m, p in enumerate(self.placements) if not isinstance(p, Replicate))

    @cached_property
    def replication(self) -> int:
        """How many ranks hold each element: the product of the Replicate mesh dims."""
        return math.prod(n for m, n in enumerate(self.mesh_shape) if m not in self.sharding_dims)

    def shard_key(self, rank: int) -> tuple[int, ...]:
        c = self._coords[rank]
        return tuple(c[m] for m in self.sharding_dims)

    @cached_property
    def _replicas(self) -> dict[tuple[int, ...], list[int]]:
        return {}

    def replicas(self, key: tuple[int, ...]) -> list[int]:
        """Ranks holding the shard ``key`` (coords on the sharding mesh dims), in mesh order."""
        got = self._replicas.get(key)
        if got is None:
            got = self._replicas[key] = self._find_replicas(tuple(key))
        return list(got)

    def _find_replicas(self, key: tuple[int, ...]) -> list[int]:
        free = [range(n) if m not in self.sharding_dims else None for m, n in enumerate(self.mesh_shape)]
        out = []
        for combo in itertools.product(*[r for r in free if r is not None]):
            coords, it, kt = [], iter(combo), iter(key)
            for m in range(len(self.mesh_shape)):
                coords.append(next(kt) if m in self.sharding_dims else next(it))
            out.append(self.rank_at(coords))
        return out

    def describe(self) -> str:
        mesh = np.array(self.mesh_ranks).reshape(self.mesh_shape).tolist()
        return f"mesh={mesh} placements={list(self.placements)} dtype={self.dtype}"


@dataclass(frozen=True)
class RosterEntry:
    """What one rank holds (``role="src"``) or needs (``role="dst"``) of one param."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    mesh: Any
    placements: Any
    role: str  # "src" or "dst"

    @classmethod
    def make(cls, name, global_shape, dtype, mesh, placements, role) -> RosterEntry:
        if role not in ("src", "dst"):
            raise PlanError(f"{name}: role must be 'src' or 'dst', got {role!r}")
        return cls(name, tuple(int(s) for s in global_shape), dtype, mesh, placements, role)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    src: TensorLayout
    dsts: tuple[TensorLayout, ...]  # ordered by lowest rank: appended engines come last


@dataclass
class ParamIndex:
    """Merged rosters: one spec per param and, per rank, the params it touches."""

    world_size: int
    specs: dict[str, ParamSpec]
    by_rank: dict[int, list[str]]

    @cached_property
    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(str(self.world_size).encode())
        layouts: dict[tuple, bytes] = {}  # the layers and experts of a model share few layout sets
        for name in sorted(self.specs):
            s = self.specs[name]
            lay = layouts.get((s.src, s.dsts))
            if lay is None:
                lay = layouts[(s.src, s.dsts)] = repr((s.src, s.dsts)).encode()
            h.update(repr((name, s.shape)).encode())
            h.update(lay)
        return h.hexdigest()

    def ranks(self) -> list[int]:
        return sorted(self.by_rank)

    def __getstate__(self) -> dict:
        # the planner's per-index cache (see refit.plan.forms.planner_cache) is local working memory
        return {k: v for k, v in self.__dict__.items() if k != "_planner_cache"}


def _layout_key(e: RosterEntry) -> tuple | None:
    """A content key for an entry's (mesh, placements, dtype), or None when it has none."""
    m = e.mesh
    if isinstance(m, np.ndarray):
        mk = ("np", m.shape, m.dtype.str, m.tobytes())
    elif isinstance(m, (list, tuple)):
        mk = ("seq", repr(m))
    else:
        return None
    pl = e.placements
    pk = tuple(pl) if isinstance(pl, (list, tuple)) else (pl,)
    try:
        hash(pk)
    except TypeError:
        return None
    return (mk, pk, str(e.dtype))


def merge_rosters(rosters: Mapping[int, Iterable[RosterEntry]], world_size: int) -> ParamIndex:
    """Check the per-rank rosters against each other and merge them into one spec per param.

    Raises ``PlanError`` / ``LayoutError`` naming the param and the ranks for: a
    destination that no source holds, a shape mismatch, placements that do not fit the
    mesh, a mesh rank outside the group, a rank listed twice, a mesh rank that did not
    report the param, and a rank in two destination layouts of one param.
    """
    seen: dict[tuple[str, str], dict[TensorLayout, list[int]]] = defaultdict(dict)
    shapes: dict[str, dict[tuple[int, ...], list[int]]] = defaultdict(dict)
    # A model's hundreds of thousands of entries repeat a few hundred layouts: build and
    # check each distinct one once (the first entry that has it is the one an error names).
    made: dict[tuple, TensorLayout] = {}
    valid: set[tuple] = set()
    for rank in sorted(rosters):
        if not 0 <= rank < world_size:
            raise PlanError(f"roster from rank {rank}, outside the process group of world size {world_size}")
        for e in rosters[rank]:
            key = _layout_key(e)
            layout = made.get(key) if key is not None else None
            if layout is None:
                layout = TensorLayout.make(e.mesh, e.placements, e.dtype, param=e.name)
                if key is not None:
                    made[key] = layout
            if (e.global_shape, layout) not in valid:
                validate_layout(
                    e.global_shape, layout.mesh_shape, layout.placements,
                    param=f"{e.name} ({e.role} on rank {rank})", world_size=world_size, mesh_ranks=layout.mesh_ranks,
                )
                valid.add((e.global_shape, layout))
            if layout.coords(rank) is None:
                raise PlanError(
                    f"{e.name}: rank {rank} reported a {e.role} layout whose mesh {list(layout.mesh_ranks)} "
                    "does not contain it"
                )
            seen[(e.name, e.role)].setdefault(layout, []).append(rank)
            shapes[e.name].setdefault(tuple(e.global_shape), []).append(rank)
    for name, by_shape in shapes.items():
        if len(by_shape) > 1:
            parts = "; ".join(f"{list(s)} on ranks {r}" for s, r in by_shape.items())
            raise PlanError(f"{name}: global shape mismatch: {parts}")
    specs: dict[str, ParamSpec] = {}
    by_rank: dict[int, set[str]] = defaultdict(set)
    names = sorted({n for n, _ in seen})
    for name in names:
        shape = next(iter(shapes[name]))
        layouts = {}
        for role in ("src", "dst"):
            layouts[role] = seen.get((name, role), {})
            if role == "src" and len(layouts[role]) > 1:
                parts = "; ".join(f"{lay.describe()} on ranks {sorted(rs)}" for lay, rs in layouts[role].items())
                raise PlanError(f"{name}: source ranks disagree on the layout: {parts}")
            claimed: dict[int, TensorLayout] = {}
            for layout, reporters in layouts[role].items():
                missing = sorted(set(layout.mesh_ranks) - set(reporters))
                if missing:
                    raise PlanError(
                        f"{name}: {role} ranks {missing} are in mesh {list(layout.mesh_ranks)} "
                        f"reported by ranks {sorted(reporters)} but did not report that layout"
                    )
                for r in layout.mesh_ranks:
                    if r in claimed:
                        raise PlanError(
                            f"{name}: rank {r} is in two {role} layouts ({claimed[r].describe()} and "
                            f"{layout.describe()}); a rank holds one local tensor per param and side"
                        )
                    claimed[r] = layout
        if not layouts["src"]:
            if layouts["dst"]:
                needers = sorted(r for lay in layouts["dst"] for r in lay.mesh_ranks)
                raise PlanError(f"{name}: destination ranks {needers} need this param but no source rank holds it")
            continue
        src = next(iter(layouts["src"]))
        dsts = tuple(sorted(layouts["dst"], key=lambda lay: (min(lay.mesh_ranks), lay.mesh_ranks)))
        specs[name] = ParamSpec(name, shape, src, dsts)
        for lay in (src, *dsts):
            for r in lay.mesh_ranks:
                by_rank[r].add(name)
    return ParamIndex(world_size, specs, {r: sorted(ns) for r, ns in by_rank.items()})


def source_shards(spec: ParamSpec) -> list[tuple[int, Region]]:
    """Each distinct source shard of a param once, as (its first replica, its region), in mesh order.

    What a broadcast-based refit sends: one broadcast per shard, rooted at one replica.
    """
    seen, out = set(), []
    for r in spec.src.mesh_ranks:
        key = spec.src.shard_key(r)
        if key not in seen:
            seen.add(key)
            root = spec.src.replicas(key)[0]
            out.append((root, spec.src.region(spec.shape, root)))
    return out


def min_bytes_needed(index: ParamIndex) -> int:
    """Bytes that must cross the wire: every destination element a rank does not already hold."""
    total = 0
    for spec in index.specs.values():
        for layout in spec.dsts:
            itemsize = dtype_from_name(wire_dtype(spec.src.dtype, layout.dtype)).itemsize
            for r in layout.mesh_ranks:
                region = layout.region(spec.shape, r)
                need = region_numel(region)
                if spec.src.coords(r) is not None:
                    need -= region_overlap_numel(region, spec.src.region(spec.shape, r))
                total += need * itemsize
    return total


def check_local_shapes(index: ParamIndex, rank: int, local_shapes: Mapping[str, Mapping[str, Sequence[int]]]) -> None:
    """Hold ``rank``'s local tensors to the merged index: ``local_shapes`` is, per role
    (``"src"`` / ``"dst"``), the shape of each of its local tensors by param name.

    Each shape must be the rank's slice of the global shape under its layout (DTensor /
    ``torch.chunk`` sizes). Raises ``LayoutError`` naming the param, the rank, its
    placements and mesh, and the wanted and given shapes: a local tensor of the wrong size
    would otherwise surface as a byte-count mismatch deep inside a transfer, naming neither.
    A param this rank does not hold on that side in the index is an error too (the rosters
    and the tensors were taken from different models).
    """
    for role, shapes in local_shapes.items():
        if role not in ("src", "dst"):
            raise PlanError(f"rank {rank}: local shapes given for role {role!r}; roles are 'src' and 'dst'")
        for name, given in shapes.items():
            spec = index.specs.get(name)
            layouts = () if spec is None else (spec.src,) if role == "src" else spec.dsts
            layout = next((lay for lay in layouts if lay.coords(rank) is not None), None)
            if layout is None:
                raise LayoutError(f"{name}: rank {rank} has a local {role} tensor, but the merged rosters "
                                  f"give it no {role} layout of this param")
            wanted = region_shape(layout.region(spec.shape, rank))
            if tuple(int(n) for n in given) != wanted:
                raise LayoutError(
                    f"{name}: rank {rank}'s local {role} tensor has shape {list(given)}, but global shape "
                    f"{list(spec.shape)} with placements {list(layout.placements)} on mesh "
                    f"{np.array(layout.mesh_ranks).reshape(layout.mesh_shape).tolist()} gives it {list(wanted)}"
                )
