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

The same code runs on CPU tensors over gloo (the lanes are the host, and a fence is a
list of works to wait on), which is how the CPU tests exercise it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from refit.errors import TransportError
from refit.plan.planner import Bucket, RankPlan
from refit.transport.rounds import _op_view, direct_view, single_block

DEFAULT_STAGING_BUDGET = 1 << 30
DEFAULT_GROUP_BYTES = 1 << 30
ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _contiguous(shape, strides) -> bool:
    """torch's rule: every dim of size > 1 has the stride of a C-contiguous layout."""
    if 0 in shape:
        return True
    expected = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


def direct_ptr(bucket: Bucket, tensors: Mapping[str, torch.Tensor], side: str) -> int | None:
    """Device address of the bucket's block in the tensor itself, when it can go on the wire
    as is (one block, wire dtype, contiguous): arithmetic only, no tensor views."""
    found = single_block(bucket, tensors)
    if found is None:
        return None
    op, t = found
    strides = t.stride()
    if not _contiguous(op.box.shape, strides):
        return None
    start = op.box.src_start if side == "src" else op.box.dst_start
    return t.data_ptr() + t.element_size() * sum(a * st for a, st in zip(start, strides))


# -- fences and lanes ----------------------------------------------------------------------

class Fence:
    """Completion of queued work: a CUDA event, and/or works the host waits on (gloo)."""

    __slots__ = ("event", "works")

    def __init__(self, event=None, works=None):
        self.event = event
        self.works = list(works or ())


def _host_wait_event(comm, event, what: str) -> None:
    aborted = getattr(comm, "_aborted", None)
    if not isinstance(aborted, threading.Event):
        event.synchronize()
        return
    from refit.comm.nccl import poll_until

    poll_until(event.query, deadline=getattr(comm, "_deadline", None), aborted=aborted, what=what)


_STREAMS: dict[int, tuple] = {}
_STREAMS_LOCK = threading.Lock()


def _streams_for(device: torch.device) -> tuple:
    with _STREAMS_LOCK:
        s = _STREAMS.get(device.index)
        if s is None:
            # the comm stream gets the highest priority: its NCCL kernels are then dispatched
            # ahead of pending pack/unpack copy blocks instead of queueing behind them
            s = _STREAMS[device.index] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device, priority=-8),
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
class _Slot:
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
        self._live: deque[_Slot] = deque()
        self.in_use = 0  # bytes of live slots (this run's and earlier runs' not yet reclaimed)
        self.peak = 0  # most bytes this run's slots held at once
        self._run = 0
        self._run_in_use = 0

    def reset_peak(self) -> None:
        """Start a new run: ``peak`` counts its slots only (older ones are reclaimable)."""
        self._run += 1
        self._run_in_use = 0
        self.peak = 0

    def _reclaim(self, slot: _Slot) -> None:
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

    def alloc(self, nbytes: int, lanes: Lanes) -> tuple[torch.Tensor, _Slot]:
        n = _align(nbytes)
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
        slot = _Slot(start, start + n, run=self._run)
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


