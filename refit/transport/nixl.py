"""One-sided NIXL transport: the same per-rank plans, moved by WRITEs with notifications.

The gloo / NCCL transport (``refit.transport.rounds``) runs a plan as matched send/recv pairs
on a communicator, so every refit needs both ends inside one collective library. This
transport moves the same ``RankPlan`` with NIXL (UCX today, RDMA where the hardware has
it): each source WRITEs straight into buffers its receivers registered once, and no
collective, barrier or process group is touched on the refit path.

Setup, once per plan (and again only when the plan or the membership changes):

    channel = NixlChannel(rank, device=dev)   # the agent: kept across plans
    executor = NixlExecutor(plan, channel)
    executor.prepare(src, dst)                # register send / receive buffers (once)
    entry = channel.local_roster_entry()      # agent metadata + this rank's receive descriptors
    ... the controller gathers every rank's entry and relays the roster ...
    channel.update_membership(roster, epoch)  # load new peers point to point; cached from now on

or, where a process group is at hand, ``channel.handshake(group)`` gathers and installs the
roster with one ``all_gather_object``. Then every refit is ``executor.run()``:

1. every receiver sends each of its sources a *ready* notification (its receive buffers
   are free: it finished unpacking the previous refit);
2. every source makes its data ready (CUDA work done, blocks packed into its registered
   staging), waits for *ready* from each receiver, and WRITEs to it; each WRITE carries a
   *data* notification, delivered after its bytes landed;
3. every receiver waits for the data notifications of its sources and unpacks.

Notifications carry the membership epoch and the refit sequence number (which restarts
at 0 with each epoch), so a late message from an aborted refit or an old membership is
never taken for a current one, and a node that joined later is in step at its first
refit. The *ready* message also carries the digest of the receiver's descriptor map: a
source whose cached map is older raises ``NixlHandshakeError`` instead of writing into
memory the receiver no longer owns; a receiver whose destination tensors moved rebinds
(new registrations, a new digest) and refuses to run until a new handshake.

Every wait has a deadline (``timeout_s``, or the one ``RefitAbortWatchdog`` hands to
``set_deadline``), and a peer that stays silent is probed with a tiny notification, which
fails at once when its process is gone: a dead receiver makes its sources raise
``RefitAborted`` naming it, a dead source does the same to its receivers. After
``update_membership`` without the dead node (and a plan rebuilt for the smaller world),
the next refit runs normally.

Buffers: a bucket that is one contiguous block with no cast is written straight from the
source tensor into the destination tensor (both registered where they live: zero copies);
the others go through one registered staging region per peer, sized by the plan's buckets
for that peer. Staging is held for the life of the plan, so a rank holds at most the bytes
it sends plus the bytes it receives that are not zero-copy (``TransferStats.
staging_capacity_bytes`` reports it).

Install the extra with ``pip install 'refit[nixl]'`` (NVIDIA's ``nixl-cu13`` wheel; the
``nixl-cu12`` or ``nixl`` packages work too). ``docs/nixl.md`` says when to pick it over NCCL.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.comm.wire import register_record
from refit.errors import PlanError, RefitError, TransportError
from refit.plan import Bucket, RankPlan
from refit.transport.base import Corruption, Executor, TensorMap, TransferStats
from refit.transport.buckets import ChecksumLedger, direct_view, local_copies, op_view, pack_bucket, unpack_bucket
from refit.transport.copy_sum import CopySumBatch, NotFusable, fused_enabled
from refit.transport.one_sided import OneSidedChannel, OneSidedRound

__all__ = [
    "NixlChannel",
    "NixlExecutor",
    "NixlHandshakeError",
    "NixlRosterEntry",
    "NixlUnavailable",
    "apply_gpu_tls",
    "gpu_ucx_tls",
    "load_nixl",
    "nixl_available",
]

log = logging.getLogger(__name__)

NIXL_MODULES = ("nixl._api", "nixl_cu13", "nixl_cu12")
INSTALL_HINT = "pip install 'refit[nixl]' (NVIDIA's nixl-cu13 wheel; nixl-cu12 for CUDA 12)"
GPU_TLS = ("cuda_copy", "cuda_ipc")
DEFAULT_CHUNK_BYTES = 256 << 20  # bytes per WRITE: packing chunk i+1 overlaps the wire of chunk i
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_PROBE_S = 0.25  # a silent peer is probed this often, so a dead one is noticed at once
_ALIGN = 256
_TAG = b"rfx1"


class NixlUnavailable(RefitError, ImportError):
    """The NIXL Python package is not installed."""


class NixlHandshakeError(TransportError):
    """The cached handshake does not match the buffers or the plan: a new one is needed."""


class _PeerFailed(Exception):
    def __init__(self, peer: int, why: str):
        super().__init__(why)
        self.peer = peer
        self.why = why


def load_nixl():
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``), whichever wheel provides it."""
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
            if "NIXL_LOG_LEVEL" not in os.environ:
                # NIXL logs every agent it creates at INFO on stdout, where `--json` commands
                # print their result; its warnings and errors still show (NIXL_LOG_LEVEL overrides)
                logging.getLogger("nixl").setLevel(logging.WARNING)
            return mod
        errors.append(f"{name}: no nixl_agent")
    raise NixlUnavailable(f"the NIXL transport needs NIXL: {INSTALL_HINT} ({'; '.join(errors)})")


def nixl_available() -> bool:
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


def gpu_ucx_tls(tls: str | None) -> str | None:
    """The ``UCX_TLS`` to use with GPU tensors: a host-only list gets ``cuda_copy,cuda_ipc`` added.

    UCX takes GPU memory only through its CUDA transports; a list such as ``tcp`` or
    ``rc,sm`` would make it treat device pointers as host memory and crash. Unset, an
    exclusion list (``^...``), ``all`` or a list naming any CUDA transport is left alone.
    """
    if tls is None or not tls.strip():
        return tls
    text = tls.strip()
    if text.startswith("^"):
        return tls
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if any(p == "all" or p.startswith(("cuda", "gdr", "rocm")) for p in parts):
        return tls
    return ",".join(parts + list(GPU_TLS))


