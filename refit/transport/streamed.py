"""The stream-ordered transport: a rank's plan on CUDA streams over NCCL, double-buffered.

Three CUDA streams ("lanes") per device do the work, and the host only queues it:

* **pack**: casts and copies the blocks of each staged send bucket into a staging slot;
* **comm**: one NCCL group per window of rounds (receives, then sends), after the pack
  of that window and after the previous readers of its receive slots are done;
* **unpack**: copies received slots into the destination views, after the group.

A bucket whose block is contiguous in the wire dtype on this rank is sent from, or
received into, the tensor itself; the two ends decide this independently, since the
wire carries the same bytes either way. Every other bucket goes through a ring of
staging memory (``StagingArena``) bounded by ``staging_budget_bytes``: a slot is
reused only after its reader is done (the group that sent it, or the unpack that read
it), which the writing lanes wait for on the device, never on the host. So packing the
next window overlaps the wire of this one, unpacking overlaps the next, and the host
runs ahead until the data is queued.

Windows merge consecutive rounds (each a contiguous interval, in order) until a window
holds ``group_bytes`` or half the arena. Ranks may cut windows differently: every op of
a rank's current window is matched by an op in its peer's current or an earlier window,
so the rank whose window ends first always completes, and no cycle of waits can form.

Source tensors made during the refit (``SourceProduction``: a trainer's FP8 copies,
quantized from its shards) are made on the pack lane, window by window, just before the
first window that sends from them: quantizing the next window overlaps the wire of this
one, and only the first window's share is ahead of the wire.

The same code runs on CPU tensors over gloo (the lanes are the host, and a fence is a
list of works to wait on), which is how the CPU tests exercise it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.comm.base import poll_until
from refit.errors import TransportError
from refit.plan import Bucket, RankPlan
from refit.transport.base import (
    Corruption,
    Executor,
    SourceProduction,
    TensorMap,
    TransferStats,
    device_of,
    op_names,
    require_tensors,
)
from refit.transport.buckets import ChecksumLedger, align, direct_view, local_copies, pack_bucket, unpack_bucket

DEFAULT_STAGING_BUDGET = 1 << 30
DEFAULT_GROUP_BYTES = 1 << 30


# -- fences and lanes ----------------------------------------------------------------------

class Fence:
    """Completion of queued work: a CUDA event, and/or works the host waits on (gloo)."""

    __slots__ = ("event", "works")

    def __init__(self, event=None, works=None):
        self.event = event
        self.works = list(works or ())


def _host_wait_event(comm, event, what: str) -> None:
    """Wait for a CUDA event without ever blocking past the communicator's deadline or abort."""
    poll_until(event.query, deadline=comm.deadline, aborted=comm.abort_event, what=what)


_STREAMS: dict[int, tuple] = {}
_STREAMS_LOCK = threading.Lock()


def _streams_for(device: torch.device) -> tuple:
    with _STREAMS_LOCK:
        s = _STREAMS.get(device.index)
        if s is None:
            # the comm stream gets the highest priority: its NCCL kernels are then dispatched
            # ahead of pending pack/unpack copy blocks instead of queueing behind them
            s = _STREAMS[device.index] = (torch.cuda.Stream(device=device),
                                          torch.cuda.Stream(device=device, priority=-8),
                                          torch.cuda.Stream(device=device))
        return s


