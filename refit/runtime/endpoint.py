"""The worker side of a refit: endpoints that trainer and engine actors mix in, and worker handles.

An RL framework already has trainer and engine actors. Mixing ``TrainerEndpoint`` or
``EngineEndpoint`` into them adds the ``refit_*`` methods the controller
(``refit.control``) calls; the actor only says which local tensors it holds and how they
are laid out. All rank-side work happens here, inside the actor: joining a fresh
``StatelessProcessGroup`` per (re)build, reporting roster entries, building this rank's
own plan from the merged rosters, and running it under the refit watchdog.

The controller never talks to an actor directly but through a small *worker handle*
(``call`` -> a pending result, ``is_dead``). ``LocalWorker`` drives an endpoint object
on a thread of this process, so the data plane and the control plane are usable without
Ray; ``refit.runtime.ray.RayWorker`` drives a Ray actor.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from refit.comm.group import StatelessProcessGroup, free_port
from refit.comm.rendezvous import RendezvousTampered
from refit.errors import InconsistentWeights, LateCall, LayoutError, PlanError, RefitError, TransportError
from refit.layout import (
    DTensorRef,
    dtype_name,
)
from refit.plan import (
    DEFAULT_BUCKET_BYTES,
    ParamIndex,
    PlanCache,
    RosterEntry,
    RosterGroup,
    TensorLayout,
    check_local_shapes,
    group_roster,
)
from refit.plan.quant import check_fp8_destinations, plan_quantization
from refit.runtime.fp8_sources import QuantizedSources
from refit.runtime.handles import listening_sockets
from refit.runtime.protocol import CommitReadiness, EndpointCall, Prepared, TransferReport, answer
from refit.runtime.watchdog import RefitAborted, RefitAbortWatchdog
from refit.transport.base import Executor, TransferStats
from refit.transport.broadcast import BROADCAST, BroadcastPlan
from refit.transport.casts import find_overflows, narrowing_casts
from refit.transport.factory import COMMUNICATOR, TransportChoice, make_executor
from refit.transport.ipc import node_id, sweep_stale_segments
from refit.transport.one_sided import RosterEntries

__all__ = [
    "ConnectSpec",
    "Staging",
    "allocate_staging",
    "copy_staged_into_live",
    "EngineEndpoint",
    "LocalShard",
    "TrainerEndpoint",
    "process_resources",
]

log = logging.getLogger(__name__)

MODES = ("reshard", "broadcast")


# -- what an actor exposes ---------------------------------------------------------------

@dataclass(frozen=True)
class LocalShard:
    """One param as one rank holds it: the local tensor and the layout it is a shard of.

    ``mesh`` holds ranks of the refit communicator as the actor sees them: a trainer
    gives its trainer ranks (``0 .. train_world_size-1``); an engine gives its shard's
    own workers (``0 .. workers_per_shard-1``) and the controller moves them to wherever
    the shard sits in the current membership.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    mesh: Any
    placements: tuple


def as_local_shard(name: str, value: Any) -> LocalShard:
    """Accept ``LocalShard``, ``(local, global_shape, mesh, placements)`` or ``(DTensorRef, mesh, placements)``."""
    if isinstance(value, LocalShard):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 4:
        local, shape, mesh, placements = value
    elif isinstance(value, (tuple, list)) and len(value) == 3:
        ref, mesh, placements = value
        if not (isinstance(ref, DTensorRef) or hasattr(ref, "_local_tensor")):
            raise LayoutError(f"{name}: a 3-tuple must start with a DTensorRef or DTensor, got {type(ref).__name__}")
        local, shape = ref._local_tensor, tuple(ref.shape)
    else:
        raise LayoutError(
            f"{name}: expected (local_tensor, global_shape, mesh, placements) or "
            f"(DTensorRef, mesh, placements), got {type(value).__name__}"
        )
    if not isinstance(local, torch.Tensor):
        raise LayoutError(f"{name}: the local tensor is a {type(local).__name__}, not a torch.Tensor")
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        placements = (placements,)
    return LocalShard(local, tuple(int(s) for s in shape), mesh, tuple(placements))


@dataclass(frozen=True)
class ConnectSpec:
    """Where one rank joins the refit communicator of one build (``epoch``)."""

    address: str
    port: int
    rank: int
    world_size: int
    epoch: int
    timeout_s: float
    mesh_offset: int = 0  # added to every rank of this actor's meshes
    mesh_size: int | None = None  # an engine's meshes must stay within its own shard
    label: str = ""
    backend: str = "gloo"
    # authenticates every value of this build's rendezvous; new every build, and handed over
    # only through the controller's own channel to the worker (an actor call, a pipe)
    secret: bytes | None = field(default=None, repr=False)
    # the controller's wall clock when it sent this call: a worker that starts it later than the
    # rendezvous lasts abandons it (``LateCall``), and one that starts it late waits only what is left
    sent_at: float | None = None
    # binds this build's sealed values to it: with the epoch, what a value's MAC covers besides
    # key and secret, so a value of another build under the same secret is refused
    nonce: bytes = b""


def call_deadline(sent_at: float | None, budget_s: float, what: str) -> float:
    """The ``time.monotonic()`` deadline of a call the controller sent at ``sent_at`` (its
    ``time.time()``) with ``budget_s`` to run; ``LateCall`` when that has already passed.

    A worker answers one call at a time, so a call can start long after it was sent; counting
    its budget from its start made a worker that was late once late for every build after.
    The hosts' clocks are assumed to agree to well under a rendezvous timeout (NTP does); a
    clock running behind the controller's only lengthens the wait to the full budget.
    """
    now = time.monotonic()
    if sent_at is None:
        return now + budget_s
    lag = time.time() - sent_at
    if lag > budget_s:
        raise LateCall(f"{what} started {lag:.1f}s after the controller sent it, past its {budget_s:g}s budget: "
                       "its peers have given up, so it is abandoned (this worker was busy, not frozen)")
    return now + budget_s - max(lag, 0.0)


