"""Worker handles: how the controller reaches one worker, whatever runs it.

The controller never calls an actor directly but through a handle (``request`` of a
``refit.runtime.protocol`` record -> a pending result, ``is_dead``; ``call`` runs any other
method of the actor by name, for the user's own calls). ``LocalWorker`` drives an endpoint object on a thread of this
process; ``ProcessWorker`` drives one in a spawned process of its own; both make the
control plane usable without Ray. ``refit.runtime.ray.RayWorker`` drives a Ray actor.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from refit.errors import RefitError
from refit.runtime.protocol import EndpointCall, answer

__all__ = ["BatchedWorkers", "FuturePending", "LocalWorker", "Outcome", "Pending", "ProcessWorker", "Sent",
           "WatchedPending", "WorkerDied", "WorkerHandle", "WorkerTimeout", "failed_call", "listening_sockets",
           "pid_alive", "process_resources", "send_requests", "sendable_error", "serve_pipe"]


class WorkerDied(RefitError):
    """The process behind a worker handle is gone."""


class WorkerTimeout(RefitError, TimeoutError):
    """A worker did not answer in time; it may be frozen, busy, or dead and not yet noticed."""


class Pending(Protocol):
    """A call in flight. ``result`` raises ``WorkerDied``, ``WorkerTimeout`` or the call's own error."""

    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...


class WorkerHandle(Protocol):
    """How the controller reaches one worker, whatever runs it.

    ``batch`` is set on the handles of workers that are reached together (a vLLM engine's):
    ``send_requests`` sends a round's calls to them as one message.
    """

    name: str
    batch: BatchedWorkers | None

    def request(self, call: EndpointCall) -> Pending: ...
    def call(self, method: str, *args: Any, **kwargs: Any) -> Pending: ...
    def is_dead(self) -> bool: ...


class BatchedWorkers(Protocol):
    """Workers reached together, as one engine reaches its own: one message carries a round's calls.

    The answer to that message holds every addressed worker's own, ``(ok, result or error)``,
    keyed by the worker handle's ``rank``.
    """

    def request_batch(self, calls: Mapping[Any, EndpointCall]) -> Pending: ...


@dataclass(frozen=True)
class Outcome:
    """One worker's answer to its call: its result, or the error it raised (``ok`` False)."""

    key: Any
    ok: bool
    value: Any


@dataclass(frozen=True)
class Sent:
    """One message in flight: a call to one worker, or a round's calls to the workers of one batch.

    ``keys`` are what the caller named the addressed workers by; ``ranks`` each one's place in
    a batch's answer (None for a call to one worker). A batch is answered as one: the
    controller waits on the message, not on a future per worker split off a shared answer.
    """

    pending: Pending
    keys: tuple[Any, ...]
    ranks: tuple[int, ...] | None = None

    def done(self) -> bool:
        return self.pending.done()

    def outcomes(self) -> list[Outcome]:
        """Each addressed worker's outcome (call only once ``done``). A failure of the message
        itself (a death, a timeout) is every addressed worker's."""
        try:
            answer = self.pending.result(0)
        except Exception as e:  # the message's own failure: each worker it addressed failed with it
            return [Outcome(key, False, e) for key in self.keys]
        if self.ranks is None:
            return [Outcome(self.keys[0], True, answer)]
        return [Outcome(key, *answer[rank]) for key, rank in zip(self.keys, self.ranks)]


def send_requests(calls: Mapping[Any, EndpointCall], worker: Callable[[Any], Any] = lambda key: key) -> list[Sent]:
    """Send each worker its call: one message per worker, or per batch for workers reached together.

    ``calls`` are keyed by anything ``worker`` maps to a worker handle (by default the handle itself).
    """
    out: list[Sent] = []
    batches: dict[int, tuple[BatchedWorkers, dict[Any, EndpointCall]]] = {}
    for key, call in calls.items():
        handle = worker(key)
        batch = getattr(handle, "batch", None)
        if batch is None:
            out.append(Sent(handle.request(call), (key,)))
        else:
            batches.setdefault(id(batch), (batch, {}))[1][key] = call
    for batch, group in batches.values():
        handles = {key: worker(key) for key in group}
        pending = batch.request_batch({handles[key]: call for key, call in group.items()})
        out.append(Sent(pending, tuple(group), tuple(handles[key].rank for key in group)))
    return out


