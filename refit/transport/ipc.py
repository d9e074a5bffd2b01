"""One-node transport: engines pull their blocks straight out of the trainer's memory.

Most RL runs put trainer and engines on the same GPUs (or at least the same host). There,
every byte can move with one copy: the engine maps the trainer's tensors (CUDA IPC on a
GPU, a shared-memory segment on the host) and copies each block of its plan from them.
No collective runs, nothing is gathered, and the only per-refit messages are two counters
in host shared memory.

Setup, once per plan (the same roster steps as ``refit.transport.nixl``):

    channel = IpcChannel(rank, device=dev)    # control segment and exports: kept across plans
    executor = IpcExecutor(plan, channel)
    executor.prepare(src, dst)                # export what this rank's receivers will read
    entry = channel.local_roster_entry()      # node, pid, control segment, exported memory
    ... the controller gathers every rank's entry and relays the roster ...
    channel.update_membership(roster, epoch)  # map the sources' memory once; cached from now on

Every refit is then ``executor.run()``:

1. a source makes its data readable (GPU: its stream is drained, so the tensors hold the
   step's weights; host: the blocks are packed into its shared staging) and publishes the
   refit's *generation* (epoch and sequence number) in its control segment;
2. a receiver waits for each source's generation, copies that source's blocks into its
   destination views, and, once the copies are complete, writes the generation into its
   own control segment under the source's rank (*done*);
3. a source returns once every receiver reported *done*: only then may the caller
   change the tensors the receivers read.

On a GPU the source side sends nothing at all: the receiver copies from the mapped
source tensor into the destination view, casting if the dtypes differ, so a refit is
one device-to-device copy of the model (the limit of the hardware). Across GPUs a
contiguous block is one peer copy on the copy engines; a strided one lands in a local
buffer first (copy engine), then moves into place on the receiving GPU. On the host,
sources pack into a shared segment and receivers unpack straight out of it.

Generations only grow, also across epochs, so a late reader of an aborted refit never
takes an old one for a current one, and a peer in another epoch is named at once.

Peers are processes of this node, so a dead one is seen at once: every wait watches the
peer's pidfd and raises ``RefitAborted`` naming it, and a frozen one is named at the
deadline (``timeout_s``, or the one ``RefitAbortWatchdog`` sets). The dead peer's
mappings are closed. A restarted peer publishes a new entry (new pid, new segments); the
next ``update_membership`` maps it afresh.

Segments are files under ``/dev/shm`` named with the owner's pid namespace, pid and start
time (``/proc/<pid>/stat``: a pid the kernel hands to a new process does not keep a dead
owner's segments alive). The owner removes them at ``close`` and, for any it did not close,
when it exits (``atexit``: normal exits and uncaught exceptions). A process killed outright
(SIGKILL, SIGTERM's default action, the OOM killer) cannot: every transport removes those of
owners that are gone when it opens, and every ``IpcExecutor`` when it is made (each plan a
controller builds), and ``refit clean-ipc`` does on a host where no refit process runs anymore.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import mmap
import os
import re
import select
import socket
import stat
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from refit.comm.wire import register_record
from refit.errors import PlanError, RefitError, TransportError
from refit.layout import dtype_from_name
from refit.plan import Bucket, Op, RankPlan
from refit.transport.base import Corruption, Executor, TensorMap, TransferStats
from refit.transport.buckets import (
    ChecksumLedger,
    StagingPool,
    align,
    direct_view,
    local_copies,
    op_view,
    pack_bucket,
    unpack_bucket,
)
from refit.transport.copy_sum import CopySumBatch, NotFusable, fused_enabled
from refit.transport.one_sided import OneSidedChannel, OneSidedRound

__all__ = ["IpcChannel", "IpcExecutor", "IpcHandshakeError", "IpcRosterEntry", "ShmSegment", "export_cuda",
           "list_segments", "node_id", "open_cuda", "sweep_stale_segments"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "refit-ipc"
CONTROL_SLOTS = 8192  # slot 0: the generation this rank published; slot 1 + r: done for source rank r
GONE = CONTROL_SLOTS - 1  # set when this rank aborted its refit or closed: its peers stop waiting at once
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_PROBE_S = 0.05
MAX_NAP_S = 5e-5  # the longest a waiting rank sleeps between checks: a refit of an 8B model is ~8 ms
# transports of this process by name: a peer in the same process (endpoints on threads) reads
# the source's tensors directly, since CUDA refuses to open a process's own IPC handles
_IN_PROCESS: weakref.WeakValueDictionary[str, IpcChannel] = weakref.WeakValueDictionary()
_FAILED_CAPTURES: list[Any] = []
# pid namespace, pid, the pid's start time (clock ticks after boot; 0: unknown), a random tag, the kind
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(\d+)-[0-9a-f]+-(control|staging)$")
# path -> pid of the process that created it: what this process removes at exit (a forked child,
# which inherits the table, removes none of its parent's)
_OWNED: dict[str, int] = {}


class IpcHandshakeError(TransportError):
    """The roster does not fit this rank's plan or this node: a new handshake (or transport) is needed."""


