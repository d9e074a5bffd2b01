"""Recovery: after a failed round, find who is lost, exclude their shards, rebuild, and retry.

A sync that loses workers keeps going over the survivors until its deadline: each loss
costs a probe, a rebuild over fewer shards and another transfer, and every worker the
sync lost is named in what it finally raises. A failure that a rebuild over fewer shards
cannot fix (a refusal of the configuration, a tampered rendezvous, a frozen rank that is
not dead) is raised as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from refit.control.errors import (
    EveryShardLost,
    NoAbsentShard,
    RecoveryDeadlineExceeded,
    RefitRefused,
    RefitTampered,
    RefitWorkerError,
    WorkersLate,
)
from refit.control.result import Recorder
from refit.control.rounds import Member
from refit.control.settle import settle_before_propagating
from refit.errors import RefitError
from refit.membership import NoSurvivingShards
from refit.runtime.handles import Sent, WorkerDied, send_requests
from refit.runtime.protocol import FailureKind, Ping, WeightsState

__all__ = ["Recovery", "raise_if_refused"]

_NOT_RECOVERABLE = (NoAbsentShard, RecoveryDeadlineExceeded, RefitTampered)


class Recovery:
    """The recovery half of a synchronizer (mixed into ``refit.control.synchronizer``'s base).

    It reads the synchronizer's membership (``_built``, ``_members``, ``_engines``), its
    rounds (``_rounds``, whose ``limits`` hold the sync's losses and deadline) and rebuilds
    through its ``_build``.
    """

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

    def _probe(self, shards: Sequence[int] | None = None) -> tuple[list[Member], list[Member]]:
        """Ping the trainers and the workers of ``shards`` (default: all): (the dead, the alive that did not answer).

        Dead means the handle says so, or the ping failed because the process is gone.
        A ping that times out is not death: a stopped process keeps its actor alive.
        Recovery probes only the shards of the round that failed: a shard already left out
        (dead before, or quarantined) is no news, and counting it as newly absent rebuilt
        the very membership that had just failed.
        """
        workers = [Member(r, w, f"trainer rank {r}") for r, w in enumerate(self._trainers)]
        workers += [Member(-1, w, f"shard {s} worker {i}", s)
                    for s, ws in enumerate(self._engines) for i, w in enumerate(ws)
                    if shards is None or s in shards]
        dead = [m for m in workers if m.worker.is_dead()]
        pings = self._rounds.request_all([m for m in workers if m not in dead], Ping())
        settle_before_propagating([s.pending for s in pings], self.ping_timeout_s, "liveness probe")
        silent = []
        for s in pings:
            if not s.done():
                for m in s.keys:
                    (dead if m.worker.is_dead() else silent).append(m)
                continue
            # an answer with an error is alive; a ping that failed because the process is gone is not
            dead += [o.key for o in s.outcomes() if not o.ok and isinstance(o.value, WorkerDied)]
        return dead, silent

    def _recover_and_retry(self, failure: RefitWorkerError, rec: Recorder) -> None:
        """Exclude the dead, rebuild over the rest and retry the transfer, until one verifies.

        Every round excludes at least one more shard (``_absent_after`` raises
        ``NoAbsentShard`` when a failed round lost no one), so there are at most as many
        rounds as shards: losing the last one raises ``NoSurvivingShards``. The time limits
        are ``_Limits``' and are checked before each rebuild.
        """
        limits = self._rounds.limits
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
                raise_if_refused(again)
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
        limits = self._rounds.limits
        if limits is None:
            return []
        limits.lose([label for label, w in limits.seen.items() if w.is_dead()])
        return list(limits.lost)

    def _deadline_error(self) -> RecoveryDeadlineExceeded:
        limits = self._rounds.limits
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
            last = self._rounds.limits.last
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
        for p in self._rounds.abandoned:
            if p.done():
                with contextlib.suppress(BaseException):
                    p.result(0)
            else:
                still.append(p)
        self._rounds.abandoned = still

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
        limits = self._rounds.limits
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
                raise_if_refused(again)
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
        if self._rounds.limits is not None:
            self._rounds.limits.lose([m.label for m in dead])
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
        sent: list[Sent] = []
        with contextlib.suppress(Exception):  # judged below by what it was sent
            sent = send_requests({label: WeightsState() for label in workers if label not in silent},
                                 workers.__getitem__)
        settle_before_propagating([s.pending for s in sent], timeout, "weights state")
        answered: dict[str, bool] = {}  # label -> consistent, for every worker that said
        for s in sent:
            if not s.done():
                self._rounds.abandoned.append(s.pending)
                continue
            for o in s.outcomes():
                if o.ok and isinstance(o.value, dict):
                    answered[o.key] = o.value.get("consistent", True)
        torn = []
        for label, w in workers.items():
            if w.is_dead():
                continue
            # silent, late, or an endpoint that cannot say: judged by what it was sent
            consistent = answered.get(label, id(w) not in self._suspects)
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


def raise_if_refused(failure: RefitWorkerError) -> None:
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