def apply_gpu_tls(environ=os.environ) -> None:
    old = environ.get("UCX_TLS")
    new = gpu_ucx_tls(old)
    if new != old:
        environ["UCX_TLS"] = new
        log.warning("UCX_TLS=%s is host-only; using %s so GPU tensors can move", old, new)


# -- the roster ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class NixlRosterEntry:
    """What a rank tells every other rank once: who it is and where to write to it.

    ``recv_descs`` maps ``(source rank, bucket index)`` of each bucket this rank receives
    to ``(address, length, device)`` in its registered memory (``mem_type`` "DRAM" or
    "VRAM"). ``digest`` names this registration; a source compares it with the one each
    *ready* notification carries.
    """

    rank: int
    agent_name: str
    metadata: bytes
    mem_type: str
    recv_descs: dict[tuple[int, int], tuple[int, int, int]]
    digest: str

    def __repr__(self) -> str:  # metadata is a few KB of binary
        return (f"NixlRosterEntry(rank={self.rank}, agent={self.agent_name!r}, {len(self.recv_descs)} recv "
                f"descriptors, digest={self.digest})")


register_record(NixlRosterEntry)  # ranks exchange it through the rendezvous store, as data


def _digest(agent_name: str, mem_type: str, descs: Mapping[tuple[int, int], tuple[int, int, int]]) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{agent_name}|{mem_type}|".encode())
    for key in sorted(descs):
        h.update(repr((key, descs[key])).encode())
    return h.hexdigest()


# -- per-pair bookkeeping -------------------------------------------------------------------------

@dataclass
class _Chunk:
    """Consecutive buckets of one pair, written by one WRITE with one data notification."""

    peer: int
    pos: int  # chunk number within the pair
    lo: int  # first bucket position (in the pair's buckets sorted by index)
    hi: int  # one past the last
    nbytes: int


@dataclass
class _Slot:
    """Where one bucket lives on this rank: a staging offset, or the tensor itself."""

    bucket: Bucket
    staging: torch.Tensor | None  # the pair's staging region, or None when direct
    offset: int = 0
    addr: int = 0  # direct: the view's address at prepare time
    temp: torch.Tensor | None = None  # a corrupted copy to write instead (fault injection)

    def view(self) -> torch.Tensor:
        return self.staging[self.offset: self.offset + self.bucket.nbytes]


@dataclass(eq=False)
class _Pair:
    peer: int
    slots: list[_Slot] = field(default_factory=list)  # sorted by bucket index
    chunks: list[_Chunk] = field(default_factory=list)
    staging: torch.Tensor | None = None
    sig: tuple = ()  # the buckets and in-place addresses it was built for
    regs: set[int] = field(default_factory=set)  # registered storages it uses


@dataclass
class _Remote:
    entry: NixlRosterEntry


@dataclass
class _FusedSlots:
    """Buckets of one pair copied into or out of staging (or only read, in place) and summed, in one kernel."""

    batch: CopySumBatch
    streams: list[tuple[tuple[int, int], int]]  # (peer, bucket index), its stream

    def record(self, ledger: ChecksumLedger, *, sent: bool) -> None:
        for key, stream in self.streams:
            ledger.summed(key, self.batch, stream, sent=sent)


def _fuse_slots(device: torch.device, slots: Sequence[_Slot], tensors: Mapping[str, torch.Tensor],
                side: str) -> _FusedSlots | None:
    """``slots`` as one fused batch: a staged bucket's blocks copied between their tensors and the
    staging (the packed form, gaps summed as zeros), an in-place bucket only read; None when a
    block casts or is not whole int64 words at one stride (those stay on pack / unpack)."""
    batch, streams = CopySumBatch(device), []
    try:
        for s in slots:
            b = s.bucket
            if not b.nbytes:
                continue
            k = batch.stream(b.nbytes)
            if s.staging is None:
                view = direct_view(b, tensors, side)
                if view is None:
                    return None
                batch.add(k, 0, view)
            else:
                buf = s.view()
                for op, off in zip(b.ops, b.offsets):
                    t = tensors[op.name][op.box.src_slices() if side == "src" else op.box.dst_slices()]
                    wire = op_view(buf, op, off)
                    if t.dtype != wire.dtype:
                        return None
                    batch.add(k, off, *((t, wire) if side == "src" else (wire, t)))
            streams.append(((b.peer, b.index), k))
    except NotFusable:
        return None
    return _FusedSlots(batch.build(), streams)


