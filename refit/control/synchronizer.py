"""The synchronizers: one control plane shared by the shard-to-shard path and the broadcast baseline.

The control plane is one lifecycle (build, sync, reconcile, shutdown), the
membership arithmetic of ``refit.membership``, settling stragglers before a rebuild,
verification, and recovery. The two data paths differ only in what each worker runs
during a transfer (``mode``), so everything that decides who is in the communicator and
what happens when someone leaves exists once.
"""

from __future__ import annotations

import math
import numbers
import secrets
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from refit.comm.rendezvous import new_secret
from refit.control.errors import (
    NoAbsentShard,
    RefitTampered,
    RefitWorkerError,
)
from refit.control.recovery import Recovery, raise_if_refused
from refit.control.result import Recorder, SyncResult
from refit.control.rounds import GRACE_S, NO_DEADLINE_ROUND_S, Member, RecoveryLimits, Rounds
from refit.control.settle import settle_before_propagating
from refit.control.verify import RankChecksums, verify_checksums
from refit.errors import CastOverflowWarning, PlanError, RefitError
from refit.membership import NoSurvivingShards, RefitMembership, desired_membership, should_rebuild
from refit.plan import DEFAULT_BUCKET_BYTES
from refit.runtime.build import PlanOptions, connect_and_prepare
from refit.runtime.handles import LocalWorker, send_requests
from refit.runtime.protocol import (
    CastOverflows,
    Commit,
    Device,
    EndpointCall,
    PeerEntry,
    PeerMembership,
    PrepareCommit,
    Prepared,
    Rendezvous,
    Teardown,
    Transfer,
    TransferReport,
)
from refit.runtime.shards import ConnectSpec
from refit.runtime.workers import as_worker
from refit.transport.factory import TransportRequest, choose_transport

__all__ = ["CollectiveWeightSynchronizer", "ReshardWeightSynchronizer", "WeightSynchronizer", "as_worker"]

@runtime_checkable
class WeightSynchronizer(Protocol):
    """The lifecycle every synchronizer offers: build, sync, reconcile after a loss, shut down."""

    def init_communicator(self) -> None: ...
    def sync_weights(self) -> SyncResult: ...
    @property
    def is_stale(self) -> bool: ...
    def reconcile_communicator(self, absent_shards: Sequence[int], force: bool = False) -> bool: ...
    def shutdown(self) -> None: ...


# -- the control plane ---------------------------------------------------------------------------

