"""The synchronizers: one control plane shared by the shard-to-shard path and the broadcast baseline.

The control plane is one lifecycle (build, sync, reconcile, shutdown), the
membership arithmetic of ``refit.membership``, settling stragglers before a rebuild,
verification, and recovery. The two data paths differ only in what each worker runs
during a transfer (``mode``), so everything that decides who is in the communicator and
what happens when someone leaves exists once.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import secrets
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from refit.comm.rendezvous import new_secret
from refit.control.errors import (
    EveryShardLost,
    NoAbsentShard,
    RecoveryDeadlineExceeded,
    RefitRefused,
    RefitTampered,
    RefitWorkerError,
    WorkersLate,
)
from refit.control.result import Recorder, SyncResult
from refit.control.settle import brief, settle_before_propagating, wait_any
from refit.control.verify import RankChecksums, verify_checksums
from refit.errors import CastOverflowWarning, PlanError, RefitError
from refit.membership import NoSurvivingShards, RefitMembership, desired_membership, should_rebuild
from refit.plan import DEFAULT_BUCKET_BYTES
from refit.runtime.build import PlanOptions, connect_and_prepare
from refit.runtime.handles import LocalWorker, WorkerDied, send_requests
from refit.runtime.protocol import (
    CastOverflows,
    Commit,
    Device,
    EndpointCall,
    EndpointFailed,
    FailureKind,
    PeerEntry,
    PeerMembership,
    Ping,
    PrepareCommit,
    Prepared,
    Rendezvous,
    Teardown,
    Transfer,
    TransferReport,
    WeightsState,
)
from refit.runtime.shards import ConnectSpec
from refit.runtime.workers import as_worker
from refit.transport.factory import TransportRequest, choose_transport

__all__ = ["CollectiveWeightSynchronizer", "ReshardWeightSynchronizer", "WeightSynchronizer", "as_worker"]

GRACE_S = 5.0  # slack on top of a worker's own deadline before the controller stops waiting
NO_DEADLINE_SETTLE_S = 30.0  # settle budget when refit_timeout_s is None
NO_DEADLINE_ROUND_S = 300.0  # bound on control calls (connect, prepare, commit) without a deadline
_STALL_SLACK_S = 1.0  # a controller wait that overruns what it asked for by more was stopped or starved


@runtime_checkable
class WeightSynchronizer(Protocol):
    """The lifecycle every synchronizer offers: build, sync, reconcile after a loss, shut down."""

    def init_communicator(self) -> None: ...
    def sync_weights(self) -> SyncResult: ...
    @property
    def is_stale(self) -> bool: ...
    def reconcile_communicator(self, absent_shards: Sequence[int], force: bool = False) -> bool: ...
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class _Member:
    """One rank of a build: who it is and how to reach it."""

    rank: int
    worker: Any
    label: str
    shard: int | None = None  # None for trainers
    first_rank: int = 0  # communicator rank of the shard's worker 0 (what its meshes are offset by)


@dataclass
class _Limits:
    """One sync's time limits for recovery, and the workers it has lost so far.

    A fleet that keeps losing engines must not hold the trainer for ever: each loss costs a
    probe, a rebuild and another transfer, and without a bound on the whole sync the caller
    could not say when an error would come. So: ``deadline``
    (``refit_timeout_s`` after the sync started) is the last moment recovery may begin a
    rebuild, except in the first round after a loss, which always may (a loss inside a
    rebuild holds the survivors in the rendezvous for the connect timeout, by default the
    whole ``refit_timeout_s``). ``hard_end`` (the deadline plus the settle budget) is when
    every step of recovery has ended: workers are given at most what is left of it less the
    controller's grace, and the controller waits no longer than it. Without a deadline both
    are None and only the shard count bounds recovery (each round excludes one more shard).
    """

    deadline: float | None
    hard_end: float | None
    grace_s: float
    recovering: bool = False
    rounds: int = 0  # recovery rounds begun: a rebuild over fewer shards and the retried transfer
    last: RefitWorkerError | None = None  # the latest failure recovery answered
    lost: list[str] = field(default_factory=list)  # workers found dead, in the order they were found
    seen: dict[str, Any] = field(default_factory=dict)  # label -> handle of every worker this sync built over

    def lose(self, labels: Sequence[str]) -> None:
        self.lost += [label for label in dict.fromkeys(labels) if label not in self.lost]

    def worker_s(self) -> float | None:
        """How long a worker may still be given (its watchdog, its rendezvous), during recovery."""
        if not self.recovering or self.hard_end is None:
            return None
        return self.hard_end - self.grace_s - time.monotonic()

    def wait_s(self) -> float | None:
        """How long the controller may still wait on a round, during recovery."""
        if not self.recovering or self.hard_end is None:
            return None
        return max(0.0, self.hard_end - time.monotonic())

    def may_start(self) -> bool:
        """Whether recovery may begin a rebuild now: a worker can still be given time, and,
        past the first round, the deadline has not passed."""
        left = self.worker_s()
        if left is None:
            return True
        return left > 0 and (self.rounds <= 1 or time.monotonic() < self.deadline)


def _died(p: Any) -> bool:
    """Whether a finished call ended because its worker's process is gone."""
    try:
        p.result(0)
    except WorkerDied:
        return True
    except Exception:  # any other failure is the worker's own
        return False
    return False


def _kind(e: BaseException) -> FailureKind | None:
    """The kind of a worker's failure; None for the handle's own (a death, a timeout)."""
    return e.kind if isinstance(e, EndpointFailed) else None


# -- the control plane ---------------------------------------------------------------------------

