"""The templated planner: one rank position's ops for one form, shared by every param having it.

A form is a param's shape and its source and destination layouts with ranks renumbered
canonically (see ``refit.plan.forms``). Params whose layouts differ only by which ranks
hold them (a model's layers, its experts) share one form, so a rank plans each form's
geometry once and then only instantiates templates, with names and real ranks, per param:
replaying the global schedule on every rank cost seconds at 1T-parameter scale.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from refit.layout import (
    Box,
    Region,
    intersect_regions,
    merge_intervals,
    region_numel,
    region_overlap_numel,
    region_shape,
    take_positions,
)
from refit.plan.buckets import contiguous, itemsize, split_box, wire_dtype
from refit.plan.geometry import GeometryCache
from refit.plan.roster import TensorLayout


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


class PlannedBlock:
    """A planned block in rank-relative form: its box, its task-id suffix, whether it can skip
    staging, and its element count (every op instantiated from it needs its bytes)."""

    __slots__ = ("box", "key", "direct", "numel")

    def __init__(self, box: Box, direct: bool):
        self.box = box
        self.key = f"|{tuple(box.start)}|{tuple(box.shape)}".encode()
        self.direct = direct
        self.numel = math.prod(box.shape)


_REPLICATION: dict[tuple, int] = {}


def _replication(layout: TensorLayout) -> int:
    """``layout.replication``, shared by every mesh of one shape and placements."""
    key = (layout.mesh_shape, layout.placements)
    got = _REPLICATION.get(key)
    if got is None:
        got = _REPLICATION[key] = layout.replication
    return got


def window(offset: int, total: int, k: int, rot: int) -> int:
    """Replica index serving the consumer whose bytes start at ``offset``.

    Contiguous byte windows bound every replica's share by ceil(total/k) plus one region;
    the per-param rotation keeps replica 0 from serving every param whose shard has a
    single consumer.
    """
    return ((offset * k) // total + rot) % k


def serving_replica(offset: int, nbytes: int, total: int, k: int, n: int, pos: int) -> int:
    """Which of ``k`` replicas serves a consumer's ``nbytes`` at ``offset`` of a shard's
    ``total``, for the param at ``pos`` of the ``n`` params sharing its shape and layouts.

    Those params' consumer bytes are laid end to end consumer by consumer (each consumer's
    bytes of every param, then the next consumer's), and the replicas take contiguous
    windows of that stream. So a consumer is served by the same replica for the whole
    group of params (one or two peers per replica set, not one per param), and each
    replica's share of the group is within one param's consumer bytes of the mean.
    """
    return ((n * offset + pos * nbytes) * k) // (n * total)


def rotation(name: str, salt: bytes = b"") -> int:
    """A param's rotation of its replicas' byte windows (a digest of its name: the same on every rank)."""
    return int.from_bytes(hashlib.blake2b(name.encode() + salt, digest_size=4).digest(), "little")


def _first_long_dim(region: Region) -> int | None:
    return next((i for i, n in enumerate(region_shape(region)) if n > 1), None)


class Stripe(NamedTuple):
    """A row block of a fan-out group's region: its offset along the cut dim (in the region's local order)."""

    offset: int
    region: Region


def stripes_of(region: Region, item_bytes: int, stripe_bytes: int) -> list[Stripe]:
    """Cut ``region`` into row blocks of about ``stripe_bytes`` along its first dim longer than one.

    The cut depends on the region alone, never on how many ranks share it, so blocks and
    their task ids stay the same when replicas join or leave.
    """
    lengths = region_shape(region)
    total = math.prod(lengths) * item_bytes
    d = _first_long_dim(region)
    if d is None or total == 0:
        return [Stripe(0, region)]
    n = max(1, min(lengths[d], -(-total // stripe_bytes)))
    out = []
    for s in range(n):
        a, b = (s * lengths[d]) // n, ((s + 1) * lengths[d]) // n
        cut = list(region)
        cut[d] = merge_intervals(take_positions(region[d], a, b))
        out.append(Stripe(a, tuple(cut)))
    return out


class FanGroup:
    """Fan-out: destination ranks needing one identical region, and the stripes it is cut into."""

    __slots__ = ("dst_index", "members", "region", "stripes", "cut_dim")

    def __init__(self, dst_index: int, region: Region, stripes: list[Stripe]):
        self.dst_index = dst_index
        self.members: list[int] = []
        self.region = region
        self.stripes = stripes
        self.cut_dim = _first_long_dim(region) or 0

    def owner(self, s: int, rot: int) -> int:
        """The member that receives stripe ``s`` from the sources: contiguous windows of
        stripes over the members, rotated per param."""
        m, n = len(self.members), len(self.stripes)
        return self.members[((s * m) // n + rot) % m]


class StripeRef(NamedTuple):
    """A fan-out consumer: stripe ``stripe`` of group ``group``."""

    group: int
    stripe: int


class Unit(NamedTuple):
    """One consumer of a source shard in canonical order: its bytes start at ``offset`` of the
    shard's consumer bytes; ``target`` is a canonical rank, or a stripe under fan-out."""

    offset: int
    nbytes: int
    target: int | StripeRef
    dst_index: int  # which destination layout of the param


