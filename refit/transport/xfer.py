"""``xferdtensor``: reshard one tensor from a source mesh to a destination mesh.

Every rank of ``process_group`` calls it with the same meshes and placements; a rank
outside a mesh passes ``None`` for that side's tensor. The ranks first exchange a few
bytes of metadata (shape, dtype, local shape, their own view of both meshes and
placements, any local error) so that every bad input is rejected on every rank with
the same message before a byte moves, then each builds its own plan (cached on the
roster digest) and executes it.

Each rank plans from its own arguments, so two ranks that disagree on a mesh's order
would each build a consistent-looking plan and data would land in the wrong rows with
no error anywhere; and a rank alone with a bad argument would raise alone and leave
the others waiting on the wire. Hence the exchange compares every rank's view first.
Callers that move more than one tensor per call (``xferdtensor_fp8``) put one
``RankRecord`` per tensor into their own record, gather it once, and check each with
``check_records``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import numbers
import time
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit.comm.group import StatelessProcessGroup, as_communicator
from refit.comm.wire import register_record
from refit.errors import LayoutError, PlanError, RefitError, TransportError, error_summary
from refit.layout import (
    dtype_name,
    local_tensor_of,
    normalize_mesh,
    normalize_placements,
)
from refit.plan import (
    DEFAULT_BUCKET_BYTES,
    PlanCache,
    RosterEntry,
    TensorLayout,
    build_rank_plan,
    check_local_shapes,
    group_roster,
    merge_rosters,
)
from refit.transport.base import TransferStats, device_of
from refit.transport.broadcast import BroadcastPlan
from refit.transport.casts import (
    CastOverflow,
    find_overflows,
    fits,
    narrowing_casts,
    raise_or_warn,
    value_range,
)
from refit.transport.factory import make_executor

PARAM = "tensor"
_plan_cache = PlanCache(max_entries=256)


@dataclass(frozen=True)
class SideMeta:
    """What a rank holds on one side of a transfer: global shape, dtype name and local shape."""

    shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...]


@dataclass(frozen=True)
class LayoutView:
    """One rank's reading of one side's mesh (nested lists of ranks) and placements (their reprs)."""

    mesh: list
    placements: tuple[str, ...]

    def __str__(self) -> str:
        return f"mesh={self.mesh} placements=[{', '.join(self.placements)}]"


@dataclass(frozen=True)
class RankSettings:
    """One rank's settings of a transfer, which every rank must pass alike (None: not a setting of this call)."""

    bucket_bytes: int | None = None
    timeout_s: float | None = None
    strict_casts: bool | None = None


# why every rank must pass the same value of each setting
_SETTINGS_WHY = {
    "bucket_bytes": "both ends of a pair cut the same buckets without talking, and a receiver that cuts others "
                    "gets sizes it did not expect (gloo aborts the process)",
    "timeout_s": "a rank that gives up first leaves the others blocked on it until their own timeout",
    "strict_casts": "the ranks would disagree on whether a value beyond its destination's range stops the transfer",
}


@dataclass(frozen=True)
class RankRecord:
    """One rank's arguments to one tensor's transfer, as every rank compares them (None: not held / not read).

    ``src_range``: the smallest and largest finite value of this rank's source, held against the
    destination dtype once every rank's record is in (``cast_overflows``)."""

    src: SideMeta | None
    dst: SideMeta | None
    src_view: LayoutView | None
    dst_view: LayoutView | None
    error: str | None
    settings: RankSettings | None = None
    src_range: tuple[float, float] | None = None


@dataclass(frozen=True)
class ResharderRecord:
    """One rank's arguments to a ``Resharder``: its roster, its local shapes by role, its settings, its error."""

    roster: list
    local_shapes: dict
    settings: RankSettings | None
    error: str | None


for _cls in (SideMeta, LayoutView, RankSettings, RankRecord, ResharderRecord):
    register_record(_cls)


def check_settings(settings: Sequence[RankSettings | None], what: str) -> None:
    """Raise ``PlanError`` on every rank, naming the setting and who passed what, when ranks disagree
    on one (``settings[r]`` is rank r's; a rank whose settings could not be read raised already)."""
    known = {r: s for r, s in enumerate(settings) if s is not None}
    for f in dataclasses.fields(RankSettings):
        check_agree(f"{what}: {f.name}", {r: getattr(s, f.name) for r, s in known.items()},
                    f"every rank must pass the same {f.name}: {_SETTINGS_WHY[f.name]}")


