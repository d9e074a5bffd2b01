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
import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgpack
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
from refit.plan.casts import check_casts
from refit.plan.quant import scale_placements

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


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    src: TensorLayout
    dsts: tuple[TensorLayout, ...]  # ordered by lowest rank: appended engines come last


class SpecTable(Mapping):
    """Every param's ``ParamSpec`` by name, each made when first read, from params grouped
    by shared layouts (what ``merge_rosters`` finds).

    A rank reads the specs of its own params only: making all 70k of a 1T-parameter model
    up front cost more than merging the rosters. Iterating, ``values()`` and comparing with
    a dict make them all."""

    def __init__(self, groups: Sequence[tuple[TensorLayout, tuple[TensorLayout, ...], Sequence[str],
                                              Sequence[tuple[int, ...]]]]):
        self.groups = list(groups)  # (src, dsts, names, shapes)
        self._group: dict[str, int] = {}
        self._pos: dict[str, int] = {}
        for g, (_, _, names, _) in enumerate(self.groups):
            self._group.update(dict.fromkeys(names, g))
            self._pos.update(zip(names, range(len(names))))
        self._made: dict[str, ParamSpec] = {}

    def __getitem__(self, name: str) -> ParamSpec:
        got = self._made.get(name)
        if got is None:
            src, dsts, _, shapes = self.groups[self._group[name]]
            got = self._made[name] = ParamSpec(name, shapes[self._pos[name]], src, dsts)
        return got

    def __contains__(self, name: object) -> bool:
        return name in self._group

    def __iter__(self):
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def forget(self) -> None:
        """Drop the specs made so far (to time a cold build, which makes them)."""
        self._made.clear()

    def __getstate__(self) -> dict:  # the specs made so far are this process's working memory
        return {"groups": self.groups}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["groups"])


@dataclass(frozen=True, slots=True)
class ParamIndex:
    """Merged rosters: one spec per param and, per rank, the params it touches.

    Frozen: every rank plans from the same index, and plans are cached under its digest,
    so an index never changes after it is made. The planner's working state for an index
    lives in a ``PlanCache`` (keyed on the digest), not on the index."""

    world_size: int
    specs: Mapping[str, ParamSpec]  # a dict, or a SpecTable
    by_rank: Mapping[int, Sequence[str]]  # each rank's params, sorted
    # a content key of the whole index (world size, names, shapes and layouts): computed
    # from the specs when not given (``merge_rosters`` gives it, having the groups at hand)
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", specs_digest(self.world_size, self.specs))

    def ranks(self) -> list[int]:
        return sorted(self.by_rank)


def specs_digest(world_size: int, specs: Mapping[str, ParamSpec]) -> str:
    """The digest of an index's specs (see ``ParamIndex.digest``).

    Params sharing their layouts are digested together (``index_digest``), so the cost
    is one pass over the names plus one per distinct layout set."""
    if isinstance(specs, SpecTable):
        return index_digest(world_size, specs.groups)
    by_id: dict[tuple[int, int], tuple] = {}
    for name, s in specs.items():
        got = by_id.get((id(s.src), id(s.dsts)))
        if got is None:
            got = by_id[(id(s.src), id(s.dsts))] = (s.src, s.dsts, [], [])
        got[2].append(name)
        got[3].append(s.shape)
    return index_digest(world_size, by_id.values())