class ShardConsumers(NamedTuple):
    """Every consumer of one source shard, their byte total, and each target's offset."""

    units: list[Unit]
    total: int
    offset_of: dict[int | StripeRef, int]


class SourceShare(NamedTuple):
    """What a source rank serves of its shard: the units in its byte window among ``replicas`` holders."""

    replicas: int
    replica_index: int
    total: int
    units: list[Unit]
    shard_key: tuple[int, ...]


class LocalCopy(NamedTuple):
    dst_index: int
    blocks: list[PlannedBlock]


class Receive(NamedTuple):
    """Blocks a destination rank receives from one source shard: ``nbytes`` at ``offset`` of
    the shard's ``total`` consumer bytes (see ``serving_replica`` for which replica sends them)."""

    replicas: list[int]
    offset: int
    total: int
    dst_index: int
    blocks: list[PlannedBlock]
    nbytes: int


class StripeReceive(NamedTuple):
    """One source shard's part of a fan-out stripe: what the owner receives, then gathers to the others."""

    replicas: list[int]
    offset: int
    total: int
    blocks: list[PlannedBlock]
    gathers: list[PlannedBlock]


class FanIn(NamedTuple):
    """A fan-out member's view of its group: its index, and per stripe the parts that make it."""

    group: FanGroup
    member_index: int
    stripes: list[list[StripeReceive]]