def finite_seconds(value: Any, name: str) -> float:
    """``value`` as seconds when it is a finite number > 0; ``PlanError`` naming ``name`` otherwise.

    An infinite timeout was taken, and failed only inside ``run`` (the deadline overflowed
    the wait), after the other ranks had started."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ArgNames:
    """How the caller names one side's tensor, mesh and placement arguments, so errors name them too."""

    tensor: str
    mesh: str
    placement: str


SIDES = {"src": ArgNames("src_tensor", "src_mesh", "src_placement"),
         "dst": ArgNames("dst_tensor", "dst_mesh", "dst_placement")}


def side_meta(t: Any) -> SideMeta | None:
    if t is None:
        return None
    local = local_tensor_of(t)
    dtype = getattr(t, "dtype", local.dtype)
    return SideMeta(tuple(int(s) for s in t.shape), dtype_name(dtype), tuple(int(s) for s in local.shape))


def layout_view(names: ArgNames, role: str, mesh: Any, placements: Any, world_size: int, *,
                param: str = PARAM) -> LayoutView:
    """This rank's reading of one side's (``role``'s) mesh and placements, as data every rank can compare."""
    if mesh is None:
        raise LayoutError(f"{names.mesh}: a mesh is required")
    arr = normalize_mesh(mesh, param=f"{param} ({role}): mesh")
    ranks = [int(r) for r in arr.reshape(-1)]
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise LayoutError(f"{names.mesh}: rank(s) {bad} outside the process group of world size {world_size}")
    placed = normalize_placements(placements, param=f"{param} ({role}): placements")
    return LayoutView(arr.tolist(), tuple(repr(p) for p in placed))


def _by_rank(values: Mapping[int, Any]) -> str:
    groups: dict[str, list[int]] = defaultdict(list)
    for r, v in values.items():
        groups[str(v)].append(r)
    return "; ".join(f"rank(s) {ranks}: {v}" for v, ranks in groups.items())


def raise_local_errors(errors: Sequence[str | None]) -> None:
    """Every rank raises the same error, naming the ranks where each failure happened (``errors[r]``: rank r's)."""
    found: dict[str, list[int]] = defaultdict(list)
    for r, e in enumerate(errors):
        if e:
            found[e].append(r)
    if found:
        raise PlanError("; ".join(f"{msg} (on rank(s) {ranks})" for msg, ranks in found.items()))


def check_agree(what: str, values: Mapping[int, Any], why: str) -> None:
    """Raise, naming which ranks passed what, when ``values`` (rank -> its argument) are not all equal."""
    if len({repr(v) for v in values.values()}) > 1:
        raise PlanError(f"{what}: the ranks disagree ({_by_rank(values)}); {why}")


def rank_record(world_size: int, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, *,
                sides: Mapping[str, ArgNames] = SIDES, param: str = PARAM) -> RankRecord:
    """This rank's record of one tensor's transfer; an argument it cannot read becomes its ``error``."""
    try:
        return RankRecord(side_meta(src_tensor), side_meta(dst_tensor),
                          layout_view(sides["src"], "src", src_mesh, src_placement, world_size, param=param),
                          layout_view(sides["dst"], "dst", dst_mesh, dst_placement, world_size, param=param),
                          None)
    except (TypeError, RefitError) as e:
        return RankRecord(None, None, None, None, str(e))