def roster_digest(names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> str:
    """A content digest of a group's names and global shapes (see ``RosterGroup``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update("\0".join(names).encode())
    h.update(msgpack.packb(shapes))  # 7x faster than repr for 70k shapes
    return h.hexdigest()


@dataclass(frozen=True)
class RosterGroup:
    """What one rank holds (``role="src"``) or needs (``role="dst"``) of every param it has
    on one layout (mesh, placements, dtype): the names sorted, with their global shapes.

    A rank reports a few groups instead of one entry per param: the layers of a pipeline
    stage, or the experts of an EP rank, share a layout. Every rank of a mesh reports the
    same names, so ``merge_rosters`` compares groups by ``digest`` and reads each distinct
    group's names once (and checks that its digest matches them), instead of reading every
    rank's copy of every name: at 1T-parameter scale that is ~140k names, not millions.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    mesh: Any
    placements: Any
    role: str  # "src" or "dst"
    digest: str
    # an FP8 destination's scale block (rows, cols), when the rank says which: lets the scale
    # grids' sources be sharded like their weights' (``derive_scale_sources``)
    block: tuple[int, int] | None = None

    @classmethod
    def make(cls, names, shapes, dtype, mesh, placements, role, block=None) -> RosterGroup:
        names = tuple(names)
        shapes = tuple(tuple(int(n) for n in s) for s in shapes)
        if role not in ("src", "dst"):
            raise PlanError(f"{names[0] if names else 'roster group'}: role must be 'src' or 'dst', got {role!r}")
        if len(names) != len(shapes):
            raise PlanError(f"roster group: {len(names)} names but {len(shapes)} shapes")
        if block is not None:
            block = tuple(int(b) for b in block)
            if len(block) != 2 or min(block) < 1:
                raise PlanError(f"{names[0] if names else 'roster group'}: block must be two positive sizes, "
                                f"got {list(block)}")
        return cls(names, shapes, dtype, mesh, placements, role, roster_digest(names, shapes), block)


def group_roster(entries: Iterable[RosterEntry | RosterGroup], *,
                 fp8_block: tuple[int, int] | None = None) -> list[RosterGroup]:
    """One rank's roster entries as groups, one per (layout, role): what a rank reports.

    Entries whose mesh or placements cannot key a group (an unhashable placement) stay
    groups of one, so ``merge_rosters`` still names their param when it rejects them.
    ``fp8_block``: the scale block of this rank's FP8 destinations, carried by their groups.
    """
    out: list[RosterGroup] = []
    by_key: dict[tuple, list[RosterEntry]] = {}
    for e in entries:
        if isinstance(e, RosterGroup):
            out.append(e)
            continue
        key = _layout_key(e)
        if key is None:
            out.append(RosterGroup.make((e.name,), (e.global_shape,), e.dtype, e.mesh, e.placements, e.role,
                                        _block_of(e, fp8_block)))
            continue
        by_key.setdefault((key, e.role), []).append(e)
    for es in by_key.values():
        es.sort(key=lambda x: x.name)
        e0 = es[0]
        out.append(RosterGroup.make([e.name for e in es], [e.global_shape for e in es], e0.dtype, e0.mesh,
                                    e0.placements, e0.role, _block_of(e0, fp8_block)))
    return out


def _block_of(e: RosterEntry, fp8_block: tuple[int, int] | None) -> tuple[int, int] | None:
    return fp8_block if e.role == "dst" and str(e.dtype).startswith("float8") else None


def index_digest(world_size: int, groups: Iterable[tuple]) -> str:
    """The digest of an index given as (src, dsts, names, shapes) groups of params sharing
    their layouts, however they were grouped: groups with equal layouts are joined, names
    sorted, and each layout's text is made once."""
    texts: dict[int, str] = {}

    def text(lay: TensorLayout) -> str:
        got = texts.get(id(lay))
        if got is None:
            got = texts[id(lay)] = repr(lay)
        return got

    by_value: dict[str, tuple[list, list]] = {}
    for src, dsts, names, shapes in groups:
        key = text(src) + "|" + ",".join(map(text, dsts))
        got = by_value.get(key)
        if got is None:
            got = by_value[key] = ([], [])
        got[0].extend(names)
        got[1].extend(shapes)
    h = hashlib.blake2b(digest_size=16)
    h.update(str(world_size).encode())
    for key, (names, shapes) in sorted(by_value.items(), key=lambda kv: min(kv[1][0])):
        if sorted(names) != names:  # a merge's groups come sorted: checking is one C-level pass
            order = sorted(range(len(names)), key=names.__getitem__)
            names, shapes = [names[i] for i in order], [shapes[i] for i in order]
        h.update(key.encode())
        h.update("\0".join(names).encode())
        h.update(msgpack.packb(shapes))
    return h.hexdigest()


def _layout_key(e: RosterEntry | RosterGroup) -> tuple | None:
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


class _NameSet:
    """One distinct group of names (by role and digest), and every layout reported with it
    and by whom."""

    __slots__ = ("group", "layouts", "index")

    def __init__(self, group: RosterGroup, index: int):
        self.group = group
        self.index = index
        self.layouts: dict[TensorLayout, list[int]] = {}


SCALE_SUFFIX = "_scale_inv"


def derive_scale_sources(rosters: Mapping[int, Iterable[RosterEntry | RosterGroup]]
                         ) -> dict[int, list[RosterEntry | RosterGroup]]:
    """Add the sources of the block scales that FP8 destinations ask for and no rank reports.

    An engine that keeps ``X`` in FP8 needs ``X_scale_inv`` too, which no trainer holds: the
    source ranks of ``X`` make it from their shards at every refit. Every such name becomes
    a float32 source on ``X``'s source mesh, reported for each of those ranks: sharded like
    ``X`` when every engine of ``X`` says its block and every source shard of ``X`` holds
    whole blocks of it (``refit.plan.quant.scale_placements``: each rank then makes the
    scales of its own blocks alone), and otherwise replicated (the ranks merge the block
    amaxes, so each holds the whole grid). Names are read once per distinct group.

    ``X`` itself is then sourced in its FP8 dtype (when every engine of it wants that one
    dtype): its source ranks send the FP8 copies they make, never a cast of their bf16.
    """
    rosters = {r: group_roster(v) for r, v in rosters.items()}
    seen: set[tuple[str, str]] = set()
    sources: dict[str, RosterGroup] = {}
    source_shapes: dict[str, tuple[int, ...]] = {}
    fp8_blocks: dict[str, set] = defaultdict(set)  # FP8 weight -> the blocks its engines said (None: unsaid)
    dst_dtypes: dict[str, set] = defaultdict(set)  # FP8 weight -> every dtype its engines want it in
    scale_wants: dict[str, tuple[int, ...]] = {}
    dst_groups = []
    for groups in rosters.values():
        for g in groups:
            if (g.role, g.digest) in seen:
                continue
            seen.add((g.role, g.digest))
            if g.role == "src":
                sources.update(dict.fromkeys(g.names, g))
                source_shapes.update(zip(g.names, g.shapes))
            else:
                dst_groups.append(g)
                if g.dtype.startswith("float8"):
                    for n in g.names:
                        fp8_blocks[n].add(None if g.block is None else tuple(g.block))
                else:
                    scale_wants.update((n, sh) for n, sh in zip(g.names, g.shapes) if n.endswith(SCALE_SUFFIX))
    for g in dst_groups:
        for n in g.names:
            if n in fp8_blocks:
                dst_dtypes[n].add(g.dtype)
    derived: dict[int, list[RosterEntry]] = {}
    quantized: dict[str, str] = {}  # FP8 weight -> the FP8 dtype its source ranks send it in
    for name, shape in sorted(scale_wants.items()):
        weight = name[: -len(SCALE_SUFFIX)]
        src = sources.get(weight)
        if name in sources or weight not in fp8_blocks or src is None:
            continue
        if len(dst_dtypes[weight]) == 1 and _quantizable(src.dtype):
            quantized[weight] = next(iter(dst_dtypes[weight]))
        mesh = np.asarray(src.mesh)
        placements = None
        blocks = fp8_blocks[weight]
        if len(blocks) == 1 and None not in blocks:
            placements = scale_placements(source_shapes[weight], mesh.shape, src.placements,
                                          next(iter(blocks)))
        placements = list(placements) if placements is not None else [Replicate()] * mesh.ndim
        for r in (int(x) for x in mesh.reshape(-1)):
            derived.setdefault(r, []).append(RosterEntry.make(name, shape, "float32", mesh.tolist(), placements, "src"))
    if quantized:
        rosters = {r: [h for g in groups for h in _sourced_quantized(g, quantized)] for r, groups in rosters.items()}
    for r, entries in derived.items():
        rosters[r] = [*rosters.get(r, []), *group_roster(entries)]
    return rosters


def _quantizable(dtype: str) -> bool:
    """Whether a source in ``dtype`` is quantized to block-scaled FP8 (bf16, fp16 or fp32)."""
    return dtype in ("bfloat16", "float16", "float32")


def _sourced_quantized(group: RosterGroup, quantized: Mapping[str, str]) -> list[RosterGroup]:
    """A source group with the weights that leave their ranks quantized split off, in their FP8 dtype.

    The source ranks send those weights from FP8 copies they make themselves, so the planner
    must see FP8 on both ends. Planned as a cast from bf16 instead, no block of theirs could
    be sent straight from the copy into the engine's tensor (a cast is never in place): every
    one went through staging buffers on both ends.
    """
    if group.role != "src" or not any(n in quantized for n in group.names):
        return [group]
    parts: dict[str, tuple[list[str], list[tuple[int, ...]]]] = {}
    for n, shape in zip(group.names, group.shapes):
        names, shapes = parts.setdefault(quantized.get(n, group.dtype), ([], []))
        names.append(n)
        shapes.append(shape)
    return [RosterGroup.make(names, shapes, dtype, group.mesh, group.placements, "src")
            for dtype, (names, shapes) in sorted(parts.items())]


def merge_rosters(rosters: Mapping[int, Iterable[RosterEntry | RosterGroup]], world_size: int) -> ParamIndex:
    """Check the per-rank rosters against each other and merge them into one spec per param.

    A rank's roster is a list of ``RosterGroup`` (what ranks report) or of ``RosterEntry``
    (one per param; grouped here first). Raises ``PlanError`` / ``LayoutError`` naming the
    param and the ranks for: a destination that no source holds, a shape mismatch,
    placements that do not fit the mesh, a mesh rank outside the group, a rank listed
    twice, a mesh rank that did not report the param, a rank in two destination
    layouts of one param, and a destination dtype that a cast would lose information into
    (``refit.plan.casts``: complex to real, floating point to integer).

    The work follows the distinct groups, not the ranks times their params: each group's
    names are read once, and params that share every group (the layers of a stage, the
    experts of an EP rank) share their layouts and their checks.

    FP8 destinations' block scales, which no rank holds, get sources derived from their
    weights' (``derive_scale_sources``).
    """
    rosters = {r: group_roster(v) for r, v in rosters.items()}
    if any(g.role == "dst" and g.dtype.startswith("float8") for gs in rosters.values() for g in gs):
        rosters = derive_scale_sources(rosters)
    made: dict[tuple, TensorLayout] = {}
    valid: set[tuple] = set()
    sets: dict[tuple[str, str], _NameSet] = {}
    distinct_shapes: dict[int, dict] = {}
    for rank in sorted(rosters):
        if not 0 <= rank < world_size:
            raise PlanError(f"roster from rank {rank}, outside the process group of world size {world_size}")
        for grp in group_roster(rosters[rank]):
            if not grp.names:
                continue
            key = _layout_key(grp)
            layout = made.get(key) if key is not None else None
            if layout is None:
                layout = TensorLayout.make(grp.mesh, grp.placements, grp.dtype, param=grp.names[0])
                if key is not None:
                    made[key] = layout
            ns = sets.get((grp.role, grp.digest))
            if ns is None:
                if roster_digest(grp.names, grp.shapes) != grp.digest:
                    raise PlanError(f"{grp.names[0]}: rank {rank}'s roster group does not match its digest")
                ns = sets[(grp.role, grp.digest)] = _NameSet(grp, len(sets))
            reporters = ns.layouts.get(layout)
            if reporters is None:
                reporters = ns.layouts[layout] = []
                shapes = distinct_shapes.get(ns.index)
                if shapes is None:
                    # each distinct shape with the first name having it (the later writes win)
                    shapes = distinct_shapes[ns.index] = dict(zip(ns.group.shapes[::-1], ns.group.names[::-1]))
                for shape, name in shapes.items():
                    if (shape, layout) not in valid:
                        validate_layout(
                            shape, layout.mesh_shape, layout.placements,
                            param=f"{name} ({grp.role} on rank {rank})", world_size=world_size,
                            mesh_ranks=layout.mesh_ranks,
                        )
                        valid.add((shape, layout))
            if layout.coords(rank) is None:
                raise PlanError(
                    f"{grp.names[0]}: rank {rank} reported a {grp.role} layout whose mesh {list(layout.mesh_ranks)} "
                    "does not contain it"
                )
            reporters.append(rank)
    namesets = list(sets.values())
    sigs = _one_source_one_destination(namesets)
    if sigs is None:
        sigs = _signatures(namesets)
    digest_groups: list[tuple] = []
    rank_sigs: dict[int, list[int]] = defaultdict(list)
    sig_names: list[Sequence[str]] = []
    for names, shapes, groups in sigs:
        src, dsts = _signature_layouts(groups, min(names))
        if src is None:
            continue
        if any(d.dtype != src.dtype for d in dsts):
            check_casts(names, src.dtype, src.mesh_ranks, [(d.dtype, d.mesh_ranks) for d in dsts])
        k = len(sig_names)
        sig_names.append(names)
        for lay in (src, *dsts):
            for r in lay.mesh_ranks:
                rank_sigs[r].append(k)
        digest_groups.append((src, dsts, names, shapes))
    by_rank: dict[int, list[str]] = {}
    lists: dict[tuple[int, ...], list[str]] = {}  # ranks of one mesh share one list
    for r in sorted(rank_sigs):
        ks = tuple(sorted(set(rank_sigs[r])))
        got = lists.get(ks)
        if got is None:
            got = lists[ks] = sorted(itertools.chain.from_iterable(sig_names[k] for k in ks))
        by_rank[r] = got
    return ParamIndex(world_size, SpecTable(digest_groups), by_rank, index_digest(world_size, digest_groups))


Signature = tuple[Sequence[str], Sequence[tuple[int, ...]], list[_NameSet]]


def _one_source_one_destination(namesets: list[_NameSet]) -> list[Signature] | None:
    """The params of each distinct combination of groups, when every param is in one source
    group and at most one destination group (how ranks that group by layout report a model:
    the replicas of one engine layout report one group, the same names); else None.

    Works a group at a time with C-level maps over its names. Anything unusual (a name in
    two groups of a side, a shape that differs, a destination no source holds) falls back
    to ``_signatures``, which finds and names it."""
    srcs = [ns for ns in namesets if ns.group.role == "src"]
    dsts = [ns for ns in namesets if ns.group.role == "dst"]
    src_of: dict[str, int] = {}
    for ns in srcs:
        src_of.update(dict.fromkeys(ns.group.names, ns.index))
    if len(src_of) != sum(len(ns.group.names) for ns in srcs):
        return None
    dst_of: dict[str, int] = {}
    dst_shape: dict[str, tuple[int, ...]] = {}
    for ns in dsts:
        dst_of.update(dict.fromkeys(ns.group.names, ns.index))
        dst_shape.update(zip(ns.group.names, ns.group.shapes))
    if len(dst_of) != sum(len(ns.group.names) for ns in dsts) or not dst_of.keys() <= src_of.keys():
        return None
    out: list[Signature] = []
    for ns in srcs:
        names, shapes = ns.group.names, ns.group.shapes
        if list(map(dst_shape.get, names, shapes)) != list(shapes):
            return None
        ids = list(map(dst_of.get, names))
        distinct = set(ids)
        if len(distinct) == 1:
            out.append((names, shapes, _with(namesets, ns, ids[0])))
            continue
        for d in sorted(distinct, key=lambda x: -1 if x is None else x):
            keep = list(map(operator.eq, ids, itertools.repeat(d)))
            out.append((list(itertools.compress(names, keep)), list(itertools.compress(shapes, keep)),
                        _with(namesets, ns, d)))
    return out


def _with(namesets: list[_NameSet], src: _NameSet, dst: int | None) -> list[_NameSet]:
    return [src] if dst is None else [src, namesets[dst]]


def _signatures(namesets: list[_NameSet]) -> list[Signature]:
    """The params of each distinct combination of groups, name by name (the general case);
    raises ``PlanError`` for a param reported with two global shapes."""
    member: dict[str, list[int]] = {}
    shape_of: dict[str, tuple[int, ...]] = {}
    mismatched: list[str] = []
    for ns in namesets:
        i = ns.index
        for name, shape in zip(ns.group.names, ns.group.shapes):
            got = member.get(name)
            if got is None:
                member[name] = [i]
                shape_of[name] = shape
            else:
                got.append(i)
                if shape != shape_of[name]:
                    mismatched.append(name)
    for name in sorted(mismatched)[:1]:
        by_shape: dict[tuple[int, ...], set[int]] = {}
        for i in member[name]:
            ns = namesets[i]
            shape = ns.group.shapes[ns.group.names.index(name)]
            for rs in ns.layouts.values():
                by_shape.setdefault(shape, set()).update(rs)
        ordered = sorted(by_shape.items(), key=lambda x: min(x[1]))
        parts = "; ".join(f"{list(s)} on ranks {sorted(r)}" for s, r in ordered)
        raise PlanError(f"{name}: global shape mismatch: {parts}")
    by_sig: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name, ids in member.items():
        by_sig[tuple(ids)].append(name)
    return [(names, [shape_of[n] for n in names], [namesets[i] for i in sig])
            for sig, names in sorted(by_sig.items(), key=lambda x: min(x[1]))]


def _signature_layouts(groups: list[_NameSet], first: str):
    """The source layout and destination layouts shared by ``names`` (params reported in
    exactly ``groups``; ``first`` names them in errors), after the checks of ``merge_rosters``;
    (None, ()) for params no rank holds as a source and none needs."""
    layouts: dict[str, dict[TensorLayout, set[int]]] = {"src": {}, "dst": {}}
    for ns in groups:
        per_role = layouts[ns.group.role]
        for lay, rs in ns.layouts.items():
            per_role.setdefault(lay, set()).update(rs)
    for role in ("src", "dst"):
        if role == "src" and len(layouts[role]) > 1:
            parts = "; ".join(f"{lay.describe()} on ranks {sorted(rs)}" for lay, rs in layouts[role].items())
            raise PlanError(f"{first}: source ranks disagree on the layout: {parts}")
        claimed: dict[int, TensorLayout] = {}
        for layout, reporters in layouts[role].items():
            missing = sorted(set(layout.mesh_ranks) - reporters)
            if missing:
                raise PlanError(
                    f"{first}: {role} ranks {missing} are in mesh {list(layout.mesh_ranks)} "
                    f"reported by ranks {sorted(reporters)} but did not report that layout"
                )
            for r in layout.mesh_ranks:
                if r in claimed:
                    raise PlanError(
                        f"{first}: rank {r} is in two {role} layouts ({claimed[r].describe()} and "
                        f"{layout.describe()}); a rank holds one local tensor per param and side"
                    )
                claimed[r] = layout
    if not layouts["src"]:
        if layouts["dst"]:
            needers = sorted(r for lay in layouts["dst"] for r in lay.mesh_ranks)
            raise PlanError(f"{first}: destination ranks {needers} need this param but no source rank holds it")
        return None, ()
    src = next(iter(layouts["src"]))
    dsts = tuple(sorted(layouts["dst"], key=lambda lay: (min(lay.mesh_ranks), lay.mesh_ranks)))
    return src, dsts


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
