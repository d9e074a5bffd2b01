"""A controller round decided on what arrived: a late answer is a straggler, never a crash."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from refit.control.errors import RefitWorkerError
from refit.control.rounds import Member, Rounds


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
        rounds.run("transfer", {first: on_time, second: late}, timeout_s=0.1, stragglers_s=0.05)
    assert caught.value.timed_out == ["engine 0 worker 0"]
    assert caught.value.died == []