def check_records(records: Sequence[RankRecord], world_size: int, src_mesh, src_placement, dst_mesh, dst_placement,
                  *, sides: Mapping[str, ArgNames] = SIDES, param: str = PARAM):
    """Every rank's record of one tensor's transfer held against the others: the merged index and the
    param's spec, or the same error on every rank (``records[r]`` is rank r's; the meshes and
    placements are this rank's, which every rank's view is checked to equal first)."""
    raise_local_errors([g.error for g in records])
    check_settings([g.settings for g in records], "xferdtensor")
    for side in ("src", "dst"):
        names = sides[side]
        check_agree(f"{names.mesh} / {names.placement}",
                    {r: getattr(g, f"{side}_view") for r, g in enumerate(records)},
                    "every rank must pass the same meshes and placements")
    shapes = {m.shape for g in records for m in (g.src, g.dst) if m is not None}
    if len(shapes) > 1:
        holders: dict[tuple[int, ...], list[str]] = {}
        for r, g in enumerate(records):
            for side in ("src", "dst"):
                m = getattr(g, side)
                if m is not None:
                    holders.setdefault(m.shape, []).append(f"{side}@{r}")
        parts = "; ".join(f"{list(k)} on {v}" for k, v in holders.items())
        raise PlanError(f"{param}: global shape mismatch between ranks: {parts}")
    layouts = {"src": (src_mesh, src_placement), "dst": (dst_mesh, dst_placement)}
    rosters = {r: [RosterEntry.make(param, m.shape, m.dtype, *layouts[side], side)
                   for side in ("src", "dst") if (m := getattr(g, side)) is not None]
               for r, g in enumerate(records)}
    for side, (mesh, _) in layouts.items():
        names = sides[side]
        lay = TensorLayout.make(mesh, [], "float32", param=f"{param} ({side})")
        for r in lay.mesh_ranks:
            if getattr(records[r], side) is None:
                raise PlanError(f"{names.tensor}: rank {r} is in {names.mesh} {list(lay.mesh_ranks)} but passed None")
        for r, g in enumerate(records):
            if getattr(g, side) is not None and r not in lay.mesh_ranks:
                raise PlanError(f"{names.tensor}: rank {r} passed a tensor but is not in "
                                f"{names.mesh} {list(lay.mesh_ranks)}")
    index = merge_rosters(rosters, world_size)
    spec = index.specs.get(param)
    if spec is None:
        raise PlanError(f"{param}: no rank holds a source tensor")
    for r, g in enumerate(records):
        for side in ("src", "dst"):
            m = getattr(g, side)
            if m is not None:
                try:
                    check_local_shapes(index, r, {side: {param: m.local_shape}})
                except LayoutError as e:
                    raise LayoutError(f"{sides[side].tensor} / {sides[side].placement}: {e}") from None
    return index, spec


def cast_overflows(records: Sequence[RankRecord], spec, *, param: str = "src_tensor") -> list[CastOverflow]:
    """Every source rank whose values (its record's ``src_range``) do not fit a destination dtype of
    ``spec``, the same list on every rank."""
    out = []
    for r, g in enumerate(records):
        if g.src is None or g.src_range is None:
            continue
        lo, hi = g.src_range
        out += [CastOverflow(param, r, spec.src.dtype, d, lo, hi)
                for d in sorted({lay.dtype for lay in spec.dsts}) if not fits(lo, hi, d)]
    return out


def _exchange(comm, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, *,
              strict_casts: bool = False):
    """Gather every rank's metadata, view of the layouts, settings, source range and local errors;
    the merged rosters and the cast overflows found, or raise everywhere."""
    mine = rank_record(comm.world_size, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement)
    if mine.error is None:
        try:
            held = local_tensor_of(src_tensor) if src_tensor is not None else None
            mine = dataclasses.replace(mine, settings=RankSettings(strict_casts=_flag(strict_casts, "strict_casts")),
                                       src_range=value_range(held) if held is not None else None)
        except (TypeError, RefitError) as e:
            mine = RankRecord(None, None, None, None, str(e))
    records = comm.all_gather_object(mine)
    index, spec = check_records(records, comm.world_size, src_mesh, src_placement, dst_mesh, dst_placement)
    overflows = cast_overflows(records, spec)
    raise_or_warn(overflows, strict_casts, warn=any(o.rank == comm.rank for o in overflows))
    return index, overflows


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"{name} must be True or False, got {value!r}")
    return value


def _stream_ctx(stream):
    if stream is not None and torch.cuda.is_available():
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


_confirmations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # comm -> transfers it confirmed