class _SynchronizerBase:
    """Lifecycle, membership, settling, verification and recovery, shared by both data paths.

    Args:
        trainers: one handle per trainer rank (Ray actor handles, worker handles, or
            endpoint objects), in trainer-rank order.
        engines: one list per generation shard of its workers' handles (tp x pp each),
            in worker order. Shards may differ in size (e.g. two of TP2 and one of TP1).
        refit_timeout_s: deadline of one transfer on every rank. Each worker arms a
            watchdog that aborts its communicator when it passes, which is what lets the
            controller rebuild over the survivors instead of hanging. It also bounds the
            rendezvous, and a sync's recovery: after the first recovery round, no further
            round begins once ``refit_timeout_s`` has passed since the sync started, and
            every step of recovery ends within the settle budget after that (see
            ``sync_weights``). None disarms it, and with it the hang protection.
        ping_timeout_s: how long a liveness probe waits before calling a worker unresponsive.
        bucket_bytes: size of the packed buckets of the reshard path.
        verify: compare per-bucket checksums of sender and receiver after every transfer.
        on_phase: called with a phase name as each step of a sync starts (for metrics and tests).
        grace_s: slack the controller adds to a worker's own deadline before it stops
            waiting, and to the settle budget.
        connect_timeout_s: how long a rank waits in the rendezvous of a (re)build for the
            others; defaults to ``refit_timeout_s``. A rank that dies during a rebuild
            holds the survivors there this long.
        transport: None (the communicator: gloo / NCCL), ``"nixl"`` (reshard only):
            one-sided NIXL WRITEs, no collective during a transfer; every build relays the
            ranks' NIXL roster entries (``refit.transport.nixl``; needs ``pip install
            'refit[nixl]'``), or ``"ipc"`` (reshard only, every rank on one node): engines
            copy their blocks straight out of the trainer's memory, CUDA IPC on GPUs (ranks
            may share a GPU: colocated training and generation), shared memory on the host
            (``refit.transport.ipc``); or ``"auto"`` (reshard only): the pairs inside a node
            over IPC and the pairs between nodes over the communicator, at once (one plan,
            split by peer). On one node the communicator then carries only control (gloo).
        across_nodes: with ``transport="auto"``, how pairs of different nodes move:
            ``"communicator"`` (NCCL / gloo) or ``"nixl"`` (one-sided writes; the
            communicator then carries control only).
        backend: the communicator's backend: ``"gloo"``, ``"nccl"``, or ``"auto"`` (each
            worker is asked once where its tensors live: NCCL when all are on GPUs, gloo
            when all are on the host; a mix, or two ranks on one GPU under NCCL, is refused
            naming the ranks).
    """

    mode: ClassVar[str] = "reshard"

    def __init__(
        self,
        trainers: Sequence[Any],
        engines: Sequence[Sequence[Any]],
        *,
        refit_timeout_s: float | None = 60.0,
        ping_timeout_s: float = 2.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: bool = True,
        on_phase: Callable[[str], None] | None = None,
        grace_s: float = GRACE_S,
        connect_timeout_s: float | None = None,
        transport: str | None = None,
        backend: str = "auto",
        across_nodes: str = "communicator",
    ):
        if not trainers:
            raise RefitError("a synchronizer needs at least one trainer rank")
        if not engines or any(len(s) == 0 for s in engines):
            raise RefitError("a synchronizer needs at least one generation shard, each with at least one worker")
        _check_settings(refit_timeout_s=refit_timeout_s, ping_timeout_s=ping_timeout_s, grace_s=grace_s,
                        connect_timeout_s=connect_timeout_s, bucket_bytes=bucket_bytes)
        self._transport = TransportRequest(transport, backend, across_nodes, self.mode)
        self.transport = transport
        self.backend = backend
        self.across_nodes = across_nodes
        self.refit_timeout_s = refit_timeout_s
        self.ping_timeout_s = ping_timeout_s
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.on_phase = on_phase
        self.grace_s = grace_s
        self.connect_timeout_s = connect_timeout_s or refit_timeout_s or NO_DEADLINE_ROUND_S
        self._trainers = [as_worker(h, f"trainer rank {r}") for r, h in enumerate(trainers)]
        self._engines = [[as_worker(h, f"shard {s} worker {w}") for w, h in enumerate(shard)]
                         for s, shard in enumerate(engines)]
        self.train_world_size = len(self._trainers)
        self.dp_size = len(self._engines)
        self.shard_sizes = [len(s) for s in self._engines]
        self.workers_per_shard = max(self.shard_sizes)  # the largest shard's, when sizes differ
        self._built: RefitMembership | None = None
        self._attempted: RefitMembership | None = None  # the membership of the last build started
        self._members: list[_Member] = []
        self._initialized = False
        self._broken = False
        self._closed = False
        self._epoch = 0
        self._steps = 0
        self._abandoned: list[Any] = []  # calls given up on; read once they end, so no error goes unseen
        self._rec: Recorder | None = None  # the sync in progress, if any
        self._limits: _Limits | None = None  # the recovery limits and losses of the sync in progress
        self._devices: dict[int, tuple[Any, dict]] = {}  # id(handle) -> (handle, where its tensors live)
        self._bucket_params: dict[int, Prepared] = {}  # rank -> params of each bucket it sends / receives
        # shards whose engine could not take verified weights (their commit failed): left out of
        # every refit until replace_shard hands in a fresh one, though their workers are alive
        self._quarantined: set[int] = set()
        # engine workers sent a transfer that was not committed since: torn unless they say otherwise
        self._suspects: dict[int, Any] = {}  # id(handle) -> handle
        self.weights_version = 0  # the version the last committed refit gave the engines' weights
        self._next_version: int | None = None
        self._strict_casts = False  # the sync in progress refuses values beyond their destination's range

    @classmethod
    def from_fleet(cls, fleet: Any, **kwargs: Any):
        """Build from anything with ``.trainers`` and ``.engines`` (e.g. ``refit.runtime.ray.RayFleet``)."""
        return cls(fleet.trainers, fleet.engines, **kwargs)

    # -- membership ------------------------------------------------------------------------
    @property
    def membership(self) -> RefitMembership | None:
        """What the live communicator was built over; None before the first build."""
        return self._built

    @property
    def epoch(self) -> int:
        """The build the live communicator belongs to; every ``refit_*`` call of a transfer names it."""
        return self._epoch

    @property
    def trainer_workers(self) -> list[Any]:
        """The trainer ranks' worker handles, in trainer-rank order (whatever the build)."""
        return list(self._trainers)

    @property
    def engine_workers(self) -> list[list[Any]]:
        """Every generation shard's worker handles, in shard and worker order (whatever the build)."""
        return [list(shard) for shard in self._engines]

    @property
    def workers(self) -> dict[int, Any]:
        """The live build's worker handles by communicator rank, trainers first.

        For tools that drive the same plan in the same workers without the control plane
        around it: ``refit bench --path sync`` times the bare transport this way.
        """
        return {m.rank: m.worker for m in self._members}

    def _desired(self, absent: Sequence[int]) -> RefitMembership:
        mixed = len(set(self.shard_sizes)) > 1
        return desired_membership(absent_shards=sorted(absent), dp_size=self.dp_size,
                                  total_gen_workers=sum(self.shard_sizes), train_world_size=self.train_world_size,
                                  shard_sizes=self.shard_sizes if mixed else None)

    def _members_of(self, membership: RefitMembership) -> list[_Member]:
        out = [_Member(r, w, f"trainer rank {r}") for r, w in enumerate(self._trainers)]
        for shard, prefix in membership.shard_prefixes.items():
            for w, worker in enumerate(self._engines[shard]):
                rank = membership.train_world_size + prefix + w
                out.append(_Member(rank, worker, f"shard {shard} worker {w}", shard, rank - w))
        return out

    def _dead_shards_now(self) -> list[int]:
        """Shards with a worker known dead, from the handles alone (no call into the workers), and the quarantined."""
        dead_trainers = [r for r, w in enumerate(self._trainers) if w.is_dead()]
        if dead_trainers:
            raise RefitWorkerError(
                f"trainer rank(s) {dead_trainers} are dead; trainers are never excluded from the refit "
                "communicator, so there is nothing to refit from", phase="check",
                died=[f"trainer rank {r}" for r in dead_trainers])
        return sorted({s for s, ws in enumerate(self._engines) if any(w.is_dead() for w in ws)} | self._quarantined)

    @property
    def quarantined_shards(self) -> list[int]:
        """Shards left out because their engine failed to take verified weights; ``replace_shard`` ends it."""
        return sorted(self._quarantined)

    def _probe(self, shards: Sequence[int] | None = None) -> tuple[list[_Member], list[_Member]]:
        """Ping the trainers and the workers of ``shards`` (default: all): (the dead, the alive that did not answer).

        Dead means the handle says so, or the ping failed because the process is gone.
        A ping that times out is not death: a stopped process keeps its actor alive.
        Recovery probes only the shards of the round that failed: a shard already left out
        (dead before, or quarantined) is no news, and counting it as newly absent rebuilt
        the very membership that had just failed.
        """
        workers = [_Member(r, w, f"trainer rank {r}") for r, w in enumerate(self._trainers)]
        workers += [_Member(-1, w, f"shard {s} worker {i}", s)
                    for s, ws in enumerate(self._engines) for i, w in enumerate(ws)
                    if shards is None or s in shards]
        dead = [m for m in workers if m.worker.is_dead()]
        pings = self._request_all([m for m in workers if m not in dead], Ping())
        settle_before_propagating(list(pings.values()), self.ping_timeout_s, "liveness probe")
        silent = []
        for m, p in pings.items():
            if not p.done():
                (dead if m.worker.is_dead() else silent).append(m)
                continue
            try:
                p.result(0)
            except WorkerDied:
                dead.append(m)
            except Exception:  # it answered, with an error: alive
                pass
        return dead, silent

    # -- rounds of calls -----------------------------------------------------------------------
    def settle_budget_s(self) -> float:
        """How long to let stragglers unwind: their own deadline, plus a little.

        A rank that has not given up yet will when its watchdog fires, at the same
        refit_timeout_s every rank was armed with. Without a deadline nothing bounds
        them, so fall back to a fixed wait rather than blocking recovery for ever.
        """
        if self.refit_timeout_s is None:
            return NO_DEADLINE_SETTLE_S
        return self.refit_timeout_s + self.grace_s

    def _round_timeout_s(self) -> float:
        return (self.refit_timeout_s or NO_DEADLINE_ROUND_S) + self.grace_s

    def _cap_wait(self, seconds: float | None) -> float | None:
        """``seconds``, cut during recovery to what is left before the sync's hard end."""
        cap = None if self._limits is None else self._limits.wait_s()
        if cap is None:
            return seconds
        return cap if seconds is None else min(seconds, cap)

    def _cap_worker(self, seconds: float | None) -> float | None:
        """A worker's own deadline, cut during recovery to what is left before the hard end less
        the grace, so that the controller's wait on it ends by the hard end. With nothing left,
        the sync is out of time: ``RecoveryDeadlineExceeded``."""
        left = None if self._limits is None else self._limits.worker_s()
        if left is None:
            return seconds
        if left <= 0:
            raise self._deadline_error()
        return left if seconds is None else min(seconds, left)

    def _round(self, phase: str, calls: dict[_Member, Any], timeout_s: float | None,
               stragglers_s: float | None = None) -> dict[_Member, Any]:
        """Wait for every call; at the first failure (or the timeout) settle the rest, then raise.

        ``stragglers_s`` is the deadline the workers themselves give up at in this phase
        (the refit deadline, or the rendezvous timeout for ``connect``). Every answer that
        arrived by the end of the settle counts: when they all arrived and none failed (the
        controller itself was stopped or starved while they came in), the round succeeded.
        """
        results: dict[_Member, Any] = {}
        pending = dict(calls)
        timeout_s = self._cap_wait(timeout_s)
        dispatched = time.monotonic()
        last: tuple[float, str] = (0.0, "")  # the slowest member so far, for the sync's events
        deadline = None if timeout_s is None else dispatched + timeout_s
        failures: dict[str, str] = {}
        errors: dict[str, BaseException] = {}
        kinds: dict[str, FailureKind] = {}
        died: list[str] = []
        stalled = 0.0  # how much longer than asked the controller's own waits took

        def collect(ready: Sequence[_Member]) -> None:
            nonlocal last
            for m in ready:
                p = pending.pop(m)
                last = (time.monotonic() - dispatched, m.label)
                try:
                    results[m] = p.result(0)
                except Exception as e:  # reported below with the worker's name
                    errors[m.label] = e
                    if isinstance(e, WorkerDied):
                        died.append(m.label)
                    elif (kind := _kind(e)) is not None:
                        kinds[m.label] = kind
                    failures[m.label] = brief(e)

        while pending and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            asked = time.monotonic()
            done = wait_any(list(pending.values()), left)
            if left is not None:
                stalled = max(stalled, time.monotonic() - asked - left - _STALL_SLACK_S)
            if not done:
                break
            collect([m for m, p in pending.items() if p in done])
        timed_out: list[str] = []
        if pending:
            # The stragglers were armed when this round was dispatched, so their own deadline
            # (plus the grace) is counted from then: a rank frozen for good is waited for
            # until every live rank must have given up, not for a whole budget after that.
            budget = self.settle_budget_s()
            if stragglers_s is not None:
                budget = stragglers_s + self.grace_s
            budget = self._cap_wait(min(budget, max(self.grace_s, dispatched + budget - time.monotonic())))
            settle_before_propagating(list(pending.values()), budget, phase)
            collect([m for m, p in pending.items() if p.done() and not m.worker.is_dead()])
            # a member whose process is gone is dead, not late: name it as such, so the
            # error blames the worker that died rather than every one still waiting for it
            for m, p in pending.items():
                if m.label not in failures and (m.worker.is_dead() or (p.done() and _died(p))):
                    died.append(m.label)
                    failures[m.label] = f"WorkerDied: {m.label} died"
            # what is still pending here did not answer (an answer landing after the collect is
            # as late as one that never came: the round is decided on what it had)
            timed_out = [m.label for m in pending if m.label not in failures]
            self._abandoned += [p for p in pending.values() if not p.done()]
            if not failures and not timed_out:
                if self._rec is not None:
                    self._rec.note("round", f"{phase}: every answer arrived by the end of the settle"
                                            + (f" (the controller stalled {stalled:.1f}s)" if stalled > 0 else ""))
                return results
        elif not failures:
            if self._rec is not None:
                self._rec.note("round", f"{phase}: {len(results)} worker(s) in {last[0]:.3f}s, "
                                        f"the last {last[1]}"
                                        + (f" (the controller stalled {stalled:.1f}s)" if stalled > 0 else ""))
            return results
        if self._limits is not None:
            self._limits.lose(died)
        tampered = [label for label, kind in kinds.items() if kind is FailureKind.TAMPERED]
        if tampered:
            label = tampered[0]
            details = errors[label].details
            raise RefitTampered(
                f"refit {phase}: the rendezvous was tampered with: {label} read a value of key {details.get('key')!r} "
                f"that no rank of this build wrote ({failures[label]}); nothing was excluded, and the next sync "
                "rebuilds with a fresh secret, nonce and port", key=details.get("key"), rank=details.get("rank"),
                seen_by=label, phase=phase, failures=failures, timed_out=timed_out, died=died)
        late = [label for label, kind in kinds.items() if kind is FailureKind.LATE]
        # a death leads the message: the workers that failed beside it were waiting for it, and
        # when both land in one wait the order of the members would blame a survivor first
        first = next(((label, failures[label]) for label in died if label in failures),
                     next(((label, failures[label]) for label in failures if label not in late),
                          next(iter(failures.items()), None)))
        if first is not None:
            msg = f"refit {phase} failed on {first[0]}: {first[1]}"
            if len(failures) > 1:
                msg += f" (and on {len(failures) - 1} other worker(s))"
        else:
            msg = f"refit {phase}: {', '.join(timed_out)} did not answer within {timeout_s:.1f}s"
        if timed_out and first is not None:
            msg += f"; still running after the settle: {', '.join(timed_out)}"
        if late:
            msg += f"; late (started the call past its deadline, abandoned it): {', '.join(late)}"
        if stalled > 0:
            msg += (f"; the controller itself stalled {stalled:.1f}s while it waited (stopped or starved), so "
                    "workers may have answered in time")
        error = RefitWorkerError(msg, phase=phase, failures=failures, timed_out=timed_out, died=died, kinds=kinds)
        error.controller_stalled_s = max(stalled, 0.0)
        error.late = late
        raise error

    def _request_all(self, members: Sequence[_Member], call: EndpointCall) -> dict[_Member, Any]:
        return self._request_each({m: call for m in members})

    @staticmethod
    def _request_each(calls: Mapping[_Member, EndpointCall]) -> dict[_Member, Any]:
        """Each member's call; an engine whose workers are reached together gets its share as one message."""
        sent = send_requests({m.worker: call for m, call in calls.items()})
        return {m: sent[m.worker] for m in calls}

    def _share(self, obj: Any) -> Any:
        """Put a large argument where every worker can fetch it once (Ray's object store)."""
        put = getattr(type(self._trainers[0]), "put", None)
        return put(obj) if put is not None else obj

    # -- build --------------------------------------------------------------------------------
    def init_communicator(self) -> None:
        """Build the communicator and the plan over the whole fleet."""
        self._check_open()
        self._build(self._desired([]))

    def _build(self, membership: RefitMembership) -> None:
        """Build everything a transfer needs, for the given membership.

        Shared by the first build and every rebuild, deliberately: the communicator ranks,
        the engines' mesh offsets and the plan are all functions of the membership, and two
        copies of that arithmetic is how a communicator and a plan come to disagree. That
        disagreement is silent (a plan for the old world still runs, into the wrong
        slices), which is also why the plan is rebuilt and never reused. And every normal
        run exercises the rebuild path.
        """
        self._broken = True  # until this build completes
        self._attempted = membership
        self._epoch += 1
        epoch = self._epoch
        members = self._members_of(membership)
        if self._limits is not None:
            self._limits.seen.update({m.label: m.worker for m in members})
        timeout = self._round_timeout_s()
        connect_s = self._cap_worker(self.connect_timeout_s)
        root = members[0]
        devices = self._devices_of(members, timeout) if self._transport.needs_devices else None
        choice = choose_transport(self._transport, None if devices is None else {m.rank: d for m, d in devices.items()},
                                  {m.rank: m.label for m in members})
        addr, port = self._round("rendezvous", {root: root.worker.request(Rendezvous())}, timeout)[root]
        secret, nonce = new_secret(), secrets.token_bytes(16)
        sent_at = time.time()
        specs = {m.rank: ConnectSpec(addr, port, m.rank, membership.world_size, epoch, connect_s,
                                     mesh_offset=m.first_rank,
                                     mesh_size=None if m.shard is None else membership.shard_size(m.shard),
                                     label=m.label, backend=choice.backend, secret=secret, sent_at=sent_at, nonce=nonce)
                 for m in members}
        by_rank = {m.rank: m for m in members}

        def run(calls: Mapping[int, EndpointCall], phase: str) -> dict[int, Any]:
            # a connect waits out the rendezvous on every worker: the stragglers' own deadline
            limit, stragglers = (timeout + connect_s, connect_s) if phase == "connect" else (timeout, None)
            replies = self._round(phase, self._request_each({by_rank[r]: c for r, c in calls.items()}), limit,
                                  stragglers_s=stragglers)
            return {m.rank: reply for m, reply in replies.items()}

        options = PlanOptions(mode=self.mode, bucket_bytes=self.bucket_bytes, transport=choice)
        built = connect_and_prepare(run, specs, options, labels={m.rank: m.label for m in members},
                                    check_index=lambda index: self._check_coverage(index, members), share=self._share)
        # what each bucket carries only changes with the plan: kept for the verification reports
        self._bucket_params = dict(built.prepared)
        if choice.one_sided:
            # every rank registers (NIXL) or exports (IPC) its memory for the new plan; the
            # controller relays the roster: new peers are loaded or mapped point to point
            entries = self._round(f"{self.transport} handshake", self._request_all(members, PeerEntry(epoch)),
                                  timeout)
            roster = self._share({e.rank: e for e in entries.values()})
            self._round(f"{self.transport} membership",
                        self._request_all(members, PeerMembership(roster, epoch)), timeout)
        self._built, self._members = membership, members
        self._initialized, self._broken = True, False

    def _devices_of(self, members: Sequence[_Member], timeout: float) -> dict[_Member, dict]:
        """Every member's ``refit_device()``; a worker's device does not change while its
        process lives, so each worker is asked once."""
        unknown = [m for m in members if id(m.worker) not in self._devices]
        if unknown:
            for m, d in self._round("devices", self._request_all(unknown, Device()), timeout).items():
                self._devices[id(m.worker)] = (m.worker, d)  # the handle is held: its id stays its own
        return {m: self._devices[id(m.worker)][1] for m in members}

    def _check_coverage(self, index, members: Sequence[_Member]) -> None:
        """Every engine rank must need something, or its shard would silently receive nothing."""
        idle = [m.label for m in members if m.shard is not None and not index.by_rank.get(m.rank)]
        if idle:
            raise PlanError(f"{', '.join(idle)} reported no destination tensors; an engine worker must "
                            "expose what it serves through refit_destinations()")

    def reconcile_communicator(self, absent_shards: Sequence[int], force: bool = False) -> bool:
        """Rebuild the communicator AND regenerate the plan over the shards not absent.

        The plan is never reused across a membership change. This is a mesh-to-mesh
        redistribute: every destination rank receives its own slices, so dropping a shard
        without replanning would leave the survivors' meshes offset by the dead shard's
        ranks, and a rank that rejoins would receive nothing. Returns whether it rebuilt.

        ``force`` says the communicator is gone rather than merely stale (after an abort);
        it only rebuilds when some shard IS absent (see ``should_rebuild``).

        Raises:
            NoSurvivingShards: every shard is absent.
        """
        self._check_open()
        absent = sorted(set(absent_shards))
        desired = self._desired(absent)
        if not should_rebuild(desired=desired, built=self._built, absent_shards=absent, force=force):
            return False
        self._build(desired)
        return True

    @property
    def is_stale(self) -> bool:
        """Whether the next sync has to rebuild first: never built, broken, or membership changed."""
        if not self._initialized or self._broken:
            return True
        absent = self._dead_shards_now()
        try:
            return should_rebuild(desired=self._desired(absent), built=self._built, absent_shards=absent, force=False)
        except NoSurvivingShards:
            return True

    def replace_shard(self, shard: int, workers: Sequence[Any]) -> None:
        """Hand in the restarted workers of ``shard``; the next sync re-admits it.

        The old workers' communicators are aborted (best effort: they are usually dead).
        """
        self._check_open()
        if not 0 <= shard < self.dp_size:
            raise RefitError(f"replace_shard: unknown shard {shard}; shards are 0..{self.dp_size - 1}")
        if len(workers) != self.shard_sizes[shard]:
            raise RefitError(f"replace_shard: shard {shard} needs {self.shard_sizes[shard]} worker(s), "
                             f"got {len(workers)}")
        old = self._engines[shard]
        self._engines[shard] = [as_worker(h, f"shard {shard} worker {w}") for w, h in enumerate(workers)]
        self._quarantined.discard(shard)
        if self._built is not None and shard in self._built.shard_prefixes:
            # The live communicator has ranks of the old workers: the membership may read the
            # same, but those ranks are gone, so the next sync must rebuild.
            self._broken = True
        live = list(send_requests({w: Teardown() for w in old if not w.is_dead()}).values())
        settle_before_propagating(live, self.ping_timeout_s, f"teardown of the old shard {shard}")

    # -- sync --------------------------------------------------------------------------------
    def sync_weights(self, version: int | None = None, *, strict_casts: bool = False) -> SyncResult:
        """Move the weights, verify them, tell the engines; recover from lost shards.

        A transfer (or rebuild, or commit) that loses engine workers is settled, their shards
        are excluded, the communicator and plan are rebuilt over the survivors and the
        transfer is retried; a retry that loses more workers recovers again, each round
        excluding at least one more shard. The limits, from the sync's start ``t0``, with
        ``T = refit_timeout_s`` and the settle budget ``S = settle_budget_s()``:

        * the first recovery round always begins (a loss inside a rebuild holds the
          survivors in its rendezvous for the connect timeout, often all of ``T``);
        * a further round begins only before ``t0 + T``;
        * every step of recovery ends by ``t0 + T + S``: a retried transfer's watchdog and a
          rebuild's rendezvous get at most what is left of it less ``grace_s``, and the
          controller waits on no round past it.

        So a sync that raises does so by ``t0 + T + S``, whatever the number of losses; only a
        first failure that itself came late can add the first round's liveness probe (up to
        ``ping_timeout_s``, while some worker does not answer), which diagnoses it (a frozen
        worker: ``NoAbsentShard``). A sync whose first attempt ran past ``t0 + T + S - grace_s``
        raises without rebuilding. ``T = None`` lifts the limits: the shard count alone bounds recovery.

        The engines' weights become ``version`` (``SyncResult.version``): by default one more
        than the newest any engine or this synchronizer has seen, so versions only grow, also
        across synchronizers over the same engines; a trainer may pass its step instead (a
        ``version`` below that default is raised to it: an engine's version never goes back).

        Casts (``docs/architecture.md``): a trainer value beyond the range of its engine's
        narrower dtype (it would land as inf, NaN, clamped or wrapped) is listed in
        ``SyncResult.cast_overflows`` with a ``CastOverflowWarning``; ``strict_casts`` asks the
        trainers before the transfer instead and raises ``PlanError`` naming them, before any
        byte moves.

        Raises:
            RefitRefused: a worker refused its layouts or its tensors (one changed shape since the
                build, say): named, with its own error, not the peers that failed because of it.
            PlanError: the rosters do not merge (a lossy cast included: complex to real, floating
                point to integer), or, with ``strict_casts``, a value does not fit its destination.
            RefitVerificationError: bytes arrived corrupted (names the shards and params).
            NoAbsentShard: a worker failed or froze but none is dead, so nothing can be excluded.
            NoSurvivingShards: every generation shard is gone (``EveryShardLost`` when this sync
                lost the last of them).
            RecoveryDeadlineExceeded: workers kept dying until the limits above ran out.
            RefitWorkerError: a trainer is gone (at once: trainers are never excluded).

        Every error raised after a loss names every worker the sync lost (in its message and
        ``died``), not only the last round's: each is a shard to replace.
        """
        self._check_open()
        if not isinstance(strict_casts, bool):
            raise RefitError(f"strict_casts must be True or False, got {strict_casts!r}")
        self._steps += 1
        self._next_version = version
        self._strict_casts = strict_casts
        rec = self._rec = Recorder(self._steps, self.on_phase)
        try:
            result = self._sync(rec)
        except RefitError as e:
            self._name_inconsistent(e)
            raise
        finally:
            self._rec = None
        if result.recovered:  # a shard left out after its transfer started may hold torn weights
            result.inconsistent = self.inconsistent_workers()
        return result

    def _sync(self, rec: Recorder) -> SyncResult:
        settle = self.settle_budget_s()
        deadline = None if self.refit_timeout_s is None else rec.t0 + self.refit_timeout_s
        self._limits = _Limits(deadline, None if deadline is None else deadline + settle, self.grace_s)
        try:
            try:
                self._attempt(rec)
            except RefitWorkerError as failure:
                if isinstance(failure, (NoAbsentShard, RefitTampered)) or failure.phase == "check":
                    raise
                _raise_if_refused(failure)
                failed_at = rec.now()
                rec.result.failure = str(failure)
                self._recover_and_retry(failure, rec)
                rec.result.recovered = True
                rec.result.recovery_s = rec.now() - failed_at
            rec.result.lost = self._lost()
            rec.result.seconds = rec.now()
            return rec.result
        except RefitError as e:
            named = self._name_lost(e)
            if named is e:
                raise
            raise named from e
        finally:
            self._limits = None

    def _recover_and_retry(self, failure: RefitWorkerError, rec: Recorder) -> None:
        """Exclude the dead, rebuild over the rest and retry the transfer, until one verifies.

        Every round excludes at least one more shard (``_absent_after`` raises
        ``NoAbsentShard`` when a failed round lost no one), so there are at most as many
        rounds as shards: losing the last one raises ``NoSurvivingShards``. The time limits
        are ``_Limits``' and are checked before each rebuild.
        """
        limits = self._limits
        limits.recovering = True
        for _ in range(self.dp_size + 1):
            limits.last = failure
            limits.rounds += 1
            rec.note("failure", str(failure))
            self._broken = True
            with rec.phase("recover", f"round {limits.rounds}"):
                self._recover(failure, rec)
            try:
                self._attempt(rec)
            except RefitWorkerError as again:
                if isinstance(again, _NOT_RECOVERABLE) or again.phase == "check":
                    raise
                _raise_if_refused(again)
                failure = again
                continue
            rec.result.recoveries = limits.rounds
            return
        raise RefitWorkerError(f"gave up after {limits.rounds} recovery rounds, each over fewer shards: {failure}",
                               phase=failure.phase, failures=failure.failures, timed_out=failure.timed_out,
                               died=failure.died) from failure

    def _lost(self) -> list[str]:
        """Every worker the sync in progress lost: named by a failed round or a probe, or built
        over in this sync and now dead by its handle (a death no round has seen yet)."""
        limits = self._limits
        if limits is None:
            return []
        limits.lose([label for label, w in limits.seen.items() if w.is_dead()])
        return list(limits.lost)

    def _deadline_error(self) -> RecoveryDeadlineExceeded:
        limits = self._limits
        last = limits.last
        lost = self._lost()
        return RecoveryDeadlineExceeded(
            f"refit gave up recovering after {limits.rounds} round(s): its deadline passed (no further recovery "
            f"round begins later than {self.refit_timeout_s:g}s after the start of the sync, and every step ends "
            f"within the {self.settle_budget_s():g}s settle budget after that); lost in this sync: "
            f"{', '.join(lost) or 'no one found dead'}; the last failure: {last}",
            phase=last.phase if last is not None else "recover",
            failures=last.failures if last is not None else None,
            timed_out=last.timed_out if last is not None else (), died=lost)

    def _name_lost(self, error: RefitError) -> RefitError:
        """``error``, naming every worker the sync lost (message and ``died``): a failure of a
        later round would otherwise name only its own dead, and the caller would replace too few
        shards. A ``NoSurvivingShards`` after losses becomes ``EveryShardLost``, which carries them."""
        lost = self._lost()
        if not lost:
            return error
        if isinstance(error, NoSurvivingShards) and not isinstance(error, RefitWorkerError):
            last = self._limits.last
            return EveryShardLost(f"{error}; lost in this sync: {', '.join(lost)}",
                                  phase=last.phase if last is not None else "check",
                                  failures=last.failures if last is not None else None, died=lost)
        if isinstance(error, RefitWorkerError):
            error.died = [*lost, *(d for d in error.died if d not in lost)]
        text = str(error)
        if error.args and any(label not in text for label in lost):
            error.args = (f"{error.args[0]}; lost in this sync: {', '.join(lost)}", *error.args[1:])
        return error

    def _drain_abandoned(self) -> None:
        still = []
        for p in self._abandoned:
            if p.done():
                with contextlib.suppress(BaseException):
                    p.result(0)
            else:
                still.append(p)
        self._abandoned = still

    def _attempt(self, rec: Recorder) -> None:
        self._drain_abandoned()
        with rec.phase("check"):
            absent = self._dead_shards_now()
            desired = self._desired(absent)
        if (not self._initialized or self._broken
                or should_rebuild(desired=desired, built=self._built, absent_shards=absent, force=False)):
            with rec.phase("build", f"shards {desired.surviving_shards}"):
                self._build(desired)
            rec.result.rebuilt = True
        members = self._members
        engines = [m for m in members if m.shard is not None]
        if self._limits is not None:
            self._limits.seen.update({m.label: m.worker for m in members})
        if self._strict_casts:
            with rec.phase("casts"):
                self._refuse_overflows([m for m in members if m.shard is None])
        self._suspects.update({id(m.worker): m.worker for m in engines})  # before a byte can land
        with rec.phase("transfer"):
            t0 = time.monotonic()
            try:
                watchdog = self._cap_worker(self.refit_timeout_s)
                transfer = Transfer(self._epoch, timeout_s=watchdog, verify=self.verify, sent_at=time.time())
                reports = self._round("transfer", self._request_all(members, transfer),
                                      None if watchdog is None else watchdog + self.grace_s, stragglers_s=watchdog)
            except RefitWorkerError:
                self._broken = True
                raise
            transfer_s = time.monotonic() - t0
        res = rec.result
        res.shards = list(self._built.surviving_shards)
        res.absent_shards = [s for s in range(self.dp_size) if s not in self._built.shard_prefixes]
        res.world_size = self._built.world_size
        res.transfer_s = transfer_s
        res.bytes = sum(r.bytes_received for r in reports.values())
        res.gbps = res.bytes / transfer_s / 1e9 if transfer_s > 0 else 0.0
        res.cast_overflows = [f"{m.label}: {line}" for m, r in reports.items() for line in r.cast_overflows]
        for line in res.cast_overflows:
            warnings.warn(line, CastOverflowWarning, stacklevel=4)
        if self.verify:
            with rec.phase("verify"):
                self._verify(reports)
            res.verified = True
        with rec.phase("commit"):
            # Two phases, so that a shard never serves a mix and the fleet never splits over a
            # refit: no worker switches before every worker of every shard has said its verified
            # transfer waits whole (staged engines keep serving version N until then). If one
            # cannot (it died, its staging did not land), none switches: all stay on N, and
            # recovery retries over the survivors, who then switch together.
            prepared = self._round("prepare commit", self._request_all(engines, PrepareCommit(self._epoch)),
                                   self._round_timeout_s())
            served = [r.version for r in prepared.values()]
            version = max([self.weights_version, *(v for v in served if v is not None)]) + 1
            if self._next_version is not None:
                version = max(version, self._next_version)
            self._round("commit", self._request_all(engines, Commit(self._epoch, version=version)),
                        self._round_timeout_s())
        self.weights_version = res.version = version
        self._next_version = None
        for m in engines:
            self._suspects.pop(id(m.worker), None)

    def _refuse_overflows(self, trainers: Sequence[_Member]) -> None:
        """``strict_casts``: ask every trainer for its values beyond their destination's range, and
        raise ``PlanError`` naming them before the transfer, which would only report them."""
        found = self._round("cast check", self._request_all(trainers, CastOverflows(self._epoch)),
                            self._round_timeout_s())
        lines = [f"{m.label}: {line}" for m, got in found.items() for line in got]
        if lines:
            raise PlanError("strict_casts: trainer values do not fit their engines' dtype, so nothing was moved: "
                            + "; ".join(lines))

    def _recover(self, failure: RefitWorkerError, rec: Recorder) -> None:
        """The failed round is already settled: find the dead, exclude their shards, rebuild.

        A death during the rebuild itself (a worker killed in the rendezvous) is handled as
        one during a transfer: its shard is excluded too and the build retried over the
        rest, rather than the rebuild's failure blaming every worker that waited for the
        dead one. Every retry excludes at least one more shard (else ``NoAbsentShard``), so
        there are at most as many as there are shards. No rebuild begins past the sync's
        limits (``_Limits.may_start``). In the first round the dead are probed for first, so
        that a late first failure is still diagnosed (a frozen worker: ``NoAbsentShard``);
        later rounds past the limits raise at once, naming the dead their rounds saw and
        those whose handles say so.
        """
        limits = self._limits
        for _ in range(self.dp_size + 1):
            if limits is not None and limits.rounds > 1 and not limits.may_start():
                # no probe: its answer cannot start a rebuild now, and workers still unwinding
                # from the failed round would hold it for the whole ping timeout past the limit
                raise self._deadline_error() from failure
            absent = self._absent_after(failure, rec)
            rec.note("absent", f"shards {absent}")
            if limits is not None and not limits.may_start():
                raise self._deadline_error() from failure
            try:
                rec.result.rebuilt = self.reconcile_communicator(absent, force=True) or rec.result.rebuilt
                return
            except RefitWorkerError as again:
                if isinstance(again, _NOT_RECOVERABLE) or again.phase == "check":
                    raise
                _raise_if_refused(again)
                rec.note("failure", f"rebuild over shards {self._attempted.surviving_shards}: {again}")
                failure = again
                if limits is not None:
                    limits.last = again
        raise RefitWorkerError(f"gave up recovering after {self.dp_size + 1} rebuilds: {failure}",
                               phase=failure.phase, failures=failure.failures, timed_out=failure.timed_out,
                               died=failure.died) from failure

    def _absent_after(self, failure: RefitWorkerError, rec: Recorder) -> list[int]:
        """The shards to leave out after ``failure``: those already out, and those of its round now dead.

        Only a shard of the failed round that is now dead (or could not take its weights)
        counts as news. With none, nothing can be excluded, and a rebuild over the same
        members would fail as this round did: ``NoAbsentShard``, naming the silent workers.
        """
        attempted = self._attempted
        in_round = set(range(self.dp_size)) if attempted is None else set(attempted.shard_prefixes)
        dead, silent = self._probe(sorted(in_round))
        rec.note("probe", f"dead={[m.label for m in dead]} unresponsive={[m.label for m in silent]}")
        if self._limits is not None:
            self._limits.lose([m.label for m in dead])
        dead_trainers = [m.label for m in dead if m.shard is None]
        if dead_trainers:
            raise RefitWorkerError(
                f"{', '.join(dead_trainers)} died during the refit ({failure}); trainers are never excluded "
                "from the refit communicator, so the fleet cannot recover here", phase=failure.phase,
                failures=failure.failures, died=[m.label for m in dead]) from failure
        newly = {m.shard for m in dead}
        if failure.phase == "commit":
            # The bytes arrived and were verified, but the engine could not take them (its load
            # failed): its workers answer, yet it cannot be trusted with this or any later refit
            # until it is replaced. Leave it out, so the others get their weights.
            shard_of = {m.label: m.shard for m in self._members if m.shard is not None}
            failed = {shard_of[label] for label in failure.failures if label in shard_of} & in_round
            if failed:
                self._quarantined |= failed
                rec.note("quarantine", f"shards {sorted(failed)}: commit failed; left out until replace_shard")
            newly |= failed
        if not newly:
            silent_labels = {m.label for m in silent}
            late = list(dict.fromkeys([*failure.late, *(t for t in failure.timed_out if t not in silent_labels)]))
            stalled = (f" The controller itself stalled {failure.controller_stalled_s:.1f}s while it waited "
                       "(stopped or starved)." if failure.controller_stalled_s > 0 else "")
            if late and not silent:
                raise WorkersLate(
                    f"refit {failure.phase} failed ({failure}): {', '.join(late)} answered late, past the round's "
                    f"deadline, and answer now: late (busy with an earlier call, or slow to start), not dead or "
                    f"frozen.{stalled} Nothing was excluded; the next sync rebuilds with them.", late=late,
                    phase=failure.phase, failures=failure.failures, timed_out=failure.timed_out) from failure
            names = ", ".join(m.label for m in silent)
            hint = (f" {names} did not answer a liveness ping within {self.ping_timeout_s:g}s: frozen or wedged, "
                    "but alive, so it cannot be excluded." if silent else
                    " Every worker answers, so the failure is not a lost engine.") + stalled
            raise NoAbsentShard(
                f"refit {failure.phase} failed ({failure}) and no generation shard could be identified as "
                f"absent.{hint} Nothing was rebuilt; fix or restart that worker (then replace_shard) and sync again.",
                phase=failure.phase, failures=failure.failures, timed_out=[m.label for m in silent]) from failure
        return sorted((set(range(self.dp_size)) - in_round) | newly | set(self._dead_shards_now()))

    def inconsistent_workers(self, timeout_s: float | None = None, *, silent: Sequence[str] = ()) -> list[str]:
        """Engine workers whose live weights are torn: a refit wrote into them and did not complete.

        Every live engine worker is asked (``refit_weights_state``): its own record is the one
        that holds when a controller or a peer died mid-transfer. A worker that does not answer
        within ``timeout_s`` (the ping timeout by default), frozen say, is counted when this
        controller sent it a transfer that was never committed. The dead are left out: they
        serve nothing. Such workers refuse to serve until a refit completes. Workers named in
        ``silent`` (already found unresponsive) are judged the same way without being asked, so
        a frozen worker does not cost a failing refit another timeout.
        """
        timeout = self.ping_timeout_s if timeout_s is None else timeout_s
        # every worker is asked at once: an engine that reaches its workers together gets one message
        workers = {f"shard {s} worker {i}": w for s, ws in enumerate(self._engines) for i, w in enumerate(ws)
                   if not w.is_dead()}
        sent: dict[Any, Any] = {}
        with contextlib.suppress(Exception):  # judged below by what it was sent
            sent = send_requests({w: WeightsState() for label, w in workers.items() if label not in silent})
        asked = {label: (w, sent.get(w)) for label, w in workers.items()}
        settle_before_propagating([p for _, p in asked.values() if p is not None], timeout, "weights state")
        torn = []
        for label, (w, p) in asked.items():
            if w.is_dead():
                continue
            try:
                if p is None:
                    raise RefitError("not asked")
                if not p.done():
                    self._abandoned.append(p)
                    raise TimeoutError
                consistent = p.result(0).get("consistent", True)
            except Exception:  # silent, or an endpoint that cannot say: judged by what it was sent
                consistent = id(w) not in self._suspects
            if consistent:
                self._suspects.pop(id(w), None)
            else:
                torn.append(label)
        return torn

    def _name_inconsistent(self, error: RefitError) -> None:
        """Name in a failed refit's error every engine worker it left torn, not only the one that failed."""
        try:
            torn = self.inconsistent_workers(silent=getattr(error, "timed_out", None) or ())
        except Exception:  # the refit's own error is the one to raise
            return
        error.inconsistent = torn
        if torn and error.args:
            error.args = (f"{error.args[0]}; engine weights now inconsistent on: {', '.join(torn)} "
                          "(they refuse to serve until a refit completes)", *error.args[1:])

    def _verify(self, reports: Mapping[_Member, TransferReport]) -> None:
        labels = {m.rank: (m.label, m.shard) for m in self._members}
        params = self._bucket_params
        verify_checksums({m.rank: RankChecksums(r.sent, r.received, params[m.rank].send_params,
                                                params[m.rank].recv_params) for m, r in reports.items()}, labels)

    # -- teardown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Abort every worker's refit communicator (bounded, errors swallowed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        calls = list(send_requests({w: Teardown() for w in [*self._trainers, *(w for s in self._engines for w in s)]
                                    if not w.is_dead()}).values())
        settle_before_propagating(calls, self.ping_timeout_s + self.grace_s, "shutdown")
        self._drain_abandoned()
        for w in [*self._trainers, *(w for s in self._engines for w in s)]:
            if isinstance(w, LocalWorker):
                w.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RefitError(f"{type(self).__name__} was shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class ReshardWeightSynchronizer(_SynchronizerBase):
    """Shard-to-shard refit: every destination block comes straight from one source shard.

    No full gather on the trainer and no full broadcast: each rank builds its own
    send/recv plan from the merged rosters (``refit.plan.roster.merge_rosters``, then
    ``refit.plan.rank_plan.build_rank_plan``) and the packed buckets move point to point.
    See ``_SynchronizerBase`` for the arguments.
    """

    mode = "reshard"


class CollectiveWeightSynchronizer(_SynchronizerBase):
    """The baseline: every source shard is broadcast to every rank, which keeps its slice.

    What a plain refit does (gather each full tensor, broadcast it to every engine rank);
    kept for comparison and as a fallback. Same lifecycle, recovery and verification as
    ``ReshardWeightSynchronizer``.
    """

    mode = "broadcast"


# failures that a rebuild over fewer shards cannot fix: raised as they are
_NOT_RECOVERABLE = (NoAbsentShard, RecoveryDeadlineExceeded, RefitTampered)


def _check_settings(*, refit_timeout_s, ping_timeout_s, grace_s, connect_timeout_s, bucket_bytes) -> None:
    """Every time a finite number of seconds > 0 (the two deadlines may be None), and the bucket
    size a positive number of bytes: an infinite timeout was taken, and overflowed only inside a
    worker's wait, once the transfer had started on the others."""
    for name, value, optional in (("refit_timeout_s", refit_timeout_s, True), ("ping_timeout_s", ping_timeout_s, False),
                                  ("grace_s", grace_s, False), ("connect_timeout_s", connect_timeout_s, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise RefitError(f"{name} must be a finite number of seconds > 0{' or None' if optional else ''}, "
                             f"got {value!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 1:
        raise RefitError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")


def _raise_if_refused(failure: RefitWorkerError) -> None:
    """Raise ``RefitRefused`` when a connect, prepare or transfer round failed on a configuration
    error and no worker died or froze: recovering would only fail the same way.

    The workers that failed beside it (a transfer's peers, a rendezvous left behind) failed
    because of it: the refusal heads the error, rather than the peer whose failure happened to
    be seen first (a trainer whose receiver refused is not an absent shard)."""
    if (failure.phase not in ("connect", "prepare", "transfer") or failure.died or failure.timed_out
            or not failure.failures):
        return
    refused = {label: text for label, text in failure.failures.items()
               if failure.kinds.get(label) is FailureKind.REFUSED}
    if not refused:
        return
    (label, text), *others = refused.items()
    more = f" (and by {', '.join(w for w, _ in others)})" if others else ""
    moved = ("the other ranks' bytes may have landed; nothing was excluded or rebuilt, and the next sync rebuilds"
             if failure.phase == "transfer" else "nothing was moved, excluded or rebuilt")
    raise RefitRefused(f"refit {failure.phase} refused by {label}{more}: {text}. A configuration error, not a lost "
                       f"engine: {moved}", phase=failure.phase, failures=failure.failures) from failure