def node_id() -> str:
    """This host, as every process on it names it (host name and boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def _generation(epoch: int, seq: int) -> int:
    return (epoch << 32) | (seq + 1)


def _describe(gen: int) -> str:
    return "nothing yet" if gen <= 0 else f"epoch {gen >> 32} refit {(gen & 0xFFFFFFFF) - 1}"


# -- host shared memory ---------------------------------------------------------------------------

class _Segment:
    """A file under /dev/shm mapped into this process; its creator removes it at close."""

    def __init__(self, name: str, nbytes: int = 0, *, create: bool):
        if "/" in name or not _NAME.match(name):
            raise IpcHandshakeError(f"{name!r} is not the name of a refit shared-memory segment")
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise IpcHandshakeError(f"cannot {'create' if create else 'open'} {path}: {e} (peers must share this "
                                    "host's /dev/shm: the same node and IPC namespace)") from None
        if create:
            _OWNED[path] = os.getpid()
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 8))
            self.nbytes = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.nbytes)
        except BaseException:
            if create:  # a file half made (no room in /dev/shm) is nobody's to remove later
                _OWNED.pop(path, None)
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.name, self.path, self.owner = name, path, create

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=torch.uint8)

    def words(self) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.int64)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass
        if self.owner:
            self.owner = False
            if _OWNED.get(self.path) != os.getpid():  # a forked child's copy: the parent's file, not ours
                return
            del _OWNED[self.path]
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def pid_namespace() -> str:
    """This process's pid namespace (an inode number): pids mean something only inside one.

    Containers of one pod share ``/dev/shm`` but not their pids: a pid seen in another
    namespace says nothing about whether that process runs.
    """
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, field 22 of ``/proc/<pid>/stat``);
    None when it cannot be read (no such process, no procfs, or a ``hidepid`` mount)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count from the last ')'
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _segment_name(kind: str) -> str:
    start = process_start_time(os.getpid()) or 0
    return f"{PREFIX}-{pid_namespace()}-{os.getpid()}-{start}-{uuid.uuid4().hex[:12]}-{kind}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class ShmSegment:
    """One refit segment under ``/dev/shm`` and whether its owner still runs.

    ``owner`` is ``"running"``, ``"gone"`` (no process has its pid), ``"replaced"`` (its pid
    now belongs to a process that started at another time: the kernel reused it) or
    ``"elsewhere"`` (another pid namespace, whose processes cannot be seen from here).
    """

    name: str
    nbytes: int
    kind: str
    pid: int
    started: int  # the owner's start time in clock ticks after boot; 0: not recorded
    owner: str

    @property
    def stale(self) -> bool:
        return self.owner in ("gone", "replaced")

    def describe(self) -> str:
        why = {"running": f"process {self.pid} runs", "gone": f"process {self.pid} is gone",
               "replaced": f"pid {self.pid} now belongs to another process",
               "elsewhere": "its owner is in another pid namespace"}[self.owner]
        return f"{self.name} ({self.kind}, {self.nbytes} bytes): {why}"


def _owner_state(pid: int, started: int, namespace: str, ours: str) -> str:
    if namespace != ours:
        return "elsewhere"
    if not _pid_alive(pid):
        return "gone"
    now = process_start_time(pid) if started else None
    return "replaced" if now is not None and now != started else "running"


def list_segments() -> list[ShmSegment]:
    """Every refit segment of this host's ``/dev/shm``, by name, with its owner's state.

    Only regular files named as refit names them are listed: anything else there belongs to
    someone else.
    """
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    ours = pid_namespace()
    out = []
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
        except OSError:  # removed meanwhile
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        pid, started = int(m.group(2)), int(m.group(3))
        out.append(ShmSegment(name, st.st_size, m.group(4), pid, started, _owner_state(pid, started, m.group(1), ours)))
    return out


def sweep_stale_segments(*, dry_run: bool = False) -> tuple[list[ShmSegment], list[tuple[ShmSegment, str]]]:
    """Remove the segments whose owner is gone (a killed rank cannot remove its own).

    They hold a host source's packed weights in plain form, readable by the owner's user,
    until someone removes them. Returns ``(removed, failed)``: the stale segments removed
    (with ``dry_run``: those that would be), and those that could not be, with the reason
    (another user's, under ``/dev/shm``'s sticky bit).
    """
    removed, failed = [], []
    for seg in list_segments():
        if not seg.stale:
            continue
        if dry_run:
            removed.append(seg)
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, seg.name))
        except FileNotFoundError:  # another sweep was first
            continue
        except OSError as e:
            failed.append((seg, e.strerror or str(e)))
            continue
        removed.append(seg)
    return removed, failed


def _sweep_quietly() -> None:
    """The sweep a transport runs as it starts and at every build; never fails the build."""
    try:
        removed, _ = sweep_stale_segments()
    except Exception as e:  # a sweep that fails leaves files behind, no more
        log.warning("could not sweep stale refit segments under %s: %s", SHM_DIR, e)
        return
    if removed:
        log.info("removed %d refit segment(s) of processes that are gone: %s", len(removed),
                 ", ".join(s.name for s in removed))


@atexit.register
def _remove_own_segments() -> None:
    """At exit, the segments this process created and never closed (a transport left open)."""
    me = os.getpid()
    for path, pid in list(_OWNED.items()):
        if pid == me:
            _OWNED.pop(path, None)
            try:
                os.unlink(path)
            except OSError:
                pass


class _Liveness:
    """Whether a peer process still runs: its pidfd turns readable when it exits (no pid reuse race).

    A peer in another pid namespace cannot be watched: it counts as running, and is named
    when it marks itself gone or at the deadline.
    """

    def __init__(self, pid: int, *, visible: bool = True):
        self.pid = pid
        self.visible = visible
        self.fd: int | None = None
        if visible:
            try:
                self.fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                self.fd = None

    def alive(self) -> bool:
        if not self.visible:
            return True
        if self.fd is not None:
            ready, _, _ = select.select([self.fd], [], [], 0)
            return not ready
        return _pid_alive(self.pid)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# -- CUDA IPC -------------------------------------------------------------------------------------

def export_cuda(t: torch.Tensor) -> tuple:
    """The IPC handle of the allocation under ``t`` (the caching allocator's or an expandable segment's)."""
    got = t.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = got
    return ("cuda", int(device), bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
            bytes(event_handle), bool(event_sync))


def open_cuda(region: tuple) -> torch.Tensor:
    _, device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = region
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, ref_handle, ref_offset,
                                                        event_handle, event_sync)
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (size,), (1,))


# -- the roster -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class IpcRosterEntry:
    """What a rank tells its peers once: who and where it is, and what they may read.

    ``regions`` maps a region id to an exported allocation: ``("shm", segment name,
    bytes)`` or ``("cuda", device, handle, ...)``. ``tensors`` (GPU sources) maps each
    source tensor a receiver reads to ``(region, byte offset, dtype, shape, stride)``;
    ``staged`` (host sources) maps ``(receiver rank, bucket index)`` to ``(region, byte
    offset, bytes)``. ``digest`` names this export.
    """

    rank: int
    name: str
    node: str
    pid: int
    pid_namespace: str
    device: int  # -1: host memory
    control: str
    regions: dict[int, tuple]
    tensors: dict[str, tuple]
    staged: dict[tuple[int, int], tuple[int, int, int]]
    digest: str

    def __repr__(self) -> str:
        return (f"IpcRosterEntry(rank={self.rank}, name={self.name!r}, pid={self.pid}, device={self.device}, "
                f"{len(self.regions)} regions, digest={self.digest})")


register_record(IpcRosterEntry)


def _digest(*parts: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()


# -- per-pair state ---------------------------------------------------------------------------------

@dataclass(eq=False)
class _Peer:
    """A mapped peer: its entry, its control words, its liveness, and (as a source) its memory."""

    entry: IpcRosterEntry
    control: _Segment
    words: np.ndarray
    live: _Liveness
    mapped: dict[int, Any] = field(default_factory=dict)  # region id -> tensor (cuda) or _Segment (shm)
    dropped: bool = False  # its mappings were closed when it failed: map it afresh, even under the same entry

    def close(self) -> None:
        self.words = np.zeros(0, dtype=np.int64)
        self.control.close()
        self.live.close()
        for m in self.mapped.values():
            if isinstance(m, _Segment):
                m.close()
        self.mapped.clear()


@dataclass
class _Copy:
    """One receive: ``dst`` (a view of the destination) takes ``src`` (a view of the peer's memory)."""

    bucket: Bucket
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (destination view, source view), in op order
    bounce: torch.Tensor | None = None  # cross-GPU strided blocks land here first
    staged: torch.Tensor | None = None  # host: the bucket's packed bytes in the source's segment


@dataclass
class _FusedSums:
    """One batch of blocks copied (or only read) and summed in one kernel, and each bucket's streams."""

    batch: CopySumBatch
    streams: list[tuple[Bucket, list[int]]]  # every bucket, with one stream per block (the blocks form)

    def record(self, ledger: ChecksumLedger, *, sent: bool) -> None:
        """Give each bucket's row sums of the last launch to ``ledger`` (after the launch was queued)."""
        for b, streams in self.streams:
            ledger.summed_blocks((b.peer, b.index), self.batch, streams, sent=sent)


def _fuse(device: torch.device, pairs: list[tuple[Bucket, list[tuple[torch.Tensor | None, torch.Tensor]]]]
          ) -> _FusedSums | None:
    """The fused form of buckets given as (bucket, [(destination or None, source) per op]), or None
    when any block cannot take it (a cast, an odd size or stride): then all stay unfused."""
    batch, streams = CopySumBatch(device), []
    try:
        for b, blocks in pairs:
            if not b.nbytes:
                continue
            ids = []
            for d, s in blocks:
                if d is not None and d.dtype != s.dtype:
                    return None
                ids.append(batch.stream(s.numel() * s.element_size()))
                batch.add(ids[-1], 0, s, d)
            streams.append((b, ids))
    except NotFusable:
        return None
    return _FusedSums(batch.build(), streams)


def _view_of(base: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int],
             stride: Sequence[int]) -> torch.Tensor:
    size = dtype.itemsize
    if offset % size:
        raise IpcHandshakeError(f"a {dtype} tensor at byte offset {offset} is not aligned to its element size")
    flat = base[: base.numel() // size * size].view(dtype)
    return flat.as_strided(tuple(shape), tuple(stride), offset // size)


class IpcChannel(OneSidedChannel):
    """This rank's end of the one-node transport, kept across plans; see the module docstring.

    It holds what outlives a plan: the control segment peers poll, the memory this rank
    exports (its GPU source tensors, or a host staging segment), the peers it mapped, and the
    membership epoch. An ``IpcExecutor`` is one plan on it.

    Args:
        rank: this rank's id in the plans and rosters.
        device: where this rank's tensors live (inferred when an executor binds, when None).
        timeout_s: default deadline of one refit (``set_deadline`` overrides it).
        probe_interval_s: how often a waiting rank checks that silent peers still run.
        graphs: on a GPU, replay each source's copies as one CUDA graph captured at the
            handshake (``False``: launch them one by one).
    """

    transport = "ipc"
    handshake_error = IpcHandshakeError
    label = "IPC"
    reregistered = "this rank exported new memory"
    max_nap_s = MAX_NAP_S

    def __init__(self, rank: int, *, device: torch.device | str | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, probe_interval_s: float = DEFAULT_PROBE_S,
                 graphs: bool = True):
        _sweep_quietly()
        self._owner_pid = os.getpid()
        super().__init__(rank)
        self.name = f"refit-ipc-r{self.rank}-{uuid.uuid4().hex[:12]}"
        self.device = torch.device(device) if device is not None else None
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.graphs = graphs
        self.node = node_id()
        self._control = _Segment(_segment_name("control"), CONTROL_SLOTS * 8, create=True)
        self._words = self._control.words()
        self._staging: _Segment | None = None
        self._staging_tensor: torch.Tensor | None = None
        self._regions: dict[int, tuple] = {}
        self._tensors: dict[str, tuple] = {}
        self._staged: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._staged_views: dict[tuple[int, int], torch.Tensor] = {}
        self._keep: dict[int, torch.Tensor] = {}  # region id -> its whole storage as bytes, while peers may read it
        self._peers: dict[int, _Peer] = {}
        _IN_PROCESS[self.name] = self

    # -- a plan's memory -----------------------------------------------------------------------
    def device_for(self, rank: int, src: TensorMap, dst: TensorMap) -> torch.device:
        """The device of this rank's tensors, which every one of them must be on."""
        device = self.device or next((t.device for t in [*src.values(), *dst.values()]), torch.device("cpu"))
        for name, t in [*src.items(), *dst.items()]:
            if t.device.type != device.type or (device.type == "cuda" and device.index is not None
                                                and t.device.index != device.index):
                raise PlanError(f"rank {rank}: {name} is on {t.device}, but this IPC transport moves {device} "
                                "tensors")
        if device.type not in ("cpu", "cuda"):
            raise PlanError(f"rank {rank}: the IPC transport moves host or CUDA tensors, not {device.type}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def bind(self, executor: IpcExecutor, src: TensorMap, signature: tuple) -> None:
        """Serve ``executor``'s plan: export what its receivers read (replacing any earlier
        plan's). Receivers learn of it only through ``local_roster_entry`` and ``update_membership``."""
        self._check_open()
        self.device = executor.device
        self.rank = executor.plan.rank
        self.bound = executor
        self._export(executor.sends, src)
        self._local_digest = _digest(self.name, sorted(self._regions.items()), sorted(self._tensors.items()),
                                     sorted(self._staged.items()), signature)

    def _export(self, sends: Mapping[int, list[Bucket]], src: TensorMap) -> None:
        self._tensors, self._staged, self._staged_views = {}, {}, {}
        regions: dict[int, tuple] = {}
        if self.device.type == "cuda":
            # An allocation this channel still holds keeps its export: the address cannot be
            # another allocation's while the storage is alive, and a handshake stays valid
            # across rebinds to new tensor objects over the same memory (DTensor.to_local()
            # makes one per call). Storages no longer read are let go.
            held = {(k.data_ptr(), k.numel()): (rid, k) for rid, k in self._keep.items()}
            exports = {rid: self._regions[rid] for rid in self._keep}
            region_of: dict[tuple[int, int], int] = {}
            keep = {}
            for name in sorted({op.name for bs in sends.values() for b in bs for op in b.ops}):
                t = src[name]
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in region_of:
                    rid = region_of[key] = len(region_of)
                    old = held.get(key)
                    regions[rid] = exports[old[0]] if old is not None else export_cuda(t)
                    keep[rid] = old[1] if old is not None else torch.empty(
                        0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
                self._tensors[name] = (region_of[key], t.storage_offset() * t.element_size(),
                                       str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
            self._keep = keep
        else:
            size = 0
            layout = []
            for peer, bs in sorted(sends.items()):
                for b in bs:
                    layout.append(((peer, b.index), size, b.nbytes))
                    size = align(size + b.nbytes)
            if self._staging is None or self._staging.nbytes < size or (size == 0 and self._staging is not None):
                self._drop_staging()
                if size:
                    self._staging = _Segment(_segment_name("staging"), size, create=True)
                    self._staging_tensor = self._staging.tensor()
            if self._staging is not None:
                regions[0] = ("shm", self._staging.name, self._staging.nbytes)
                for key, off, n in layout:
                    self._staged[key] = (0, off, n)
                    self._staged_views[key] = self._staging_tensor[off: off + n]
        self._regions = regions

    def _drop_staging(self) -> None:
        self._staged_views, self._staging_tensor = {}, None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def staged_view(self, peer: int, index: int) -> torch.Tensor:
        """Where a host source packs bucket ``index`` for ``peer``: its place in the shared staging."""
        return self._staged_views[(peer, index)]

    @property
    def staging_bytes(self) -> int:
        return self._staging.nbytes if self._staging is not None else 0

    # -- the roster ------------------------------------------------------------------------------
    @property
    def identity(self) -> str:
        return self.name

    @staticmethod
    def entry_identity(entry: IpcRosterEntry) -> str:
        return entry.name

    def local_roster_entry(self) -> IpcRosterEntry:
        """This rank's node, process, control segment and exported memory, for the controller to relay."""
        self._check_open()
        if self.bound is None:
            raise RefitError(f"rank {self.rank}: bind an executor (executor.prepare(src, dst)) before "
                             "local_roster_entry()")
        dev = self.device.index if self.device.type == "cuda" else -1
        return IpcRosterEntry(self.rank, self.name, self.node, os.getpid(), pid_namespace(), dev, self._control.name,
                              dict(self._regions), dict(self._tensors), dict(self._staged), self._local_digest)

    def update_membership(self, roster: Mapping[int, IpcRosterEntry], epoch: int) -> None:
        """Install the roster of ``epoch``: map the peers of the bound plan (new ones only).

        Every peer must run on this node. A peer whose entry is unchanged keeps its
        mappings; one that changed (a restarted process, a new plan) is mapped afresh and
        the old mapping closed. No collective: the next refit starts the epoch.
        """
        executor = self.bound
        peers = executor.peers() if executor is not None else []
        epoch = self._check_roster(roster, epoch, peers)
        elsewhere = [f"{p} ({roster[p].node})" for p in peers if roster[p].node != self.node]
        if elsewhere:
            raise IpcHandshakeError(f"rank {self.rank} (on {self.node}): rank(s) {', '.join(elsewhere)} run on another "
                                    "node; CUDA IPC and shared memory reach this node only (transport='auto' splits a "
                                    "plan over IPC and a network transport)")
        too_high = [p for p in [self.rank, *peers] if p + 1 >= GONE]
        if too_high:
            raise IpcHandshakeError(f"the IPC transport signals at most {GONE - 1} ranks; got rank(s) "
                                    f"{too_high}")
        executor.check_sources(roster)
        old = self._peers
        self._peers = {}
        for p in peers:
            e = roster[p]
            prev = old.pop(p, None)
            if prev is not None and prev.entry == e and not prev.dropped:
                self._peers[p] = prev
                continue
            if prev is not None:
                prev.close()
            self._peers[p] = self._map(e, reads=executor.receives_from(p))
        for prev in old.values():
            prev.close()
        executor.install(self._peers)
        self.epoch = epoch
        self.seq = 0
        self._installed_digest = self._local_digest
        self._aborted.clear()
        self._words[GONE] = 0

    def _map(self, e: IpcRosterEntry, *, reads: bool) -> _Peer:
        """A peer's control words and liveness; with ``reads``, the memory this rank copies from."""
        live = _Liveness(e.pid, visible=e.pid_namespace == pid_namespace())
        if not live.alive():
            live.close()
            raise IpcHandshakeError(f"rank {self.rank}: peer rank {e.rank} ({e.name}, pid {e.pid}) is not running")
        control = _Segment(e.control, create=False)
        peer = _Peer(e, control, control.words(), live)
        if reads:
            local = _IN_PROCESS.get(e.name) if e.pid == os.getpid() and e.pid_namespace == pid_namespace() else None
            try:
                for rid, region in e.regions.items():
                    if region[0] == "cuda" and local is not None:
                        peer.mapped[rid] = local._keep[rid]
                    elif region[0] == "cuda":
                        peer.mapped[rid] = open_cuda(region)
                    elif region[0] == "shm":
                        peer.mapped[rid] = _Segment(region[1], create=False)
                    else:
                        raise IpcHandshakeError(f"rank {e.rank} exports a region of unknown kind {region[0]!r}")
            except Exception:
                peer.close()
                raise
        return peer

    @property
    def mapped_regions(self) -> int:
        """How many peer allocations this rank holds mapped (for leak checks)."""
        return sum(len(p.mapped) for p in self._peers.values())

    # -- the words a refit is signalled by ---------------------------------------------------------
    def publish(self, gen: int) -> None:
        """A source's data for refit ``gen`` is readable."""
        self._words[0] = gen

    def report_done(self, source: int, gen: int) -> None:
        """This receiver's copies of refit ``gen`` from ``source`` landed: it may change its tensors."""
        self._words[1 + source] = gen

    def published(self, source: int) -> int:
        return int(self._peers[source].words[0])

    def reported(self, receiver: int) -> int:
        return int(self._peers[receiver].words[1 + self.rank])

    def peer(self, rank: int) -> _Peer:
        return self._peers[rank]

    def give_up(self) -> None:
        """This rank left its refit: its peers stop waiting for it now, not at their deadline (a
        new membership clears the mark)."""
        self._aborted.set()
        if self._words.size:
            self._words[GONE] = 1

    def abort(self) -> None:
        """Make a refit in progress raise ``RefitAborted`` now, and the peers waiting on this
        rank at their next check (idempotent; thread-safe)."""
        super().abort()
        if self._words.size:
            self._words[GONE] = 1

    def gone(self, peer: int) -> str | None:
        """Why ``peer`` will not answer (its process exited, or it gave up), or None."""
        p = self._peers[peer]
        if not p.live.alive():
            return f"its process (pid {p.entry.pid}) exited"
        if p.words.size and p.words[GONE]:
            return "it aborted its refit or closed its transport"
        return None

    def drop_peer(self, peer: int) -> None:
        """Close a failed peer's mappings; no refit runs before a new membership maps the survivors again."""
        p = self._peers.get(peer)
        if p is None:
            return
        if self.bound is not None:
            self.bound.forget(peer)
        for m in p.mapped.values():
            if isinstance(m, _Segment):
                m.close()
        p.mapped.clear()
        p.dropped = True
        self._installed_digest = None

    def peer_name(self, peer: int) -> str:
        return self._peers[peer].entry.name

    # -- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every mapping and remove this rank's segments (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.bound is not None:
            self.bound.forget_all()
        for p in self._peers.values():
            p.close()
        self._peers = {}
        self._keep, self._regions = {}, {}
        _IN_PROCESS.pop(self.name, None)
        self._drop_staging()
        if self._words.size:
            self._words[GONE] = 1
        self._words = np.zeros(0, dtype=np.int64)
        self._control.close()

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) != os.getpid():
            return  # a forked child's copy: closing it would mark the parent's channel gone to its peers
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"IpcChannel(rank={self.rank}, name={self.name!r}, epoch={self.epoch})"


class IpcExecutor(Executor):
    """One rank's ``RankPlan`` over an ``IpcChannel``: the channel (its segments and mappings)
    outlives the plan. See the module docstring for one refit."""

    transport = "ipc"

    def __init__(self, plan: RankPlan, channel: IpcChannel):
        if plan.fanout and (plan.gather_sends or plan.gather_recvs):
            raise PlanError("the IPC transport runs plans without replica fan-out (build_rank_plan(fanout=False))")
        # One executor per plan a controller builds: a rank of this host killed since the last
        # build left its segments (the weights it staged, in plain form), and nothing else would
        # remove them. Not at prepare, which a rebind repeats on the refit's own path.
        _sweep_quietly()
        super().__init__(plan, None)
        self.channel = channel
        self.device: torch.device | None = None
        self.sends: dict[int, list[Bucket]] = {}
        self.recvs: dict[int, list[Bucket]] = {}
        self._copies: dict[int, list[_Copy]] = {}
        self._graphs: dict[int, Any] = {}  # source rank -> the CUDA graph of its copies
        self._scratch: StagingPool | None = None
        # one kernel per refit that copies and sums (receiver) or sums (sender): made on the
        # first verified run, None where some block cannot take it (then the eager path runs)
        self._fused_recv: dict[int, _FusedSums | None] = {}
        self._fused_send: _FusedSums | None | bool = False  # False: not made yet
        self._side_stream: Any = None

    # -- binding and membership --------------------------------------------------------------------
    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        """Export what this rank's receivers read, on the channel (on a GPU the source tensors
        themselves, so ``src`` must hold the weights at every refit; on the host the sends are
        packed into one shared segment)."""
        self.device = self.channel.device_for(self.plan.rank, src, dst)
        self.sends = self._by_peer(self.plan.sends, src, "src")
        self.recvs = self._by_peer(self.plan.recvs, dst, "dst")
        self._fused_send, self._fused_recv = False, {}
        self.channel.bind(self, src, self._signature(src, dst))

    def _by_peer(self, buckets: Sequence[Bucket], tensors: TensorMap, side: str) -> dict[int, list[Bucket]]:
        out: dict[int, list[Bucket]] = {}
        for b in buckets:
            missing = sorted({op.name for op in b.ops} - set(tensors))
            if missing:
                raise PlanError(f"rank {self.plan.rank}: the plan {'sends' if side == 'src' else 'receives'} "
                                f"{missing} but no {side} tensor was given for it")
            out.setdefault(b.peer, []).append(b)
        for bs in out.values():
            bs.sort(key=lambda b: b.index)
        return out

    def peers(self) -> list[int]:
        return sorted(set(self.sends) | set(self.recvs))

    def receives_from(self, rank: int) -> bool:
        return rank in self.recvs

    def check_sources(self, roster: Mapping[int, IpcRosterEntry]) -> None:
        """Every source's export covers every bucket this rank receives from it."""
        for rank, mine in self.recvs.items():
            e = roster[rank]
            if e.device >= 0 and self.device.type != "cuda":
                raise IpcHandshakeError(f"rank {self.plan.rank} moves host tensors, but source rank {e.rank} exports "
                                        f"GPU memory (cuda:{e.device}): both ends of the IPC transport must be on "
                                        "GPUs, or the source on the host")
            if e.device >= 0:
                lacking = sorted({op.name for b in mine for op in b.ops} - set(e.tensors))
                if lacking:
                    raise IpcHandshakeError(f"rank {self.plan.rank}: source rank {e.rank} does not export "
                                            f"{lacking[:8]}, which this rank's plan reads from it: both must build "
                                            "their plans from the same rosters")
                continue
            bad = [b.index for b in mine if e.staged.get((self.plan.rank, b.index), (0, 0, -1))[2] != b.nbytes]
            if bad:
                raise IpcHandshakeError(f"rank {self.plan.rank}: source rank {e.rank} stages buckets that do not "
                                        f"match this rank's plan (buckets {bad[:8]}): both must build their plans "
                                        "from the same rosters")

    def install(self, peers: Mapping[int, _Peer]) -> None:
        """The copies from every mapped source (and their CUDA graphs), after a new membership."""
        self._copies = {p: [self._copy_of(b, peers[p]) for b in bs] for p, bs in self.recvs.items()}
        self._graphs = {p: g for p, cs in self._copies.items() if (g := self._capture(p, cs)) is not None}
        self._fused_recv = {}

    def forget(self, peer: int) -> None:
        """Drop what reads a failed peer's memory."""
        self._copies.pop(peer, None)
        self._graphs.pop(peer, None)
        self._fused_recv.pop(peer, None)

    def forget_all(self) -> None:
        self._copies, self._graphs, self._fused_recv = {}, {}, {}
        self._fused_send = False

    def _copy_of(self, b: Bucket, peer: _Peer) -> _Copy:
        e = peer.entry
        if e.device < 0:
            rid, off, n = e.staged[(self.plan.rank, b.index)]
            return _Copy(b, [], staged=peer.mapped[rid].tensor()[off: off + n])
        pairs = []
        cross = self.device.type != "cuda" or self.device.index != e.device
        for op in b.ops:
            rid, off, dtype, shape, stride = e.tensors[op.name]
            src = _view_of(peer.mapped[rid], off, dtype_from_name(dtype), shape, stride)[op.box.src_slices()]
            dst = self.dst[op.name][op.box.dst_slices()]
            pairs.append((dst, src))
        copy = _Copy(b, pairs)
        if cross and any(not (d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype) for d, s in pairs):
            copy.bounce = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
        return copy

    # -- one refit --------------------------------------------------------------------------------
    def _run(self, *, verify: bool, corrupt: Corruption | None) -> TransferStats:
        """One refit of the bound plan; returns this rank's ``TransferStats``.

        Raises ``RefitAborted`` naming the peer when one is gone or stays silent past the
        deadline (the other peers' transfers still complete), ``IpcHandshakeError`` when
        tensors moved without a new handshake. ``corrupt`` (tests) flips bytes of what a
        receiver reads after the sender's checksum was taken.
        """
        try:
            return self._refit(verify, corrupt)
        except BaseException:
            self.channel.give_up()
            raise

    def _refit(self, verify: bool, corrupt: Corruption | None) -> TransferStats:
        ch = self.channel
        src, dst = self.src, self.dst
        rnd = ch.begin_round(verify=verify)
        gen = _generation(ch.epoch, rnd.seq)
        stats, ledger = rnd.stats, rnd.ledger
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None
        restore: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            # 1. sources: make the data readable, then publish the generation
            side = self._publish(src, dst, gen, rnd, corrupt, restore)
            # 2. receivers: take each source's blocks once it published; 3. sources: wait for 'done'
            self._exchange(dst, gen, rnd)
        finally:
            for view, saved in restore:
                view.copy_(saved)
        ch.raise_failed(rnd)
        stats.zero_copy_buckets = sum(len(bs) for bs in self.recvs.values()) if cuda else 0
        stats.staging_capacity_bytes = ch.staging_bytes
        stats.peak_staging_bytes = stats.staging_capacity_bytes
        if ledger is not None:
            if side is not None:
                stream.wait_stream(side)
            stats.checksums_sent, stats.checksums_received = ledger.settle()
        stats.seconds = time.perf_counter() - rnd.t0
        return stats

    def _publish(self, src: TensorMap, dst: TensorMap, gen: int, rnd: OneSidedRound, corrupt: Corruption | None,
                 restore: list) -> Any:
        """A source's half before its peers read: sums (beside their copies on a GPU, packed on
        the host), then the generation published. Returns the side stream the sums run on."""
        stats, ledger = rnd.stats, rnd.ledger
        cuda = self.device.type == "cuda"
        stats.local_bytes = local_copies(self.plan, src, dst)
        fused_send = self._fused_sends() if cuda and ledger is not None and corrupt is None else None
        side = None
        if fused_send is not None:  # the sums run beside the receivers' copies, never ahead of them
            side = self._side()
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fused_send.batch.launch()
            fused_send.record(ledger, sent=True)
        for peer, bs in self.sends.items():
            for b in bs:
                if cuda:
                    if fused_send is None and (ledger is not None or corrupt is not None):
                        self._sum_or_corrupt(b, src, ledger, corrupt, restore)
                else:
                    buf = pack_bucket(b, src, self.channel.staged_view(peer, b.index), ledger=ledger,
                                      key=(peer, b.index))
                    if corrupt is not None:
                        corrupt(peer, b.index, buf)
                stats.bytes_sent += b.nbytes
                stats.buckets_sent += 1
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.channel.publish(gen)
        return side

    def _exchange(self, dst: TensorMap, gen: int, rnd: OneSidedRound) -> None:
        """Poll the peers' words: read each source once it published (and say 'done' once the
        copies landed), and wait for every receiver's 'done'."""
        awaiting = set(self.recvs)
        landing: dict[int, Any] = {}  # source -> CUDA event of its copies
        unreported = set(self.sends)

        def step() -> int:
            progress = 0
            for p in sorted(awaiting):
                have = self.channel.published(p)
                if have == gen:
                    awaiting.discard(p)
                    landing[p] = self._receive(p, dst, rnd.stats, rnd.ledger)
                    progress += 1
                elif have > gen:
                    raise IpcHandshakeError(f"{self.channel.where(rnd.seq)}: source rank {p} published "
                                            f"{_describe(have)}, "
                                            "ahead of this rank: the two installed different memberships")
            for p in list(landing):
                event = landing[p]
                if event is None or event.query():
                    del landing[p]
                    self.channel.report_done(p, gen)
                    progress += 1
            for p in sorted(unreported):
                have = self.channel.reported(p)
                if have == gen:
                    unreported.discard(p)
                    progress += 1
                elif have > gen:
                    raise IpcHandshakeError(f"{self.channel.where(rnd.seq)}: receiver rank {p} reported "
                                            f"{_describe(have)} done, ahead of this rank: the two installed "
                                            "different memberships")
            return progress

        def probe() -> None:
            for p in sorted(awaiting | unreported):
                why = self.channel.gone(p)
                if why:
                    rnd.failed[p] = why
                    awaiting.discard(p)
                    unreported.discard(p)
                    self.channel.drop_peer(p)

        def nap(idle: int) -> None:
            if landing and not awaiting and not unreported and len(landing) == 1:
                next(iter(landing.values())).synchronize()  # only this rank's own copies are left
            else:
                self.channel.nap(idle)

        self.channel.poll_round(rnd, pending=lambda: bool(awaiting or landing or unreported), step=step,
                         missing=lambda: self._missing(awaiting, unreported, rnd.failed), probe=probe, nap=nap)

    def _side(self) -> Any:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def _fused_sends(self) -> _FusedSums | None:
        """The sender's sums of every block it exports, as one read-only kernel (made once per prepare)."""
        if self._fused_send is False:
            self._fused_send = None
            buckets = [b for bs in self.sends.values() for b in bs]
            casts = any(self.src[op.name].dtype != dtype_from_name(op.dst_dtype) for b in buckets for op in b.ops)
            if fused_enabled(self.device) and not casts:  # a cast block is summed as the receiver casts it
                self._fused_send = _fuse(self.device, [
                    (b, [(None, self.src[op.name][op.box.src_slices()]) for op in b.ops]) for b in buckets])
        return self._fused_send

    def _fused_receives(self, peer: int) -> _FusedSums | None:
        """The copies from ``peer`` and their sums as one kernel (made once per membership)."""
        if peer not in self._fused_recv:
            copies = self._copies[peer]
            ok = fused_enabled(self.device) and all(c.bounce is None and c.staged is None for c in copies)
            self._fused_recv[peer] = _fuse(self.device, [(c.bucket, list(c.pairs)) for c in copies]) if ok else None
        return self._fused_recv[peer]

    def _capture(self, peer: int, copies: list[_Copy]) -> Any:
        """The copies from one source as one CUDA graph, replayed at every refit.

        An 8B model is a few hundred blocks; launched one by one from Python, the gaps
        between the copies cost about a fifth of the refit on one GPU. Strided blocks from
        another GPU (through a local buffer) stay eager; so does everything if capture fails.
        """
        if not self.channel.graphs or self.device.type != "cuda" or not copies:
            return None
        if len(_IN_PROCESS) > 1:  # endpoints on threads of one process: their CUDA work would break a capture
            return None
        if any(c.bounce is not None or c.staged is not None for c in copies):
            return None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for c in copies:
                    for d, src in c.pairs:
                        d.copy_(src)
        except Exception as e:  # the eager copies are as correct, only slower
            _FAILED_CAPTURES.append(graph)  # torch aborts the process when a failed capture is destroyed
            log.warning("rank %d: the copies from rank %d could not be captured as a CUDA graph (%s: %s); "
                        "they run eagerly", self.plan.rank, peer, type(e).__name__, e)
            return None
        return graph

    def _receive(self, peer: int, dst: TensorMap, stats: TransferStats, ledger: ChecksumLedger | None) -> Any:
        fused = self._fused_receives(peer) if ledger is not None and self.device.type == "cuda" else None
        if fused is not None:
            fused.batch.launch()  # every copy from this source and its checksums, in one pass
            fused.record(ledger, sent=False)
            for c in self._copies[peer]:
                stats.bytes_received += c.bucket.nbytes
                stats.buckets_received += 1
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        graph = self._graphs.get(peer)
        if graph is not None:
            graph.replay()  # every copy from this source at once
        for c in self._copies[peer]:
            b = c.bucket
            if graph is None:
                self._copy(c, dst, ledger)
            if ledger is not None and c.staged is None and b.nbytes:
                self._sum(ledger, b, dst, "dst")
            stats.bytes_received += b.nbytes
            stats.buckets_received += 1
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        return None

    def _copy(self, c: _Copy, dst: TensorMap, ledger: ChecksumLedger | None) -> None:
        """One bucket's blocks, launched one by one (no graph)."""
        b = c.bucket
        if c.staged is not None:
            unpack_bucket(b, c.staged, dst, ledger=ledger if b.nbytes else None, key=(b.peer, b.index))
        elif c.bounce is not None:
            for op, off, (d, s) in zip(b.ops, b.offsets, c.pairs):
                wire = op_view(c.bounce, op, off)
                if s.is_contiguous() and s.dtype == wire.dtype:
                    wire.copy_(s)  # a peer copy on the copy engines
                else:
                    wire.copy_(s.contiguous())  # strided on the peer: gathered there first
                d.copy_(wire)
        else:
            for d, s in c.pairs:
                d.copy_(s)

    def _sum(self, ledger: ChecksumLedger, b: Bucket, tensors: TensorMap, side: str) -> None:
        """The checksum of the bucket's blocks as the destination holds them (the GPU path packs
        nothing and has no wire dtype): block by block, each summed where it lies when it is
        contiguous in the destination's dtype, else through scratch (the source's blocks cast
        as the receiver's copy casts them). Summing the widened values themselves, not their
        narrower wire form, also catches a flipped low bit of a widened value."""
        parts, scratch = [], []
        for op in b.ops:
            block = tensors[op.name][op.box.dst_slices() if side == "dst" else op.box.src_slices()]
            want = dtype_from_name(op.dst_dtype)
            if block.dtype != want or not block.is_contiguous():
                if self._scratch is None:
                    self._scratch = StagingPool(self.device)
                buf = self._scratch.take(op.box.numel * want.itemsize)
                buf.view(want).view(op.box.shape).copy_(block)
                scratch.append(buf)
                block = buf
            parts.append(block.reshape(-1).view(torch.uint8))
        ledger.blocks((b.peer, b.index), parts, sent=side == "src")  # summed now, in stream order
        for buf in scratch:
            self._scratch.give_back(buf)  # reused only by work queued after the sums

    def _sum_or_corrupt(self, b: Bucket, src: TensorMap, ledger: ChecksumLedger | None, corrupt,
                        restore: list) -> None:
        if ledger is not None and b.nbytes:
            self._sum(ledger, b, src, "src")
        if corrupt is not None and b.nbytes:
            view = direct_view(b, src, "src")
            if view is None:  # corrupt the first op's block (in its own dtype)
                op: Op = b.ops[0]
                view = src[op.name][op.box.src_slices()].reshape(-1).view(torch.uint8) \
                    if src[op.name][op.box.src_slices()].is_contiguous() else None
            if view is not None:
                restore.append((view, view.clone()))
                corrupt(b.peer, b.index, view)

    def _missing(self, awaiting, unreported, failed) -> str:
        ch = self.channel
        parts = [ch.failures(failed)] if failed else []
        if awaiting:
            parts.append("no data from source rank(s) " + ", ".join(
                f"{p} ({ch.peer(p).entry.name}, pid {ch.peer(p).entry.pid}: at {_describe(ch.published(p))})"
                for p in sorted(awaiting)))
        if unreported:
            parts.append("no 'done' from receiver rank(s) " + ", ".join(
                f"{p} ({ch.peer(p).entry.name}, pid {ch.peer(p).entry.pid})" for p in sorted(unreported)))
        return "; ".join(parts) or "nothing outstanding"

    def _signature(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> tuple:
        """Where the memory a GPU refit reads and writes is: the exported source tensors and
        the destination views the copies (and their graphs) were made for. On the host the
        sources are packed and the destinations unpacked at every run, so any tensors do."""
        if self.device is None or self.device.type != "cuda":
            return ()
        names = {op.name for bs in self.recvs.values() for b in bs for op in b.ops}
        out = []
        for n in sorted({op.name for bs in self.sends.values() for b in bs for op in b.ops}):
            t = src.get(n)
            out.append(("src", n) if t is None else ("src", n, t.untyped_storage().data_ptr(), t.storage_offset(),
                                                     tuple(t.shape), tuple(t.stride()), t.dtype))
        for n in sorted(names):
            t = dst.get(n)
            out.append(("dst", n) if t is None else ("dst", n, t.data_ptr(), tuple(t.shape), tuple(t.stride()),
                                                     t.dtype))
        return tuple(out)

    def _release(self) -> None:
        self.forget_all()
        if self.channel.bound is self:
            self.channel.bound = None
        if self._scratch is not None:
            self._scratch.release()
            self._scratch = None