class _SynchronizerBase(Recovery):
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
        self._members: list[Member] = []
        self._initialized = False
        self._broken = False
        self._closed = False
        self._epoch = 0
        self._steps = 0
        # every round of calls to the workers, with the sync in progress and its recovery limits
        self._rounds = Rounds(refit_timeout_s, grace_s, deadline_error=lambda: self._deadline_error())
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

    def _members_of(self, membership: RefitMembership) -> list[Member]:
        out = [Member(r, w, f"trainer rank {r}") for r, w in enumerate(self._trainers)]
        for shard, prefix in membership.shard_prefixes.items():
            for w, worker in enumerate(self._engines[shard]):
                rank = membership.train_world_size + prefix + w
                out.append(Member(rank, worker, f"shard {shard} worker {w}", shard, rank - w))
        return out

    def settle_budget_s(self) -> float:
        """How long stragglers are let unwind before a failure is raised (``Rounds.settle_budget_s``)."""
        return self._rounds.settle_budget_s()

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
        if self._rounds.limits is not None:
            self._rounds.limits.seen.update({m.label: m.worker for m in members})
        timeout = self._rounds.round_timeout_s()
        connect_s = self._rounds.cap_worker(self.connect_timeout_s)
        root = members[0]
        devices = self._devices_of(members, timeout) if self._transport.needs_devices else None
        choice = choose_transport(self._transport, None if devices is None else {m.rank: d for m, d in devices.items()},
                                  {m.rank: m.label for m in members})
        addr, port = self._rounds.run("rendezvous", self._rounds.request_each({root: Rendezvous()}), timeout)[root]
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
            sent = self._rounds.request_each({by_rank[r]: c for r, c in calls.items()})
            replies = self._rounds.run(phase, sent, limit, stragglers_s=stragglers)
            return {m.rank: reply for m, reply in replies.items()}

        options = PlanOptions(mode=self.mode, bucket_bytes=self.bucket_bytes, transport=choice)
        prepared = connect_and_prepare(run, specs, options, labels={m.rank: m.label for m in members},
                                       check_index=lambda index: self._check_coverage(index, members),
                                       share=self._share)
        # what each bucket carries only changes with the plan: kept for the verification reports
        self._bucket_params = prepared
        if choice.one_sided:
            # every rank registers (NIXL) or exports (IPC) its memory for the new plan; the
            # controller relays the roster: new peers are loaded or mapped point to point
            entries = self._rounds.run(f"{self.transport} handshake",
                                       self._rounds.request_all(members, PeerEntry(epoch)), timeout)
            roster = self._share({e.rank: e for e in entries.values()})
            self._rounds.run(f"{self.transport} membership",
                        self._rounds.request_all(members, PeerMembership(roster, epoch)), timeout)
        self._built, self._members = membership, members
        self._initialized, self._broken = True, False

    def _devices_of(self, members: Sequence[Member], timeout: float) -> dict[Member, dict]:
        """Every member's ``refit_device()``; a worker's device does not change while its
        process lives, so each worker is asked once."""
        unknown = [m for m in members if id(m.worker) not in self._devices]
        if unknown:
            for m, d in self._rounds.run("devices", self._rounds.request_all(unknown, Device()), timeout).items():
                self._devices[id(m.worker)] = (m.worker, d)  # the handle is held: its id stays its own
        return {m: self._devices[id(m.worker)][1] for m in members}

    def _check_coverage(self, index, members: Sequence[Member]) -> None:
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
        live = send_requests({w: Teardown() for w in old if not w.is_dead()})
        settle_before_propagating([s.pending for s in live], self.ping_timeout_s, f"teardown of the old shard {shard}")

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
        rec = self._rounds.rec = Recorder(self._steps, self.on_phase)
        try:
            result = self._sync(rec)
        except RefitError as e:
            self._name_inconsistent(e)
            raise
        finally:
            self._rounds.rec = None
        if result.recovered:  # a shard left out after its transfer started may hold torn weights
            result.inconsistent = self.inconsistent_workers()
        return result

    def _sync(self, rec: Recorder) -> SyncResult:
        settle = self.settle_budget_s()
        deadline = None if self.refit_timeout_s is None else rec.t0 + self.refit_timeout_s
        self._rounds.limits = RecoveryLimits(deadline, None if deadline is None else deadline + settle, self.grace_s)
        try:
            try:
                self._attempt(rec)
            except RefitWorkerError as failure:
                if isinstance(failure, (NoAbsentShard, RefitTampered)) or failure.phase == "check":
                    raise
                raise_if_refused(failure)
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
            self._rounds.limits = None

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
        if self._rounds.limits is not None:
            self._rounds.limits.seen.update({m.label: m.worker for m in members})
        if self._strict_casts:
            with rec.phase("casts"):
                self._refuse_overflows([m for m in members if m.shard is None])
        self._suspects.update({id(m.worker): m.worker for m in engines})  # before a byte can land
        with rec.phase("transfer"):
            t0 = time.monotonic()
            try:
                watchdog = self._rounds.cap_worker(self.refit_timeout_s)
                transfer = Transfer(self._epoch, timeout_s=watchdog, verify=self.verify, sent_at=time.time())
                reports = self._rounds.run("transfer", self._rounds.request_all(members, transfer),
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
            prepared = self._rounds.run("prepare commit", self._rounds.request_all(engines, PrepareCommit(self._epoch)),
                                   self._rounds.round_timeout_s())
            served = [r.version for r in prepared.values()]
            version = max([self.weights_version, *(v for v in served if v is not None)]) + 1
            if self._next_version is not None:
                version = max(version, self._next_version)
            self._rounds.run("commit", self._rounds.request_all(engines, Commit(self._epoch, version=version)),
                        self._rounds.round_timeout_s())
        self.weights_version = res.version = version
        self._next_version = None
        for m in engines:
            self._suspects.pop(id(m.worker), None)

    def _refuse_overflows(self, trainers: Sequence[Member]) -> None:
        """``strict_casts``: ask every trainer for its values beyond their destination's range, and
        raise ``PlanError`` naming them before the transfer, which would only report them."""
        found = self._rounds.run("cast check", self._rounds.request_all(trainers, CastOverflows(self._epoch)),
                            self._rounds.round_timeout_s())
        lines = [f"{m.label}: {line}" for m, got in found.items() for line in got]
        if lines:
            raise PlanError("strict_casts: trainer values do not fit their engines' dtype, so nothing was moved: "
                            + "; ".join(lines))

    def _verify(self, reports: Mapping[Member, TransferReport]) -> None:
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
        sent = send_requests({w: Teardown() for w in [*self._trainers, *(w for s in self._engines for w in s)]
                              if not w.is_dead()})
        settle_before_propagating([s.pending for s in sent], self.ping_timeout_s + self.grace_s, "shutdown")
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
