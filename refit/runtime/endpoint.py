"""The worker side of a refit: connect and transfer, shared by the trainer and engine mixins.

An RL framework already has trainer and engine actors. Mixing ``TrainerEndpoint`` (here)
or ``EngineEndpoint`` (``refit.runtime.engine_endpoint``) into them adds the ``refit_*``
methods the controller's calls (``refit.runtime.protocol``) run; the actor only says which
local tensors it holds and how they are laid out (``refit.runtime.shards``). All rank-side
work of a build happens here, inside the actor: joining a fresh ``StatelessProcessGroup``
per (re)build, reporting roster entries, building this rank's own plan from the merged
rosters and its executor, and running it under the refit watchdog.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from refit.comm.base import wait_for_listener
from refit.comm.group import StatelessProcessGroup, free_port
from refit.comm.rendezvous import RendezvousTampered
from refit.errors import LateCall, LayoutError, PlanError, RefitError, TransportError, error_summary, first_line
from refit.layout import dtype_name
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
from refit.plan.quant import check_fp8_destinations
from refit.runtime.faults import OneShotCorruption
from refit.runtime.fp8_sources import plan_sources
from refit.runtime.handles import process_resources
from refit.runtime.protocol import CommitReadiness, EndpointCall, Prepared, TransferReport, answer
from refit.runtime.shards import ConnectSpec, LocalShard, as_local_shard, call_deadline
from refit.runtime.watchdog import RefitAborted, RefitAbortWatchdog
from refit.runtime.weights_state import WeightsState
from refit.transport.base import Executor, TransferStats, tensor_identity
from refit.transport.broadcast import BroadcastPlan
from refit.transport.casts import find_overflows
from refit.transport.factory import COMMUNICATOR, Channels, TransportChoice
from refit.transport.ipc import node_id, sweep_stale_segments
from refit.transport.one_sided import RosterEntries

__all__ = ["RefitEndpointBase", "TrainerEndpoint"]

MODES = ("reshard", "broadcast")


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
    bound: tuple = ()  # tensor_identity of the local tensors the executor is bound to
    plans: PlanCache = field(default_factory=lambda: PlanCache(max_entries=4))
    fault: OneShotCorruption | None = None
    loaded_epoch: int = -1
    transport: TransportChoice = COMMUNICATOR  # the build's, as the controller chose it
    channels: Channels = field(default_factory=Channels)  # one-sided channels: they outlive plans
    quantized: Any = None  # refit.runtime.fp8_sources.QuantizedSources: what this trainer rank sends in FP8
    # params this trainer rank sends into a destination dtype of smaller range -> those dtypes
    narrowing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    weights: WeightsState = field(default_factory=WeightsState)  # engines: whether, and which, weights serve


class RefitEndpointBase:
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

    def _refit_local(self) -> tuple[dict[str, torch.Tensor], tuple | None]:
        """This rank's local tensors for a transfer, and their ``tensor_identity`` when the executor
        must rebind to them (None when it is bound to them already).

        This is the one check of tensor identity on a transfer: the executor is bound to the
        tensors (objects and storage) it was prepared with, and runs with them unchecked. A
        parameter replaced since (a trainer may swap its tensors, or their ``.data``, between
        steps) is checked against the layout reported at connect time, before any byte moves.
        """
        st = self._refit_state()
        shards = self._refit_tensors()
        out = {}
        for name in st.layouts:
            value = shards.get(name)
            out[name] = None if value is None else as_local_shard(name, value).tensor
        identity = tensor_identity(out)
        if identity == st.bound:
            return out, None
        self._refit_check_local(out)
        return out, identity

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
        executor, st.executor, st.bound = st.executor, None, ()
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
        if "ray" in sys.modules:  # a Ray actor: large arguments arrive as object references
            from refit.runtime.ray import fetch_shared

            call = fetch_shared(call)
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
                    wait_for_listener(spec.address, spec.port, deadline)
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
            bound = tensor_identity(local)
            st.quantized, st.narrowing = None, {}
            if self._refit_role == "src":
                st.quantized, st.narrowing, local = plan_sources(index, rank, local, block=self.refit_fp8_block,
                                                                 label=self._refit_label())
            else:
                check_fp8_destinations(index, rank, self.refit_fp8_block, label=self._refit_label())
            try:
                check_local_shapes(index, rank, {self._refit_role: {n: t.shape for n, t in local.items()}})
            except LayoutError as e:
                raise LayoutError(f"{self._refit_label()}: {e}") from None
            device = self._refit_tensor_device(st.shards)
            plan = (st.plans.get(index, rank, bucket_bytes=bucket_bytes) if mode == "reshard"
                    else BroadcastPlan.build(index, rank))
            send_params, recv_params = plan.params_by_bucket()
            st.channels.update(transport, rank, device)
            executor = st.channels.executor(transport, plan, st.group, rank, device)
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
            near, far = st.channels.near, st.channels.far
            if near is None or st.executor is None:
                raise RefitError(f"refit_peer_entry: {self._refit_label()} has no one-sided executor; "
                                 f"refit_prepare(..., transport='nixl' or 'ipc') first")
            if far is not None:
                return RosterEntries(near.rank, near.local_roster_entry(), far.local_roster_entry())
            return near.local_roster_entry()

    def refit_peer_membership(self, roster: Mapping[int, Any], epoch: int) -> None:
        """One-sided transports: install the roster the controller relays (new peers point to point)."""
        st = self._refit_state()
        with st.lock:
            self._refit_check_epoch(epoch, "refit_peer_membership")
            near, far = st.channels.near, st.channels.far
            if far is not None:
                near.update_membership({r: e.ipc for r, e in roster.items()}, epoch)
                far.update_membership({r: e.nixl for r, e in roster.items()}, epoch)
                return
            near.update_membership(roster, epoch)

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
                                               f"{first_line(e)}")
            except (PlanError, LayoutError) as e:
                # this rank refused its own tensors (one changed shape or dtype since the build):
                # the cause of the failure, which the controller must see as such, not as one
                # more broken transfer among those it left behind on the other ranks
                failure = (type(e), first_line(e))
            except Exception as e:  # re-raised below, without the broken group
                failure = (RefitAborted if isinstance(e, RefitAborted) else TransportError,
                           f"{self._refit_label()}: refit transfer failed (epoch {epoch}): "
                           f"{error_summary(e)}")
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
        abortable = [st.channels.near] if st.transport.channel is not None else [st.group]
        if st.transport.split:  # this node's pairs over IPC, the others over the communicator
            abortable = [st.group, *st.channels.abortable()]
        if st.quantized is not None and st.transport.channel is not None:
            abortable.append(st.group)  # the block amaxes are merged over the communicator
        with RefitAbortWatchdog(abortable, timeout_s):
            self.on_refit_start()
            local, rebind = self._refit_local()
            src, dst = self._refit_sides(local)
            overflows = find_overflows(st.narrowing, src, st.spec.rank) if st.narrowing else []
            quantization = None
            if st.quantized is not None:  # the scales now, the FP8 weights as the executor reaches them
                quantization = st.quantized.begin(src, st.group)
                src = quantization.tensors
            if rebind is not None:
                st.executor.prepare(src, dst)
                st.bound = rebind
            fault, st.fault = st.fault, None
            stats = st.executor.run(verify=verify, corrupt=fault, production=quantization)
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
            src, _ = self._refit_sides(self._refit_local()[0])
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
            return self._refit_readiness()

    def _refit_prepare(self, epoch: int) -> None:
        """Raise when this rank cannot switch to the transfer of ``epoch`` (a hook of engines)."""

    def _refit_readiness(self) -> CommitReadiness:
        return CommitReadiness(None, False)

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
            st.channels.close()

    def refit_status(self) -> dict:
        """What this rank's refit state is: for logs, dashboards and tests.

        ``epoch`` of the live communicator (-1 without one), its ``backend`` (None without
        one), the ``transport`` of the executor, the NIXL agent or IPC transport name
        (``nixl_agent`` / ``ipc_name``, None without one) and its rank in the plans.
        """
        st = self._refit_state()
        near = st.channels.near
        return {"epoch": st.epoch, "backend": st.group.backend if st.group is not None else None,
                "transport": st.executor.transport if st.executor is not None else None,
                "nixl_agent": getattr(near, "agent_name", None), "ipc_name": getattr(near, "name", None),
                "one_sided_rank": near.rank if near is not None else None,
                "nixl_rank": near.rank if getattr(near, "agent_name", None) else None}

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
        for channel in st.channels.abortable():
            channel.abort()

    def refit_inject_fault(self, *, peer: int | None = None, byte: int = 0) -> None:
        """Testing: corrupt one byte of the next bucket this rank sends (to ``peer``, or to anyone)."""
        self._refit_state().fault = OneShotCorruption(peer, byte)

    def refit_resources(self) -> dict:
        return process_resources()

    def _refit_check_epoch(self, epoch: int, what: str) -> None:
        st = self._refit_state()
        if st.group is None or st.spec is None:
            raise RefitError(f"{what}: {self._refit_label()} has no refit communicator (epoch {epoch}); "
                             "it was torn down or never built")
        if epoch != st.epoch:
            raise RefitError(f"{what}: {self._refit_label()} is in epoch {st.epoch}, not {epoch}")


class TrainerEndpoint(RefitEndpointBase):
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