class StreamedExecutor:
    """Runs a ``RankPlan`` with the three-lane pipeline; see the module docstring."""

    def __init__(self, plan: RankPlan, comm, *, device: torch.device, verify: bool = False,
                 corrupt: Callable | None = None, staging_budget_bytes: int | None = None,
                 group_bytes: int | None = None, sync: bool = True, arena: StagingArena | None = None,
                 timing: bool = False):
        self.plan = plan
        self.comm = comm
        self.device = device
        self.verify = verify
        self._corrupt = corrupt
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

    # -- planning the windows -------------------------------------------------------------------
    def _classify(self, src, dst, raw: bool):
        """Per bucket: its direct address (``raw``) or view in the tensor itself, or None to stage."""
        fn = direct_ptr if raw else direct_view
        send_direct = {}
        for b in self.plan.sends:
            send_direct[(b.peer, b.index)] = None if self._corrupt is not None else fn(b, src, "src")
        recv_direct = {(b.peer, b.index): fn(b, dst, "dst") for b in self.plan.recvs}
        return send_direct, recv_direct

    def _windows(self, send_direct, recv_direct, capacity: int) -> list[_Window]:
        limit = max(capacity // 2, 1)
        windows: list[_Window] = []
        cur = None
        for r in range(self.plan.num_rounds):
            sends, recvs = self._send_by_round.get(r, []), self._recv_by_round.get(r, [])
            if not sends and not recvs:
                continue
            nbytes = sum(b.nbytes for b in sends + recvs)
            stage = [_align(b.nbytes) for b in sends if send_direct[(b.peer, b.index)] is None]
            stage += [_align(b.nbytes) for b in recvs if recv_direct[(b.peer, b.index)] is None]
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

    def _round_need(self, send_direct, recv_direct) -> tuple[int, int]:
        """(the staging one round needs at least, the staging of the whole plan)."""
        need, total = 0, 0
        for r in range(self.plan.num_rounds):
            stage = [_align(b.nbytes) for b in self._send_by_round.get(r, []) if send_direct[(b.peer, b.index)] is None]
            stage += [_align(b.nbytes) for b in self._recv_by_round.get(r, []) if recv_direct[(b.peer, b.index)] is None]
            if stage:
                need = max(need, sum(stage) + max(stage))
                total += sum(stage)
        return need, total

    # -- run -------------------------------------------------------------------------------------
    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]):
        from refit.transport.rounds import TransferStats

        stats = TransferStats()
        t0 = time.perf_counter()
        lanes = Lanes(self.device, self.comm)
        # raw: hand NCCL addresses and sizes, no tensor views (refit's own NCCL communicator)
        raw = lanes.cuda and getattr(self.comm, "nccl_comm", None) is not None
        send_direct, recv_direct = self._classify(src, dst, raw)
        need, total = self._round_need(send_direct, recv_direct)
        if need > self.budget:
            raise TransportError(
                f"rank {self.plan.rank}: one round of this plan stages {need} bytes, more than "
                f"staging_budget_bytes={self.budget}; raise the budget or lower bucket_bytes")
        arena = self.arena
        if need:
            if arena is None:
                arena = arena_for(self.device, self.budget)
            arena.ensure(min(self.budget, max(2 * need, total + need)), lanes)
            arena.reset_peak()
        capacity = arena.capacity if (need and arena is not None) else 0
        windows = self._windows(send_direct, recv_direct, capacity)
        stats.zero_copy_buckets = sum(v is not None for v in send_direct.values())
        stats.zero_copy_buckets += sum(v is not None for v in recv_direct.values())

        if raw:
            self.comm.connect_peers(self.plan.peers())
        marks = {}
        if self.timing and lanes.cuda:  # CUDA events: caller's stream at start, comm lane around the groups
            marks = {k: torch.cuda.Event(enable_timing=True) for k in ("begin", "first_group", "last_group")}
            marks["begin"].record(lanes.current)
        stats.timing["setup_s"] = time.perf_counter() - t0
        lanes.begin()
        with lanes.on("unpack"):
            self._local_copies(src, dst, stats)
        last_comm = last_unpack = None
        host_fences: list[Fence] = []  # gloo: every window's works, waited at the end at the latest
        for w in windows:
            per_round, unpacks, send_slots, recv_slots, staged_sends = [], [], [], [], []
            for r in w.rounds:
                recv_ops, send_ops = [], []
                for b in self._recv_by_round.get(r, []):
                    view = recv_direct[(b.peer, b.index)]
                    if view is None:
                        view, slot = arena.alloc(b.nbytes, lanes)
                        recv_slots.append(slot)
                        unpacks.append((b, view))
                        if raw:
                            view = view.data_ptr()
                    recv_ops.append((view, b.nbytes, b.peer) if raw else (view, b.peer))
                    stats.bytes_received += b.nbytes
                    stats.buckets_received += 1
                for b in self._send_by_round.get(r, []):
                    view = send_direct[(b.peer, b.index)]
                    if view is None:
                        view, slot = arena.alloc(b.nbytes, lanes)
                        send_slots.append(slot)
                        staged_sends.append((b, view))
                        if raw:
                            view = view.data_ptr()
                    send_ops.append((view, b.nbytes, b.peer) if raw else (view, b.peer))
                    stats.bytes_sent += b.nbytes
                    stats.buckets_sent += 1
                per_round.append((r, recv_ops, send_ops))
            if staged_sends:
                with lanes.on("pack"):
                    for b, view in staged_sends:
                        self._pack_into(view, b, src)
                        if self._corrupt is not None:
                            self._corrupt(b, view)
                lanes.wait("comm", lanes.record("pack"))
            works: list[Any] = []
            if stats.groups == 0:
                if marks:
                    marks["first_group"].record(lanes.comm_s)
                stats.timing["first_group_queued_s"] = time.perf_counter() - t0
            with lanes.on("comm"):
                if lanes.cuda:  # one NCCL group for the whole window
                    recv_all = [op for _, rv, _ in per_round for op in rv]
                    send_all = [op for _, _, sd in per_round for op in sd]
                    if raw:
                        self.comm.p2p_group_raw(recv_all, send_all, stream=lanes.comm_s)
                    else:
                        works += self.comm.p2p_group(recv_all, send_all, stream=lanes.comm_s)
                else:  # gloo: tag each round, so pairs never mix up messages
                    for r, rv, sd in per_round:
                        works += self.comm.p2p_group(rv, sd, tag=r)
            last_comm = lanes.record("comm", works)
            if works:
                host_fences.append(last_comm)
            stats.groups += 1
            for s_ in send_slots:
                s_.fence = last_comm
            if unpacks:
                lanes.wait("unpack", last_comm)
                with lanes.on("unpack"):
                    for b, view in unpacks:
                        for op, off in zip(b.ops, b.offsets):
                            dst[op.name][op.box.dst_slices()].copy_(_op_view(view, op, off))
                last_unpack = lanes.record("unpack")
                for s_ in recv_slots:
                    s_.fence = last_unpack
        if marks:
            marks["last_group"].record(lanes.comm_s)
            stats.timing["events"] = marks
        stats.timing["enqueue_s"] = time.perf_counter() - t0
        local_fence = lanes.record("unpack") if self.plan.local else None
        finals = host_fences + [f for f in (last_comm, last_unpack, local_fence) if f is not None]
        lanes.join(finals)
        stats.peak_staging_bytes = arena.peak if (need and arena is not None) else 0
        stats.staging_capacity_bytes = capacity
        if self.sync or self.verify:
            for f in finals:
                lanes.host_wait(f, f"rank {self.plan.rank}: refit transfer")
            if self.verify:
                self._checksums(src, dst, stats)
        stats.seconds = time.perf_counter() - t0
        return stats

    # -- helpers ----------------------------------------------------------------------------------
    def _pack_into(self, buf: torch.Tensor, b: Bucket, src) -> None:
        pos = 0
        for op, off in zip(b.ops, b.offsets):
            if off > pos:
                buf[pos:off].zero_()  # alignment padding: keep the bytes deterministic
            _op_view(buf, op, off).copy_(src[op.name][op.box.src_slices()])
            pos = off + op.nbytes
        if b.nbytes > pos:
            buf[pos:b.nbytes].zero_()

    def _local_copies(self, src, dst, stats) -> None:
        for op in self.plan.local:
            dst[op.name][op.box.dst_slices()].copy_(src[op.name][op.box.src_slices()])
            stats.local_bytes += op.nbytes

    def _checksums(self, src, dst, stats) -> None:
        """Per-bucket checksums of what was sent (from the sources) and what arrived (from the
        destinations, in wire dtype): both ends compute them over the bucket's layout."""
        from refit.transport.rounds import checksum

        for b in self.plan.sends:
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            self._pack_into(buf, b, src)
            stats.checksums_sent[(b.peer, b.index)] = checksum(buf)
        for b in self.plan.recvs:
            buf = torch.zeros(b.nbytes, dtype=torch.uint8, device=self.device)
            for op, off in zip(b.ops, b.offsets):
                _op_view(buf, op, off).copy_(dst[op.name][op.box.dst_slices()])
            stats.checksums_received[(b.peer, b.index)] = checksum(buf)


__all__ = [
    "DEFAULT_GROUP_BYTES", "DEFAULT_STAGING_BUDGET", "Fence", "Lanes", "StagingArena", "StreamedExecutor",
    "arena_for", "direct_view", "release_staging",
]