def confirm_finished(comm, what: str) -> None:
    """Return once every rank of ``comm`` has finished its part of the transfer just run, or raise
    ``TransportError`` naming the ranks that did not.

    A rank's sends complete once the bytes left, so without this a rank whose receiver died
    inside the transfer (gloo aborts a process that gets a size it did not expect) reported
    success. Each rank notes in the store the transfer it finished (one key per rank,
    overwritten), then all meet in ``comm.confirm()``; when that fails, the keys say who did
    not finish.
    """
    count = _confirmations.get(comm, 0) + 1
    _confirmations[comm] = count
    store = getattr(comm, "store", None)
    key = f"{getattr(comm, 'name', 'refit')}/finished/{{}}"
    try:
        if store is not None:
            store.set(key.format(comm.rank), str(count).encode())
        confirm = getattr(comm, "confirm", None)
        confirm() if confirm is not None else comm.barrier()
        return
    except Exception as e:  # raised below, naming the ranks that did not finish
        failure = error_summary(e)
    missing = "some peer"
    if store is not None:
        done = str(count).encode()
        try:
            late = [r for r in range(comm.world_size) if r != comm.rank
                    and not (store.check([key.format(r)]) and store.get(key.format(r)) == done)]
            missing = f"rank(s) {late}" if late else missing
        except Exception:  # the store's host is gone
            missing = "rank 0 (the store's host)"
    raise TransportError(f"rank {comm.rank}: {what} finished here, but {missing} did not finish: {failure}")


def run_checked(index, comm, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                stream=None) -> TransferStats:
    """Plan this rank's part of an index every rank has checked (``check_records``), move its bytes,
    and confirm every rank finished (``confirm_finished``)."""
    plan = _plan_cache.get(index, comm.rank)
    with _stream_ctx(stream):
        with make_executor(plan, comm, device=device_of(src, dst)) as executor:
            stats = executor.run(src, dst)
    confirm_finished(comm, "the transfer")
    return stats


def xferdtensor(src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, process_group, stream=None,
                *, strict_casts: bool = False):
    """Move ``src_tensor`` (sharded on ``src_mesh``) into ``dst_tensor`` (sharded on ``dst_mesh``).

    Shard to shard: each destination block comes from one source rank (replicas share
    the load), without a full gather. Returns this rank's ``TransferStats``.

    A destination dtype that a cast would lose information into (complex to real, floating
    point to integer) is refused on every rank. Source values beyond a narrower destination
    dtype's range (they would land as inf, NaN, clamped or wrapped) are listed in
    ``TransferStats.cast_overflows`` with a ``CastOverflowWarning`` on the source ranks; with
    ``strict_casts`` every rank raises ``PlanError`` instead, before any byte moves.
    """
    comm = as_communicator(process_group)
    index, overflows = _exchange(comm, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement,
                                 strict_casts=strict_casts)
    src = {PARAM: local_tensor_of(src_tensor)} if src_tensor is not None else {}
    dst = {PARAM: local_tensor_of(dst_tensor)} if dst_tensor is not None else {}
    stats = run_checked(index, comm, src, dst, stream)
    stats.cast_overflows = list(overflows)
    return stats


def xferdtensor_golden(src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, process_group):
    """The broadcast-based reference: rebuild the full tensor everywhere, then slice.

    One broadcast per distinct source shard, from that shard's first replica; a fully
    replicated source needs a single broadcast. Simple on purpose: it is the reference
    ``xferdtensor`` is tested against, and the cost every rank pays in the naive refit.
    The full tensor is never materialised: each rank keeps the part of every broadcast
    shard that falls in its destination region.
    """
    comm = as_communicator(process_group)
    index, _ = _exchange(comm, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement)
    src = {PARAM: local_tensor_of(src_tensor)} if src_tensor is not None else {}
    dst = {PARAM: local_tensor_of(dst_tensor)} if dst_tensor is not None else {}
    with make_executor(BroadcastPlan.build(index, comm.rank), comm) as executor:
        return executor.run(src, dst)


DEFAULT_TIMEOUT_S = 60.0


