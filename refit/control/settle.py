"""Waiting on calls to many workers, and letting the stragglers of a failure unwind."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from refit.runtime.protocol import EndpointFailed

log = logging.getLogger(__name__)


def wait_any(pendings: list, timeout: float | None) -> list:
    """The pendings that completed, waiting up to ``timeout`` for at least one."""
    kinds = {getattr(type(p), "wait_any", None) for p in pendings}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop()(pendings, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:  # handles of different kinds: wait on each kind in short turns
        for p in pendings:
            if p.done():
                return [q for q in pendings if q.done()]
        if deadline is not None and time.monotonic() >= deadline:
            return []
        for p in pendings:
            waiter = getattr(type(p), "wait_any", None)
            if waiter is not None and waiter([p], 0.02):
                break


def brief(e: BaseException) -> str:
    """``Type: first line`` of an error; a worker's failure in the worker's own words."""
    if isinstance(e, EndpointFailed):
        return e.brief()
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def settle_before_propagating(futures: Sequence[Any], budget_s: float | None, what: str) -> list[Any]:
    """Let every rank finish unwinding before a refit failure reaches the caller.

    Waiting on a group of calls returns at the first failure and leaves the rest running.
    That is fine for a caller about to stop and wrong for one about to rebuild: the rebuild
    is itself a rendezvous, and ranks still inside the old refit would join it late or not
    at all (the reference system lost 690s to exactly this). So wait, bounded, for every
    outstanding call, and swallow what they raise: they are unwinding from the failure the
    caller already holds, and a straggler's version of it would bury the diagnosis. When
    the budget runs out, return anyway; a controller stuck here would be a worse wedge than
    the one it is recovering from. Returns the calls still outstanding.
    """
    pending = [f for f in futures if not f.done()]
    deadline = None if budget_s is None else time.monotonic() + budget_s
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        for f in wait_any(pending, left):
            with contextlib.suppress(BaseException):
                f.result(0)
        pending = [f for f in pending if not f.done()]
    if pending:
        log.warning("refit %s: %d call(s) still outstanding after the %.1fs settle budget; propagating anyway",
                    what, len(pending), budget_s or 0.0)
    return pending

