"""Rounds of calls: one call per worker, waited for together, and a failure settled before it is raised.

A round is how the controller reaches its workers: every worker gets its call at once, the
answers are collected as they come, and at the first failure (or the timeout) every other
call is given until its own deadline to unwind before the error is raised. A rebuild right
after a failure is itself a rendezvous, and ranks still inside the old refit would join it
late or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit.control.errors import RefitTampered, RefitWorkerError
from refit.control.result import Recorder
from refit.control.settle import brief, settle_before_propagating, wait_any
from refit.runtime.handles import Sent, WorkerDied, send_requests
from refit.runtime.protocol import EndpointCall, EndpointFailed, FailureKind

__all__ = ["GRACE_S", "NO_DEADLINE_ROUND_S", "NO_DEADLINE_SETTLE_S", "Member", "RecoveryLimits", "Rounds"]

GRACE_S = 5.0  # slack on top of a worker's own deadline before the controller stops waiting
NO_DEADLINE_SETTLE_S = 30.0  # settle budget when refit_timeout_s is None
NO_DEADLINE_ROUND_S = 300.0  # bound on control calls (connect, prepare, commit) without a deadline
_STALL_SLACK_S = 1.0  # a controller wait that overruns what it asked for by more was stopped or starved


@dataclass(frozen=True)
class Member:
    """One rank of a build: who it is and how to reach it."""

    rank: int
    worker: Any
    label: str
    shard: int | None = None  # None for trainers
    first_rank: int = 0  # communicator rank of the shard's worker 0 (what its meshes are offset by)


@dataclass
class RecoveryLimits:
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


def died(p: Any) -> bool:
    """Whether a finished call ended because its worker's process is gone (any other failure is
    the worker's own)."""
    try:
        p.result(0)
    except WorkerDied:
        return True
    except Exception:  # a failure of the worker's own is not a death
        pass
    return False


def failure_kind_of(e: BaseException) -> FailureKind | None:
    """The kind of a worker's failure; None for the handle's own (a death, a timeout)."""
    return e.kind if isinstance(e, EndpointFailed) else None


