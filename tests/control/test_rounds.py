"""A controller round decided on what arrived: a late answer is a straggler, never a crash."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from refit.control.errors import RefitWorkerError
from refit.control.rounds import Member, Rounds
from refit.runtime.handles import Sent, WorkerDied
from refit.runtime.protocol import EndpointFailed, FailureKind


class _LateAnswer:
    """A call that has not answered when the round collects, and has by the time the round looks
    for deaths (its worker's liveness check is what lets it land)."""

    def __init__(self) -> None:
        self.landed = False

    def done(self) -> bool:
        return self.landed

    def result(self, timeout: float | None = None) -> str:
        assert self.landed, "read before it landed"
        return "late"


class _Worker:
    def __init__(self, call: _LateAnswer | None = None) -> None:
        self.call = call

    def is_dead(self) -> bool:
        if self.call is not None:
            self.call.landed = True
        return False


def test_an_answer_landing_after_the_collect_is_late_not_a_crash() -> None:
    on_time: Future = Future()
    on_time.set_result("ok")
    late = _LateAnswer()
    first = Member(0, _Worker(), "trainer rank 0")
    second = Member(1, _Worker(late), "engine 0 worker 0", shard=0)
    rounds = Rounds(refit_timeout_s=0.05, grace_s=0.05, deadline_error=lambda: TimeoutError("out of time"))
    with pytest.raises(RefitWorkerError) as caught:
        rounds.run("transfer", [Sent(on_time, (first,)), Sent(late, (second,))], timeout_s=0.1, stragglers_s=0.05)
    assert caught.value.timed_out == ["engine 0 worker 0"]
    assert caught.value.died == []


def test_one_message_to_an_engine_answers_each_of_its_workers() -> None:
    """An engine's workers get a round as one message, and its one answer holds each worker's own:
    a failure is the failing worker's, and the others' results still count."""
    answer: Future = Future()
    refused = EndpointFailed(FailureKind.REFUSED, "PlanError", "bad layout")
    answer.set_result({0: (True, "r0"), 1: (False, refused)})
    trainer: Future = Future()
    trainer.set_result("t0")
    t = Member(0, _Worker(), "trainer rank 0")
    w0, w1 = Member(1, _Worker(), "shard 0 worker 0", shard=0), Member(2, _Worker(), "shard 0 worker 1", shard=0)
    rounds = Rounds(refit_timeout_s=1.0, grace_s=0.05, deadline_error=lambda: TimeoutError("out of time"))
    with pytest.raises(RefitWorkerError) as caught:
        rounds.run("prepare", [Sent(trainer, (t,)), Sent(answer, (w0, w1), ranks=(0, 1))], timeout_s=1.0)
    assert list(caught.value.failures) == ["shard 0 worker 1"]
    assert caught.value.kinds == {"shard 0 worker 1": FailureKind.REFUSED}

    whole: Future = Future()
    whole.set_result({0: (True, "r0"), 1: (True, "r1")})
    assert rounds.run("prepare", [Sent(whole, (w1, w0), ranks=(1, 0))], timeout_s=1.0) == {w1: "r1", w0: "r0"}


def test_a_dead_engine_is_the_death_of_every_worker_its_message_addressed() -> None:
    gone: Future = Future()
    gone.set_exception(WorkerDied("vllm engine: its process or a worker of it died"))
    w0, w1 = Member(1, _Worker(), "shard 0 worker 0", shard=0), Member(2, _Worker(), "shard 0 worker 1", shard=0)
    rounds = Rounds(refit_timeout_s=1.0, grace_s=0.05, deadline_error=lambda: TimeoutError("out of time"))
    with pytest.raises(RefitWorkerError) as caught:
        rounds.run("transfer", [Sent(gone, (w0, w1), ranks=(0, 1))], timeout_s=1.0)
    assert caught.value.died == ["shard 0 worker 0", "shard 0 worker 1"]