class _OneShotCorruption:
    """Fault injection: flip one byte of the first matching bucket this rank sends."""

    def __init__(self, peer: int | None, byte: int):
        self.peer = peer
        self.byte = byte
        self.fired = False

    def __call__(self, peer: int, index: int, buf: torch.Tensor) -> None:
        if self.fired or buf.numel() == 0:
            return
        if self.peer is not None and peer not in (self.peer, BROADCAST):
            return
        i = self.byte % buf.numel()
        buf[i] = buf[i] ^ 0xFF
        self.fired = True


@dataclass(frozen=True)
class Staging:
    """How an engine stages a refit: where the copies live and how the switch is made.

    ``device_fraction`` of the model's bytes (params in name order) is staged on the engine's
    device, the rest in host memory; the switch copies both into the live weights. At 1.0,
    an engine that keeps a second set of its weights (``refit_staging_destinations``) is
    switched by a pointer swap (``on_weights_swap``) instead of a copy.
    ``require_version``: refuse to serve until a refit has committed a version, so an engine
    started or restarted with no weights of the current run never answers a request.
    """

    device_fraction: float = 1.0
    require_version: bool = True


# -- endpoint state ---------------------------------------------------------------------

@dataclass
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    group: StatelessProcessGroup | None = None
    spec: ConnectSpec | None = None
    epoch: int = -1
    layouts: dict[str, tuple] = field(default_factory=dict)  # name -> (local shape, dtype), checked at connect
    shards: dict[str, LocalShard] = field(default_factory=dict)  # what refit_connect saw, for refit_prepare
    mode: str = "reshard"
    executor: Executor | None = None  # made with the plan, reused every transfer of this build
    bound: dict[str, int] = field(default_factory=dict)  # id() of each local tensor the executor is bound to
    plans: PlanCache = field(default_factory=lambda: PlanCache(max_entries=4))
    fault: _OneShotCorruption | None = None
    loaded_epoch: int = -1
    # whether the live weights are whole (engines): cleared before the first byte of a transfer
    # can land in them, set again only when a verified transfer is committed and loaded
    consistent: bool = True
    inconsistent_reason: str | None = None
    committed_epoch: int = -1  # the build whose transfer was last committed and loaded
    commits: int = 0  # refits committed and loaded by this endpoint
    # the transport object of a one-sided transport (NixlTransport for "nixl", IpcTransport for
    # "ipc"): it outlives plans, and its roster entries are relayed by the controller
    transport: TransportChoice = COMMUNICATOR  # the build's, as the controller chose it
    one_sided: Any = None
    across: Any = None  # split by node with NIXL across nodes: the NixlTransport of the far pairs
    quantized: Any = None  # refit.runtime.fp8_sources.QuantizedSources: what this trainer rank sends in FP8
    # params this trainer rank sends into a destination dtype of smaller range -> those dtypes
    narrowing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # -- versions and staging (engines) --
    weights_version: int | None = None  # the version the live weights are; None until a refit commits one
    staging: Staging | None = None  # set by refit_configure_staging: transfers land beside the live weights
    staged_epoch: int = -1  # the build whose transfer landed whole in the staging copies (not yet switched)
    prepared_epoch: int = -1  # the staged transfer this worker promised it can switch to (refit_prepare_commit)
    # copy mode: name -> (id of the live tensor, its staging copy)
    staging_buffers: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    serving: threading.Condition = field(default_factory=threading.Condition)  # held for one engine step, or a switch
    switches: list[dict] = field(default_factory=list)  # the last switches: version, mode, seconds
    paused_at: float | None = None  # in place: when the transfer began refusing steps