@dataclass(slots=True)
class Template:
    """One rank position's ops for one (shape, canonical layouts) form, before names and ranks.

    Ranks here are canonical indices; the per-param rotation is applied when the template
    is instantiated, so every param sharing the form (a model's layers and experts) reuses it.
    """

    local: list[LocalCopy] = field(default_factory=list)
    src: SourceShare | None = None
    recv: list[Receive] = field(default_factory=list)
    fan: FanIn | None = None
    windows: dict[int, list[int]] = field(default_factory=dict)  # rotation -> indices of my units
    unit_blocks: dict[int, list[PlannedBlock]] = field(default_factory=dict)

    def serves(self, n: int, pos: int) -> list[int]:
        """Indices of my units for the param at ``pos`` of ``n`` sharing this form's shape and
        layouts: those ``serving_replica`` gives to me (a bisection: stream offsets grow with the unit)."""
        if n == 1:
            return self.mine(0)
        k, w, total, units = self.src.replicas, self.src.replica_index, self.src.total, self.src.units
        whole = n * total

        def at(u: Unit) -> int:
            return n * u.offset + pos * u.nbytes

        lo = bisect.bisect_left(units, -(-w * whole // k), key=at)
        hi = bisect.bisect_left(units, -(-(w + 1) * whole // k), key=at)
        return [i for i in range(lo, hi) if units[i].nbytes]

    def mine(self, rot: int) -> list[int]:
        """Indices of the units in my byte window, for one rotation."""
        got = self.windows.get(rot)
        if got is None:
            k, w, total, units = self.src.replicas, self.src.replica_index, self.src.total, self.src.units
            # window(offset) == w  <=>  offset in [ceil(v*total/k), ceil((v+1)*total/k)), v = (w - rot) % k
            v = (w - rot) % k
            offsets = [u.offset for u in units]
            lo = bisect.bisect_left(offsets, -(-v * total // k))
            hi = bisect.bisect_left(offsets, -(-(v + 1) * total // k))
            got = self.windows[rot] = [i for i in range(lo, hi) if units[i].nbytes]
        return got


class FormPlanner:
    """Planning facts of one (shape, canonical layouts) form, shared by every param and rank having it.

    The consumers of one source shard are put in a canonical order (destination layouts
    by their lowest rank, ranks in mesh order; with fan-out, ranks that also hold a source
    shard first, then each fan-out group with its stripes), each gets a byte offset, and
    the replica whose byte window holds that offset serves it.
    """

    def __init__(self, shape, form, cache: GeometryCache, bucket_bytes: int, stripe_bytes: int | None):
        self.shape = shape
        self.src, self.dsts, self.domains = form
        self.cache = cache
        self.bucket_bytes = bucket_bytes
        self.stripe_bytes = stripe_bytes
        self.src_geo = cache.geometry(shape, self.src)
        self.wire = [wire_dtype(self.src.dtype, d.dtype) for d in self.dsts]
        self.witem = [itemsize(w) for w in self.wire]
        self._src_regions: dict[tuple, Region] = {}
        self._dst_regions: dict[tuple, Region] = {}
        self._units: dict[tuple, ShardConsumers] = {}
        self._blocks: dict[tuple, list[PlannedBlock]] = {}
        self._templates: dict[int, Template] = {}
        self._groups: list[FanGroup] | None = None
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

    def blocks(self, g: int, src_region: Region, dst_region: Region, within: FanGroup | None = None,
               offset: int = 0) -> list[PlannedBlock]:
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
                direct = (src_plain and dst_plain and contiguous(piece.shape, src_shape)
                          and contiguous(piece.shape, dst_shape))
                out.append(PlannedBlock(piece, direct))
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
    def groups(self, stats) -> list[FanGroup]:
        """Destination ranks outside the source mesh grouped by identical region (and dtype,
        and domain when domains are given), in consumer order."""
        if self._groups is None:
            by_key: dict[tuple, int] = {}
            groups: list[FanGroup] = []
            for g, layout in enumerate(self.dsts):
                for r in layout.mesh_ranks:
                    if self.src.coords(r) is not None:
                        continue
                    region = self.dst_region(g, r, stats)
                    key = (region, layout.dtype, None if self.domains is None else self.domains[r])
                    q = by_key.get(key)
                    if q is None:
                        q = by_key[key] = len(groups)
                        groups.append(FanGroup(g, region, stripes_of(region, self.witem[g], self.stripe_bytes)))
                    self._member[r] = (q, len(groups[q].members))
                    groups[q].members.append(r)
            self._groups = groups
        return self._groups

    def units(self, key, stats) -> ShardConsumers:
        """All consumers of source shard ``key`` in canonical order, their byte total, and
        each target's offset."""
        got = self._units.get(key)
        if got is not None:
            return got
        src_region = self.src_region(key, stats)
        rep_set = set(self.src_geo.key_ranks(key))
        units: list[Unit] = []
        off = 0
        if self.stripe_bytes is None:
            for g in range(len(self.dsts)):
                gb = self._group_bytes(g, src_region, rep_set, stats)
                if gb:
                    at = off
                    for r, nbytes in self._consumers_in_group(g, src_region, rep_set, stats):
                        units.append(Unit(at, nbytes, r, g))
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
                    units.append(Unit(off, nbytes, r, g))
                    off += nbytes
            for q, grp in enumerate(groups):
                if not region_overlap_numel(src_region, grp.region):
                    continue
                for s, (_, stripe) in enumerate(grp.stripes):
                    stats.consumers_walked += 1
                    nbytes = region_overlap_numel(src_region, stripe) * self.witem[grp.dst_index]
                    if nbytes:
                        units.append(Unit(off, nbytes, StripeRef(q, s), grp.dst_index))
                        off += nbytes
        got = self._units[key] = ShardConsumers(units, off, {u.target: u.offset for u in units})
        return got

    def unit_blocks(self, template: Template, i: int, stats) -> list[PlannedBlock]:
        got = template.unit_blocks.get(i)
        if got is None:
            unit = template.src.units[i]
            g, target = unit.dst_index, unit.target
            src_region = self.src_region(template.src.shard_key, stats)
            if isinstance(target, StripeRef):
                grp = self._groups[target.group]
                offset, stripe = grp.stripes[target.stripe]
                got = self.blocks(g, src_region, stripe, grp, offset)
            else:
                got = self.blocks(g, src_region, self.dst_region(g, target, stats))
            template.unit_blocks[i] = got
        return got

    # -- one rank position's template -------------------------------------------------------------
    def template(self, c: int, stats) -> Template:
        t = self._templates.get(c)
        if t is not None:
            stats.reused += 1
            return t
        stats.templates += 1
        t = Template()
        src, dsts = self.src, self.dsts
        fan = self.stripe_bytes is not None
        if src.coords(c) is not None:
            key = src.shard_key(c)
            replicas = self.src_geo.key_ranks(key)
            src_region = self.src_region(key, stats)
            for g, layout in enumerate(dsts):
                if layout.coords(c) is not None:
                    t.local.append(LocalCopy(g, self.blocks(g, src_region, self.dst_region(g, c, stats))))
            consumers = self.units(key, stats)
            if consumers.total:
                t.src = SourceShare(len(replicas), replicas.index(c), consumers.total, consumers.units, key)
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
                        consumers = self.units(key, stats)
                        blocks = self.blocks(g, self.src_region(key, stats), stripe, grp, offset)
                        gathers = [PlannedBlock(Box(b.box.start, b.box.shape, b.box.dst_start, b.box.dst_start),
                                                contiguous(b.box.shape, region_shape(grp.region))) for b in blocks]
                        parts.append(StripeReceive(replicas, consumers.offset_of[StripeRef(q, s)], consumers.total,
                                                   blocks, gathers))
                    per_stripe.append(parts)
                t.fan = FanIn(grp, j, per_stripe)
                continue
            for key in self.src_geo.overlapping_keys(my_region):
                replicas = self.src_geo.key_ranks(key)
                if c in replicas:
                    continue  # a local copy, planned on the source side
                src_region = self.src_region(key, stats)
                if fan:
                    consumers = self.units(key, stats)
                    off, total = consumers.offset_of[c], consumers.total
                else:
                    off, total = self._plain_offset(key, g, c, stats)
                nbytes = region_overlap_numel(src_region, my_region) * self.witem[g]
                t.recv.append(Receive(replicas, off, total, g, self.blocks(g, src_region, my_region), nbytes))
        self._templates[c] = t
        return t