class WatchedPending:
    """A call whose answer is read off ``inner``, given up as ``WorkerDied`` once ``is_dead`` says so.

    A vLLM engine's host answers one call at a time and cannot report its own worker's death
    while the refit that worker was in waits for it: the call is watched from outside. With
    ``pick``, the answer is a batch's and this call's is the worker ``pick``'s alone.
    """

    _SLICE_S = 0.25  # how often a wait looks at ``is_dead``

    def __init__(self, inner: Pending, is_dead: Callable[[], bool], name: str, pick: int | None = None):
        self.inner, self.is_dead, self.name, self.pick = inner, is_dead, name, pick

    def done(self) -> bool:
        return self.inner.done() or self.is_dead()

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.inner.done():
            if self.is_dead():
                raise WorkerDied(f"{self.name}: its process or a worker of it died")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WorkerTimeout(f"{self.name} did not answer within {timeout}s")
            with contextlib.suppress(WorkerTimeout):
                self.inner.result(self._SLICE_S if left is None else min(self._SLICE_S, left))
        answer = self.inner.result(0)
        if self.pick is None:
            return answer
        ok, value = answer[self.pick]
        if not ok:
            raise value
        return value

    @staticmethod
    def wait_any(pendings: Sequence[WatchedPending], timeout: float | None) -> list[WatchedPending]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [p for p in pendings if p.done()]
            left = None if deadline is None else deadline - time.monotonic()
            if ready or (left is not None and left <= 0):
                return ready
            inner = [p.inner for p in pendings]
            kinds = {getattr(type(q), "wait_any", None) for q in inner}
            wait = WatchedPending._SLICE_S if left is None else min(WatchedPending._SLICE_S, left)
            if len(kinds) == 1 and None not in kinds:
                kinds.pop()(inner, wait)
            else:
                time.sleep(min(wait, 0.02))


class FuturePending:
    """A call answered through a ``concurrent.futures.Future`` (the in-process and process handles)."""

    def __init__(self, future: cf.Future, worker: LocalWorker | ProcessWorker):
        self.future = future
        self.worker = worker

    def done(self) -> bool:
        return self.future.done() or self.worker.dead

    def result(self, timeout: float | None = None) -> Any:
        if self.worker.dead and not self.future.done():
            raise WorkerDied(f"{self.worker.name} is dead")
        try:
            return self.future.result(timeout)
        except cf.TimeoutError:
            raise WorkerTimeout(f"{self.worker.name} did not answer within {timeout}s") from None

    @staticmethod
    def wait_any(pendings: Sequence[FuturePending], timeout: float | None) -> list[FuturePending]:
        ready = [p for p in pendings if p.done()]
        if ready:
            return ready
        done, _ = cf.wait([p.future for p in pendings], timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return [p for p in pendings if p.future in done or p.worker.dead]


def _failed(exc: BaseException) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_exception(exc)
    return fut


def failed_call(exc: BaseException, worker: Any) -> FuturePending:
    """A call that failed before it was sent (its worker is known dead, say)."""
    return FuturePending(_failed(exc), worker)


class LocalWorker:
    """Drives an endpoint object in this process, on a thread of its own (calls run in order).

    Tests and single-process tools put several endpoints in one process, each on its own
    gloo rank. ``kill()`` marks the worker dead and aborts its communicator, which is as
    close to a process death as a thread can come.
    """

    batch = None

    def __init__(self, endpoint: Any, name: str | None = None):
        self.endpoint = endpoint
        self.name = name or type(endpoint).__name__
        self.dead = False
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"refit-{self.name}")

    def call(self, method: str, *args: Any, **kwargs: Any) -> FuturePending:
        if self.dead:
            return FuturePending(_failed(WorkerDied(f"{self.name} is dead")), self)
        return FuturePending(self._pool.submit(getattr(self.endpoint, method), *args, **kwargs), self)

    def request(self, call: EndpointCall) -> FuturePending:
        if self.dead:
            return FuturePending(_failed(WorkerDied(f"{self.name} is dead")), self)
        return FuturePending(self._pool.submit(answer, self.endpoint, call), self)

    def is_dead(self) -> bool:
        return self.dead

    def kill(self) -> None:
        self.dead = True
        self.endpoint.refit_abort()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"LocalWorker({self.name}{', dead' if self.dead else ''})"


