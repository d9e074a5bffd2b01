import logging
import threading
import time

import pytest

from refit.runtime.watchdog import RefitAborted, RefitAbortWatchdog
from refit.testing.launch import scaled

# Bounds sized for a busy machine: a wait that should end in milliseconds gets tens of seconds, so only a
# watchdog that never fires (or a thread that is waited out) fails the tests, never a slow scheduler.
BOUND_S = scaled(20.0)  # how long a fake collective may stay blocked before the test fails
LONG_S = 60.0  # a deadline no test reaches: a watchdog armed with it must be woken, not waited out


class FakeGroup:
    """A communicator whose blocking call is released only by abort()."""

    def __init__(self, name: str, order: list[str] | None = None, fail: bool = False) -> None:
        self.name = name
        self.order = order
        self.fail = fail
        self.released = threading.Event()
        self.abort_calls = 0

    def abort(self) -> None:
        self.abort_calls += 1
        if self.order is not None:
            self.order.append(self.name)
        self.released.set()
        if self.fail:
            raise RuntimeError(f"{self.name}: abort failed")

    def recv(self) -> None:
        if not self.released.wait(BOUND_S):
            raise AssertionError(f"{self.name}: never released by the watchdog")
        raise ConnectionError(f"{self.name}: communicator aborted")

    def __repr__(self) -> str:
        return f"FakeGroup({self.name})"


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "refit-abort-watchdog"]


@pytest.fixture
def thread_errors(monkeypatch):
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


@pytest.mark.timeout(120)
def test_fires_at_deadline_and_releases_blocked_call(thread_errors):
    g = FakeGroup("g")
    before = set(threading.enumerate())
    wd = RefitAbortWatchdog([g], timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RefitAborted) as info:
        with wd:
            assert len(watchdog_threads()) == 1
            g.recv()
    elapsed = time.monotonic() - t0
    assert 0.19 <= elapsed < BOUND_S
    assert wd.fired and g.abort_calls == 1
    assert wd.fired_at is not None and wd.deadline is not None and wd.fired_at >= wd.deadline - 0.01
    assert isinstance(info.value.__cause__, ConnectionError)
    assert "0.2s" in str(info.value) and "FakeGroup(g)" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert set(threading.enumerate()) == before
    assert not watchdog_threads()
    assert not thread_errors


@pytest.mark.timeout(120)
def test_does_not_fire_when_block_finishes_early():
    g = FakeGroup("g")
    before = set(threading.enumerate())
    wd = RefitAbortWatchdog([g], timeout_s=LONG_S)
    t0 = time.monotonic()
    with wd:
        pass
    assert time.monotonic() - t0 < LONG_S / 2  # the thread is woken, not waited out
    assert not wd.fired and wd.fired_at is None and g.abort_calls == 0
    assert wd.elapsed_s is not None and wd.elapsed_s < LONG_S / 2
    assert set(threading.enumerate()) == before


@pytest.mark.timeout(120)
def test_block_error_propagates_unchanged_when_not_fired():
    g = FakeGroup("g")
    with pytest.raises(KeyError):
        with RefitAbortWatchdog([g], timeout_s=LONG_S):
            raise KeyError("boom")
    assert g.abort_calls == 0 and not watchdog_threads()


@pytest.mark.timeout(120)
def test_raises_even_if_block_returns_after_firing():
    g = FakeGroup("g")
    wd = RefitAbortWatchdog([g], timeout_s=0.1)
    with pytest.raises(RefitAborted) as info:
        with wd:
            assert g.released.wait(BOUND_S)  # the transfer "completes" after the abort
    assert info.value.__cause__ is None
    assert not watchdog_threads()


@pytest.mark.timeout(120)
def test_disarmed_with_none():
    g = FakeGroup("g")
    wd = RefitAbortWatchdog([g], timeout_s=None)
    with pytest.raises(ValueError):
        with wd:
            assert not watchdog_threads()
            raise ValueError("mine")
    assert not wd.fired and wd.deadline is None and g.abort_calls == 0


@pytest.mark.timeout(120)
def test_aborts_in_order_and_swallows_abort_errors(caplog, thread_errors):
    order: list[str] = []
    child = FakeGroup("child", order, fail=True)
    parent = FakeGroup("parent", order)
    with caplog.at_level(logging.WARNING, logger="refit.runtime.watchdog"):
        with pytest.raises(RefitAborted) as info:
            with RefitAbortWatchdog([child, parent], timeout_s=0.1):
                parent.recv()
    assert order == ["child", "parent"]  # a failing abort does not stop the next one
    assert isinstance(info.value.__cause__, ConnectionError)
    assert any("child: abort failed" in (r.exc_text or "") for r in caplog.records)
    assert not thread_errors
    assert not watchdog_threads()


@pytest.mark.timeout(120)
def test_idempotent_aborts_and_reuse():
    child = FakeGroup("child")

    class Parent(FakeGroup):
        def abort(self) -> None:
            child.abort()  # a parent's abort also covers its split children
            super().abort()

    parent = Parent("parent")
    wd = RefitAbortWatchdog([child, parent], timeout_s=0.1)
    for round_ in (1, 2):
        child.released.clear()
        with pytest.raises(RefitAborted):
            with wd:
                child.recv()
        assert parent.abort_calls == round_ and child.abort_calls == 2 * round_
    parent.released.clear()
    with pytest.raises(RefitAborted):  # aborting an aborted group again is harmless
        with RefitAbortWatchdog([parent, parent], timeout_s=0.1):
            parent.recv()
    # A quick block after a fired one starts clean.
    with wd:
        pass
    assert not wd.fired and not watchdog_threads()


@pytest.mark.timeout(120)
def test_callable_groups_are_resolved_at_the_deadline():
    groups: list[FakeGroup] = []
    with pytest.raises(RefitAborted) as info:
        with RefitAbortWatchdog(lambda: groups, timeout_s=0.1):
            g = FakeGroup("late")
            groups.append(g)  # built inside the guarded block
            g.recv()
    assert g.abort_calls == 1 and "FakeGroup(late)" in str(info.value)


@pytest.mark.timeout(120)
def test_cannot_enter_twice_while_armed():
    wd = RefitAbortWatchdog([], timeout_s=LONG_S)
    with wd:
        with pytest.raises(RuntimeError, match="already armed"):
            wd.__enter__()
    assert not watchdog_threads()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_rejects_bad_timeout(bad):
    with pytest.raises(ValueError):
        RefitAbortWatchdog([], timeout_s=bad)
