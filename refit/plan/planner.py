"""The planner: from rosters to one rank's send / recv / local-copy ops, with no communicator.

Every rank contributes roster entries (what it holds as a source, what it needs as a
destination). From the same merged rosters each rank builds ITS OWN ops, and the two
ends of a transfer agree without talking, because everything that decides an op is a
pure function of the rosters:

* a task id is a digest of (param, destination rank, global block), so it is the same on
  both ends, and adding ranks never renumbers the ops that already existed;
* which source replica serves a destination is decided by byte offsets along a canonical
  consumer order (destination layouts by their lowest rank, ranks in mesh order), so
  appended engines land at the end of that order;
* ops between one pair of ranks are sorted by (param, block) and packed greedily into
  buckets, so both ends cut the same buckets.

A rank's planning work follows its own ops: intersecting regions are found per tensor dim
from the mesh dims that shard it, and a whole destination layout's byte total is
``numel x replication`` rather than a walk over its ranks. Params whose layouts differ only
by which ranks hold them (a model's layers, its experts) share one rank-relative template
of that geometry, so a 70k-tensor MoE model costs little more than its distinct shapes plus
one pass over its own ops. Replaying the global schedule on every rank (the approach this
replaces) costs seconds at 1T-parameter scale.

Opt-in replica fan-out (``fanout=True``) sends a region that several destination ranks
need alike once per group, striped across the group, and completes it with an all-gather
inside the group; see ``build_rank_plan``.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from refit.errors import LayoutError, PlanError
from refit.layout import (
    Box,
    Placement,
    Region,
    Replicate,
    _dim_overlaps,
    _merge,
    _take,
    dtype_from_name,
    dtype_name,
    intersect_regions,
    normalize_mesh,
    normalize_placements,
    region_numel,
    region_shape,
    region_overlap_numel,
    shard_region,
    validate_layout,
)

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_DIRECT_BYTES = 64 << 10  # smaller blocks are cheaper packed than sent alone (measured on gloo)
DEFAULT_STRIPE_BYTES = 4 << 20  # fan-out stripe grid (see build_rank_plan)

_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = dtype_from_name(dtype).itemsize
    return size


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
    def make(cls, mesh: Any, placements: Any, dtype: Any, *, param: str = "tensor") -> "TensorLayout":
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
    def make(cls, name, global_shape, dtype, mesh, placements, role) -> "RosterEntry":
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
        # the planner's per-index cache (see _planner_cache) is local working memory
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


@dataclass(frozen=True)
class Op:
    """One block of one param moving from ``src`` to ``dst`` (the same rank for a local copy)."""

    task_id: int
    name: str
    src: int
    dst: int
    box: Box
    src_dtype: str
    dst_dtype: str
    wire_dtype: str
    direct: bool = False  # contiguous in both local tensors, no cast: can skip staging

    @cached_property
    def nbytes(self) -> int:
        return self.box.numel * _itemsize(self.wire_dtype)

    def sort_key(self):
        return (self.name, self.box.start)


@dataclass(frozen=True)
class Bucket:
    """Ops between one pair of ranks packed into one buffer; ``index`` is its round."""

    peer: int
    index: int
    ops: tuple[Op, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops)


@dataclass
class RankPlan:
    rank: int
    world_size: int
    bucket_bytes: int
    key: tuple
    sends: list[Bucket] = field(default_factory=list)
    recvs: list[Bucket] = field(default_factory=list)
    local: list[Op] = field(default_factory=list)
    # replica fan-out (``build_rank_plan(..., fanout=True)``): the all-gather inside each
    # group of destination ranks, run after the sends and recvs above (see refit.transport.fanout)
    gather_sends: list[Bucket] = field(default_factory=list)
    gather_recvs: list[Bucket] = field(default_factory=list)
    fanout: bool = False

    @property
    def num_rounds(self) -> int:
        return 1 + max((b.index for b in self.sends + self.recvs), default=-1)

    @property
    def bytes_sent(self) -> int:
        return sum(b.nbytes for b in self.sends)

    @property
    def bytes_received(self) -> int:
        return sum(b.nbytes for b in self.recvs)

    @property
    def local_bytes(self) -> int:
        return sum(op.nbytes for op in self.local)

    def send_ops(self) -> list[Op]:
        return [op for b in self.sends for op in b.ops]

    def recv_ops(self) -> list[Op]:
        return [op for b in self.recvs for op in b.ops]

    def peers(self) -> list[int]:
        return sorted({b.peer for b in self.sends} | {b.peer for b in self.recvs})

    @property
    def gather_bytes_sent(self) -> int:
        return sum(b.nbytes for b in self.gather_sends)

    @property
    def gather_bytes_received(self) -> int:
        return sum(b.nbytes for b in self.gather_recvs)

    def gather_plan(self) -> "RankPlan":
        """The fan-out all-gather as a plan of its own: its sources are this rank's
        destination tensors (``refit.transport.fanout`` runs it after the main plan)."""
        return RankPlan(self.rank, self.world_size, self.bucket_bytes, self.key + ("gather",),
                        sends=self.gather_sends, recvs=self.gather_recvs)


def wire_dtype(src: str, dst: str) -> str:
    """The narrower of the two: narrowing casts happen while packing, widening on unpack,
    so the wire never carries more bytes than the narrower side needs."""
    if src == dst:
        return src
    return dst if dtype_from_name(dst).itemsize <= dtype_from_name(src).itemsize else src


def task_id(name: str, dst: int, start: Sequence[int], shape: Sequence[int]) -> int:
    h = hashlib.blake2b(f"{name}|{dst}|{tuple(start)}|{tuple(shape)}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Cut ``box`` into row blocks of at most ``limit`` bytes (rectangular, so every piece
    stays one strided view on both sides). A piece can only exceed ``limit`` if one
    element does."""
    if box.numel * itemsize <= limit or box.numel == 0:
        return [box]
    for d in range(len(box.shape)):
        inner = math.prod(box.shape[d + 1:]) * itemsize
        if inner <= limit and box.shape[d] > 1:
            step = max(1, limit // inner)
            out = []
            for a in range(0, box.shape[d], step):
                n = min(step, box.shape[d] - a)
                out.append(_shift(box, d, a, n))
            return out
        if box.shape[d] > 1:
            return [p for a in range(box.shape[d]) for p in split_box(_shift(box, d, a, 1), itemsize, limit)]
    return [box]


def _shift(box: Box, d: int, offset: int, length: int) -> Box:
    def bump(t):
        return tuple(x + offset if i == d else x for i, x in enumerate(t))

    shape = tuple(length if i == d else n for i, n in enumerate(box.shape))
    return Box(bump(box.start), shape, bump(box.src_start), bump(box.dst_start))


class _LayoutGeometry:
    """Per tensor dim, the intervals of every coordinate of the mesh dims sharding it.

    Finding which shards of a layout overlap a region then costs a filter per tensor dim
    over that dim's sharding coordinates, not a walk over every rank of the layout.
    """

    def __init__(self, shape: tuple[int, ...], layout: TensorLayout, tables: tuple | None = None):
        self.shape = shape
        self.layout = layout
        if tables is not None:  # the same shape on another mesh of the same shape and placements
            self.dims_of, self.by_dim = tables
            return
        self.dims_of: dict[int, list[int]] = defaultdict(list)
        for m, p in enumerate(layout.placements):
            if not isinstance(p, Replicate):
                self.dims_of[p.dim].append(m)
        self.by_dim: dict[int, list[tuple[tuple[int, ...], tuple]]] = {}
        for t, mdims in self.dims_of.items():
            sub_shape = [layout.mesh_shape[m] for m in mdims]
            sub_places = [layout.placements[m] for m in mdims]
            entries = []
            for sub in itertools.product(*[range(n) for n in sub_shape]):
                one_dim = shard_region((shape[t],), sub_shape, sub, [_retarget(p) for p in sub_places])
                entries.append((sub, one_dim[0]))
            self.by_dim[t] = entries

    def overlapping_keys(self, region: Region) -> list[tuple[int, ...]]:
        """Shard keys (coords on the sharding mesh dims, in their order) overlapping ``region``."""
        if any(not iv for iv in region):
            return []
        per_t: list[tuple[list[int], list[tuple[int, ...]]]] = []
        for t, entries in self.by_dim.items():
            hits = [sub for sub, iv in entries if _dim_overlaps(iv, region[t])]
            if not hits:
                return []
            per_t.append((self.dims_of[t], hits))
        order = self.layout.sharding_dims
        keys = []
        for combo in itertools.product(*[hits for _, hits in per_t]):
            coords = {}
            for (mdims, _), sub in zip(per_t, combo):
                coords.update(zip(mdims, sub))
            keys.append(tuple(coords[m] for m in order))
        keys.sort()
        return keys

    def key_ranks(self, key: tuple[int, ...]) -> list[int]:
        return self.layout.replicas(key)


def _retarget(p: Placement) -> Placement:
    """The same placement acting on dim 0 of a one-dim view of its tensor dim."""
    return type(p)(0) if not hasattr(p, "split_factor") else type(p)(0, p.split_factor)


@dataclass
class PlanStats:
    """Work counters: what a rank's planning cost grows with (see property (e)).

    ``regions`` and ``consumers_walked`` count the geometry done for this rank's params.
    Params sharing a shape and a rank-relative layout (a model's layers, its experts)
    share that geometry through one template per rank position: ``templates`` counts
    those built, ``reused`` those found, ``ops`` the ops instantiated from them.
    """

    regions: int = 0
    consumers_walked: int = 0
    templates: int = 0
    reused: int = 0
    ops: int = 0


class _Block:
    """A planned block in rank-relative form: its box, its task-id suffix, whether it can skip staging."""

    __slots__ = ("box", "key", "direct")

    def __init__(self, box: Box, direct: bool):
        self.box = box
        self.key = f"|{tuple(box.start)}|{tuple(box.shape)}".encode()
        self.direct = direct


_REPLICATION: dict[tuple, int] = {}


def _replication(layout: TensorLayout) -> int:
    """``layout.replication``, shared by every mesh of one shape and placements."""
    key = (layout.mesh_shape, layout.placements)
    got = _REPLICATION.get(key)
    if got is None:
        got = _REPLICATION[key] = layout.replication
    return got


def _window(offset: int, total: int, k: int, rot: int) -> int:
    """Replica index serving the consumer whose bytes start at ``offset``.

    Contiguous byte windows bound every replica's share by ceil(total/k) plus one region;
    the per-param rotation keeps replica 0 from serving every param whose shard has a
    single consumer.
    """
    return ((offset * k) // total + rot) % k


def _rotation(name: str, salt: bytes = b"") -> int:
    return int.from_bytes(hashlib.blake2b(name.encode() + salt, digest_size=4).digest(), "little")


def _first_long_dim(region: Region) -> int | None:
    return next((i for i, n in enumerate(region_shape(region)) if n > 1), None)


def _stripes(region: Region, itemsize: int, stripe_bytes: int) -> list[tuple[int, Region]]:
    """Cut ``region`` into row blocks of about ``stripe_bytes`` along its first dim longer than one:
    (offset along that dim in the region's local order, stripe).

    The cut depends on the region alone, never on how many ranks share it, so blocks and
    their task ids stay the same when replicas join or leave.
    """
    lengths = region_shape(region)
    total = math.prod(lengths) * itemsize
    d = _first_long_dim(region)
    if d is None or total == 0:
        return [(0, region)]
    n = max(1, min(lengths[d], -(-total // stripe_bytes)))
    out = []
    for s in range(n):
        a, b = (s * lengths[d]) // n, ((s + 1) * lengths[d]) // n
        cut = list(region)
        cut[d] = _merge(_take(region[d], a, b))
        out.append((a, tuple(cut)))
    return out


class _Group:
    """Fan-out: destination ranks needing one identical region, and the stripes it is cut into."""

    __slots__ = ("g", "members", "region", "stripes", "cut_dim")

    def __init__(self, g: int, region: Region, stripes: list[tuple[int, Region]]):
        self.g = g
        self.members: list[int] = []
        self.region = region
        self.stripes = stripes
        self.cut_dim = _first_long_dim(region) or 0

    def owner(self, s: int, rot: int) -> int:
        """The member that receives stripe ``s`` from the sources: contiguous windows of
        stripes over the members, rotated per param."""
        m, n = len(self.members), len(self.stripes)
        return self.members[((s * m) // n + rot) % m]


class _Template:
    """One rank position's ops for one (shape, canonical layouts) form, before names and ranks.

    Ranks here are canonical indices; the per-param rotation is applied when the template
    is instantiated, so every param sharing the form (a model's layers and experts) reuses it.
    """

    __slots__ = ("local", "src", "recv", "fan", "_mine", "_unit_blocks")

    def __init__(self):
        self.local: list[tuple[int, list[_Block]]] = []
        self.src: tuple | None = None  # (k, my window, total, units, source shard key)
        self.recv: list[tuple] = []  # (k, replicas, offset, total, g, blocks)
        self.fan: tuple | None = None  # (group, my index, [per stripe: [(k, replicas, offset, total, blocks, gathers)]])
        self._mine: dict[int, list[int]] = {}
        self._unit_blocks: dict[int, list[_Block]] = {}

    def mine(self, rot: int) -> list[int]:
        """Indices of the units in my byte window, for one rotation."""
        got = self._mine.get(rot)
        if got is None:
            k, w, total, units, _ = self.src
            # window(offset) == w  <=>  offset in [ceil(v*total/k), ceil((v+1)*total/k)), v = (w - rot) % k
            v = (w - rot) % k
            offsets = [u[0] for u in units]
            lo = bisect.bisect_left(offsets, -(-v * total // k))
            hi = bisect.bisect_left(offsets, -(-(v + 1) * total // k))
            got = self._mine[rot] = [i for i in range(lo, hi) if units[i][1]]
        return got


class _FormPlanner:
    """Planning facts of one (shape, canonical layouts) form, shared by every param and rank having it.

    The consumers of one source shard are put in a canonical order (destination layouts
    by their lowest rank, ranks in mesh order; with fan-out, ranks that also hold a source
    shard first, then each fan-out group with its stripes), each gets a byte offset, and
    the replica whose byte window holds that offset serves it.
    """

    def __init__(self, shape, form, cache: "_PlannerCache", bucket_bytes: int, stripe_bytes: int | None):
        self.shape = shape
        self.src, self.dsts, self.domains = form
        self.cache = cache
        self.bucket_bytes = bucket_bytes
        self.stripe_bytes = stripe_bytes
        self.src_geo = cache.geometry(shape, self.src)
        self.wire = [wire_dtype(self.src.dtype, d.dtype) for d in self.dsts]
        self.witem = [_itemsize(w) for w in self.wire]
        self._src_regions: dict[tuple, Region] = {}
        self._dst_regions: dict[tuple, Region] = {}
        self._units: dict[tuple, tuple] = {}
        self._blocks: dict[tuple, list[_Block]] = {}
        self._templates: dict[int, _Template] = {}
        self._groups: list[_Group] | None = None
        self._consumer_forms: dict[tuple, list[tuple[int, int]]] = {}
        self._prefix: dict[tuple, list[int]] = {}
        n_src = len(self.src.mesh_ranks)  # canonical: the source mesh is 0..n_src-1
        self._disjoint = [min(lay.mesh_ranks) >= n_src for lay in self.dsts]
        self._member: dict[int, tuple[int, int]] = {}

    # -- geometry ----------------------------------------------------------------------------
    def src_region(self, key, stats) -> Region:
        reg = self._src_regions.get(key)
        if reg is None:
            stats.regions += 1
            reg = self._src_regions[key] = self.cache.region(self.shape, self.src, self.src_geo.key_ranks(key)[0])
        return reg

    def dst_region(self, g: int, rank: int, stats) -> Region:
        layout = self.dsts[g]
        k = (g, layout.shard_key(rank))
        reg = self._dst_regions.get(k)
        if reg is None:
            stats.regions += 1
            reg = self._dst_regions[k] = self.cache.region(self.shape, layout, rank)
        return reg

    def blocks(self, g: int, src_region: Region, dst_region: Region, within: _Group | None = None,
               offset: int = 0) -> list[_Block]:
        """Boxes of ``src_region`` ∩ ``dst_region`` cut to the bucket size. With ``within``,
        ``dst_region`` is a stripe of that group's region starting at local ``offset``
        along its cut dim, and destination offsets are given in the region's local order.
        Memoized: the replicas of one engine layout all cut the same blocks."""
        memo_key = (src_region, dst_region, None if within is None else within.region, offset,
                    self.wire[g], self.dsts[g].dtype)
        got = self._blocks.get(memo_key)
        if got is not None:
            return got
        itemsize = self.witem[g]
        wire = wire_dtype(self.src.dtype, self.dsts[g].dtype)
        src_plain, dst_plain = self.src.dtype == wire, self.dsts[g].dtype == wire
        src_shape = region_shape(src_region)
        dst_shape = region_shape(dst_region if within is None else within.region)
        out = []
        for box in intersect_regions(src_region, dst_region):
            if within is not None and offset:
                d = within.cut_dim
                box = Box(box.start, box.shape, box.src_start,
                          tuple(x + offset if i == d else x for i, x in enumerate(box.dst_start)))
            for piece in split_box(box, itemsize, self.bucket_bytes):
                direct = (src_plain and dst_plain and _contiguous(piece.shape, src_shape)
                          and _contiguous(piece.shape, dst_shape))
                out.append(_Block(piece, direct))
        self._blocks[memo_key] = out
        return out

    # -- plain consumers ----------------------------------------------------------------------
    def _group_bytes(self, g: int, src_region: Region, replicas, stats, numel: int | None = None) -> int:
        """Bytes that dst layout ``g`` needs from one shard, less what its ranks hold themselves."""
        layout = self.dsts[g]
        total = (region_numel(src_region) if numel is None else numel) * _replication(layout)
        for r in () if self._disjoint[g] else replicas:
            if layout.coords(r) is not None:
                total -= region_overlap_numel(src_region, self.dst_region(g, r, stats))
        return total * self.witem[g]

    def _consumers_in_group(self, g: int, src_region: Region, rep_set, stats):
        """(rank, bytes) of the non-local consumers of one source shard in dst layout ``g``, in mesh order."""
        layout = self.dsts[g]
        if self._disjoint[g]:
            # no source rank in this layout: the answer depends on its form alone, and the
            # replicas of one engine share it (mesh positions, mapped to this layout's ranks)
            fkey = (src_region, layout.mesh_shape, layout.placements, layout.dtype)
            flat = self._consumer_forms.get(fkey)
            if flat is None:
                flat = self._consumer_forms[fkey] = [
                    (layout.flat_index(r), n) for r, n in self._walk_consumers(g, src_region, rep_set, stats)]
            ranks = layout.mesh_ranks
            return [(ranks[i], n) for i, n in flat]
        return self._walk_consumers(g, src_region, rep_set, stats)

    def _walk_consumers(self, g: int, src_region: Region, rep_set, stats):
        layout = self.dsts[g]
        geo = self.cache.geometry(self.shape, layout)
        out = [r for dkey in geo.overlapping_keys(src_region) for r in geo.key_ranks(dkey) if r not in rep_set]
        out.sort(key=layout.flat_index)
        stats.consumers_walked += len(out)
        item = self.witem[g]
        return [(r, region_overlap_numel(src_region, self.dst_region(g, r, stats)) * item) for r in out]

    def _plain_offset(self, key, g: int, c: int, stats) -> tuple[int, int]:
        """(my offset, total) among the consumers of shard ``key``, walking my own layout only:
        the other layouts' byte totals are ``numel x replication`` less what they hold."""
        src_region = self.src_region(key, stats)
        rep_set = set(self.src_geo.key_ranks(key))
        prefix = self._prefix.get(key)
        if prefix is None:  # byte totals of the layouts before each one, shared by every rank position
            prefix = [0]
            numel = region_numel(src_region)
            for h in range(len(self.dsts)):
                prefix.append(prefix[-1] + self._group_bytes(h, src_region, rep_set, stats, numel))
            self._prefix[key] = prefix
        off = prefix[g]
        for r, nbytes in self._consumers_in_group(g, src_region, rep_set, stats):
            if r == c:
                break
            off += nbytes
        return off, prefix[-1]

    # -- fan-out --------------------------------------------------------------------------------
    def groups(self, stats) -> list[_Group]:
        """Destination ranks outside the source mesh grouped by identical region (and dtype,
        and domain when domains are given), in consumer order."""
        if self._groups is None:
            by_key: dict[tuple, int] = {}
            groups: list[_Group] = []
            for g, layout in enumerate(self.dsts):
                for r in layout.mesh_ranks:
                    if self.src.coords(r) is not None:
                        continue
                    region = self.dst_region(g, r, stats)
                    key = (region, layout.dtype, None if self.domains is None else self.domains[r])
                    q = by_key.get(key)
                    if q is None:
                        q = by_key[key] = len(groups)
                        groups.append(_Group(g, region, _stripes(region, self.witem[g], self.stripe_bytes)))
                    self._member[r] = (q, len(groups[q].members))
                    groups[q].members.append(r)
            self._groups = groups
        return self._groups

    def units(self, key, stats) -> tuple[list[tuple], int, dict]:
        """All consumers of source shard ``key`` as (offset, bytes, target, g) in canonical
        order, their byte total, and each target's offset. A target is a rank, or
        (group, stripe) under fan-out."""
        got = self._units.get(key)
        if got is not None:
            return got
        src_region = self.src_region(key, stats)
        rep_set = set(self.src_geo.key_ranks(key))
        units: list[tuple] = []
        off = 0
        if self.stripe_bytes is None:
            for g in range(len(self.dsts)):
                gb = self._group_bytes(g, src_region, rep_set, stats)
                if gb:
                    at = off
                    for r, nbytes in self._consumers_in_group(g, src_region, rep_set, stats):
                        units.append((at, nbytes, r, g))
                        at += nbytes
                off += gb
        else:
            groups = self.groups(stats)
            colocated = sorted((g, lay.flat_index(r), r) for r in self.src.mesh_ranks if r not in rep_set
                               for g, lay in enumerate(self.dsts) if lay.coords(r) is not None)
            for g, _, r in colocated:
                stats.consumers_walked += 1
                nbytes = region_overlap_numel(src_region, self.dst_region(g, r, stats)) * self.witem[g]
                if nbytes:
                    units.append((off, nbytes, r, g))
                    off += nbytes
            for q, grp in enumerate(groups):
                if not region_overlap_numel(src_region, grp.region):
                    continue
                for s, (_, stripe) in enumerate(grp.stripes):
                    stats.consumers_walked += 1
                    nbytes = region_overlap_numel(src_region, stripe) * self.witem[grp.g]
                    if nbytes:
                        units.append((off, nbytes, (q, s), grp.g))
                        off += nbytes
        got = self._units[key] = (units, off, {u[2]: u[0] for u in units})
        return got

    def unit_blocks(self, t: _Template, i: int, stats) -> list[_Block]:
        got = t._unit_blocks.get(i)
        if got is None:
            key = t.src[4]
            _, _, target, g = t.src[3][i]
            src_region = self.src_region(key, stats)
            if isinstance(target, tuple):
                grp = self._groups[target[0]]
                offset, stripe = grp.stripes[target[1]]
                got = self.blocks(g, src_region, stripe, grp, offset)
            else:
                got = self.blocks(g, src_region, self.dst_region(g, target, stats))
            t._unit_blocks[i] = got
        return got

    # -- one rank position's template -------------------------------------------------------------
    def template(self, c: int, stats) -> _Template:
        t = self._templates.get(c)
        if t is not None:
            stats.reused += 1
            return t
        stats.templates += 1
        t = _Template()
        src, dsts = self.src, self.dsts
        fan = self.stripe_bytes is not None
        if src.coords(c) is not None:
            key = src.shard_key(c)
            replicas = self.src_geo.key_ranks(key)
            src_region = self.src_region(key, stats)
            for g, layout in enumerate(dsts):
                if layout.coords(c) is not None:
                    t.local.append((g, self.blocks(g, src_region, self.dst_region(g, c, stats))))
            units, total, _ = self.units(key, stats)
            if total:
                t.src = (len(replicas), replicas.index(c), total, units, key)
        for g, layout in enumerate(dsts):
            if layout.coords(c) is None:
                continue
            my_region = self.dst_region(g, c, stats)
            if fan and src.coords(c) is None:
                groups = self.groups(stats)
                q, j = self._member[c]
                grp = groups[q]
                per_stripe = []
                for s, (offset, stripe) in enumerate(grp.stripes):
                    parts = []
                    for key in self.src_geo.overlapping_keys(stripe):
                        replicas = self.src_geo.key_ranks(key)
                        units, total, where = self.units(key, stats)
                        blocks = self.blocks(g, self.src_region(key, stats), stripe, grp, offset)
                        gathers = [_Block(Box(b.box.start, b.box.shape, b.box.dst_start, b.box.dst_start),
                                          _contiguous(b.box.shape, region_shape(grp.region))) for b in blocks]
                        parts.append((len(replicas), replicas, where[(q, s)], total, blocks, gathers))
                    per_stripe.append(parts)
                t.fan = (grp, j, per_stripe)
                continue
            for key in self.src_geo.overlapping_keys(my_region):
                replicas = self.src_geo.key_ranks(key)
                if c in replicas:
                    continue  # a local copy, planned on the source side
                src_region = self.src_region(key, stats)
                if fan:
                    units, total, where = self.units(key, stats)
                    off = where[c]
                else:
                    off, total = self._plain_offset(key, g, c, stats)
                t.recv.append((len(replicas), replicas, off, total, g, self.blocks(g, src_region, my_region)))
        self._templates[c] = t
        return t


class _DisjointMap:
    """Canonical index <-> rank for layouts whose source mesh shares no rank with the
    destinations: index ``i < n`` is source mesh position ``i``, the rest run through the
    destination layouts in order. Costs nothing per param beyond the lookups it serves."""

    __slots__ = ("src", "dsts", "where", "offsets", "n")

    def __init__(self, src: TensorLayout, dsts: tuple[TensorLayout, ...], info: tuple, n: int):
        self.src, self.dsts = src, dsts
        self.where, self.offsets = info
        self.n = n

    def __getitem__(self, x: int) -> int:  # canonical index -> rank
        if x < self.n:
            return self.src.mesh_ranks[x]
        x -= self.n
        g = bisect.bisect_right(self.offsets, x) - 1
        return self.dsts[g].mesh_ranks[x - self.offsets[g]]

    def canonical(self, rank: int) -> int:  # rank -> canonical index
        i = self.src._flat.get(rank)
        return i if i is not None else self.n + self.where[rank]


class _PlannerCache:
    """Per-index planning state: canonical forms, geometry and templates, filled on demand.

    A form is a param's source and destination layouts with ranks renumbered by first
    appearance (source mesh, then each destination mesh): params whose layouts differ
    only by which ranks hold them (the layers of one pipeline stage, the experts of one
    EP rank) share a form, and so share their geometry and templates.
    """

    def __init__(self):
        self._geometry: dict[tuple, _LayoutGeometry] = {}
        self._tables: dict[tuple, tuple] = {}
        self._regions: dict[tuple, Region] = {}
        self._forms: dict[tuple, tuple] = {}
        self._by_id: dict[tuple, tuple] = {}
        self._form_objects: dict[tuple, tuple] = {}
        self._dst_infos: dict[tuple, tuple] = {}
        self._canon_dsts: dict[tuple, tuple] = {}
        self._canon_layouts: dict[tuple, TensorLayout] = {}
        self._planners: dict[tuple, _FormPlanner] = {}

    def geometry(self, shape, layout: TensorLayout) -> _LayoutGeometry:
        key = (shape, layout)
        geo = self._geometry.get(key)
        if geo is None:
            tkey = (shape, layout.mesh_shape, layout.placements)
            tables = self._tables.get(tkey)
            geo = self._geometry[key] = _LayoutGeometry(shape, layout, tables)
            if tables is None:
                self._tables[tkey] = (geo.dims_of, geo.by_dim)
        return geo

    def region(self, shape, layout: TensorLayout, rank: int) -> Region:
        """``layout.region(shape, rank)``, shared by every mesh of one shape and placements."""
        coords = layout.coords(rank)
        key = (shape, layout.mesh_shape, layout.placements, coords)
        reg = self._regions.get(key)
        if reg is None:
            reg = self._regions[key] = shard_region(shape, layout.mesh_shape, coords, layout.placements)
        return reg

    def form(self, src: TensorLayout, dsts: tuple[TensorLayout, ...], domains) -> tuple:
        """(form, canonical index -> rank, rank -> canonical index) of one param's layouts.

        Looked up by object identity first: the params of one model share their layout
        objects, and hashing a tuple of hundreds of engine layouts per param would make
        a rank's work grow with the engine count."""
        key = (id(src), id(dsts), id(domains))
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is src and hit[1] is dsts and hit[2] is domains:
            return hit[3]
        got = self._form(src, dsts, domains)
        self._by_id[key] = (src, dsts, domains, got)
        return got

    def _form(self, src: TensorLayout, dsts: tuple[TensorLayout, ...], domains) -> tuple:
        if domains is None:
            info = self._dst_info(dsts)
            if not any(r in info[0] for r in src.mesh_ranks):
                # the usual case, sources and destinations on different ranks: canonical
                # indices are the source mesh positions, then the destination layouts' in order
                n = len(src.mesh_ranks)
                cdsts = self._canon_dsts.get((dsts, n))
                if cdsts is None:
                    cdsts = self._canon_dsts[(dsts, n)] = tuple(
                        self._canon_range(d, n + off) for d, off in zip(dsts, info[1]))
                form = self._interned((self._canon_range(src, 0), cdsts, None))
                m = _DisjointMap(src, dsts, info, n)
                return (form, m, m)
        key = (src, dsts, domains)
        got = self._forms.get(key)
        if got is None:
            to_c: dict[int, int] = {}
            for lay in (src, *dsts):
                for r in lay.mesh_ranks:
                    if r not in to_c:
                        to_c[r] = len(to_c)
            ranks = tuple(to_c)
            cdoms = None
            if domains is not None:
                labels: dict[Any, int] = {}
                cdoms = tuple(labels.setdefault(domains[r], len(labels)) for r in ranks)
            form = self._interned((self._canon(src, to_c), tuple(self._canon(d, to_c) for d in dsts), cdoms))
            got = self._forms[key] = (form, ranks, to_c)
        return got

    def _interned(self, form: tuple) -> tuple:
        """One object per distinct form, so that later lookups key on its identity."""
        return self._form_objects.setdefault(form, form)

    def _dst_info(self, dsts: tuple[TensorLayout, ...]) -> tuple:
        """(rank -> canonical offset among the destination layouts, each layout's first offset)."""
        info = self._dst_infos.get(dsts)
        if info is None:
            where: dict[int, int] = {}
            offsets = []
            for lay in dsts:
                offsets.append(len(where))
                for r in lay.mesh_ranks:
                    where[r] = len(where)
            info = self._dst_infos[dsts] = (where, tuple(offsets))
        return info

    def _canon_range(self, layout: TensorLayout, first: int) -> TensorLayout:
        key = (tuple(range(first, first + len(layout.mesh_ranks))), layout.mesh_shape, layout.placements, layout.dtype)
        lay = self._canon_layouts.get(key)
        if lay is None:
            lay = self._canon_layouts[key] = TensorLayout(*key)
        return lay

    def _canon(self, layout: TensorLayout, to_c: dict[int, int]) -> TensorLayout:
        ranks = tuple(to_c[r] for r in layout.mesh_ranks)
        key = (ranks, layout.mesh_shape, layout.placements, layout.dtype)
        lay = self._canon_layouts.get(key)
        if lay is None:
            lay = self._canon_layouts[key] = TensorLayout(*key)
        return lay

    def planner(self, shape, form, bucket_bytes: int, stripe_bytes: int | None) -> _FormPlanner:
        key = (shape, id(form), bucket_bytes, stripe_bytes)  # forms are interned: see _form
        fp = self._planners.get(key)
        if fp is None:
            fp = self._planners[key] = _FormPlanner(shape, form, self, bucket_bytes, stripe_bytes)
        return fp


def _planner_cache(index: ParamIndex) -> _PlannerCache:
    cache = index.__dict__.get("_planner_cache")
    if cache is None:
        cache = index.__dict__["_planner_cache"] = _PlannerCache()
    return cache


def reset_planner_cache(index: ParamIndex) -> None:
    """Forget the geometry and templates cached on ``index`` (to time a cold build)."""
    index.__dict__.pop("_planner_cache", None)


def _stripe_rotation(index: ParamIndex, name: str, leader: int, members: int) -> int:
    """Which member takes a param's first stripe window: the param's position among the
    group leader's params, so consecutive params start on consecutive members and every
    member ends up owning its share of stripes (every rank can compute it from the index)."""
    return bisect.bisect_left(index.by_rank[leader], name) % members


def _task_id_from(prefix: bytes, block: _Block) -> int:
    return int.from_bytes(hashlib.blake2b(prefix + block.key, digest_size=8).digest(), "little") >> 1


def _normalize_domains(domains, world_size: int):
    if domains is None:
        return None
    if callable(domains):
        return tuple(domains(r) for r in range(world_size))
    if isinstance(domains, Mapping):
        return tuple(domains.get(r, ("rank", r)) for r in range(world_size))
    out = tuple(domains)
    if len(out) < world_size:
        raise PlanError(f"fanout_domains: {len(out)} entries for a world of {world_size} ranks")
    return out[:world_size]


def _contiguous(box_shape: Sequence[int], tensor_shape: Sequence[int]) -> bool:
    """Whether a block is one contiguous run of a C-contiguous tensor of ``tensor_shape``."""
    d = 0
    while d < len(box_shape) and box_shape[d] == 1:
        d += 1
    return all(box_shape[e] == tensor_shape[e] for e in range(d + 1, len(box_shape)))


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def pack_buckets(ops: Sequence[Op], peer: int, bucket_bytes: int, direct_bytes: int | None = None) -> list[Bucket]:
    """Greedy packing of one pair's ops, in canonical order, into buckets of at most
    ``bucket_bytes``; each op aligned to its element size so it can be viewed in place.

    An op of at least ``direct_bytes`` that is contiguous on both ends with no cast gets
    a bucket of its own, after the packed ones: the transport then sends it from, and
    receives it into, the tensors themselves, and the copies in and out of staging (the
    largest cost on a CPU host) disappear for the bulk of a model's bytes. A block that
    only one end holds contiguous stays packed: alone, its staged end would take a round
    of its own, and many medium blocks would then move one round trip at a time.
    """
    direct_bytes = DEFAULT_DIRECT_BYTES if direct_bytes is None else direct_bytes
    ordered = sorted(ops, key=Op.sort_key)
    alone = [op for op in ordered if op.direct and op.nbytes >= direct_bytes]
    packed = [op for op in ordered if not (op.direct and op.nbytes >= direct_bytes)]
    buckets: list[Bucket] = []
    cur_ops: list[Op] = []
    cur_offsets: list[int] = []
    size = 0
    for op in packed:
        itemsize = _itemsize(op.wire_dtype)
        at = _align(size, itemsize)
        if cur_ops and at + op.nbytes > bucket_bytes:
            buckets.append(Bucket(peer, len(buckets), tuple(cur_ops), tuple(cur_offsets), size))
            cur_ops, cur_offsets, at = [], [], 0
        cur_ops.append(op)
        cur_offsets.append(at)
        size = at + op.nbytes
    if cur_ops:
        buckets.append(Bucket(peer, len(buckets), tuple(cur_ops), tuple(cur_offsets), size))
    for op in alone:
        buckets.append(Bucket(peer, len(buckets), (op,), (0,), op.nbytes))
    return buckets


class _GeometryCache:
    def __init__(self):
        self._cache: dict[tuple, _LayoutGeometry] = {}

    def __call__(self, shape, layout) -> _LayoutGeometry:
        key = (shape, layout)
        geo = self._cache.get(key)
        if geo is None:
            geo = self._cache[key] = _LayoutGeometry(shape, layout)
        return geo


def build_rank_plan(
    index: ParamIndex,
    rank: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stats: PlanStats | None = None,
    fanout: bool = False,
    fanout_domains: Any = None,
    fanout_stripe_bytes: int = DEFAULT_STRIPE_BYTES,
) -> RankPlan:
    """Build the ops of ``rank`` alone, from merged rosters.

    ``fanout=True`` (opt-in) stripes every region that several destination ranks outside
    the source mesh need alike: the sources send each stripe once per group, to one
    member, and the members complete the region with an all-gather among themselves
    (``RankPlan.gather_sends`` / ``gather_recvs``, run by ``refit.transport.fanout``). So the
    sources' egress is one copy per group instead of one per replica. ``fanout_domains``
    (a rank -> domain sequence, mapping or callable, e.g. the node of each rank) keeps
    groups inside one domain, so the all-gather stays on the fast links. Stripes are cut
    on a grid of about ``fanout_stripe_bytes`` that depends on the region alone, so task
    ids stay stable when replicas join.
    """
    if bucket_bytes < 16:
        raise PlanError(f"bucket_bytes must be at least 16, got {bucket_bytes}")
    if fanout and fanout_stripe_bytes < 1:
        raise PlanError(f"fanout_stripe_bytes must be positive, got {fanout_stripe_bytes}")
    # The build allocates many small acyclic objects next to a large index: the cyclic
    # collector's full passes over that heap would cost more than the build itself.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _build_rank_plan(index, rank, bucket_bytes, stats if stats is not None else PlanStats(), fanout,
                                fanout_domains, fanout_stripe_bytes)
    finally:
        if collecting:
            gc.enable()


def _build_rank_plan(index, rank, bucket_bytes, stats, fanout, fanout_domains, fanout_stripe_bytes) -> RankPlan:
    cache = _planner_cache(index)
    domains = _normalize_domains(fanout_domains, index.world_size) if fanout else None
    stripe_bytes = fanout_stripe_bytes if fanout else None
    sends: dict[int, list[Op]] = defaultdict(list)
    recvs: dict[int, list[Op]] = defaultdict(list)
    gsends: dict[int, list[Op]] = defaultdict(list)
    grecvs: dict[int, list[Op]] = defaultdict(list)
    local: list[Op] = []
    for name in index.by_rank.get(rank, ()):
        spec = index.specs[name]
        form, ranks, to_c = cache.form(spec.src, spec.dsts, domains)
        fp = cache.planner(spec.shape, form, bucket_bytes, stripe_bytes)
        c = to_c.canonical(rank) if isinstance(to_c, _DisjointMap) else to_c[rank]
        t = fp.template(c, stats)
        src_dtype = fp.src.dtype
        dsts = fp.dsts
        prefixes: dict[int, bytes] = {}

        def emit(out: list, blocks: list[_Block], s: int, d: int, g: int, gather: bool = False) -> None:
            """Ops of ``blocks`` from rank ``s`` to rank ``d`` (actual ranks) into ``out``."""
            prefix = prefixes.get(d)
            if prefix is None:
                prefix = prefixes[d] = f"{name}|{d}".encode()
            dd = dsts[g].dtype
            sd, wire = (dd, dd) if gather else (src_dtype, fp.wire[g])
            for b in blocks:
                out.append(Op(_task_id_from(prefix, b), name, s, d, b.box, sd, dd, wire, b.direct))

        for g, blocks in t.local:
            emit(local, blocks, rank, rank, g)
        if t.src is not None:
            k = t.src[0]
            rot = _rotation(name) % k
            units = t.src[3]
            for i in t.mine(rot):
                target, g = units[i][2], units[i][3]
                if isinstance(target, tuple):
                    grp = fp._groups[target[0]]
                    dst_c = grp.owner(target[1], _stripe_rotation(index, name, ranks[grp.members[0]], len(grp.members)))
                else:
                    dst_c = target
                d = ranks[dst_c]
                emit(sends[d], fp.unit_blocks(t, i, stats), rank, d, g)
        if t.recv:
            h = _rotation(name)
            for k, replicas, off, total, g, blocks in t.recv:
                s = ranks[replicas[_window(off, total, k, h % k)]]
                emit(recvs[s], blocks, s, rank, g)
        if t.fan is not None:
            grp, j, per_stripe = t.fan
            g = grp.g
            h = _rotation(name)
            rot_f = _stripe_rotation(index, name, ranks[grp.members[0]], len(grp.members))
            for s, parts in enumerate(per_stripe):
                owner = grp.owner(s, rot_f)
                if owner == c:
                    others = [ranks[m] for m in grp.members if m != c]
                    for k, replicas, off, total, blocks, gathers in parts:
                        s = ranks[replicas[_window(off, total, k, h % k)]]
                        emit(recvs[s], blocks, s, rank, g)
                        for d in others:
                            emit(gsends[d], gathers, rank, d, g, gather=True)
                else:
                    o = ranks[owner]
                    for *_, gathers in parts:
                        emit(grecvs[o], gathers, o, rank, g, gather=True)
    plan = RankPlan(rank, index.world_size, bucket_bytes,
                    plan_key(index, rank, bucket_bytes, fanout=_fanout_key(fanout, stripe_bytes, domains)))

    def packed(by_peer: dict[int, list[Op]]) -> list[Bucket]:
        return sorted((b for p, o in by_peer.items() for b in pack_buckets(o, p, bucket_bytes)),
                      key=lambda b: (b.index, b.peer))

    plan.sends = packed(sends)
    plan.recvs = packed(recvs)
    plan.local = sorted(local, key=Op.sort_key)
    plan.gather_sends = packed(gsends)
    plan.gather_recvs = packed(grecvs)
    plan.fanout = fanout
    stats.ops += len(local) + sum(len(v) for d in (sends, recvs, gsends, grecvs) for v in d.values())
    return plan


def _fanout_key(fanout: bool, stripe_bytes, domains) -> tuple | None:
    if not fanout:
        return None
    digest = None
    if domains is not None:
        digest = hashlib.blake2b(repr(domains).encode(), digest_size=8).hexdigest()
    return ("fanout", stripe_bytes, digest)


def plan_key(index: ParamIndex, rank: int, bucket_bytes: int, *, fanout: tuple | None = None) -> tuple:
    key = (index.world_size, index.digest, rank, bucket_bytes)
    return key if fanout is None else key + (fanout,)


class PlanCache:
    """Plans keyed on (world size, roster digest, rank, bucket size).

    The world size is in the key on purpose: a fleet that grows by an engine whose
    rosters happen to digest the same must not reuse a plan sized for the old world.
    """

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._plans: dict[tuple, RankPlan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, index: ParamIndex, rank: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            fanout: bool = False, fanout_domains: Any = None,
            fanout_stripe_bytes: int = DEFAULT_STRIPE_BYTES) -> RankPlan:
        domains = _normalize_domains(fanout_domains, index.world_size) if fanout else None
        key = plan_key(index, rank, bucket_bytes, fanout=_fanout_key(fanout, fanout_stripe_bytes, domains))
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = build_rank_plan(index, rank, bucket_bytes=bucket_bytes, fanout=fanout, fanout_domains=domains,
                               fanout_stripe_bytes=fanout_stripe_bytes)
        if len(self._plans) >= self.max_entries:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()


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
        geo_cache = _GeometryCache()
        src_geo = geo_cache(spec.shape, spec.src)
        for layout in spec.dsts:
            itemsize = dtype_from_name(wire_dtype(spec.src.dtype, layout.dtype)).itemsize
            for r in layout.mesh_ranks:
                region = layout.region(spec.shape, r)
                need = region_numel(region)
                if spec.src.coords(r) is not None:
                    need -= region_overlap_numel(region, spec.src.region(spec.shape, r))
                total += need * itemsize
    return total