class ProcessWorker:
    """Drives an endpoint built by ``factory(*args, **kwargs)`` in a spawned process of its own.

    Without Ray, ``LocalWorker`` puts every endpoint in one process: one CUDA context, and
    transports that need two processes (CUDA IPC between ranks on one GPU, as NIXL uses
    it) fall back to host copies. Here each endpoint gets its process; calls run in order,
    one at a time, as on an actor. Requests and answers are pickled over an OS pipe to the
    child this handle spawned, never over a socket. ``kill()`` is a real SIGKILL.
    ``daemon=False`` lets the endpoint start processes of its own (a vLLM engine does); the
    child still ends when this handle's end of the pipe closes.
    """

    batch = None

    def __init__(self, factory: Callable[..., Any], *args: Any, name: str | None = None,
                 start_timeout_s: float = 120.0, daemon: bool = True, **kwargs: Any):
        self.name = name or getattr(factory, "__name__", "worker")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, factory, args, kwargs), daemon=daemon,
                                   name=f"refit-{self.name}")
        self.process.start()
        child.close()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._futures: dict[int, cf.Future] = {}
        self._reader = threading.Thread(target=self._read, name=f"refit-{self.name}-answers", daemon=True)
        self._reader.start()
        try:
            self.call("refit_ping").result(start_timeout_s)  # the endpoint is built and answers
        except BaseException:
            self.close()
            raise

    @property
    def dead(self) -> bool:
        return not self.process.is_alive()

    def is_dead(self) -> bool:
        return self.dead

    def call(self, method: str, *args: Any, **kwargs: Any) -> FuturePending:
        return self._send(method, args, kwargs)

    def request(self, call: EndpointCall) -> FuturePending:
        return self._send(call)

    def _send(self, *message: Any) -> FuturePending:
        """Send ``(id, *message)``: a protocol record, or a method name with its arguments."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self.dead:
                return FuturePending(_failed(WorkerDied(f"{self.name} is dead")), self)
            call_id = next(self._ids)
            self._futures[call_id] = fut
            try:
                self._conn.send((call_id, *message))
            except (OSError, ValueError) as e:
                self._futures.pop(call_id, None)
                return FuturePending(_failed(WorkerDied(f"{self.name}: {e}")), self)
        return FuturePending(fut, self)

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if call_id is None:  # the endpoint could not be built: every call fails with why
                with self._lock:
                    pending, self._futures = self._futures, {}
                for fut in pending.values():
                    fut.set_exception(payload)
                continue
            with self._lock:
                fut = self._futures.pop(call_id, None)
            if fut is not None:
                fut.set_result(payload) if ok else fut.set_exception(payload)
        with self._lock:  # the process is gone: nothing outstanding will be answered
            pending, self._futures = self._futures, {}
        for fut in pending.values():
            fut.set_exception(WorkerDied(f"{self.name} died"))

    def kill(self) -> None:
        """SIGKILL the process and every process it started (they would outlive it as orphans)."""
        tree = _descendants(self.process.pid) if self.process.pid else []
        self.process.kill()
        for pid in tree:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.process.join(10)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the process to tear its endpoint down and exit; kill it if it does not.

        Processes it started and left behind (a vLLM engine core outlives the process that
        made it when that one exits first) are killed too.
        """
        tree = _descendants(self.process.pid) if self.process.pid else []
        if self.process.is_alive():
            with self._lock:
                try:
                    self._conn.send(None)
                except (OSError, ValueError):
                    pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.kill()
        for pid in tree:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._conn.close()

    def __repr__(self) -> str:
        return f"ProcessWorker({self.name}{', dead' if self.dead else ''})"


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then ppid), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on (Linux ``/proc``).

    One reader for the leak checks (ports a worker still holds) and for the checks of where
    a rendezvous binds (addresses): both match the process's socket inodes against the
    kernel's tables. A table that cannot be read counts as empty.
    """
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                        continue
                    hex_addr, hex_port = parts[1].split(":")
                    raw = bytes.fromhex(hex_addr)
                    # IPv4: one little-endian word; IPv6: four of them
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    out.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
        except OSError:
            continue
    return out


def process_resources() -> dict:
    """Open fds, threads and listening TCP ports of this process (Linux ``/proc``), for leak checks."""
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        fds = os.listdir("/proc/self/fd")
        out["fds"] = len(fds)
        out["threads"] = len(os.listdir("/proc/self/task"))
        out["listening_ports"] = sorted(port for _, port in listening_sockets())
    except OSError:
        out.update(fds=-1, threads=threading.active_count(), listening_ports=[])
    return out


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not), from ``/proc``."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from ``/proc`` (empty where there is no ``/proc``)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for e in entries:
        fields = _stat_fields(int(e))
        if fields and len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def sendable_error(e: BaseException, tb: str) -> BaseException:
    """The exception itself when it survives pickling, else a ``RefitError`` carrying its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RefitError(f"{type(e).__name__}: {e}\n{tb}")


def serve_pipe(conn, handle: Callable[..., Any],
               error: Callable[[BaseException, str], Any] = sendable_error) -> None:
    """Answer each ``(id, *request)`` read from ``conn``, in order, with ``(id, True, handle(*request))``,
    or with ``(id, False, error(exception, traceback text))`` when that raises. Ends at ``None`` or
    when the other end of the pipe is gone.

    The one request loop behind a pipe: ``ProcessWorker``'s child and the fleets of
    ``refit.testing.launch`` both run it.
    """
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        call_id, *request = msg
        try:
            conn.send((call_id, True, handle(*request)))
        except BaseException as e:  # every failure goes back to the caller
            conn.send((call_id, False, error(e, traceback.format_exc())))


def _serve(conn, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The child: build the endpoint, then answer ``(id, call)`` (a protocol record) or ``(id, method, args,
    kwargs)`` in order until told to stop.

    An endpoint that fails to build is answered as ``(None, False, error)``, which fails every
    call waiting on this child at once. Left to exit, the child would hang first: Python
    joins a process's non-daemon children before it even prints the error, and a
    half-built vLLM engine leaves its engine core running, so the caller waited out its
    whole start timeout and never learnt why.
    """
    try:
        endpoint = factory(*args, **kwargs)
    except BaseException as e:
        try:
            conn.send((None, False, sendable_error(e, traceback.format_exc())))
        finally:
            conn.close()
            for child in mp.active_children():
                child.terminate()
        raise

    def handle(*request: Any) -> Any:
        if len(request) == 1:
            return answer(endpoint, request[0])
        method, a, kw = request
        return getattr(endpoint, method)(*a, **kw)

    try:
        serve_pipe(conn, handle)
    finally:
        teardown = getattr(endpoint, "refit_teardown", None)
        if teardown is not None:
            teardown()
        conn.close()