def _device_index(device: torch.device) -> int:
    return (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 0


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _chunks(peer: int, slots: Sequence[_Slot], chunk_bytes: int) -> list[_Chunk]:
    out, lo, size = [], 0, 0
    for i, s in enumerate(slots):
        size += s.bucket.nbytes
        if size >= chunk_bytes or i == len(slots) - 1:
            out.append(_Chunk(peer, len(out), lo, i + 1, size))
            lo, size = i + 1, 0
    return out


# -- the transport ---------------------------------------------------------------------------------

@dataclass
class _Flight:
    """What one NIXL refit still has in flight, and what it made on the way."""

    src: Mapping[str, torch.Tensor]
    dst: Mapping[str, torch.Tensor]
    corrupt: Corruption | None
    fusing: bool  # on a GPU a chunk packs and unpacks in one kernel
    fused: ChecksumLedger | None  # verified and fusing: the sums are taken in that same pass
    to_pack: list[tuple[_Pair, _Chunk]] = field(default_factory=list)
    awaiting: dict[int, set[int]] = field(default_factory=dict)  # source -> positions of buckets still to land
    ready: set[int] = field(default_factory=set)  # receivers whose buffers are free
    queued: list[tuple[_Pair, _Chunk, Any]] = field(default_factory=list)  # packed, waiting for 'ready' or the event
    posted: dict[tuple[int, int], Any] = field(default_factory=dict)  # (peer, chunk) -> WRITE handle
    temps: list[int] = field(default_factory=list)  # registrations made for this refit alone
    unsummed: list[tuple[tuple[int, int], torch.Tensor]] = field(default_factory=list)  # direct sends, summed last

    def pending(self) -> bool:
        return bool(self.to_pack or self.queued or self.posted or self.awaiting)

    def fail(self, rnd: OneSidedRound, peer: int, why: str) -> None:
        """Drop a failed peer's work; the other peers' goes on."""
        rnd.failed.setdefault(peer, why)
        self.to_pack = [(p, c) for p, c in self.to_pack if p.peer != peer]
        self.queued = [q for q in self.queued if q[0].peer != peer]
        for key in [k for k in self.posted if k[0] == peer]:
            del self.posted[key]
        self.awaiting.pop(peer, None)


class NixlChannel(OneSidedChannel):
    """This rank's NIXL agent and what it knows of its peers, kept across plans; see the module docstring.

    It holds what outlives a plan: the agent, the memory registered with it, the peers'
    agents loaded into it, the WRITE handles, the notifications, and the membership epoch.
    A ``NixlExecutor`` is one plan on it.

    Args:
        rank: this rank's id in the plans and rosters.
        device: where this rank's tensors live (inferred from the tensors when an executor
            binds, when None). For CUDA, a host-only ``UCX_TLS`` gets the CUDA transports
            added before the NIXL agent starts.
        agent_name: unique per rank AND per incarnation; the default adds a random suffix
            to the rank, since separate worlds (a trainer's and an engine's) each have a
            rank 0, and a restarted rank must not be mistaken for the one it replaces.
        timeout_s: default deadline of one refit (``set_deadline`` overrides it).
        chunk_bytes: bytes per WRITE (and data notification) to one peer.
        direct: write from / into the tensors themselves when a bucket is one contiguous
            block with no cast (registers the tensors' storage).
        progress_thread: NIXL's progress thread (it spins a core; the refit loop drives
            progress itself, so it is off by default).
        backends: NIXL backends to create (``["UCX"]``).
    """

    transport = "nixl"
    handshake_error = NixlHandshakeError
    label = "NIXL"
    reregistered = "receive buffers were registered again"

    def __init__(self, rank: int, *, device: torch.device | str | None = None, agent_name: str | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 direct: bool = True, progress_thread: bool = False, backends: Sequence[str] = ("UCX",),
                 probe_interval_s: float = DEFAULT_PROBE_S):
        if chunk_bytes < 1:
            raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
        super().__init__(rank)
        self.agent_name = agent_name or f"refit-nixl-r{self.rank}-{uuid.uuid4().hex[:12]}"
        self.device = torch.device(device) if device is not None else None
        self.timeout_s = timeout_s
        self.chunk_bytes = int(chunk_bytes)
        self.direct = direct
        self.probe_interval_s = probe_interval_s
        self._progress_thread = progress_thread
        self._backends = list(backends)
        self._nixl = load_nixl()
        self.agent = None
        self.mem_type = "DRAM"
        self.dev = 0
        self._regs: dict[int, tuple[Any, Any]] = {}  # storage ptr -> (registration, keep-alive)
        self._recv_descs: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._remotes: dict[int, _Remote] = {}  # plan peers by rank, from the installed roster
        self._loaded: dict[str, bytes] = {}  # remote agents loaded into NIXL: name -> metadata
        self._handles: dict[tuple[int, int], tuple[tuple, Any]] = {}
        self._inbox: dict[tuple[bytes, int, int, int], list[tuple[str, bytes]]] = {}
        # the pairs (sends, receives) of the plan bound last: a new plan keeps those that did not change
        self.last_pairs: tuple[dict[int, _Pair], dict[int, _Pair]] = ({}, {})
        if self.device is not None:
            self.start(self.device)

    # -- agent and memory --------------------------------------------------------------------
    def start(self, device: torch.device) -> None:
        """Start the agent for tensors on ``device`` (once)."""
        if self.agent is not None:
            return
        if device.type == "cuda":
            apply_gpu_tls()
        cfg = self._nixl.nixl_agent_config(enable_prog_thread=self._progress_thread, backends=self._backends)
        self.agent = self._nixl.nixl_agent(self.agent_name, cfg)
        self.device = device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.dev = _device_index(device)

    def register(self, t: torch.Tensor) -> int:
        """Register the storage under ``t`` once; return its address."""
        ptr, nbytes = _storage_span(t)
        if ptr not in self._regs and nbytes:
            reg = self.agent.register_memory([(ptr, nbytes, self.dev, "")], self.mem_type)
            self._regs[ptr] = (reg, t.untyped_storage())
        return ptr

    def registered(self, t: torch.Tensor) -> bool:
        return _storage_span(t)[0] in self._regs

    @property
    def registrations(self) -> set[int]:
        return set(self._regs)

    def deregister(self, ptrs) -> None:
        for ptr in list(ptrs):
            got = self._regs.pop(ptr, None)
            if got is not None:
                try:
                    self.agent.deregister_memory(got[0])
                except Exception as e:  # best effort: the memory goes anyway
                    log.warning("NIXL deregister of 0x%x failed: %s", ptr, e)

    def release_handles(self, peer: int | None = None) -> None:
        for key in [k for k in self._handles if peer is None or k[0] == peer]:
            self.release_handle(key)

    def release_handle(self, key) -> None:
        got = self._handles.pop(key, None)
        if got is not None:
            try:
                self.agent.release_xfer_handle(got[1])
            except Exception:  # a handle of a dead peer may refuse release
                pass

    def release_handles_over(self, ptrs) -> None:
        """Release the WRITE handles whose local memory is any of ``ptrs`` (about to be deregistered)."""
        for key in [k for k, (descs, _) in self._handles.items() if any(d[0] in ptrs for d in descs)]:
            self.release_handle(key)

    # -- a plan's receive buffers ----------------------------------------------------------------
    def bind(self, executor: NixlExecutor, recv_descs: Mapping[tuple[int, int], tuple[int, int, int]],
             used: set[int]) -> None:
        """Serve ``executor``'s plan: its receive descriptors go in this rank's roster entry, and
        registrations it does not use (``used``) are let go."""
        self._check_open()
        self.bound = executor
        self.last_pairs = (executor.sends, executor.recvs)
        self.deregister(set(self._regs) - used)
        self._recv_descs = dict(recv_descs)
        self._local_digest = _digest(self.agent_name, self.mem_type, self._recv_descs)

    def renumber(self, rank: int) -> None:
        """The controller renumbered this rank (a new membership): the agent stays, the rank in
        the plans, descriptors and notifications follows the plan."""
        if rank != self.rank:
            self.release_handles()
            self.last_pairs = ({}, {})
            self.rank = rank

    @property
    def local_digest(self) -> str:
        """The digest of this rank's receive descriptors, which its 'ready' notifications carry."""
        return self._local_digest

    @property
    def identity(self) -> str:
        return self.agent_name

    @staticmethod
    def entry_identity(entry: NixlRosterEntry) -> str:
        return entry.agent_name

    def local_roster_entry(self) -> NixlRosterEntry:
        """This rank's agent metadata and receive descriptors, for the controller to relay."""
        self._check_open()
        if self.bound is None or self.agent is None:
            raise RefitError(f"rank {self.rank}: bind an executor (executor.prepare(src, dst)) before "
                             "local_roster_entry()")
        return NixlRosterEntry(self.rank, self.agent_name, bytes(self.agent.get_agent_metadata()), self.mem_type,
                               dict(self._recv_descs), self._local_digest)

    def update_membership(self, roster: Mapping[int, NixlRosterEntry], epoch: int) -> None:
        """Install the roster of membership ``epoch`` (relayed by the controller to every rank).

        Peers of the bound plan that are new, or whose agent or registrations changed, are
        loaded point to point; agents no longer in the roster are dropped. No collective: a
        node that joins only needs the new roster and a plan that counts it, and is in step
        at the next refit (sequence numbers restart with the epoch).
        """
        executor = self.bound
        peers = executor.peers() if executor is not None else []
        epoch = self._check_roster(roster, epoch, peers)
        executor.check_receivers(roster)
        wanted = {roster[p].agent_name for p in peers}
        for name in [n for n in self._loaded if n not in wanted]:
            self._drop_agent(name)
        for p in peers:
            e = roster[p]
            if self._loaded.get(e.agent_name) != e.metadata:
                if e.agent_name in self._loaded:
                    # A known agent that registered new memory (a new plan): NIXL refuses to load
                    # an agent twice (NIXL_ERR_NOT_ALLOWED), so drop it, and the handles into it, first.
                    for q, r in list(self._remotes.items()):
                        if r.entry.agent_name == e.agent_name:
                            self.release_handles(q)
                    self._drop_agent(e.agent_name)
                try:
                    name = self.agent.add_remote_agent(e.metadata)
                except Exception as err:
                    raise NixlHandshakeError(f"rank {self.rank}: could not load the NIXL metadata of rank {p} "
                                             f"({e.agent_name}): {err}") from err
                name = name.decode() if isinstance(name, bytes) else name
                if name != e.agent_name:
                    raise NixlHandshakeError(f"rank {self.rank}: rank {p}'s metadata names agent {name!r}, its roster "
                                             f"entry {e.agent_name!r}")
                self._loaded[e.agent_name] = e.metadata
        for p in set(self._remotes) | set(peers):
            old = self._remotes.get(p)
            if old is None or p not in peers or old.entry != roster[p]:
                self.release_handles(p)
        self._remotes = {p: _Remote(roster[p]) for p in peers}
        self.epoch = epoch
        self.seq = 0
        self._installed_digest = self._local_digest
        self._aborted.clear()
        self._inbox = {k: v for k, v in self._inbox.items() if k[1] >= epoch}

    def _drop_agent(self, name: str) -> None:
        self._loaded.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # a dead agent may be gone already
            log.debug("remove_remote_agent(%s): %s", name, e)

    def remote(self, peer: int) -> NixlRosterEntry:
        """``peer``'s entry in the installed roster."""
        return self._remotes[peer].entry

    def peer_name(self, peer: int) -> str:
        return self._remotes[peer].entry.agent_name

    # -- notifications and WRITEs ----------------------------------------------------------------
    def message(self, kind: bytes, seq: int, extra: str = "") -> bytes:
        return b"|".join((_TAG, kind, str(self.epoch).encode(), str(seq).encode(), str(self.rank).encode(),
                          extra.encode()))

    def notify(self, peer: int, msg: bytes, what: str) -> None:
        name = self._remotes[peer].entry.agent_name
        try:
            self.agent.send_notif(name, msg)
        except Exception as e:  # a dead peer's endpoint fails here
            raise _PeerFailed(peer, f"unreachable while sending {what}: {type(e).__name__}: {e}") from None

    def poll(self, seq: int) -> int:
        """Move new notifications into the inbox; drop those of older epochs or refits."""
        got = self.agent.get_new_notifs()
        n = 0
        for sender, msgs in got.items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for m in msgs:
                parts = bytes(m).split(b"|", 5)
                if len(parts) != 6 or parts[0] != _TAG or parts[1] == b"P":
                    continue
                try:
                    key = (parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
                except ValueError:
                    continue
                if (key[1], key[2]) < (self.epoch, seq):
                    continue  # a refit that is over (or an aborted one)
                self._inbox.setdefault(key, []).append((sender, parts[5]))
                n += 1
        return n

    def take(self, kind: bytes, seq: int, peer: int) -> list[bytes]:
        msgs = self._inbox.pop((kind, self.epoch, seq, peer), [])
        name = self._remotes[peer].entry.agent_name
        return [extra for sender, extra in msgs if sender == name]

    def write(self, peer: int, key: tuple[int, int], local: list[tuple[int, int, int]],
              remote: list[tuple[int, int, int]], msg: bytes) -> Any:
        """WRITE ``local`` into ``peer``'s ``remote`` descriptors with the notification ``msg``; the
        handle is cached under ``key`` while the local memory stays the same."""
        entry = self._remotes[peer].entry
        cached = self._handles.get(key)
        if cached is None or cached[0] != tuple(local):
            self.release_handle(key)
            try:
                h = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.mem_type),
                                               self.agent.get_xfer_descs(remote, entry.mem_type),
                                               entry.agent_name, b"")
            except Exception as e:
                raise _PeerFailed(peer, f"could not set up the WRITE: {type(e).__name__}: {e}") from None
            self._handles[key] = (tuple(local), h)
        h = self._handles[key][1]
        try:
            state = self.agent.transfer(h, msg)
        except Exception as e:  # e.g. the receiver disconnected
            self.release_handle(key)
            raise _PeerFailed(peer, f"WRITE failed: {type(e).__name__}: {e}") from None
        if state == "ERR":
            self.release_handle(key)
            raise _PeerFailed(peer, "WRITE failed to post (state ERR)")
        return h

    def state(self, h, peer: int) -> str:
        """A posted WRITE's state; ``_PeerFailed`` when it failed."""
        if h is None:
            return "DONE"
        try:
            state = self.agent.check_xfer_state(h)
        except Exception as e:
            state, why = "ERR", f"{type(e).__name__}: {e}"
        else:
            why = "transfer state ERR"
        if state == "ERR":
            for key in [k for k, v in self._handles.items() if v[1] is h]:
                self.release_handle(key)
            raise _PeerFailed(peer, f"WRITE failed: {why}")
        return state

    # -- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Release handles, peers and registrations (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.agent is None:
            return
        self.release_handles()
        for name in list(self._loaded):
            self._drop_agent(name)
        self._remotes = {}
        self.deregister(list(self._regs))
        self.agent = None

    def __repr__(self) -> str:
        return f"NixlChannel(rank={self.rank}, agent={self.agent_name!r}, epoch={self.epoch})"


