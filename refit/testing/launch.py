"""A local fleet of worker processes, each holding a rank of one ``StatelessProcessGroup``.

Used by the benchmarks and the tests to run real multi-process transfers on one
machine without Ray (``LocalFleet`` over gloo on CPUs, ``DeviceFleet`` over NCCL with one GPU
a process): the parent sends a picklable function, every rank runs it with its
communicator, and the parent collects the results. Every wait is bounded; a fleet that
misses its deadline is killed rather than left to hang the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import wait as wait_conns
from typing import Any

from refit.comm.group import StatelessProcessGroup, free_port
from refit.comm.rendezvous import new_secret
from refit.errors import RefitError
from refit.runtime.handles import serve_pipe

LOAD_FACTOR_ENV = "REFIT_TEST_LOAD_FACTOR"


def load_factor() -> float:
    """How much slower than an idle machine this run starts processes (``REFIT_TEST_LOAD_FACTOR``, at least 1).

    The suite measures it once, from how long a fresh interpreter took to import torch, and
    every start-up deadline and hang guard of the tests and of these harnesses is scaled by
    it: the same suite passed alone and timed out with two busy loops beside it, where
    starting a Ray actor took three times as long.
    """
    try:
        return max(1.0, float(os.environ.get(LOAD_FACTOR_ENV, "1")))
    except ValueError:
        return 1.0


def scaled(seconds: float) -> float:
    """``seconds`` scaled by this run's ``load_factor()``: a wait for start-up, or a hang guard."""
    return seconds * load_factor()


class WorkerError(RefitError):
    """A function raised on one or more ranks of a LocalFleet."""

    def __init__(self, failures: dict[int, tuple[str, str]]):
        self.failures = failures
        lines = [f"rank {r}: {etype}: {tb.strip().splitlines()[-1] if tb.strip() else ''}"
                 for r, (etype, tb) in sorted(failures.items())]
        super().__init__("; ".join(lines))


def serve_requests(conn, call: Callable[[Callable[..., Any], tuple, dict], Any]) -> None:
    """A fleet worker's loop (``serve_pipe``): answer each ``(id, fn, args, kwargs)`` from ``conn`` with
    ``call(fn, args, kwargs)``; a failure goes back as ``(exception type name, traceback)``."""
    serve_pipe(conn, call, error=lambda e, tb: (type(e).__name__, tb))