class Lanes:
    """Where the work runs: pack / comm / unpack CUDA streams, or the host for CPU tensors."""

    def __init__(self, device: torch.device, comm):
        self.comm = comm
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.pack, self.comm_s, self.unpack = _streams_for(device)
            self.current = torch.cuda.current_stream(device)
        else:
            self.pack = self.comm_s = self.unpack = self.current = None

    def refresh(self) -> None:
        """Follow the caller's current stream (an executor is reused across refits and streams)."""
        if self.cuda:
            self.current = torch.cuda.current_stream(self.device)

    def lane(self, name: str):
        return {"pack": self.pack, "comm": self.comm_s, "unpack": self.unpack}[name]

    def on(self, name: str):
        return torch.cuda.stream(self.lane(name)) if self.cuda else contextlib.nullcontext()

    def record(self, name: str, works=()) -> Fence:
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.lane(name))
        return Fence(ev, works)

    def _drain_works(self, fence: Fence) -> None:
        while fence.works:
            self.comm.wait(fence.works[0])
            fence.works.pop(0)

    def wait(self, name: str, fence: Fence | None) -> None:
        """Make lane ``name`` wait for ``fence`` (on the device; works are waited on the host)."""
        if fence is None:
            return
        if self.cuda and fence.event is not None:
            self.lane(name).wait_event(fence.event)
        self._drain_works(fence)

    def host_wait(self, fence: Fence | None, what: str = "refit transfer") -> None:
        if fence is None:
            return
        if self.cuda and fence.event is not None:
            _host_wait_event(self.comm, fence.event, what)
        self._drain_works(fence)

    def begin(self) -> None:
        """Order every lane after the work already queued on the caller's stream."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.current)
            for s in (self.pack, self.comm_s, self.unpack):
                s.wait_event(ev)

    def join(self, fences) -> None:
        """Order the caller's stream after ``fences``."""
        for f in fences:
            if f is None:
                continue
            if self.cuda and f.event is not None:
                self.current.wait_event(f.event)
            self._drain_works(f)


# -- staging ---------------------------------------------------------------------------------

@dataclass
class StagingSlot:
    start: int
    end: int
    fence: Fence | None = None  # its last reader; set once that reader is queued
    run: int = 0  # which run allocated it


class StagingArena:
    """A ring of staging memory on one device, never larger than ``budget_bytes``.

    Slots are handed out in order and reclaimed oldest first; before a reclaimed region is
    written again, every lane that writes staging waits on its reader's fence. The
    buffer is kept between refits (no allocation per refit, no growth), grows only up to
    the budget when a plan needs more, and is freed by ``release()``.
    """

    def __init__(self, device: torch.device, budget_bytes: int):
        self.device = device
        self.budget = int(budget_bytes)
        self.buf: torch.Tensor | None = None
        self.capacity = 0
        self._live: deque[StagingSlot] = deque()
        self.in_use = 0  # bytes of live slots (this run's and earlier runs' not yet reclaimed)
        self.peak = 0  # most bytes this run's slots held at once
        self._run = 0
        self._run_in_use = 0

    def reset_peak(self) -> None:
        """Start a new run: ``peak`` counts its slots only (older ones are reclaimable)."""
        self._run += 1
        self._run_in_use = 0
        self.peak = 0

    def _reclaim(self, slot: StagingSlot) -> None:
        self.in_use -= slot.end - slot.start
        if slot.run == self._run:
            self._run_in_use -= slot.end - slot.start

    def _drain(self, lanes: Lanes) -> None:
        while self._live:
            s = self._live.popleft()
            lanes.host_wait(s.fence, "staging release")
            self._reclaim(s)
        self.in_use = 0

    def ensure(self, nbytes: int, lanes: Lanes) -> None:
        if nbytes > self.budget:
            raise TransportError(f"staging: {nbytes} bytes needed exceed staging_budget_bytes={self.budget}")
        if self.capacity >= nbytes:
            return
        self._drain(lanes)
        self.buf = None
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.capacity = nbytes

    def release(self, lanes: Lanes | None = None) -> None:
        if lanes is not None:
            self._drain(lanes)
        elif self.device.type == "cuda" and self.buf is not None:
            torch.cuda.synchronize(self.device)
        self._live.clear()
        self.in_use = self._run_in_use = 0
        self.buf = None
        self.capacity = 0

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0 if n <= self.capacity else None
        first, last = self._live[0].start, self._live[-1].end
        if last > first:
            if self.capacity - last >= n:
                return last
            if first >= n:
                return 0
            return None
        # wrapped: live = [first, capacity) + [0, last); free = [last, first)
        return last if first - last >= n else None

    def alloc(self, nbytes: int, lanes: Lanes) -> tuple[torch.Tensor, StagingSlot]:
        n = align(nbytes)
        if n > self.capacity:
            raise TransportError(f"staging: a {nbytes}-byte bucket does not fit the {self.capacity}-byte arena")
        while True:
            start = self._fit(n)
            if start is not None:
                break
            old = self._live.popleft()
            if old.fence is None:
                raise TransportError(
                    f"staging: one window needs more than the {self.capacity}-byte arena "
                    "(raise staging_budget_bytes or lower bucket_bytes / group_bytes)")
            for lane in ("pack", "comm"):
                lanes.wait(lane, old.fence)
            self._reclaim(old)
        slot = StagingSlot(start, start + n, run=self._run)
        self._live.append(slot)
        self.in_use += n
        self._run_in_use += n
        self.peak = max(self.peak, self._run_in_use)
        return self.buf[start: start + nbytes], slot