class _RefitEndpoint:
    """Methods shared by both sides. State lives in one attribute, created on first use,
    so a mixin needs no ``__init__`` call from the actor class."""

    # the block of the scales, when an engine keeps params in block-scaled FP8 (128 x 128: DeepSeek-V3, Kimi-K2)
    refit_fp8_block: tuple[int, int] = (128, 128)

    _refit_role = "src"

    # hooks an actor may override
    def on_refit_start(self) -> None:
        """Called on this rank at the start of every transfer, inside the refit deadline."""

    # -- internals --------------------------------------------------------------------
    def _refit_state(self) -> _State:
        st = self.__dict__.get("_refit_state_")
        if st is None:
            st = self.__dict__.setdefault("_refit_state_", _State())
        return st

    def _refit_label(self) -> str:
        st = self._refit_state()
        if st.spec is not None and st.spec.label:
            return f"{st.spec.label} (rank {st.spec.rank})"
        return type(self).__name__

    def _refit_tensors(self) -> dict[str, LocalShard]:
        raise NotImplementedError

    def _refit_local(self) -> dict[str, torch.Tensor]:
        """This rank's local tensors for a transfer.

        The executor is bound to the tensors it was prepared with, so a transfer only
        checks that it is handed the same tensor objects. A parameter replaced since (a
        trainer may swap its tensors between steps) is checked against the layout reported
        at connect time, and the executor rebinds to it.
        """
        st = self._refit_state()
        shards = self._refit_tensors()
        out = {}
        for name in st.layouts:
            value = shards.get(name)
            out[name] = None if value is None else as_local_shard(name, value).tensor
        if {n: id(t) for n, t in out.items()} != st.bound:
            self._refit_check_local(out)
            st.bound = {n: id(t) for n, t in out.items()}
        return out

    def _refit_check_local(self, local: Mapping[str, torch.Tensor | None]) -> None:
        st = self._refit_state()
        missing = sorted(n for n, t in local.items() if t is None)
        if missing:
            raise PlanError(f"{self._refit_label()}: param(s) {missing} were reported at connect time but are gone; "
                            "layouts changed, rebuild the communicator")
        for name, (shape, dt) in st.layouts.items():
            t = local[name]
            if dtype_name(t.dtype) != dt:
                raise PlanError(f"{self._refit_label()}: {name} changed dtype from {dt} to {dtype_name(t.dtype)} "
                                "since the plan was built; rebuild the communicator")
            if tuple(t.shape) != shape:
                raise PlanError(f"{self._refit_label()}: {name} changed local shape from {list(shape)} to "
                                f"{list(t.shape)} since the plan was built; rebuild the communicator")

    def _refit_sides(self, local: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        return (local, {}) if self._refit_role == "src" else ({}, local)

    def _refit_drop_group(self, *, collect: bool = False) -> None:
        st = self._refit_state()
        group, st.group = st.group, None
        executor, st.executor, st.bound = st.executor, None, {}
        if executor is not None:
            executor.close()
        if group is not None:
            group.abort()
        del group
        if collect:
            # Gloo closes a pair's socket only when the last reference to its process group
            # goes, and a failed transfer leaves some in reference cycles (tracebacks, works);
            # collecting them now closes this rank's connections, so peers blocked on it
            # fail at once instead of at their own deadline (measured: 0.02s against 6s).
            gc.collect()

    # -- the methods the controller calls ------------------------------------------------
    def refit_request(self, call: EndpointCall) -> Any:
        """Run one of the controller's calls (``refit.runtime.protocol``); the entry a Ray actor exposes."""
        return answer(self, call)

    def refit_ping(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def refit_device(self) -> dict:
        """Where this rank's tensors live: ``{"type", "index", "uuid", "host", "node"}``.

        The controller picks the communicator's backend from these (NCCL when every rank
        is on a GPU, gloo when every rank is on the host) and refuses two ranks on one
        GPU before NCCL does: NCCL allows one rank per GPU in a communicator and says so
        only as "invalid usage" from inside the rendezvous, on every rank at once.
        """
        dev = self._refit_tensor_device()
        out = {"type": dev.type, "index": None, "uuid": None, "host": socket.gethostname(), "node": node_id()}
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            out.update(index=index, uuid=str(torch.cuda.get_device_properties(index).uuid))
        return out

    def _refit_tensor_device(self, shards: Mapping[str, LocalShard] | None = None) -> torch.device:
        """The one device of this rank's tensors (the host when it has none)."""
        if shards is None:
            shards = {n: as_local_shard(n, v) for n, v in self._refit_tensors().items()}
        devices = sorted({str(s.tensor.device) for s in shards.values()})
        if len(devices) > 1:
            raise LayoutError(f"{self._refit_label()}: tensors on several devices {devices}; one rank moves "
                              "tensors of one device")
        return next(iter(shards.values())).tensor.device if shards else torch.device("cpu")

    def refit_rendezvous(self) -> tuple[str, int]:
        """Address and a free port for the store this rank (rank 0) will host."""
        host = os.environ.get("REFIT_MASTER_ADDR")
        if not host and "ray" in sys.modules:  # only if the actor already runs under Ray
            try:
                host = sys.modules["ray"].util.get_node_ip_address()
            except Exception:
                host = None
        host = host or "127.0.0.1"
        return host, free_port("" if host != "127.0.0.1" else host)

    def refit_connect(self, spec: ConnectSpec) -> list[RosterGroup]:
        """Join the communicator of build ``spec.epoch`` and report what this rank holds or needs.

        The old communicator is aborted first. The rank joins before it inspects its own
        tensors, so that a bad tensor fails this call quickly instead of leaving the other
        ranks waiting in the rendezvous for a rank that never comes.

        The whole call is bounded by ``spec.timeout_s``: a peer that dies during the
        rendezvous held the others in gloo's connect five times that long, and a worker
        answers one call at a time, so the controller's recovery queued behind them. A call
        that starts past its budget (counted from ``spec.sent_at``), or for an older epoch
        than this worker's, raises ``LateCall`` at once: it would wait out a rendezvous whose
        peers are gone, and every later call would queue behind it.
        """
        st = self._refit_state()
        with st.lock:
            what = f"{spec.label or self._refit_label()} (rank {spec.rank}): connect of epoch {spec.epoch}"
            if spec.epoch < st.epoch:
                raise LateCall(f"{what} arrived after this worker joined epoch {st.epoch}: abandoned")
            deadline = call_deadline(spec.sent_at, spec.timeout_s, what)
            self._refit_drop_group()
            # a rank SIGKILLed on this host left its IPC segments (weights, in plain form): every
            # build removes those of dead owners, whatever transport this build runs
            sweep_stale_segments()
            st.spec, st.epoch, st.layouts, st.shards = spec, spec.epoch, {}, {}
            try:
                if spec.rank != 0:
                    _wait_for_listener(spec.address, spec.port, deadline)
                # the actor's tensors are read once per build: the roster, the device and the
                # executor's binding all come from this one call
                shards = {n: as_local_shard(n, v) for n, v in self._refit_tensors().items()}
                device = self._refit_tensor_device(shards) if spec.backend == "nccl" else None
                if time.monotonic() >= deadline:
                    raise LateCall(f"{what}: its {spec.timeout_s:g}s rendezvous was over before this worker could "
                                   "join (reading its tensors took that long); abandoned")
                st.group = StatelessProcessGroup(
                    spec.address, spec.port, spec.rank, spec.world_size,
                    backend=spec.backend, timeout_s=spec.timeout_s, name=f"refit/{spec.epoch}", device=device,
                    secret=spec.secret, init_timeout_s=max(deadline - time.monotonic(), 0.1),
                    binding=f"refit/{spec.epoch}".encode() + b"\0" + spec.nonce if spec.nonce else None,
                )
            except RendezvousTampered as e:
                raise RendezvousTampered(f"{self._refit_label()}: the rendezvous of epoch {spec.epoch} was tampered "
                                         f"with: {e}", key=e.key, rank=spec.rank) from None
            except LateCall:
                raise
            except Exception as e:
                raise TransportError(f"{self._refit_label()}: could not join the refit communicator "
                                     f"(epoch {spec.epoch}, world {spec.world_size}): {e}") from None
            try:
                return self._refit_roster(spec, shards)
            except Exception:
                self._refit_drop_group()
                raise

    def _refit_roster(self, spec: ConnectSpec, shards: Mapping[str, LocalShard]) -> list[RosterGroup]:
        st = self._refit_state()
        entries = []
        for name, shard in sorted(shards.items()):
            local_mesh = np.asarray(shard.mesh)
            if spec.mesh_size is not None:
                bad = sorted(set(int(r) for r in local_mesh.reshape(-1)) - set(range(spec.mesh_size)))
                if bad:
                    raise LayoutError(
                        f"{self._refit_label()}: {name}: mesh {local_mesh.tolist()} names worker(s) {bad}; an engine "
                        f"mesh is given in its own shard's workers 0..{spec.mesh_size - 1}"
                    )
            mesh = (local_mesh + spec.mesh_offset).tolist()
            dt = dtype_name(shard.tensor.dtype)
            layout = TensorLayout.make(mesh, shard.placements, dt, param=name)
            if layout.coords(spec.rank) is None:
                raise LayoutError(f"{self._refit_label()}: {name}: mesh {local_mesh.tolist()} (communicator ranks "
                                  f"{mesh}) does not contain this rank")
            st.layouts[name] = (tuple(shard.tensor.shape), dt)
            entries.append(RosterEntry.make(name, shard.global_shape, dt, mesh, shard.placements, self._refit_role))
        st.shards = dict(shards)
        # one entry per layout: the controller reads each distinct group once. An engine's FP8
        # destinations say their block, so that trainers can make the scales of their own blocks
        block = self.refit_fp8_block if self._refit_role == "dst" else None
        return group_roster(entries, fp8_block=block)

    def refit_prepare(self, index: ParamIndex, *, epoch: int, mode: str = "reshard",
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      transport: TransportChoice = COMMUNICATOR) -> Prepared:
        """Build this rank's plan from the merged rosters, and its executor, bound to its tensors.

        The executor lives until the next build and runs every transfer of this one, so
        its staging and its views of the tensors are made once. What each bucket carries
        (param names, for verification reports) is returned here, once per build.
        ``transport`` is the controller's choice for this build (``choose_transport``): the
        communicator, a one-sided channel, or split by node (the pairs inside this rank's
        node over IPC and the others over the communicator or NIXL, at once).
        """
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_prepare")
            if mode not in MODES:
                raise RefitError(f"refit_prepare: mode must be one of {MODES}, got {mode!r}")
            if transport.one_sided and mode != "reshard":
                raise RefitError(f"refit_prepare: {transport} moves reshard plans only")
            t0 = time.perf_counter()
            rank = st.spec.rank
            st.mode = mode
            if st.executor is not None:
                st.executor.close()
                st.executor = None
            local = {n: shard.tensor for n, shard in st.shards.items()}
            bound = {n: id(t) for n, t in local.items()}
            st.quantized = None
            st.narrowing = {}
            if self._refit_role == "src":
                # params an engine keeps in FP8 leave this rank quantized, with their scales
                quantization = plan_quantization(index, rank, list(local), block=self.refit_fp8_block,
                                                 label=self._refit_label())
                scaled = {op.name for op in quantization.ops} if quantization is not None else set()
                st.narrowing = narrowing_casts(index, rank, [n for n in local if n not in scaled])
                if quantization is not None:
                    st.quantized = QuantizedSources(quantization, local)
                    local = st.quantized.executor_tensors(local)
            else:
                check_fp8_destinations(index, rank, self.refit_fp8_block, label=self._refit_label())
            try:
                check_local_shapes(index, rank, {self._refit_role: {n: t.shape for n, t in local.items()}})
            except LayoutError as e:
                raise LayoutError(f"{self._refit_label()}: {e}") from None
            device = self._refit_tensor_device(st.shards)
            if mode == "reshard":
                plan = st.plans.get(index, rank, bucket_bytes=bucket_bytes)
                send_params = {(b.peer, b.index): sorted({op.name for op in b.ops}) for b in plan.sends}
                recv_params = {(b.peer, b.index): sorted({op.name for op in b.ops}) for b in plan.recvs}
            else:
                plan = BroadcastPlan.build(index, rank)
                send_params, recv_params = plan.params_by_bucket()
            wanted = transport.near_channel
            if st.one_sided is not None and st.one_sided.transport != wanted:
                st.one_sided.close()
                st.one_sided = None
            if wanted is not None and st.one_sided is None:
                # no deadline of its own: the refit watchdog hands it the deadline of each transfer
                if wanted == "nixl":
                    from refit.transport.nixl import NixlTransport

                    st.one_sided = NixlTransport(rank, device=device, timeout_s=None)
                else:
                    from refit.transport.ipc import IpcTransport

                    st.one_sided = IpcTransport(rank, device=device, timeout_s=None)
            if st.across is not None and transport.far_channel is None:
                st.across.close()
                st.across = None
            if transport.far_channel is not None and st.across is None:
                from refit.transport.nixl import NixlTransport

                st.across = NixlTransport(rank, device=device, timeout_s=None)
            executor = make_executor(plan, st.group, transport=transport.executor_transport, device=device,
                                     nixl=st.one_sided if wanted == "nixl" else st.across,
                                     ipc=st.one_sided if wanted == "ipc" else None, near=transport.near_ranks(rank))
            executor.prepare(*self._refit_sides(local))
            st.executor, st.bound, st.transport = executor, bound, transport
            return Prepared(rank, plan.bytes_sent, plan.bytes_received, time.perf_counter() - t0, send_params,
                            recv_params)

    def refit_peer_entry(self, epoch: int) -> Any:
        """One-sided transports (``"nixl"``, ``"ipc"``): this rank's roster entry for the memory
        its executor registered or exported.

        Called once per build, after ``refit_prepare``; the controller relays every rank's
        entry back through ``refit_peer_membership``.
        """
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_peer_entry")
            if st.one_sided is None or st.executor is None:
                raise RefitError(f"refit_peer_entry: {self._refit_label()} has no one-sided executor; "
                                 f"refit_prepare(..., transport='nixl' or 'ipc') first")
            if st.across is not None:
                return RosterEntries(st.one_sided.rank, st.one_sided.local_roster_entry(),
                                     st.across.local_roster_entry())
            return st.one_sided.local_roster_entry()

    def refit_peer_membership(self, roster: Mapping[int, Any], epoch: int) -> None:
        """One-sided transports: install the roster the controller relays (new peers point to point)."""
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_peer_membership")
            if st.across is not None:
                st.one_sided.update_membership({r: e.ipc for r, e in roster.items()}, epoch)
                st.across.update_membership({r: e.nixl for r, e in roster.items()}, epoch)
                return
            st.one_sided.update_membership(roster, epoch)

    def refit_transfer(self, epoch: int, *, timeout_s: float | None, verify: bool = True,
                       sent_at: float | None = None) -> TransferReport:
        """Move this rank's share of the weights under the refit watchdog; report checksums.

        On any failure the communicator is dropped at once (it is unusable anyway), which
        releases peers blocked on this rank, and a ``RefitAborted`` (deadline) or
        ``TransportError`` naming this rank is raised without the broken group attached; a
        tensor of this rank that changed shape or dtype since the build raises its own
        ``PlanError`` (naming this rank, the param, the old and the new shape), since it is the
        cause, and the peers' failures only its effect.
        ``sent_at`` (the controller's ``time.time()``) counts ``timeout_s`` from when the call
        was sent: a call that starts past it raises ``LateCall`` before a byte can land.
        """
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_transfer")
            if timeout_s is not None:
                what = f"{self._refit_label()}: the transfer of epoch {epoch}"
                timeout_s = max(call_deadline(sent_at, timeout_s, what) - time.monotonic(), 0.0)
            self._refit_transfer_starts(epoch)
            failure: tuple[type, str] | None = None
            tampered: RendezvousTampered | None = None
            try:
                stats = self._refit_run(timeout_s, verify)
            except RendezvousTampered as e:
                tampered = e
                failure = (RendezvousTampered, f"{self._refit_label()}: refit transfer failed (epoch {epoch}): "
                                               f"{_first_line(e)}")
            except (PlanError, LayoutError) as e:
                # this rank refused its own tensors (one changed shape or dtype since the build):
                # the cause of the failure, which the controller must see as such, not as one
                # more broken transfer among those it left behind on the other ranks
                failure = (type(e), _first_line(e))
            except Exception as e:  # re-raised below, without the broken group
                failure = (RefitAborted if isinstance(e, RefitAborted) else TransportError,
                           f"{self._refit_label()}: refit transfer failed (epoch {epoch}): "
                           f"{type(e).__name__}: {_first_line(e)}")
            if failure is None:
                self._refit_transfer_landed(epoch)
                return TransferReport(st.spec.rank, stats.bytes_sent, stats.bytes_received, stats.local_bytes,
                                      stats.seconds, dict(stats.checksums_sent), dict(stats.checksums_received),
                                      stats.timing.get("quantize"), tuple(str(o) for o in stats.cast_overflows))
            self._refit_drop_group(collect=True)
            cls, msg = failure
            self._refit_transfer_failed(epoch, msg)
            if tampered is not None:
                raise RendezvousTampered(msg, key=tampered.key, rank=st.spec.rank if st.spec else None)
            raise cls(msg)

    def _refit_run(self, timeout_s: float | None, verify: bool) -> TransferStats:
        st = self._refit_state()
        if st.executor is None:
            raise RefitError(f"{self._refit_label()}: no plan for epoch {st.epoch}; refit_prepare first")
        # a one-sided path runs no collective: its transport is what the watchdog aborts
        abortable = [st.one_sided] if st.transport.channel is not None else [st.group]
        if st.transport.split:  # this node's pairs over IPC, the others over the communicator
            abortable = [st.one_sided, st.group] + ([st.across] if st.across is not None else [])
        if st.quantized is not None and st.transport.channel is not None:
            abortable.append(st.group)  # the block amaxes are merged over the communicator
        with RefitAbortWatchdog(abortable, timeout_s):
            self.on_refit_start()
            src, dst = self._refit_sides(self._refit_local())
            overflows = find_overflows(st.narrowing, src, st.spec.rank) if st.narrowing else []
            quantization = None
            if st.quantized is not None:  # the scales now, the FP8 weights as the executor reaches them
                quantization = st.quantized.begin(src, st.group)
                src = quantization.tensors
            fault, st.fault = st.fault, None
            stats = st.executor.run(src, dst, verify=verify, corrupt=fault, production=quantization)
            if quantization is not None:
                stats.timing["quantize"] = quantization.report()
            stats.cast_overflows = overflows
            return stats

    def refit_cast_overflows(self, epoch: int) -> list[str]:
        """This trainer rank's source values beyond the range of their destination dtype, one line each.

        The controller asks before a transfer when the sync is strict about casts, so that an
        overflow stops it before any byte moves (a transfer would only report it).
        """
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_cast_overflows")
            if not st.narrowing:
                return []
            src, _ = self._refit_sides(self._refit_local())
            return [str(o) for o in find_overflows(st.narrowing, src, st.spec.rank)]

    def refit_prepare_commit(self, epoch: int) -> CommitReadiness:
        """Phase one of the commit: say whether this rank can switch to the transfer of ``epoch``.

        Returns the version served now and whether the transfer waits in staging. Raises when a
        staged transfer of ``epoch`` did not land whole here, so that
        the controller switches no worker of any shard.
        """
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_prepare_commit")
            self._refit_prepare(epoch)
            return CommitReadiness(st.weights_version, st.staging is not None)

    def _refit_prepare(self, epoch: int) -> None:
        pass

    def refit_commit(self, epoch: int, version: int | None = None) -> None:
        """The controller verified the transfer of ``epoch``: tell the actor (engines only).

        An engine's weights are whole again once its ``on_weights_loaded`` has returned; they
        are then version ``version`` (one more than the last, when the controller gives none).
        """
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_commit")
            st.loaded_epoch = epoch
        self._refit_committed(version)

    def _refit_committed(self, version: int | None) -> None:
        pass

    def _refit_transfer_starts(self, epoch: int) -> None:
        pass

    def _refit_transfer_landed(self, epoch: int) -> None:
        pass

    def _refit_transfer_failed(self, epoch: int, msg: str) -> None:
        pass

    def refit_teardown(self) -> None:
        """Abort this rank's refit communicator (idempotent)."""
        st = self._refit_state()
        with st.lock:
            self._refit_drop_group()
            st.spec, st.epoch = None, -1
            for t in (st.one_sided, st.across):
                if t is not None:
                    t.close()
            st.one_sided = st.across = None

    def refit_status(self) -> dict:
        """What this rank's refit state is: for logs, dashboards and tests.

        ``epoch`` of the live communicator (-1 without one), its ``backend`` (None without
        one), the ``transport`` of the executor, the NIXL agent or IPC transport name
        (``nixl_agent`` / ``ipc_name``, None without one) and its rank in the plans.
        """
        st = self._refit_state()
        return {"epoch": st.epoch, "backend": st.group.backend if st.group is not None else None,
                "transport": st.executor.transport if st.executor is not None else None,
                "nixl_agent": getattr(st.one_sided, "agent_name", None),
                "ipc_name": getattr(st.one_sided, "name", None),
                "one_sided_rank": st.one_sided.rank if st.one_sided is not None else None,
                "nixl_rank": st.one_sided.rank if getattr(st.one_sided, "agent_name", None) else None}

    def refit_connected(self) -> bool:
        """Whether this rank holds a live refit communicator (built, and not aborted since)."""
        group = self._refit_state().group
        return group is not None and not group.aborted

    def refit_all_gather(self, value: Any, timeout_s: float) -> list[Any]:
        """Every rank's ``value``, by rank, over this build's communicator, within ``timeout_s``.

        Ranks that run a build without a controller (the vLLM weight-transfer engine) swap
        their rosters so; with a controller, it gathers them instead.
        """
        group = self._refit_state().group
        if group is None:
            raise RefitError(f"{self._refit_label()} has no refit communicator to gather over; connect first")
        group.store.set_timeout(timedelta(seconds=max(timeout_s, 0.1)))
        return group.all_gather_object(value)

    def refit_abort(self) -> None:
        """Abort this rank's communicator and NIXL transport now, from any thread (idempotent).

        What a dying process does to its peers, on purpose: a rank blocked on this one is
        released at once instead of at its deadline.
        """
        st = self._refit_state()
        if st.group is not None:
            st.group.abort()
        for t in (st.one_sided, st.across):
            if t is not None:
                t.abort()

    def refit_inject_fault(self, *, peer: int | None = None, byte: int = 0) -> None:
        """Testing: corrupt one byte of the next bucket this rank sends (to ``peer``, or to anyone)."""
        self._refit_state().fault = _OneShotCorruption(peer, byte)

    def refit_resources(self) -> dict:
        return process_resources()

    def _refit_check_epoch(self, epoch: int, what: str) -> None:
        st = self._refit_state()
        if st.group is None or st.spec is None:
            raise RefitError(f"{what}: {self._refit_label()} has no refit communicator (epoch {epoch}); "
                             "it was torn down or never built")
        if epoch != st.epoch:
            raise RefitError(f"{what}: {self._refit_label()} is in epoch {st.epoch}, not {epoch}")


class TrainerEndpoint(_RefitEndpoint):
    """Mix into a trainer actor; implement ``refit_sources``.

    ``refit_sources()`` returns ``{canonical_name: (local_tensor, global_shape, mesh,
    placements)}`` (or ``(DTensorRef, mesh, placements)``, or a ``LocalShard``), with the
    mesh in trainer ranks ``0 .. train_world_size-1``. It is called at every build and
    every transfer, so parameters replaced between steps are picked up, as long as their
    layout stays the same.
    """

    _refit_role = "src"

    def refit_sources(self) -> Mapping[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement refit_sources()")

    def _refit_tensors(self) -> dict[str, LocalShard]:
        return dict(self.refit_sources())


class EngineEndpoint(_RefitEndpoint):
    """Mix into an inference engine worker; implement ``refit_destinations``.

    ``refit_destinations()`` returns the tensors the weights land in, in place, laid out
    over the shard's own workers ``0 .. workers_per_shard-1``. ``on_weights_loaded()``
    runs after every transfer that the controller has verified.

    Bytes land before they are checked, so a transfer that fails or is cut short leaves the
    live weights torn (some params new, some old, some half of each). The endpoint marks
    itself inconsistent before the first byte can land and consistent again only when the
    controller commits a verified transfer and ``on_weights_loaded`` returns, so even a
    worker whose controller or peers died knows. ``on_weights_inconsistent(reason)`` tells
    the engine; ``refit_weights_state()`` and ``check_weights_consistent()`` ask. An endpoint
    whose transfers land in side buffers, loaded at commit, says so by returning False from
    ``_refit_in_place`` and marks itself while its load runs (``mark_weights_inconsistent``).

    Staged refit (``refit_configure_staging``): a transfer lands in a staging copy of every
    destination while the engine keeps serving its live weights, and the commit switches
    between two engine steps (``serving_step``), by a copy or a pointer swap. Generation
    then stalls for the switch, not for the transfer, and a transfer that fails leaves the
    live weights whole. Every commit gives the live weights a version (``weights_version``).
    """

    _refit_role = "dst"

    def refit_destinations(self) -> Mapping[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement refit_destinations()")

    def refit_staging_destinations(self) -> Mapping[str, Any] | None:
        """A second set of weights laid out as ``refit_destinations()``, for a pointer swap; None: copy.

        An engine that can serve from either of two sets of tensors returns the set it does
        not serve from now, and swaps the two in ``on_weights_swap``.
        """
        return None

    def on_weights_swap(self) -> None:
        """Serve from the set ``refit_staging_destinations()`` returned (called between two steps)."""
        raise NotImplementedError(f"{type(self).__name__} returned staging destinations but cannot swap them")

    def on_weights_loaded(self) -> None:
        """Called after new weights landed and were verified (e.g. to re-process them)."""

    def on_weights_inconsistent(self, reason: str) -> None:
        """Called each time the live weights are marked torn, with why; an engine stops serving them.

        It may come again while they are already torn, with a more precise reason (a transfer
        started, then failed). They are whole again once ``on_weights_loaded`` has returned.
        """

    # -- staging ---------------------------------------------------------------------------
    def refit_configure_staging(self, staged: bool = True, *, device_fraction: float = 1.0,
                                require_version: bool = True) -> dict:
        """Land later transfers beside the live weights (``staged``) or in them; from the next build on.

        The staging copies are made once and kept while the live tensors stay the same
        objects, so every refit reuses them. Returns what ``refit_weights_state`` says.
        """
        if not 0.0 <= device_fraction <= 1.0:
            raise RefitError(f"device_fraction must be within [0, 1], got {device_fraction!r}")
        st = self._refit_state()
        with st.lock:
            st.staging = Staging(float(device_fraction), bool(require_version)) if staged else None
            st.staging_buffers, st.staged_epoch, st.prepared_epoch = {}, -1, -1
        return self.refit_weights_state()

    def _refit_swaps(self) -> bool:
        st = self._refit_state()
        return (st.staging is not None and st.staging.device_fraction >= 1.0
                and type(self).refit_staging_destinations is not EngineEndpoint.refit_staging_destinations)

    def _refit_tensors(self) -> dict[str, LocalShard]:
        st = self._refit_state()
        live = dict(self.refit_destinations())
        if st.staging is None:
            return live
        if self._refit_swaps():
            return dict(self.refit_staging_destinations())
        shards = {n: as_local_shard(n, v) for n, v in live.items()}
        self._refit_stage_buffers(shards)
        return {n: LocalShard(st.staging_buffers[n][1], s.global_shape, s.mesh, s.placements)
                for n, s in shards.items()}

    def _refit_stage_buffers(self, shards: Mapping[str, LocalShard]) -> None:
        """Copy mode: one staging tensor per destination, made once per live tensor.

        The first ``device_fraction`` of the bytes (params in name order) is staged on the
        live tensors' device and the rest in host memory (pinned under CUDA), so that the
        device holds at most that fraction of a second model.
        """
        st = self._refit_state()
        if all(st.staging_buffers.get(n, (None,))[0] == id(s.tensor) for n, s in shards.items()) \
                and len(st.staging_buffers) == len(shards):
            return
        total = sum(s.tensor.numel() * s.tensor.element_size() for s in shards.values())
        if st.staging.device_fraction * total < total and any(s.tensor.device.type != "cpu" for s in shards.values()):
            # one rank's executor moves the tensors of one device: NCCL cannot land bytes in host
            # memory, so a part staged there would need a host transport of its own
            raise RefitError(f"{self._refit_label()}: device_fraction {st.staging.device_fraction:g} < 1 stages "
                             "part of the model in host memory, which a transfer into GPU tensors cannot land in "
                             "yet; stage on the device (device_fraction=1.0)")
        kept = {n: old[1] for n, old in st.staging_buffers.items() if n in shards and old[0] == id(shards[n].tensor)}
        buffers = allocate_staging({n: s.tensor for n, s in shards.items()}, st.staging.device_fraction, kept)
        st.staging_buffers = {n: (id(shards[n].tensor), buf) for n, buf in buffers.items()}

    def _refit_in_place(self) -> bool:
        """Whether a transfer writes into the live weights (True) or into buffers loaded at commit."""
        return self._refit_state().staging is None

    def _refit_transfer_starts(self, epoch: int) -> None:
        st = self._refit_state()
        st.staged_epoch = st.prepared_epoch = -1  # the staging copies are about to be overwritten
        if self._refit_in_place():
            # the step in flight ends before the first byte lands; no later step reads torn weights
            with st.serving:
                self.mark_weights_inconsistent(f"a refit transfer (epoch {epoch}) is writing into the live weights")
                st.paused_at = time.perf_counter()

    def _refit_transfer_landed(self, epoch: int) -> None:
        st = self._refit_state()
        if st.staging is not None:
            st.staged_epoch = epoch

    def _refit_transfer_failed(self, epoch: int, msg: str) -> None:
        if self._refit_in_place():
            self.mark_weights_inconsistent(f"the refit transfer of epoch {epoch} failed part way: {msg}")

    def _refit_prepare(self, epoch: int) -> None:
        st = self._refit_state()
        if st.staging is not None:
            if st.staged_epoch != epoch:
                raise RefitError(f"{self._refit_label()}: no whole staged transfer of epoch {epoch} to switch to "
                                 f"(staged: {st.staged_epoch}); no worker switches")
            st.prepared_epoch = epoch

    def _refit_committed(self, version: int | None) -> None:
        st = self._refit_state()
        if version is None:
            version = (st.weights_version or 0) + 1
        if st.staging is not None:
            self._refit_switch(version, f"commit of epoch {st.loaded_epoch}")
            return
        try:
            self.on_weights_loaded()
        except BaseException as e:
            if self._refit_in_place():  # the verified bytes are in place, but the engine could not take them
                self.mark_weights_inconsistent(f"loading the verified weights of epoch {st.loaded_epoch} failed: "
                                               f"{type(e).__name__}: {_first_line(e)}")
            raise
        with st.serving:
            st.committed_epoch, st.commits, st.weights_version = st.loaded_epoch, st.commits + 1, version
            if st.paused_at is not None:  # how long no step could run: from the first byte to now
                st.switches = [*st.switches[-63:], {"version": version, "mode": "in place",
                                                    "seconds": time.perf_counter() - st.paused_at}]
                st.paused_at = None
            self.mark_weights_consistent()
            st.serving.notify_all()

    def _refit_switch(self, version: int, why: str) -> None:
        """Serve the staged weights as ``version``, between two steps; a no-op if already switched.

        A worker of a shard may switch first, from its step loop, when a peer of the same
        shard already serves ``version`` (``refit_catch_up``): the controller commits only
        once every worker prepared, so a peer's switch is the decision.
        """
        st = self._refit_state()
        with st.serving:
            if st.weights_version == version and st.prepared_epoch == -1:
                return
            if st.prepared_epoch == -1 or st.prepared_epoch != st.staged_epoch:
                raise InconsistentWeights(f"{self._refit_label()}: cannot switch to version {version} ({why}): "
                                          "no prepared staged transfer")
            t0 = time.perf_counter()
            if self._refit_swaps():
                self.on_weights_swap()
                mode = "swap"
            else:
                live = {n: as_local_shard(n, v).tensor for n, v in self.refit_destinations().items()}
                copy_staged_into_live(live, {n: buf for n, (_, buf) in st.staging_buffers.items()})
                mode = "copy"
            self.on_weights_loaded()
            seconds = time.perf_counter() - t0
            st.committed_epoch, st.commits, st.weights_version = st.prepared_epoch, st.commits + 1, version
            st.staged_epoch = st.prepared_epoch = -1
            st.switches = [*st.switches[-63:], {"version": version, "mode": mode, "seconds": seconds}]
            self.mark_weights_consistent()
            st.serving.notify_all()

    def refit_catch_up(self, version: int) -> bool:
        """Switch to ``version`` now if this worker prepared it; whether it could (called inside a step)."""
        st = self._refit_state()
        if st.staging is None or st.prepared_epoch == -1:
            return False
        self._refit_switch(version, "a peer of this shard already serves it")
        return True

    def serving_step(self) -> _ServingStep:
        """Hold the live weights for one engine step: a switch waits for it, and it for a switch.

        What an engine's step loop wraps every step in. Refuses (``InconsistentWeights``)
        while the weights are torn, or, staged, before any version was committed. Gives the
        version served.
        """
        return _ServingStep(self)

    def refit_wait_version(self, newer_than: int | None, timeout_s: float) -> int | None:
        """Wait until the live weights are whole and newer than ``newer_than``; the version then."""
        st = self._refit_state()
        deadline = time.monotonic() + timeout_s
        with st.serving:
            while not (st.consistent and st.weights_version is not None
                       and (newer_than is None or st.weights_version > newer_than)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                st.serving.wait(left)
            return st.weights_version

    def mark_weights_inconsistent(self, reason: str) -> None:
        """Record that the live weights are torn, and tell the engine (``on_weights_inconsistent``)."""
        st = self._refit_state()
        st.inconsistent_reason, st.consistent = reason, False
        try:
            self.on_weights_inconsistent(reason)
        except Exception:  # the mark stands; raising here would strand the transfer's peers
            log.exception("%s: on_weights_inconsistent raised", self._refit_label())

    def mark_weights_consistent(self) -> None:
        """Record that the live weights are whole again (a verified refit was loaded completely)."""
        st = self._refit_state()
        st.consistent, st.inconsistent_reason = True, None

    def refit_weights_state(self) -> dict:
        """``consistent``, the ``epoch`` and count (``commits``) of the last refit committed, and the ``reason``.

        Also the ``version`` served (None before the first commit), whether transfers are
        ``staged``, the epoch waiting in staging (``staged_epoch``, -1 for none) and the last
        ``switch`` (its mode and seconds). Read without the endpoint's lock, so that it
        answers while a transfer runs.
        """
        st = self._refit_state()
        return {"consistent": st.consistent, "epoch": st.committed_epoch, "commits": st.commits,
                "reason": st.inconsistent_reason, "label": self._refit_label(), "version": st.weights_version,
                "staged": st.staging is not None, "staged_epoch": st.staged_epoch,
                "switch": st.switches[-1] if st.switches else None}

    def refit_switches(self) -> list[dict]:
        """The last switches: ``version``, ``mode`` (swap or copy; in place: the refit wrote the live
        weights, and ``seconds`` runs from its first byte to the commit), ``seconds`` no step could run."""
        return list(self._refit_state().switches)

    @property
    def weights_version(self) -> int | None:
        """The version of the live weights: None until a refit commits one."""
        return self._refit_state().weights_version

    def check_weights_consistent(self) -> None:
        """Raise ``InconsistentWeights`` while the live weights are torn: what a serving entry point calls first."""
        st = self._refit_state()
        if not st.consistent:
            raise InconsistentWeights(f"{self._refit_label()}: refusing to serve torn weights "
                                      f"({st.inconsistent_reason}); a refit must complete first")
        if st.staging is not None and st.staging.require_version and st.weights_version is None:
            raise InconsistentWeights(f"{self._refit_label()}: refusing to serve before a refit brought this "
                                      "worker to the current weights version")


def allocate_staging(live: Mapping[str, torch.Tensor], device_fraction: float,
                     kept: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A staging tensor per live tensor: the first ``device_fraction`` of the bytes (names in
    order) beside the live one on its device, the rest in host memory (pinned under CUDA).

    ``kept`` holds staging tensors made earlier for the same live tensors; they are reused,
    so that every refit writes into the same memory.
    """
    total = sum(t.numel() * t.element_size() for t in live.values())
    budget, used, out = device_fraction * total, 0, {}
    for name in sorted(live):
        t = live[name]
        nbytes = t.numel() * t.element_size()
        on_device = used + nbytes <= budget or t.device.type == "cpu"
        used += nbytes if on_device else 0
        if kept and name in kept:
            out[name] = kept[name]
        elif on_device:
            out[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
        else:
            out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return out


def copy_staged_into_live(live: Mapping[str, torch.Tensor], staging: Mapping[str, torch.Tensor]) -> None:
    """The switch of a staged refit without a second set of weights: every staged tensor into its live one.

    Copies are queued without waiting (device-to-device from staging on the device, host-to-
    device from pinned host memory) and waited for once at the end, on the current stream of
    each device, so the switch costs the copies at the copy engines' rate, not a round trip
    per tensor.
    """
    for name, t in live.items():
        t.copy_(staging[name], non_blocking=True)
    # the copies' own streams only: a device-wide sync would also wait for unrelated work on other streams
    for device in {t.device for t in live.values() if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


class _ServingStep:
    def __init__(self, endpoint: EngineEndpoint):
        self.endpoint = endpoint
        self.cond = endpoint._refit_state().serving

    def __enter__(self) -> int | None:
        self.cond.acquire()
        try:
            self.endpoint.check_weights_consistent()
        except BaseException:
            self.cond.release()
            raise
        return self.endpoint._refit_state().weights_version

    def __exit__(self, *exc) -> None:
        self.cond.release()


def _wait_for_listener(address: str, port: int, deadline: float) -> None:
    """Wait until rank 0's store accepts connections, or the deadline passes.

    A store client that arrives before the store is up backs off for about half a
    second before it retries, and every rebuild pays that (measured: 0.6s against 0.05s
    for a 4-rank rendezvous). A plain TCP probe every 10 ms costs nothing and lets the
    client connect as soon as the store listens.
    """
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return  # let the store client report the failure in its own words
            time.sleep(0.01)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def process_resources() -> dict:
    """Open fds, threads and listening TCP ports of this process (Linux ``/proc``), for leak checks."""
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        fds = os.listdir("/proc/self/fd")
        out["fds"] = len(fds)
        out["threads"] = len(os.listdir("/proc/self/task"))
        out["listening_ports"] = sorted(port for _, port in listening_sockets())
    except OSError:
        out.update(fds=-1, threads=threading.active_count(), listening_ports=[])
    return out