def _worker(rank: int, world_size: int, port: int, secret: bytes, conn, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    group = StatelessProcessGroup("127.0.0.1", port, rank, world_size, timeout_s=120, secret=secret)
    try:
        serve_requests(conn, lambda fn, args, kwargs: fn(group, *args, **kwargs))
    finally:
        group.abort()
        conn.close()


class LocalFleet:
    def __init__(self, world_size: int, *, threads_per_rank: int = 1, start_timeout_s: float | None = None):
        self._start(world_size, _worker, (threads_per_rank,),
                    scaled(120.0) if start_timeout_s is None else start_timeout_s)

    def _start(self, world_size: int, target: Callable[..., None], extra: tuple, start_timeout_s: float) -> None:
        """One spawned process per rank running ``target(rank, world_size, port, secret, conn, *extra)``."""
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port, secret = free_port(), new_secret()
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(rank, world_size, port, secret, child, *extra), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self.run(_ready, timeout_s=start_timeout_s)

    def run(self, fn: Callable[..., Any], *args, timeout_s: float = 120.0, **kwargs) -> list[Any]:
        """Run ``fn(group, *args, **kwargs)`` on every rank; return the results by rank."""
        for r, c in enumerate(self._conns):
            c.send((r, fn, args, kwargs))
        return self._collect(timeout_s)

    def run_per_rank(self, calls: list[tuple[Callable[..., Any], tuple]], *, timeout_s: float = 120.0) -> list[Any]:
        for r, (c, (fn, args)) in enumerate(zip(self._conns, calls)):
            c.send((r, fn, args, {}))
        return self._collect(timeout_s)

    def _replies(self, ranks, timeout_s: float) -> tuple[dict[int, tuple[bool, Any] | None], list[int]]:
        """The answers ``(ok, value)`` of ``ranks`` by rank (None for a rank whose process ended), and
        the ranks that did not answer within ``timeout_s``."""
        import time

        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[bool, Any] | None] = {}
        pending = {self._conns[r]: r for r in ranks}
        while pending:
            left = deadline - time.monotonic()
            ready = wait_conns(list(pending), timeout=left) if left > 0 else []
            if not ready:
                return replies, sorted(pending.values())
            for c in ready:
                r = pending.pop(c)
                try:
                    _, ok, value = c.recv()
                    replies[r] = (ok, value)
                except EOFError:
                    replies[r] = None
        return replies, []

    def _collect(self, timeout_s: float) -> list[Any]:
        replies, late = self._replies(range(self.world_size), timeout_s)
        if late:
            self.close(kill=True)
            raise RefitError(f"LocalFleet: ranks {late} did not finish within {timeout_s}s")
        failures: dict[int, tuple[str, str]] = {}
        for r, reply in replies.items():
            if reply is None:
                failures[r] = ("ProcessDied", f"rank {r} exited (code {self._procs[r].exitcode})")
            elif not reply[0]:
                failures[r] = reply[1]
        if failures:
            raise WorkerError(failures)
        return [replies[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        for c in self._conns:
            try:
                if not kill:
                    c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ready(group) -> int:
    return os.getpid()


# -- a fleet of GPU processes ------------------------------------------------------------------

def rebuild_group(group, port: int, secret: bytes, peer: str | None = None, init_timeout_s: float = 60.0):
    """Special job for ``DeviceFleet.rebuild``: abort this rank's group and join a new one."""
    if group is not None:
        group.abort()
    return StatelessProcessGroup("127.0.0.1", port, group.rank, group.world_size, backend="nccl",
                                 device=group.device, peer=peer or group.peer, timeout_s=120,
                                 init_timeout_s=init_timeout_s, secret=secret)


def abort_blocked_recv(group, comm=None, *, delay_s: float = 0.3, nbytes: int = 1 << 20) -> dict:
    """A job for a 2-rank ``DeviceFleet``: rank 1 blocks in an NCCL receive on ``comm`` (``group``, or a
    split child of it) that rank 0 never sends, and a thread aborts ``group`` after ``delay_s``.

    Rank 1 answers the error its wait raised, ``release_s`` (from the abort to the release),
    ``abort_call_s`` (how long ``abort()`` took) and ``kernel_ended_after_abort`` (the aborted
    kernel's stream moved on); rank 0 answers ``{}``.
    """
    import math
    import threading
    import time

    import torch

    from refit.comm.group import GroupAborted

    comm = group if comm is None else comm
    # NCCL connects p2p lazily: exchange a few bytes first, so the recv below is a running kernel
    peer = 1 - comm.rank
    a = torch.ones(16, dtype=torch.uint8, device=group.device)
    b = torch.empty(16, dtype=torch.uint8, device=group.device)
    comm.p2p_group([(b, peer)], [(a, peer)])
    torch.cuda.synchronize()
    group.barrier()
    if group.rank == 0:  # never sends; keeps the store alive until rank 1 is released
        time.sleep(delay_s + 3.0)
        group.abort()
        return {}
    buf = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    fired = {}

    def aborter():
        time.sleep(delay_s)
        fired["t"] = time.monotonic()
        group.abort()
        fired["done"] = time.monotonic()

    th = threading.Thread(target=aborter, daemon=True)
    th.start()
    err, work = None, None
    try:
        work = comm.irecv(buf, 0)
        comm.wait(work)
    except GroupAborted as e:
        err = type(e).__name__
    released = time.monotonic()
    th.join(10)
    limit = time.monotonic() + 10  # the aborted kernel really ended: its stream moves on
    while work is not None and not work.event.query() and time.monotonic() < limit:
        time.sleep(0.01)
    return {"error": err, "release_s": released - fired["t"], "abort_call_s": fired.get("done", math.nan) - fired["t"],
            "kernel_ended_after_abort": bool(work is not None and work.event.query())}


def _device_worker(rank: int, world_size: int, port: int, secret: bytes, conn, peer: str,
                   init_timeout_s: float) -> None:
    import torch

    dev = rank % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(dev)
    state: dict[str, Any] = {}
    try:
        state["group"] = StatelessProcessGroup("127.0.0.1", port, rank, world_size, backend="nccl", device=dev,
                                               peer=peer, timeout_s=120, init_timeout_s=init_timeout_s,
                                               secret=secret)
    except BaseException as e:  # reported on every request
        state["error"] = e

    def call(fn, args, kwargs):
        if "error" in state:
            raise state["error"]
        if fn is rebuild_group:  # the new group stays here; the parent gets this process's pid
            state["group"] = fn(state["group"], *args, **kwargs)
            return os.getpid()
        return fn(state["group"], *args, **kwargs)

    try:
        serve_requests(conn, call)
    finally:
        if "group" in state:
            state["group"].abort()
        conn.close()


class DeviceFleet(LocalFleet):
    """``LocalFleet`` with one GPU per process and NCCL groups (``peer`` protocol)."""

    def __init__(self, world_size: int = 2, *, peer: str = "nemo", init_timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0):
        self._start(world_size, _device_worker, (peer, init_timeout_s), start_timeout_s)

    def rebuild(self, peer: str | None = None, timeout_s: float = 120.0) -> None:
        """Every rank aborts its group and joins a new one on a fresh port."""
        self.run(rebuild_group, free_port(), new_secret(), peer, timeout_s=timeout_s)
