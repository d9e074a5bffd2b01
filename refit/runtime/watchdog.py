"""In-worker deadline for the blocking communication of one refit.

A rank blocked in a collective on a dead or frozen peer cannot be reached from the
controller: the call never returns, and nothing that arrives over the actor's own
channel runs until it does. The only thing that can release it is code in the same
process, so each worker arms this watchdog around its refit. When the deadline passes,
a thread aborts the worker's communicators, the blocked call fails, and the worker
reports ``RefitAborted`` instead of hanging; the controller can then settle the ranks
and rebuild over the survivors.

    with RefitAbortWatchdog([bulk_group, update_group], timeout_s=refit_timeout_s):
        transport.run(plan)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol

from refit.errors import RefitAborted

__all__ = ["Abortable", "RefitAborted", "RefitAbortWatchdog"]

logger = logging.getLogger(__name__)


class Abortable(Protocol):
    """A communicator the watchdog can tear down; ``abort()`` must be idempotent."""

    def abort(self) -> None: ...


Groups = Sequence[Abortable] | Callable[[], Sequence[Abortable]]


class RefitAbortWatchdog:
    """Abort ``groups`` if the guarded block outlives ``timeout_s``.

    On entry a daemon thread waits on an event with the timeout, so a block that ends
    early wakes it at once rather than leaving it asleep. If the wait times out, the
    thread calls ``abort()`` on every group in the order given; callers list split
    children before their parents, and each group's own abort also covers its
    children. Errors from one abort are logged and the next group is still aborted:
    a group left un-aborted is a rank left blocked.

    On exit the thread is always joined. If the watchdog fired, ``RefitAborted`` is
    raised, chained to whatever the block raised.

    Args:
        groups: the groups to abort, or a callable returning them. A callable is
            resolved when the deadline passes, so it sees groups built inside the block.
        timeout_s: seconds before the abort; None disarms the watchdog (no thread, and
            no protection against a hang).
    """

    def __init__(self, groups: Groups, timeout_s: float | None) -> None:
        if timeout_s is not None and (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        self._groups = groups
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._armed_at: float | None = None
        self._exited_at: float | None = None
        self._fired_at: float | None = None
        self._aborted: list[str] = []

    @property
    def timeout_s(self) -> float | None:
        return self._timeout_s

    @property
    def fired(self) -> bool:
        return self._fired_at is not None

    @property
    def fired_at(self) -> float | None:
        """``time.monotonic()`` when the deadline passed, or None if it has not fired."""
        return self._fired_at

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` at which the watchdog fires; None if disarmed or not entered."""
        if self._armed_at is None or self._timeout_s is None:
            return None
        return self._armed_at + self._timeout_s

    @property
    def elapsed_s(self) -> float | None:
        """Seconds since entry, frozen at exit; None before the first entry."""
        if self._armed_at is None:
            return None
        end = self._exited_at if self._exited_at is not None else time.monotonic()
        return end - self._armed_at

    def __enter__(self) -> RefitAbortWatchdog:
        if self._thread is not None:
            raise RuntimeError("RefitAbortWatchdog is already armed; it cannot be entered twice")
        self._closing = False
        self._fired_at = None
        self._exited_at = None
        self._aborted = []
        self._done.clear()
        self._armed_at = time.monotonic()
        if self._timeout_s is not None:
            self._arm_groups(self._armed_at + self._timeout_s)
            self._thread = threading.Thread(target=self._watch, name="refit-abort-watchdog", daemon=True)
            self._thread.start()
        return self

    def _arm_groups(self, deadline: float | None) -> None:
        """Hand the deadline to groups that can enforce it in their own waits.

        A gloo wait is not released by ``abort()``; it is released by a wait that times
        out, so gloo groups need the deadline itself, not just the abort at it.
        """
        if callable(self._groups):
            return
        for group in self._groups:
            set_deadline = getattr(group, "set_deadline", None)
            if set_deadline is not None:
                set_deadline(deadline)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exited_at = time.monotonic()
        thread, self._thread = self._thread, None
        if thread is not None:
            deadline = self._armed_at + self._timeout_s
            if exc is not None and time.monotonic() >= deadline - 0.05:
                # released by the deadline inside a wait: let the watchdog fire as it must
                thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            self._arm_groups(None)
            with self._lock:
                self._closing = True  # past this point the thread may no longer fire
            self._done.set()
            thread.join()
        if self._fired_at is None:
            return
        if exc is not None and not isinstance(exc, Exception):
            return  # never mask KeyboardInterrupt / SystemExit
        raise RefitAborted(self._message(exc)) from exc

    def _watch(self) -> None:
        if self._done.wait(self._timeout_s):
            return
        with self._lock:
            if self._closing:
                return  # the block finished just as the deadline passed
            self._fired_at = time.monotonic()
        try:
            groups = list(self._groups() if callable(self._groups) else self._groups)
        except Exception:
            logger.exception("refit watchdog: could not resolve the groups to abort")
            return
        self._aborted = [repr(g) for g in groups]
        logger.warning(
            "refit exceeded its %gs deadline; aborting %d group(s): %s",
            self._timeout_s,
            len(groups),
            ", ".join(self._aborted),
        )
        for group in groups:
            try:
                group.abort()
            except Exception:
                logger.exception("refit watchdog: abort() of %r raised; continuing with the others", group)

    def _message(self, exc: BaseException | None = None) -> str:
        groups = ", ".join(self._aborted) if self._aborted else "no groups"
        text = (
            f"refit did not finish within its {self._timeout_s:g}s deadline; the watchdog aborted "
            f"{groups}. The communicator is unusable until it is rebuilt."
        )
        # what the released wait knew (which peer it was waiting for) is worth keeping
        return text if exc is None or not str(exc) else f"{text} Where it stood: {exc}"