def _entry(role: str, name: str, value: Any) -> tuple[Any, Any, Any]:
    """``(tensor, mesh, placements)`` of one param of a ``Resharder``'s ``src`` or ``dst``, checked."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise PlanError(f"{role}[{name!r}]: expected (tensor, mesh, placements), got {type(value).__name__}")
    t = value[0]
    if t is None:
        raise PlanError(f"{role}[{name!r}]: the tensor is None; a rank that holds or needs nothing of a param "
                        f"leaves it out of {role}")
    if not (hasattr(t, "shape") and hasattr(t, "dtype")):
        raise PlanError(f"{role}[{name!r}]: expected a tensor, a DTensorRef or a DTensor, got {type(t).__name__}")
    return value[0], value[1], value[2]



class Resharder:
    """Many tensors at once: rosters exchanged and checked once, the plan built once.

    ``src`` and ``dst`` map a param name to ``(tensor, mesh, placements)`` for what this
    rank holds and needs; every rank of ``process_group`` constructs one (possibly with
    empty maps). Bad rosters, and settings (``bucket_bytes``, ``timeout_s``,
    ``strict_casts``) that differ between ranks, raise the same ``PlanError`` on every rank
    here, before any byte moves: each rank reads only its own arguments, so a rank alone
    with a bad one would otherwise raise alone, or die inside the transfer.

    On a ``StatelessProcessGroup`` the transfers run on a child communicator of their
    own, so that a rank that fails can close it without touching the caller's group. A
    rank that cannot go on calls ``abort(reason)``, or leaves a ``with Resharder(...)``
    block by an exception: its failure is published in the store and its connections
    close, so the ranks waiting on it raise within about a second, naming it and its
    reason, instead of waiting out the group's timeout; those ranks close theirs in turn.
    Every ``run`` gives up after ``timeout_s`` all the same (a rank that hangs publishes
    nothing), and returns only once every rank has finished its part.

    Casts: see ``xferdtensor``; ``strict_casts`` makes a value beyond its destination
    dtype's range a ``PlanError`` on every rank before ``run`` moves a byte (one more
    exchange per run), otherwise it is warned about and listed in ``cast_overflows``.
    """

    def __init__(self, process_group, src=None, dst=None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 depth: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, strict_casts: bool = False):
        self.comm = as_communicator(process_group)
        self.closed = False
        self._group = None
        self.executor = None
        rank = self.comm.rank
        entries, local_shapes, settings, error = [], {"src": {}, "dst": {}}, None, None
        src, dst = dict(src or {}), dict(dst or {})
        try:
            if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 1:
                raise PlanError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
            if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 1:
                raise PlanError(f"depth must be a positive number of rounds, got {depth!r}")
            settings = RankSettings(bucket_bytes, finite_seconds(timeout_s, "timeout_s"),
                                    _flag(strict_casts, "strict_casts"))
            for role, side in (("src", src), ("dst", dst)):
                for name, value in side.items():
                    t, mesh, placements = _entry(role, name, value)
                    entries.append(RosterEntry.make(name, tuple(t.shape), dtype_name(t.dtype), mesh, placements, role))
                    local_shapes[role][name] = tuple(local_tensor_of(t).shape)
        except Exception as e:  # every rank raises it, naming this rank, after the exchange
            error, settings = str(e), None
        gathered = self.comm.all_gather_object(ResharderRecord(group_roster(entries) if error is None else [],
                                                               local_shapes, settings, error))
        raise_local_errors([g.error for g in gathered])
        check_settings([g.settings for g in gathered], "Resharder")
        self.timeout_s = settings.timeout_s
        self.strict_casts = settings.strict_casts
        self.index = merge_rosters({r: g.roster for r, g in enumerate(gathered)}, self.comm.world_size)
        for r, g in enumerate(gathered):  # every rank raises the same error, naming the rank
            check_local_shapes(self.index, r, g.local_shapes)
        self.src = {n: local_tensor_of(t) for n, (t, _, _) in src.items()}
        self.dst = {n: local_tensor_of(t) for n, (t, _, _) in dst.items()}
        self._narrowing = narrowing_casts(self.index, rank, self.src)
        self._src_dtypes = {n: dtype_name(self.src[n].dtype) for n in self._narrowing}
        t0 = time.perf_counter()
        self.plan = build_rank_plan(self.index, rank, bucket_bytes=bucket_bytes)
        self.plan_seconds = time.perf_counter() - t0
        # every rank reaches this point or raised above on every rank: the split is collective
        self._group = self.comm.split(0) if isinstance(self.comm, StatelessProcessGroup) else None
        wire_comm = self._group if self._group is not None else self.comm
        self.executor = make_executor(self.plan, wire_comm, device=device_of(self.src, self.dst), depth=depth)
        self.executor.prepare(self.src, self.dst)

    def _cast_overflows(self) -> list[CastOverflow]:
        """This run's sources held to their destinations' ranges: every rank's with ``strict_casts``
        (raising the same ``PlanError`` everywhere), else this rank's, warned about."""
        mine = find_overflows(self._narrowing, self.src, self.comm.rank, self._src_dtypes)
        if not self.strict_casts:
            raise_or_warn(mine, False)
            return mine
        group = self._group if self._group is not None else self.comm
        every = [o for found in group.all_gather_object(mine) for o in found]
        raise_or_warn(every, True)
        return every

    def run(self, *, verify: bool = False) -> TransferStats:
        """Move every tensor once; returns this rank's ``TransferStats`` once every rank has finished.

        Raises ``TransportError`` naming the rank that failed first (and its reason) when
        another rank aborted, or the ranks that did not finish, and after ``timeout_s`` at
        the latest. With ``strict_casts``, a source value beyond its destination dtype's
        range raises ``PlanError`` on every rank before any byte moves (the Resharder stays usable).
        """
        if self.closed:
            raise TransportError(f"rank {self.comm.rank}: this Resharder was aborted or closed")
        self._raise_if_peer_failed()
        overflows = self._cast_overflows()
        group = self._group if self._group is not None else self.comm
        group.set_deadline(time.monotonic() + self.timeout_s)
        failure = None
        try:
            stats = self.executor.run(verify=verify)
            confirm_finished(group, "the transfer")
            stats.cast_overflows = overflows
            return stats
        except Exception as e:  # re-raised below, once this rank's connections are closed
            failure = error_summary(e)
        finally:
            if not self.closed:
                group.set_deadline(None)
        # outside the handler: the traceback's frames would keep the broken group, and its sockets, alive
        failed = self._peer_failures()
        self.abort(failure)
        cause = f"because {failed}" if failed else f"on this rank: {failure}"
        raise TransportError(f"rank {self.comm.rank}: the transfer stopped {cause}")

    # -- failure publishing -------------------------------------------------------------------
    def _failure_key(self, rank: int) -> str:
        return f"{self._group.name}/failed/{rank}"

    def _peer_failures(self) -> str:
        """Who published a failure, and why ('' when nobody did, or this is not a refit group).

        A rank that fails because of another publishes after it, so a scan that found any
        failure is read again: the ones it followed, written during the first scan after its
        turn had passed (seen on a busy machine: only the followers were named), are there
        by the second.
        """
        found = self._scan_failures()
        return self._scan_failures() if found else found

    def _scan_failures(self) -> str:
        group = self._group
        if group is None or group.store is None:
            return ""
        found = []
        for r in range(group.world_size):
            key = self._failure_key(r)
            try:
                if r != group.rank and group.store.check([key]):
                    found.append(f"rank {r} failed: {group.store.get(key).decode(errors='replace')}")
            except Exception:  # a store that went away tells nothing more
                break
        return "; ".join(found)

    def _raise_if_peer_failed(self) -> None:
        failed = self._peer_failures()
        if failed:
            self.abort("a peer failed before this rank started")
            raise TransportError(f"rank {self.comm.rank}: not started: {failed}")

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Tell the other ranks this one will not take part, and release them (idempotent).

        The reason goes to the store first, then this rank's connections close: a peer
        blocked on this rank is released by the close and finds the reason to report.
        """
        if self.closed:
            return
        self.closed = True
        group = self._group
        if group is not None and group.store is not None:
            try:
                group.store.set(self._failure_key(group.rank), reason.encode())
            except Exception:  # the store may be gone with its host
                pass
        if self.executor is not None:
            self.executor.close()
        if group is not None:
            group.abort()
            self._group = None
            del group
            gc.collect()  # gloo closes a pair's socket when the last reference to its group goes

    def close(self) -> None:
        """Release the executor's staging and this Resharder's own communicator."""
        if self.closed:
            return
        self.closed = True
        if self.executor is not None:
            self.executor.close()
        if self._group is not None:
            self._group.abort()
            self._group = None

    def __enter__(self) -> Resharder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.abort(error_summary(exc))
        else:
            self.close()


__all__ = ["ArgNames", "LayoutView", "RankRecord", "RankSettings", "Resharder", "ResharderRecord", "SideMeta",
           "cast_overflows", "check_records", "check_settings", "confirm_finished", "finite_seconds", "rank_record",
           "run_checked", "xferdtensor", "xferdtensor_golden"]