_ARENAS: dict[str, StagingArena] = {}
_ARENAS_LOCK = threading.Lock()


def arena_for(device: torch.device, budget_bytes: int) -> StagingArena:
    """The staging arena kept for ``device`` (one per device, re-budgeted on request)."""
    key = str(device)
    with _ARENAS_LOCK:
        a = _ARENAS.get(key)
        if a is None:
            a = _ARENAS[key] = StagingArena(device, budget_bytes)
        elif a.budget != budget_bytes:
            a.budget = int(budget_bytes)
            if a.capacity > a.budget:
                a.release()
        return a


def release_staging(device: Any = None) -> int:
    """Free the staging kept for ``device`` (all devices by default); returns bytes freed."""
    freed = 0
    with _ARENAS_LOCK:
        keys = [str(torch.device(device))] if device is not None else list(_ARENAS)
        for k in keys:
            a = _ARENAS.pop(k, None)
            if a is not None:
                freed += a.capacity
                a.release()
    return freed


# -- the executor -------------------------------------------------------------------------------

@dataclass
class _Window:
    rounds: list[int]
    nbytes: int = 0
    staging: int = 0


@dataclass
class _Schedule:
    """How one binding runs: which buckets go direct, what staging they need, the windows."""

    send_views: dict[tuple[int, int], torch.Tensor | None]
    recv_views: dict[tuple[int, int], torch.Tensor | None]
    need: int  # the staging one round needs at least
    total: int  # the staging of the whole plan
    capacity: int = -1  # the arena capacity the windows were cut for
    windows: list[_Window] = field(default_factory=list)


@dataclass
class _Pass:
    """One refit's state across its windows: what it reads and writes, and the fences it leaves."""

    src: TensorMap
    dst: TensorMap
    sched: _Schedule
    arena: StagingArena | None
    lanes: Lanes
    raw: bool
    ledger: ChecksumLedger | None
    corrupt: Corruption | None
    production: SourceProduction | None
    stats: TransferStats
    t0: float
    marks: dict = field(default_factory=dict)
    host_fences: list = field(default_factory=list)  # gloo: every window's works, waited at the end at the latest
    last_comm: Fence | None = None
    last_unpack: Fence | None = None


@dataclass
class _WindowWork:
    """One window's buckets: its wire ops by round, and which are staged or go from the tensor itself."""

    per_round: list = field(default_factory=list)  # (round, receive ops, send ops)
    unpacks: list = field(default_factory=list)  # (bucket, staged view) received, to unpack
    direct_received: list = field(default_factory=list)  # (bucket, view of the destination)
    staged_sends: list = field(default_factory=list)  # (bucket, staged view) to pack
    direct_sends: list = field(default_factory=list)  # (bucket, view of the source)
    send_slots: list = field(default_factory=list)
    recv_slots: list = field(default_factory=list)


def _post_ops(buckets: list[Bucket], views: dict, arena: StagingArena | None, lanes: Lanes, raw: bool,
              slots: list, staged: list, direct: list) -> list:
    """The wire ops of one round's ``buckets`` (one side): a bucket with a view of its own tensor
    (``views``) goes from it (into ``direct``), any other from a slot of ``arena`` (into ``staged``,
    its slot into ``slots``). An op is ``(address, bytes, peer)`` when ``raw``, else ``(view, peer)``."""
    ops = []
    for b in buckets:
        view = views[(b.peer, b.index)]
        if view is None:
            view, slot = arena.alloc(b.nbytes, lanes)
            slots.append(slot)
            staged.append((b, view))
        else:
            direct.append((b, view))
        ops.append((view.data_ptr(), b.nbytes, b.peer) if raw else (view, b.peer))
    return ops


