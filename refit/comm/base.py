"""What every communicator shares: the abort errors, the protocol, host polling, free ports.

This module sits under both ``group`` (the stateless process group) and ``nccl`` (the NCCL
binding). The NCCL binding raises the group's abort error and the group builds NCCL
communicators; with these names in either of the two, each imported the other and the
group could only reach the binding through an import inside a function.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from refit.errors import TransportError


class GroupAborted(TransportError):
    """The communicator was aborted while this rank waited on it."""


class NcclAborted(GroupAborted):
    """The communicator was aborted while this thread polled a queued operation."""


class NcclTimeout(GroupAborted):
    """A polled operation did not finish before the refit deadline."""


class Communicator(Protocol):
    """What the transport needs from a process group. Peers are ranks of this group.

    ``abort_event`` and ``deadline`` let a layer that polls work of its own (a CUDA event
    of a streamed transfer) give up exactly when the group's own waits would: at once
    after ``abort()`` from another thread, and at the deadline the watchdog armed.
    """

    rank: int
    world_size: int

    @property
    def abort_event(self) -> threading.Event: ...
    @property
    def deadline(self) -> float | None: ...

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any: ...
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any: ...
    def wait(self, work: Any) -> None: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def barrier(self) -> None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the caller races others for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def poll_until(done: Callable[[], bool], *, deadline: float | None, aborted: threading.Event,
               what: str) -> None:
    """Spin on ``done()`` briefly, then poll every 0.2 ms at most.

    Raises ``NcclAborted`` as soon as ``aborted`` is set and ``NcclTimeout`` at ``deadline``
    (a ``time.monotonic()`` value).
    """
    spins = 0
    sleep = 0.0
    while True:
        if aborted.is_set():
            raise NcclAborted(f"{what}: the communicator was aborted")
        if done():
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise NcclTimeout(f"{what}: did not finish before the deadline")
        spins += 1
        if spins < 2000:
            time.sleep(0)
        else:
            sleep = min(5e-5 if sleep == 0 else sleep * 1.5, 2e-4)  # <= 0.2 ms late on a long wait
            time.sleep(sleep)


__all__ = ["Communicator", "GroupAborted", "NcclAborted", "NcclTimeout", "free_port", "poll_until",
           "wait_for_listener"]


def wait_for_listener(address: str, port: int, deadline: float) -> None:
    """Wait until rank 0's store accepts connections, or the deadline passes.

    A store client that arrives before the store is up backs off for about half a
    second before it retries, and every rebuild pays that (measured: 0.6s against 0.05s
    for a 4-rank rendezvous). A plain TCP probe every 10 ms costs nothing and lets the
    client connect as soon as the store listens.
    """
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return  # let the store client report the failure in its own words
            time.sleep(0.01)