class NixlExecutor(Executor):
    """One rank's ``RankPlan`` over a ``NixlChannel``: the channel (its agent and peers) outlives the plan.

    ``prepare`` registers this rank's buffers for the plan; the peers learn of them when
    the controller relays every rank's ``local_roster_entry()`` through the channel's
    ``update_membership`` (or ``channel.handshake(group)``), before the first refit.
    """

    transport = "nixl"

    def __init__(self, plan: RankPlan, channel: NixlChannel):
        if plan.fanout and (plan.gather_sends or plan.gather_recvs):
            raise PlanError("the NIXL transport runs plans without replica fan-out (build_rank_plan(fanout=False))")
        super().__init__(plan, None)
        self.channel = channel
        self.device: torch.device | None = None
        self.sends: dict[int, _Pair] = {}
        self.recvs: dict[int, _Pair] = {}
        # fused copies (and, verified, checksums) of this plan's staged and in-place buckets on a
        # GPU: made when first used, None where a bucket cannot take them
        self._fused: dict[tuple, _FusedSlots | None] = {}
        self._fused_src: tuple = ()  # the source tensors the send batches describe
        self._side_stream: Any = None

    # -- binding ------------------------------------------------------------------------------
    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        """Register this rank's send and receive buffers (replacing the channel's earlier plan).

        With the channel's ``direct``, buckets that are one contiguous block are registered
        in place, so ``dst`` must be the tensors the weights land in at every refit. Peers
        learn of the new buffers only through ``local_roster_entry`` + ``update_membership``:
        until then a refit raises ``NixlHandshakeError``.
        """
        ch = self.channel
        ch._check_open()
        device = ch.device
        if device is None:
            device = next((t.device for t in [*src.values(), *dst.values()]), torch.device("cpu"))
        for name, t in [*src.items(), *dst.items()]:
            if t.device.type != device.type:
                raise PlanError(f"{name}: on {t.device}, but this NIXL transport moves {device} tensors")
        ch.start(device)
        self.device = ch.device
        # a pair whose buckets and in-place addresses did not change keeps its staging and
        # registrations, so its peer's cached handshake stays valid
        ch.renumber(self.plan.rank)
        old_sends, old_recvs = ch.last_pairs
        used: set[int] = set()
        self.sends = self._pairs(self.plan.sends, src, "src", old_sends, used)
        self.recvs = self._pairs(self.plan.recvs, dst, "dst", old_recvs, used)
        for peer, pair in old_sends.items():
            if self.sends.get(peer) is not pair:
                ch.release_handles(peer)
        self._fused = {}
        recv_descs = {}
        for peer, pair in self.recvs.items():
            for s in pair.slots:
                addr = s.addr if s.staging is None else s.staging.data_ptr() + s.offset
                recv_descs[(peer, s.bucket.index)] = (addr, s.bucket.nbytes, ch.dev)
        ch.bind(self, recv_descs, used)

    def _pairs(self, buckets: Sequence[Bucket], tensors: Mapping[str, torch.Tensor], side: str,
               old: Mapping[int, _Pair], used: set[int]) -> dict[int, _Pair]:
        """One ``_Pair`` per peer; a pair whose buckets and in-place addresses did not change
        keeps its staging and registrations (so its peer's cached handshake stays valid)."""
        ch = self.channel
        by_peer: dict[int, list[Bucket]] = {}
        for b in buckets:
            by_peer.setdefault(b.peer, []).append(b)
        pairs = {}
        for peer, bs in sorted(by_peer.items()):
            bs.sort(key=lambda b: b.index)
            views = []
            for b in bs:
                missing = sorted({op.name for op in b.ops} - set(tensors))
                if missing:
                    raise PlanError(f"rank {self.plan.rank}: the plan {'sends' if side == 'src' else 'receives'} "
                                    f"{missing} but no {side} tensor was given for it")
                view = direct_view(b, tensors, side) if ch.direct else None
                views.append(view if view is not None and view.numel() else None)
            sig = tuple((b, None if v is None else v.data_ptr()) for b, v in zip(bs, views))
            prev = old.get(peer)
            if prev is not None and prev.sig == sig:
                pairs[peer] = prev
                used |= prev.regs
                continue
            pair = _Pair(peer, sig=sig)
            size = 0
            for b, view in zip(bs, views):
                if view is not None:
                    pair.regs.add(ch.register(tensors[b.ops[0].name]))
                    pair.slots.append(_Slot(b, None, 0, view.data_ptr()))
                else:
                    pair.slots.append(_Slot(b, None, size))
                    size = _align(size + b.nbytes)
            if size:
                pair.staging = torch.zeros(size, dtype=torch.uint8, device=self.device)
                pair.regs.add(ch.register(pair.staging))
                for slot in pair.slots:
                    if slot.addr == 0:
                        slot.staging = pair.staging
            pair.chunks = _chunks(peer, pair.slots, ch.chunk_bytes)
            used |= pair.regs
            pairs[peer] = pair
        return pairs

    def peers(self) -> list[int]:
        return sorted(set(self.sends) | set(self.recvs))

    def check_receivers(self, roster: Mapping[int, NixlRosterEntry]) -> None:
        """Every receiver's descriptors are for exactly the buckets this rank sends it, of their sizes."""
        rank = self.plan.rank
        for p, pair in self.sends.items():
            e = roster[p]
            mine = {k for k in e.recv_descs if k[0] == rank}
            want = {(rank, s.bucket.index) for s in pair.slots}
            bad = [s.bucket.index for s in pair.slots
                   if e.recv_descs.get((rank, s.bucket.index), (0, -1))[1] != s.bucket.nbytes]
            if mine != want or bad:
                raise NixlHandshakeError(
                    f"rank {rank}: rank {p}'s receive descriptors do not match this rank's plan (it expects "
                    f"buckets {sorted(i for _, i in mine)}, this rank sends {sorted(i for _, i in want)}, sizes differ "
                    f"for {bad}): every rank must build its plan from the same rosters before the handshake")

    def _release(self) -> None:
        if self.channel.bound is self:
            self.channel.bound = None
        self._fused = {}

    # -- one refit --------------------------------------------------------------------------------
    def _run(self, *, verify: bool, corrupt: Corruption | None) -> TransferStats:
        """One refit of the bound plan; returns this rank's ``TransferStats``.

        Raises ``RefitAborted`` (naming the peer) when a peer stays silent past the
        deadline, is gone, or a WRITE fails; ``NixlHandshakeError`` when a peer's buffers
        changed without a new handshake. ``corrupt`` (tests) mutates a bucket's bytes after
        its checksum was taken.
        """
        ch = self.channel
        src, dst = self.src, self.dst
        rnd = ch.begin_round(verify=verify)
        stats, ledger = rnd.stats, rnd.ledger
        stats.staging_capacity_bytes = sum(p.staging.numel() for p in [*self.sends.values(), *self.recvs.values()]
                                           if p.staging is not None)
        stats.peak_staging_bytes = stats.staging_capacity_bytes
        cuda = self.device.type == "cuda"
        if cuda:
            # the caller's work on the source tensors is done, and nothing still reads the
            # receive buffers (staging, or destination tensors written in place)
            torch.cuda.current_stream(self.device).synchronize()
        # 1. receivers: tell every source the buffers are free
        for peer in self.recvs:
            try:
                ch.notify(peer, ch.message(b"R", rnd.seq, ch.local_digest), "'ready'")
            except _PeerFailed as e:
                rnd.failed[peer] = e.why
        stats.local_bytes = local_copies(self.plan, src, dst)
        # on a GPU a chunk packs and unpacks in one kernel, verified or not; verified, it sums in the same pass
        fusing = cuda and corrupt is None and fused_enabled(self.device)
        if fusing:
            self._check_fused_src(src)
        fl = _Flight(
            src, dst, corrupt, fusing, fused=ledger if fusing else None,
            # 2. sources: pack (chunk by chunk), post each chunk once its receiver is ready
            to_pack=[(p, c) for p in self.sends.values() for c in p.chunks if p.peer not in rnd.failed],
            # 3. receivers: buckets still to land, by source (positions in the pair's buckets)
            awaiting={p: set(range(len(pair.slots))) for p, pair in self.recvs.items()
                      if pair.slots and p not in rnd.failed})
        side = self._sum_direct_sends(src, fl.fused) if fl.fused is not None else None
        try:
            ch.poll_round(rnd, pending=fl.pending, step=lambda: self._step(rnd, fl),
                          probe=lambda: self._probe(rnd, fl),
                          missing=lambda: self._missing(fl.ready, fl.queued, fl.posted, fl.awaiting, rnd.failed))
            for key, buf in fl.unsummed:
                ledger.sent(key, buf)
            if cuda:
                if side is not None:
                    torch.cuda.current_stream(self.device).wait_stream(side)
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            if fl.temps:
                ch.release_handles_over(fl.temps)
                ch.deregister(fl.temps)
        ch.raise_failed(rnd)
        stats.zero_copy_buckets = sum(s.staging is None for p in [*self.sends.values(), *self.recvs.values()]
                                      for s in p.slots)
        if ledger is not None:
            stats.checksums_sent, stats.checksums_received = ledger.settle()
        stats.seconds = time.perf_counter() - rnd.t0
        return stats

    def _step(self, rnd: OneSidedRound, fl: _Flight) -> int:
        """One poll of a refit: 'ready's in, a chunk packed, packed chunks posted, WRITEs
        completed, buckets landed. Returns how many of these moved."""
        ch = self.channel
        progress = ch.poll(rnd.seq)
        for peer in self.sends:
            if peer in fl.ready or peer in rnd.failed:
                continue
            for extra in ch.take(b"R", rnd.seq, peer):
                want = ch.remote(peer).digest
                if extra.decode() != want:
                    raise NixlHandshakeError(
                        f"{ch.where(rnd.seq)}: receiver rank {peer} registered new receive buffers (its 'ready' "
                        f"carries digest {extra.decode()}, the installed roster has {want}); relay its "
                        "local_roster_entry() with update_membership() before the next refit")
                fl.ready.add(peer)
                progress += 1
        if fl.to_pack:
            pair, chunk = fl.to_pack.pop(0)
            fl.queued.append((pair, chunk, self._pack_chunk(pair, chunk, fl.src, rnd.ledger, fl.corrupt, fl.temps,
                                                            fl.unsummed, fl.fused, fusing=fl.fusing)))
            progress += 1
        for item in list(fl.queued):
            pair, chunk, event = item
            if pair.peer in rnd.failed:  # dropped by a failed post earlier in this poll
                continue
            if pair.peer in fl.ready and (event is None or event.query()):
                fl.queued.remove(item)
                try:
                    fl.posted[(pair.peer, chunk.pos)] = self._post(pair, chunk, fl.src, rnd.seq)
                except _PeerFailed as e:
                    fl.fail(rnd, pair.peer, e.why)
                progress += 1
        return progress + self._complete_writes(rnd, fl) + self._land(rnd, fl)

    def _complete_writes(self, rnd: OneSidedRound, fl: _Flight) -> int:
        done = 0
        for key in list(fl.posted):
            if key not in fl.posted:
                continue
            try:
                state = self.channel.state(fl.posted[key], key[0])
            except _PeerFailed as e:
                fl.fail(rnd, key[0], e.why)
                continue
            if state == "DONE":
                del fl.posted[key]
                chunk = self.sends[key[0]].chunks[key[1]]
                rnd.stats.bytes_sent += chunk.nbytes
                rnd.stats.buckets_sent += chunk.hi - chunk.lo
                done += 1
        return done

    def _land(self, rnd: OneSidedRound, fl: _Flight) -> int:
        """Unpack (or sum in place) what the sources said they wrote."""
        landed = 0
        for peer in list(fl.awaiting):
            for extra in self.channel.take(b"D", rnd.seq, peer):
                lo, hi = (int(x) for x in extra.split(b"-"))
                pending = fl.awaiting[peer]
                if not set(range(lo, hi)) <= pending:
                    raise NixlHandshakeError(f"{self.channel.where(rnd.seq)}: source rank {peer} wrote buckets "
                                             f"[{lo}, {hi}) of the pair, which this rank does not expect "
                                             "(again, or at all)")
                self._unpack(self.recvs[peer], lo, hi, fl.dst, rnd.stats, rnd.ledger, fl.fused, fusing=fl.fusing)
                pending.difference_update(range(lo, hi))
                if not pending:
                    del fl.awaiting[peer]
                landed += 1
        return landed

    def _probe(self, rnd: OneSidedRound, fl: _Flight) -> None:
        """A liveness probe to every peer this rank still waits on; one that cannot be reached fails."""
        silent = {pair.peer for pair, _, _ in fl.queued if pair.peer not in fl.ready}
        silent |= set(fl.awaiting)
        for peer in sorted(silent):
            try:
                self.channel.notify(peer, self.channel.message(b"P", rnd.seq), "a liveness probe")
            except _PeerFailed as e:
                fl.fail(rnd, peer, e.why)

    def _missing(self, ready, queued, posted, awaiting, failed) -> str:
        parts = [self.channel.failures(failed)] if failed else []
        no_ready = sorted({pair.peer for pair, _, _ in queued if pair.peer not in ready})
        if no_ready:
            parts.append("no 'ready' from receiver rank(s) " + ", ".join(
                f"{p} ({self.channel.peer_name(p)})" for p in no_ready))
        if posted:
            parts.append(f"WRITEs to rank(s) {sorted({k[0] for k in posted})} not complete")
        if awaiting:
            parts.append("no data from source rank(s) " + ", ".join(
                f"{p} ({self.channel.peer_name(p)}: {len(left)} of {len(self.recvs[p].slots)} buckets "
                "missing)" for p, left in sorted(awaiting.items())))
        return "; ".join(parts) or "nothing outstanding"

    def _fused_batch(self, key: tuple, slots: Sequence[_Slot], tensors, side: str) -> _FusedSlots | None:
        if key not in self._fused:
            self._fused[key] = _fuse_slots(self.device, slots, tensors, side) if slots else None
        return self._fused[key]

    def _check_fused_src(self, src) -> None:
        """Drop the send batches when the source tensors are not those they describe."""
        sig = tuple((n, t.data_ptr()) for n, t in sorted(src.items()))
        if sig != self._fused_src:
            self._fused = {k: v for k, v in self._fused.items() if k[0] == "unpack"}
            self._fused_src = sig

    def _sum_direct_sends(self, src, ledger: ChecksumLedger) -> Any:
        """Launch the sums of every bucket sent from the tensor itself, on a side stream: the WRITEs
        read those tensors meanwhile, so the sums run beside the wire, never ahead of it. Returns
        the stream (None when nothing is summed there)."""
        direct = [s for p in self.sends.values() for s in p.slots if s.staging is None]
        batch = self._fused_batch(("direct",), direct, src, "src")
        if batch is None:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side_stream):
            batch.batch.launch()
        batch.record(ledger, sent=True)
        return self._side_stream

    def _pack_chunk(self, pair: _Pair, chunk: _Chunk, src, ledger: ChecksumLedger | None, corrupt, temps,
                    unsummed: list, fused: ChecksumLedger | None = None, *, fusing: bool = False):
        """Pack one chunk's staged buckets: on a GPU (``fusing``) in one kernel, whose sums ``fused``
        records when the refit is verified; unverified, the copies alone matter. A chunk packed op
        by op launches a copy per block, and the launches, not HBM, then bound an unverified refit."""
        batch = None
        if fusing:
            staged = [s for s in pair.slots[chunk.lo: chunk.hi] if s.staging is not None]
            batch = self._fused_batch(("pack", pair.peer, chunk.pos), staged, src, "src")
            if batch is not None:
                batch.batch.launch()  # pack (and checksum) in one pass
                if fused is not None:
                    batch.record(fused, sent=True)
        direct_summed = fused is not None and self._fused.get(("direct",)) is not None
        for s in pair.slots[chunk.lo: chunk.hi]:
            b = s.bucket
            if not b.nbytes:
                continue
            if s.staging is not None and batch is not None:
                continue
            if s.staging is None and direct_summed:
                continue
            if s.staging is not None:
                buf = pack_bucket(b, src, s.view(), ledger=ledger, key=(b.peer, b.index))
            else:
                buf = direct_view(b, src, "src")
                if buf is None:
                    raise PlanError(f"rank {self.plan.rank}: {b.ops[0].name} is no longer contiguous in "
                                    f"{b.ops[0].wire_dtype}; prepare() again with the new tensors")
                if ledger is not None:  # the WRITE reads the tensor itself: it does not wait for the sum
                    unsummed.append(((b.peer, b.index), buf))
            if corrupt is not None:
                if s.staging is None:  # never corrupt the caller's tensor: write from a copy instead
                    buf = buf.clone()
                    temps.append(self.channel.register(buf))
                    s.temp = buf
                corrupt(b.peer, b.index, buf)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        return None

    def _local_descs(self, pair: _Pair, chunk: _Chunk, src) -> list[tuple[int, int, int]]:
        out = []
        for s in pair.slots[chunk.lo: chunk.hi]:
            b = s.bucket
            if not b.nbytes:
                continue
            if s.staging is not None:
                out.append((s.staging.data_ptr() + s.offset, b.nbytes, self.channel.dev))
                continue
            tmp, s.temp = s.temp, None
            if tmp is not None:
                out.append((tmp.data_ptr(), b.nbytes, self.channel.dev))
                continue
            view = direct_view(b, src, "src")
            if not self.channel.registered(src[b.ops[0].name]):  # a replaced source tensor: register it (local only)
                self.channel.register(src[b.ops[0].name])
            out.append((view.data_ptr(), b.nbytes, self.channel.dev))
        return out

    def _post(self, pair: _Pair, chunk: _Chunk, src, seq: int) -> Any:
        """WRITE one chunk to its receiver with its data notification."""
        ch, peer = self.channel, pair.peer
        msg = ch.message(b"D", seq, f"{chunk.lo}-{chunk.hi}")
        if chunk.nbytes == 0:
            ch.notify(peer, msg, "a data notification")
            return None
        remote = ch.remote(peer).recv_descs
        rdescs = [remote[(self.plan.rank, s.bucket.index)] for s in pair.slots[chunk.lo: chunk.hi] if s.bucket.nbytes]
        return ch.write(peer, (peer, chunk.pos), self._local_descs(pair, chunk, src), rdescs, msg)

    def _unpack(self, pair: _Pair, lo: int, hi: int, dst, stats: TransferStats,
                ledger: ChecksumLedger | None, fused: ChecksumLedger | None = None, *, fusing: bool = False) -> None:
        """Unpack the buckets ``[lo, hi)`` that landed from ``pair``'s peer: on a GPU (``fusing``) in one
        kernel, which verified also sums the buckets that landed in place; unverified, only the staged
        buckets are copied (reading the in-place ones would be a pass over HBM for nothing)."""
        batch = None
        if fusing and fused is not None:
            batch = self._fused_batch(("unpack", pair.peer, lo, hi), pair.slots[lo: hi], dst, "dst")
        elif fusing:
            staged = [s for s in pair.slots[lo: hi] if s.staging is not None]
            batch = self._fused_batch(("unpack", pair.peer, lo, hi, "copies"), staged, dst, "dst")
        if batch is not None:
            batch.batch.launch()  # unpack (and checksum) in one pass
            if fused is not None:
                batch.record(fused, sent=False)
            for s in pair.slots[lo: hi]:
                stats.bytes_received += s.bucket.nbytes
                stats.buckets_received += 1
            return
        for s in pair.slots[lo: hi]:
            b = s.bucket
            if s.staging is not None:
                unpack_bucket(b, s.view(), dst, ledger=ledger if b.nbytes else None, key=(b.peer, b.index))
            elif ledger is not None and b.nbytes:
                ledger.received((b.peer, b.index), direct_view(b, dst, "dst"))
            stats.bytes_received += b.nbytes
            stats.buckets_received += 1
