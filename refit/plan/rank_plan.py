"""One rank's plan: its sends, receives and local copies, built from the merged index alone.

From the same rosters every rank builds ITS OWN ops, and the two ends of a transfer agree
without talking, because everything that decides an op is a pure function of the index:

* a task id is a digest of (param, destination rank, global block), so it is the same on
  both ends, and adding ranks never renumbers the ops that already existed;
* which source replica serves a destination is decided by byte offsets along a canonical
  consumer order (destination layouts by their lowest rank, ranks in mesh order), so
  appended engines land at the end of that order. The params sharing a shape and layouts
  (a stage's layers, an EP rank's experts) are laid end to end consumer by consumer and
  the replicas take contiguous windows of that stream: a destination meets one or two
  replicas of each source shard, not one per param, and the replicas' loads stay within
  one param's bytes of even (fan-out plans rotate each param's windows instead);
* ops between one pair of ranks are sorted by (param, block) and packed greedily into
  buckets, so both ends cut the same buckets.

A rank's planning work follows its own ops: the geometry of a form is shared by every
param having it (``refit.plan.templates``), so a 70k-tensor MoE model costs little more
than its distinct shapes plus one pass over its own ops.

Opt-in replica fan-out (``fanout=True``) sends a region that several destination ranks
need alike once per group, striped across the group, and completes it with an all-gather
inside the group; see ``build_rank_plan``.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from refit.errors import PlanError
from refit.plan.buckets import DEFAULT_BUCKET_BYTES, Bucket, Op, itemsize, pack_buckets
from refit.plan.forms import PlannerCache
from refit.plan.roster import ParamIndex, SpecTable
from refit.plan.templates import PlannedBlock, PlanStats, StripeRef, rotation, serving_replica, window

DEFAULT_STRIPE_BYTES = 4 << 20  # fan-out stripe grid (see build_rank_plan)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank's ops: what it sends and receives, packed into buckets per peer, and its
    local copies. Frozen once built, as both ends of every transfer rely on the same
    buckets; transports read it and never change it."""

    rank: int
    world_size: int
    bucket_bytes: int
    key: tuple  # plan_key(...), plus a suffix for plans derived from another
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

    def params_by_bucket(self) -> tuple[dict[tuple[int, int], list[str]], dict[tuple[int, int], list[str]]]:
        """(params of each bucket this rank sends, of each it receives), keyed as the checksums are."""
        return ({(b.peer, b.index): sorted({op.name for op in b.ops}) for b in self.sends},
                {(b.peer, b.index): sorted({op.name for op in b.ops}) for b in self.recvs})

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

    def gather_plan(self) -> RankPlan:
        """The fan-out all-gather as a plan of its own: its sources are this rank's
        destination tensors (``refit.transport.fanout`` runs it after the main plan)."""
        return RankPlan(self.rank, self.world_size, self.bucket_bytes, self.key + ("gather",),
                        sends=self.gather_sends, recvs=self.gather_recvs)


def _stripe_rotation(index: ParamIndex, name: str, leader: int, members: int) -> int:
    """Which member takes a param's first stripe window: the param's position among the
    group leader's params, so consecutive params start on consecutive members and every
    member ends up owning its share of stripes (every rank can compute it from the index)."""
    return bisect.bisect_left(index.by_rank[leader], name) % members


def _task_id_from(prefix: bytes, block: PlannedBlock) -> int:
    return int.from_bytes(hashlib.blake2b(prefix + block.key, digest_size=8).digest(), "little") >> 1


def normalize_domains(domains, world_size: int) -> tuple | None:
    """Fan-out domains as one label per rank (given as a sequence, a mapping or a callable)."""
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