class Rounds:
    """The controller's rounds of calls, under one sync's recovery limits (``limits``).

    ``rec`` records the sync in progress; ``abandoned`` holds calls given up on, read once
    they end so that no error goes unseen; ``deadline_error`` makes the error raised when
    recovery is out of time.
    """

    def __init__(self, refit_timeout_s: float | None, grace_s: float,
                 deadline_error: Callable[[], BaseException]):
        self.refit_timeout_s = refit_timeout_s
        self.grace_s = grace_s
        self.deadline_error = deadline_error
        self.limits: RecoveryLimits | None = None
        self.rec: Recorder | None = None
        self.abandoned: list[Any] = []

    def settle_budget_s(self) -> float:
        """How long to let stragglers unwind: their own deadline, plus a little.

        A rank that has not given up yet will when its watchdog fires, at the same
        refit_timeout_s every rank was armed with. Without a deadline nothing bounds
        them, so fall back to a fixed wait rather than blocking recovery for ever.
        """
        if self.refit_timeout_s is None:
            return NO_DEADLINE_SETTLE_S
        return self.refit_timeout_s + self.grace_s

    def round_timeout_s(self) -> float:
        return (self.refit_timeout_s or NO_DEADLINE_ROUND_S) + self.grace_s

    def cap_wait(self, seconds: float | None) -> float | None:
        """``seconds``, cut during recovery to what is left before the sync's hard end."""
        cap = None if self.limits is None else self.limits.wait_s()
        if cap is None:
            return seconds
        return cap if seconds is None else min(seconds, cap)

    def cap_worker(self, seconds: float | None) -> float | None:
        """A worker's own deadline, cut during recovery to what is left before the hard end less
        the grace, so that the controller's wait on it ends by the hard end. With nothing left,
        the sync is out of time: ``RecoveryDeadlineExceeded``."""
        left = None if self.limits is None else self.limits.worker_s()
        if left is None:
            return seconds
        if left <= 0:
            raise self.deadline_error()
        return left if seconds is None else min(seconds, left)

    def run(self, phase: str, sent: Sequence[Sent], timeout_s: float | None,
            stragglers_s: float | None = None) -> dict[Member, Any]:
        """Wait for every message; at the first failure (or the timeout) settle the rest, then raise.

        ``sent`` are the round's messages to its members (``request_each``): one per worker, or
        one per engine whose workers are reached together. ``stragglers_s`` is the deadline the
        workers themselves give up at in this phase (the refit deadline, or the rendezvous
        timeout for ``connect``). Every answer that arrived by the end of the settle counts: when
        they all arrived and none failed (the controller itself was stopped or starved while
        they came in), the round succeeded.
        """
        results: dict[Member, Any] = {}
        pending = {id(s): s for s in sent}
        timeout_s = self.cap_wait(timeout_s)
        dispatched = time.monotonic()
        last: tuple[float, str] = (0.0, "")  # the slowest member so far, for the sync's events
        deadline = None if timeout_s is None else dispatched + timeout_s
        failures: dict[str, str] = {}
        errors: dict[str, BaseException] = {}
        kinds: dict[str, FailureKind] = {}
        dead: list[str] = []  # labels of members whose process is gone (not ``died``, the check)
        stalled = 0.0  # how much longer than asked the controller's own waits took

        def collect(ready: Sequence[Sent]) -> None:
            nonlocal last
            for s in ready:
                del pending[id(s)]
                for outcome in s.outcomes():
                    m = outcome.key
                    last = (time.monotonic() - dispatched, m.label)
                    if outcome.ok:
                        results[m] = outcome.value
                        continue
                    e = outcome.value
                    errors[m.label] = e  # reported below with the worker's name
                    if isinstance(e, WorkerDied):
                        dead.append(m.label)
                    elif (kind := failure_kind_of(e)) is not None:
                        kinds[m.label] = kind
                    failures[m.label] = brief(e)

        while pending and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            asked = time.monotonic()
            done = {id(p) for p in wait_any([s.pending for s in pending.values()], left)}
            if left is not None:
                stalled = max(stalled, time.monotonic() - asked - left - _STALL_SLACK_S)
            if not done:
                break
            collect([s for s in pending.values() if id(s.pending) in done])
        timed_out: list[str] = []
        if pending:
            # The stragglers were armed when this round was dispatched, so their own deadline
            # (plus the grace) is counted from then: a rank frozen for good is waited for
            # until every live rank must have given up, not for a whole budget after that.
            budget = self.settle_budget_s()
            if stragglers_s is not None:
                budget = stragglers_s + self.grace_s
            budget = self.cap_wait(min(budget, max(self.grace_s, dispatched + budget - time.monotonic())))
            settle_before_propagating([s.pending for s in pending.values()], budget, phase)
            collect([s for s in pending.values() if s.done() and not any(m.worker.is_dead() for m in s.keys)])
            # a member whose process is gone is dead, not late: name it as such, so the
            # error blames the worker that died rather than every one still waiting for it
            for s in pending.values():
                for m in s.keys:
                    if m.label not in failures and (m.worker.is_dead() or (s.done() and died(s.pending))):
                        dead.append(m.label)
                        failures[m.label] = f"WorkerDied: {m.label} died"
            # what is still pending here did not answer (an answer landing after the collect is
            # as late as one that never came: the round is decided on what it had)
            timed_out = [m.label for s in pending.values() for m in s.keys if m.label not in failures]
            self.abandoned += [s.pending for s in pending.values() if not s.done()]
            if not failures and not timed_out:
                if self.rec is not None:
                    self.rec.note("round", f"{phase}: every answer arrived by the end of the settle"
                                            + (f" (the controller stalled {stalled:.1f}s)" if stalled > 0 else ""))
                return results
        elif not failures:
            if self.rec is not None:
                self.rec.note("round", f"{phase}: {len(results)} worker(s) in {last[0]:.3f}s, "
                                        f"the last {last[1]}"
                                        + (f" (the controller stalled {stalled:.1f}s)" if stalled > 0 else ""))
            return results
        if self.limits is not None:
            self.limits.lose(dead)
        raise _round_failure(phase, failures, errors, kinds, dead, timed_out, timeout_s, stalled)

    def request_all(self, members: Sequence[Member], call: EndpointCall) -> list[Sent]:
        return self.request_each({m: call for m in members})

    @staticmethod
    def request_each(calls: Mapping[Member, EndpointCall]) -> list[Sent]:
        """Each member's call; an engine whose workers are reached together gets its share as one message."""
        return send_requests(calls, lambda m: m.worker)


def _round_failure(phase: str, failures: dict[str, str], errors: dict[str, BaseException],
                   kinds: dict[str, FailureKind], died: list[str], timed_out: list[str], timeout_s: float | None,
                   stalled: float) -> RefitWorkerError:
    """The error a failed round raises: a tampered rendezvous as such, else every failure, death,
    straggler and late worker named, a death first."""
    tampered = [label for label, kind in kinds.items() if kind is FailureKind.TAMPERED]
    if tampered:
        label = tampered[0]
        details = errors[label].details
        return RefitTampered(
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
    return error