class StreamedExecutor(Executor):
    """Runs a ``RankPlan`` with the three-lane pipeline; see the module docstring.

    ``sync=False`` returns once the work is queued (the caller's stream is ordered after
    it); ``timing=True`` records host marks and CUDA events in ``stats.timing``.
    """

    transport = "streamed"
    streams_production = True

    def __init__(self, plan: RankPlan, comm, *, device: torch.device | None = None,
                 staging_budget_bytes: int | None = None, group_bytes: int | None = None, sync: bool = True,
                 arena: StagingArena | None = None, timing: bool = False):
        super().__init__(plan, comm)
        self.device = device
        self.budget = DEFAULT_STAGING_BUDGET if staging_budget_bytes is None else int(staging_budget_bytes)
        self.group_bytes = DEFAULT_GROUP_BYTES if group_bytes is None else int(group_bytes)
        self.sync = sync
        self.arena = arena
        self.timing = timing
        self._send_by_round: dict[int, list[Bucket]] = {}
        self._recv_by_round: dict[int, list[Bucket]] = {}
        for b in sorted(plan.sends, key=lambda b: (b.index, b.peer)):
            self._send_by_round.setdefault(b.index, []).append(b)
        for b in sorted(plan.recvs, key=lambda b: (b.index, b.peer)):
            self._recv_by_round.setdefault(b.index, []).append(b)
        self._schedule: _Schedule | None = None
        self._lanes: Lanes | None = None

    # -- binding -----------------------------------------------------------------------------------
    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        require_tensors(self.plan, src, dst)
        device = self.device or device_of(src, dst)
        self._lanes = Lanes(device, self.comm)
        self._schedule = self._classify(src, dst, staged_sends=False)

    def _classify(self, src: TensorMap, dst: TensorMap, *, staged_sends: bool) -> _Schedule:
        """Per bucket: its view in the tensor itself, or None to stage; and the staging that needs."""
        send_views = {(b.peer, b.index): None if staged_sends else direct_view(b, src, "src") for b in self.plan.sends}
        recv_views = {(b.peer, b.index): direct_view(b, dst, "dst") for b in self.plan.recvs}
        need, total = 0, 0
        for r in range(self.plan.num_rounds):
            stage = self._round_staging(r, send_views, recv_views)
            if stage:
                need = max(need, sum(stage) + max(stage))
                total += sum(stage)
        if need > self.budget:
            raise TransportError(
                f"rank {self.plan.rank}: one round of this plan stages {need} bytes, more than "
                f"staging_budget_bytes={self.budget}; raise the budget or lower bucket_bytes")
        return _Schedule(send_views, recv_views, need, total)

    def _round_staging(self, r: int, send_views, recv_views) -> list[int]:
        stage = [align(b.nbytes) for b in self._send_by_round.get(r, []) if send_views[(b.peer, b.index)] is None]
        stage += [align(b.nbytes) for b in self._recv_by_round.get(r, []) if recv_views[(b.peer, b.index)] is None]
        return stage

    def _windows(self, sched: _Schedule, capacity: int) -> list[_Window]:
        limit = max(capacity // 2, 1)
        windows: list[_Window] = []
        cur = None
        for r in range(self.plan.num_rounds):
            sends, recvs = self._send_by_round.get(r, []), self._recv_by_round.get(r, [])
            if not sends and not recvs:
                continue
            nbytes = sum(b.nbytes for b in sends + recvs)
            stage = self._round_staging(r, sched.send_views, sched.recv_views)
            staging = sum(stage) + (max(stage) if stage else 0)
            if cur is not None and (cur.nbytes + nbytes > self.group_bytes or cur.staging + staging > limit):
                windows.append(cur)
                cur = None
            if cur is None:
                cur = _Window([])
            cur.rounds.append(r)
            cur.nbytes += nbytes
            cur.staging += staging
        if cur is not None:
            windows.append(cur)
        return windows

    def _arena_for(self, sched: _Schedule, lanes: Lanes) -> StagingArena | None:
        """The staging arena, grown to this plan's need (the windows are re-cut if its size changed)."""
        if not sched.need:
            if sched.capacity != 0:
                sched.windows, sched.capacity = self._windows(sched, 0), 0
            return None
        arena = self.arena if self.arena is not None else arena_for(lanes.device, self.budget)
        arena.ensure(min(self.budget, max(2 * sched.need, sched.total + sched.need)), lanes)
        if arena.capacity != sched.capacity:
            sched.windows, sched.capacity = self._windows(sched, arena.capacity), arena.capacity
        return arena

    # -- run -------------------------------------------------------------------------------------
    def _run(self, *, verify: bool, corrupt: Corruption | None,
             production: SourceProduction | None = None) -> TransferStats:
        t0 = time.perf_counter()
        lanes = self._lanes
        lanes.refresh()
        sched = self._schedule if corrupt is None else self._classify(self.src, self.dst, staged_sends=True)
        # raw: hand NCCL addresses and sizes, no tensor views (refit's own NCCL communicator)
        raw = lanes.cuda and getattr(self.comm, "nccl_comm", None) is not None
        arena = self._arena_for(sched, lanes)
        if arena is not None:
            arena.reset_peak()
        p = _Pass(self.src, self.dst, sched, arena, lanes, raw, ChecksumLedger() if verify else None, corrupt,
                  production, TransferStats(), t0)
        stats = p.stats
        stats.zero_copy_buckets = sum(v is not None for v in sched.send_views.values())
        stats.zero_copy_buckets += sum(v is not None for v in sched.recv_views.values())
        if raw:
            self.comm.connect_peers(self.plan.peers())
        if self.timing and lanes.cuda:  # CUDA events: caller's stream at start, comm lane around the groups
            p.marks = {k: torch.cuda.Event(enable_timing=True) for k in ("begin", "first_group", "last_group")}
            p.marks["begin"].record(lanes.current)
        stats.timing["setup_s"] = time.perf_counter() - t0
        lanes.begin()
        local_names = dict.fromkeys(op.name for op in self.plan.local)
        made_locally = production is not None and any(production.waiting(n) for n in local_names)
        if not made_locally:  # otherwise after the last window: making them first would delay the wire
            with lanes.on("unpack"):
                stats.local_bytes = local_copies(self.plan, p.src, p.dst)
        for w in sched.windows:
            work = self._post_window(w, p)
            self._pack_window(work, p)
            self._send_window(work, p)
            self._unpack_window(work, p)
        if made_locally:
            with lanes.on("pack"):
                production.produce(local_names)
            lanes.wait("unpack", lanes.record("pack"))
            with lanes.on("unpack"):
                stats.local_bytes = local_copies(self.plan, p.src, p.dst)
        if p.marks:
            p.marks["last_group"].record(lanes.comm_s)
            stats.timing["events"] = p.marks
        stats.timing["enqueue_s"] = time.perf_counter() - t0
        # the unpack lane also carries local copies and checksums of direct sends: the caller waits for it
        local_fence = lanes.record("unpack") if (self.plan.local or p.ledger is not None) else None
        finals = p.host_fences + [f for f in (p.last_comm, p.last_unpack, local_fence) if f is not None]
        lanes.join(finals)
        stats.peak_staging_bytes = arena.peak if arena is not None else 0
        stats.staging_capacity_bytes = sched.capacity if arena is not None else 0
        if self.sync or p.ledger is not None:
            for f in finals:
                lanes.host_wait(f, f"rank {self.plan.rank}: refit transfer")
            if p.ledger is not None:
                stats.checksums_sent, stats.checksums_received = p.ledger.settle()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _post_window(self, w: _Window, p: _Pass) -> _WindowWork:
        """The wire ops of a window's rounds, with a staging slot for each bucket that needs one."""
        work = _WindowWork()
        for r in w.rounds:
            recvs, sends = self._recv_by_round.get(r, []), self._send_by_round.get(r, [])
            recv_ops = _post_ops(recvs, p.sched.recv_views, p.arena, p.lanes, p.raw, work.recv_slots, work.unpacks,
                                 work.direct_received)
            send_ops = _post_ops(sends, p.sched.send_views, p.arena, p.lanes, p.raw, work.send_slots,
                                 work.staged_sends, work.direct_sends)
            p.stats.bytes_received += sum(b.nbytes for b in recvs)
            p.stats.buckets_received += len(recvs)
            p.stats.bytes_sent += sum(b.nbytes for b in sends)
            p.stats.buckets_sent += len(sends)
            work.per_round.append((r, recv_ops, send_ops))
        return work

    @staticmethod
    def _pack_window(work: _WindowWork, p: _Pass) -> None:
        """Make the window's sources, pack its staged sends, and sum its direct ones beside the wire."""
        lanes, ledger = p.lanes, p.ledger
        made = False
        if p.production is not None:
            with lanes.on("pack"):
                made = p.production.produce(op_names([b for b, _ in work.staged_sends + work.direct_sends]))
        if work.staged_sends:
            with lanes.on("pack"):
                for b, view in work.staged_sends:
                    pack_bucket(b, p.src, view, ledger=ledger, key=(b.peer, b.index))
                    if p.corrupt is not None:
                        p.corrupt(b.peer, b.index, view)
        if work.staged_sends or made:
            packed = lanes.record("pack")
            lanes.wait("comm", packed)
            if made and ledger is not None:
                # the unpack lane sums direct sends, of this window or a later one, from
                # tensors made here: it waits whenever something was made
                lanes.wait("unpack", packed)
        if ledger is not None and work.direct_sends:
            # blocks sent from the tensors themselves: summed beside the wire, not ahead of it
            # (the group never waits for them; nothing writes the sources during a refit)
            with lanes.on("unpack"):
                for b, view in work.direct_sends:
                    ledger.sent((b.peer, b.index), view)

    def _send_window(self, work: _WindowWork, p: _Pass) -> None:
        """The window's wire: one NCCL group on a GPU, a tagged group per round over gloo."""
        lanes, stats = p.lanes, p.stats
        works: list[Any] = []
        if stats.groups == 0:
            if p.marks:
                p.marks["first_group"].record(lanes.comm_s)
            stats.timing["first_group_queued_s"] = time.perf_counter() - p.t0
        with lanes.on("comm"):
            if lanes.cuda:  # one NCCL group for the whole window
                recv_all = [op for _, rv, _ in work.per_round for op in rv]
                send_all = [op for _, _, sd in work.per_round for op in sd]
                if p.raw:
                    self.comm.p2p_group_raw(recv_all, send_all, stream=lanes.comm_s)
                else:
                    works += self.comm.p2p_group(recv_all, send_all, stream=lanes.comm_s)
            else:  # gloo: tag each round, so pairs never mix up messages
                for r, rv, sd in work.per_round:
                    works += self.comm.p2p_group(rv, sd, tag=r)
        p.last_comm = lanes.record("comm", works)
        if works:
            p.host_fences.append(p.last_comm)
        stats.groups += 1
        for slot in work.send_slots:
            slot.fence = p.last_comm

    @staticmethod
    def _unpack_window(work: _WindowWork, p: _Pass) -> None:
        """After the window's group: sum what landed in place, unpack the staged receives."""
        lanes, ledger = p.lanes, p.ledger
        if not (work.unpacks or (ledger is not None and work.direct_received)):
            return
        lanes.wait("unpack", p.last_comm)
        with lanes.on("unpack"):
            if ledger is not None:
                for b, view in work.direct_received:
                    ledger.received((b.peer, b.index), view)
            for b, view in work.unpacks:
                unpack_bucket(b, view, p.dst, ledger=ledger, key=(b.peer, b.index))
        p.last_unpack = lanes.record("unpack")
        for slot in work.recv_slots:
            slot.fence = p.last_unpack

    def _release(self) -> None:
        self._schedule = None
        self._lanes = None


__all__ = [
    "DEFAULT_GROUP_BYTES", "DEFAULT_STAGING_BUDGET", "Fence", "Lanes", "StagingArena", "StagingSlot",
    "StreamedExecutor", "arena_for", "release_staging",
]