def build_rank_plan(
    index: ParamIndex,
    rank: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stats: PlanStats | None = None,
    fanout: bool = False,
    fanout_domains: Any = None,
    fanout_stripe_bytes: int = DEFAULT_STRIPE_BYTES,
    cache: PlanCache | None = None,
) -> RankPlan:
    """Build the ops of ``rank`` alone, from merged rosters.

    The planning state (canonical forms, geometry, templates) is kept by ``cache`` for the
    index's digest, so the other ranks' builds from an equal index reuse it; without a
    cache, the module's shared one keeps it (``default_plan_cache``).

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
        planner = (cache if cache is not None else _DEFAULT_CACHE).planner(index)
        return _build_rank_plan(index, rank, planner, bucket_bytes, stats if stats is not None else PlanStats(),
                                fanout, fanout_domains, fanout_stripe_bytes)
    finally:
        if collecting:
            gc.enable()


def _build_rank_plan(index: ParamIndex, rank: int, cache: PlannerCache, bucket_bytes: int, stats: PlanStats,
                     fanout: bool, fanout_domains: Any, fanout_stripe_bytes: int) -> RankPlan:
    domains = normalize_domains(fanout_domains, index.world_size) if fanout else None
    stripe_bytes = fanout_stripe_bytes if fanout else None
    sends: dict[int, list[Op]] = defaultdict(list)
    recvs: dict[int, list[Op]] = defaultdict(list)
    gsends: dict[int, list[Op]] = defaultdict(list)
    grecvs: dict[int, list[Op]] = defaultdict(list)
    local: list[Op] = []
    names = index.by_rank.get(rank, ())
    specs = [index.specs[name] for name in names]
    # each param's position among the params sharing its shape and layouts (all of them are
    # this rank's too): the plain plan's replica choice lays a group's bytes end to end
    sizes: dict[tuple, int] = defaultdict(int)
    positions = []
    same = _SameLayouts()
    for spec in specs:
        key = (same.key(spec), spec.shape)
        positions.append(sizes[key])
        sizes[key] += 1
    for name, spec, pos in zip(names, specs, positions):
        lookup = cache.form(spec.src, spec.dsts, domains)
        ranks = lookup.ranks
        fp = cache.planner(spec.shape, lookup.form, bucket_bytes, stripe_bytes)
        c = lookup.canonical(rank)
        t = fp.template(c, stats)
        emit = _Emitter(name, fp.src.dtype, fp.dsts, fp.wire)

        for part in t.local:
            emit(local, part.blocks, rank, rank, part.dst_index)
        if t.src is not None:
            units = t.src.units
            if fanout:
                mine = t.mine(rotation(name) % t.src.replicas)
            else:
                mine = t.serves(sizes[(same.key(spec), spec.shape)], pos)
            for i in mine:
                target, g = units[i].target, units[i].dst_index
                if isinstance(target, StripeRef):
                    grp = fp.groups(stats)[target.group]
                    dst_c = grp.owner(target.stripe,
                                      _stripe_rotation(index, name, ranks[grp.members[0]], len(grp.members)))
                else:
                    dst_c = target
                d = ranks[dst_c]
                emit(sends[d], fp.unit_blocks(t, i, stats), rank, d, g)
        if t.recv:
            h = rotation(name)
            n = sizes[(same.key(spec), spec.shape)]
            for part in t.recv:
                k = len(part.replicas)
                if fanout:
                    v = window(part.offset, part.total, k, h % k)
                else:
                    v = serving_replica(part.offset, part.nbytes, part.total, k, n, pos)
                s = ranks[part.replicas[v]]
                emit(recvs[s], part.blocks, s, rank, part.dst_index)
        if t.fan is not None:
            grp = t.fan.group
            g = grp.dst_index
            h = rotation(name)
            rot_f = _stripe_rotation(index, name, ranks[grp.members[0]], len(grp.members))
            for stripe, parts in enumerate(t.fan.stripes):
                owner = grp.owner(stripe, rot_f)
                if owner == c:
                    others = [ranks[m] for m in grp.members if m != c]
                    for part in parts:
                        k = len(part.replicas)
                        s = ranks[part.replicas[window(part.offset, part.total, k, h % k)]]
                        emit(recvs[s], part.blocks, s, rank, g)
                        for d in others:
                            emit(gsends[d], part.gathers, rank, d, g, gather=True)
                else:
                    o = ranks[owner]
                    for part in parts:
                        emit(grecvs[o], part.gathers, o, rank, g, gather=True)

    def packed(by_peer: dict[int, list[Op]]) -> list[Bucket]:
        return sorted((b for p, o in by_peer.items() for b in pack_buckets(o, p, bucket_bytes)),
                      key=lambda b: (b.index, b.peer))

    plan = RankPlan(rank, index.world_size, bucket_bytes,
                    plan_key(index, rank, bucket_bytes, fanout=fanout_key(fanout, stripe_bytes, domains)),
                    sends=packed(sends), recvs=packed(recvs), local=sorted(local, key=Op.sort_key),
                    gather_sends=packed(gsends), gather_recvs=packed(grecvs), fanout=fanout)
    stats.ops += len(local) + sum(len(v) for d in (sends, recvs, gsends, grecvs) for v in d.values())
    return plan


class _SameLayouts:
    """Keys params by the value of their (source, destinations) layouts, hashing each
    distinct pair of layout objects once (params of one model share those objects)."""

    __slots__ = ("_by_id", "_by_value")

    def __init__(self):
        self._by_id: dict[tuple[int, int], int] = {}
        self._by_value: dict[tuple, int] = {}

    def key(self, spec) -> int:
        ids = (id(spec.src), id(spec.dsts))
        got = self._by_id.get(ids)
        if got is None:
            got = self._by_id[ids] = self._by_value.setdefault((spec.src, spec.dsts), len(self._by_value))
        return got


class _Emitter:
    """Turns one param's planned blocks into ops between actual ranks (task ids from the
    param's name and the destination rank, whose prefix is digested once per destination)."""

    __slots__ = ("name", "src_dtype", "dsts", "wire", "prefixes")

    def __init__(self, name: str, src_dtype: str, dsts, wire: list[str]):
        self.name, self.src_dtype, self.dsts, self.wire = name, src_dtype, dsts, wire
        self.prefixes: dict[int, bytes] = {}

    def __call__(self, out: list, blocks: list[PlannedBlock], s: int, d: int, g: int, gather: bool = False) -> None:
        """Ops of ``blocks`` from rank ``s`` to rank ``d`` (actual ranks) into ``out``."""
        prefix = self.prefixes.get(d)
        if prefix is None:
            prefix = self.prefixes[d] = f"{self.name}|{d}".encode()
        dd = self.dsts[g].dtype
        sd, wire = (dd, dd) if gather else (self.src_dtype, self.wire[g])
        item = itemsize(wire)
        name = self.name
        planned = Op.planned
        for b in blocks:
            out.append(planned(_task_id_from(prefix, b), name, s, d, b.box, sd, dd, wire, b.direct, b.numel * item))


def fanout_key(fanout: bool, stripe_bytes, domains) -> tuple | None:
    """The fan-out settings' part of a plan key (None without fan-out, so plain keys stay as they were)."""
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
    """Plans keyed on (world size, roster digest, rank, bucket size), and the planning state
    (canonical forms, geometry, templates) of the last ``max_indexes`` indexes, keyed on
    (world size, roster digest).

    The world size is in the key on purpose: a fleet that grows by an engine whose
    rosters happen to digest the same must not reuse a plan sized for the old world.
    Indexes are frozen, so equal keys mean equal content: an index's planning state is
    shared by every rank's build from it, and by a copy of it (one unpickled on another
    rank, or merged again from the same rosters).
    """

    def __init__(self, max_entries: int = 64, *, max_indexes: int = 4):
        self.max_entries = max_entries
        self.max_indexes = max_indexes
        self._plans: dict[tuple, RankPlan] = {}
        self._planners: OrderedDict[tuple[int, str], PlannerCache] = OrderedDict()
        self._lock = threading.Lock()  # builds on several threads may share one cache
        self.hits = 0
        self.misses = 0

    def planner(self, index: ParamIndex) -> PlannerCache:
        """The planning state of ``index`` (made empty on first use; the least recently used
        index's state is dropped past ``max_indexes``)."""
        key = (index.world_size, index.digest)
        with self._lock:
            got = self._planners.get(key)
            if got is None:
                got = self._planners[key] = PlannerCache()
                while len(self._planners) > self.max_indexes:
                    self._planners.popitem(last=False)
            else:
                self._planners.move_to_end(key)
            return got

    def forget(self, index: ParamIndex) -> None:
        """Drop the planning state of ``index`` (its plans stay cached)."""
        with self._lock:
            self._planners.pop((index.world_size, index.digest), None)

    def get(self, index: ParamIndex, rank: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            fanout: bool = False, fanout_domains: Any = None,
            fanout_stripe_bytes: int = DEFAULT_STRIPE_BYTES) -> RankPlan:
        domains = normalize_domains(fanout_domains, index.world_size) if fanout else None
        key = plan_key(index, rank, bucket_bytes, fanout=fanout_key(fanout, fanout_stripe_bytes, domains))
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = build_rank_plan(index, rank, bucket_bytes=bucket_bytes, fanout=fanout, fanout_domains=domains,
                               fanout_stripe_bytes=fanout_stripe_bytes, cache=self)
        if len(self._plans) >= self.max_entries:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        """Drop every cached plan and every index's planning state."""
        self._plans.clear()
        with self._lock:
            self._planners.clear()


_DEFAULT_CACHE = PlanCache()


def default_plan_cache() -> PlanCache:
    """The cache that keeps planning state for ``build_rank_plan`` calls given none (it
    caches no plans: only ``PlanCache.get`` does)."""
    return _DEFAULT_CACHE


def reset_planner_cache(index: ParamIndex, cache: PlanCache | None = None) -> None:
    """Forget the planning state kept for ``index`` (by ``cache``, or the shared one) and
    the specs made from a merge's groups: to time a cold build, as a rank's first after a
    membership change."""
    (cache if cache is not None else _DEFAULT_CACHE).forget(index)
    if isinstance(index.specs, SpecTable):
        index.specs.forget()
