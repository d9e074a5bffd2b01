"""A rendezvous store that speaks only to the ranks of its build, and holds at most what they need.

torch's ``TCPStore`` answers anyone who reaches its port: sealing values (``SealedStore``)
stops a stranger's value from being taken for a rank's, but not the stranger from making
the store hold it. Forty-eight 8 MiB values grew a store host by 390 MiB in 1.3 s, for as
long as the build lived. So a group with a secret rendezvouses here instead:

- every connection proves it holds the build's secret (a challenge-response bound to the
  build) before a single request is read; a connection that sends anything else is a
  tampering attempt, recorded, and the build that sees it fails as tampered. A connection
  that sends nothing (a port probe) is closed and forgotten;
- an unproven connection costs at most ``HANDSHAKE_BYTES`` and ``HANDSHAKE_S``, and at most
  ``MAX_UNPROVEN`` are held at once; once every rank of the world has proven itself the
  store accepts no one else;
- what proven ranks store is bounded too (``StoreLimits``): a value, the values together
  and the number of keys. Past a limit the request is refused and the build is tampered.

Requests and answers are length-prefixed byte strings, never pickled. The client is a
``torch.distributed.Store``, so gloo's own rendezvous goes through it. vLLM's NCCL peer
protocol needs torch's ``TCPStore`` on the wire (vLLM's ranks connect with their own
client), so groups built for ``peer="vllm"`` keep it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from refit.comm.rendezvous import RendezvousTampered
from refit.errors import RefitError

log = logging.getLogger(__name__)

HANDSHAKE_BYTES = 64  # what a connection may send before it has proven it holds the secret
HANDSHAKE_S = 10.0  # how long it has to
MAX_UNPROVEN = 32  # unproven connections held at once; more wait in the kernel's backlog
_CHALLENGE = 32
_MAC = 32
_HEADER = struct.Struct("!BI")  # operation, length of the body
_ITEM = struct.Struct("!I")

# operations
_SET, _GET, _MULTI_GET, _ADD, _CHECK, _WAIT, _DELETE, _NUM_KEYS = range(1, 9)
# answers
_OK, _TIMEOUT, _REFUSED = range(3)


@dataclass(frozen=True)
class StoreLimits:
    """What the ranks of one build may make the store hold.

    The largest legitimate content is the rendezvous of a world and an object gathered from
    every rank: a roster of a few thousand parameters is about 1 MiB in ``wire`` form, and
    gathering one from each of a few hundred ranks holds them all at once. The defaults
    leave room for that (a value up to 64 MiB, 4 MiB a rank plus 64 MiB in all) and are
    far below what would hurt a host. A build that needs more passes its own.
    """

    value_bytes: int = 64 << 20
    bytes_per_rank: int = 4 << 20
    base_bytes: int = 64 << 20
    keys_per_rank: int = 4096

    def total_bytes(self, world_size: int) -> int:
        return self.base_bytes + self.bytes_per_rank * world_size

    def keys(self, world_size: int) -> int:
        return 1024 + self.keys_per_rank * world_size


def _proof(secret: bytes, binding: bytes, side: bytes, *challenges: bytes) -> bytes:
    return hmac.new(secret, b"refit-store\0" + side + b"\0" + binding + b"".join(challenges), hashlib.sha256).digest()


def _items(*parts: bytes) -> bytes:
    return b"".join(_ITEM.pack(len(p)) + p for p in parts)


def _parse(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(body):
        (n,) = _ITEM.unpack_from(body, i)
        i += _ITEM.size
        if i + n > len(body):
            raise ValueError("an item runs past the end of its request")
        out.append(body[i:i + n])
        i += n
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


class StoreServer:
    """The store of one build, hosted by its rank 0 on a listening socket it owns from now on.

    ``tampered`` is the first reason the build cannot be trusted (None while it can): an
    unproven connection that sent something other than a proof, or a proven rank past a limit.
    """

    def __init__(self, listener: socket.socket, secret: bytes, binding: bytes, world_size: int,
                 limits: StoreLimits | None = None):
        self._listener = listener
        self._secret, self._binding = secret, binding
        self.world_size = world_size
        self.limits = limits or StoreLimits()
        self._data: dict[str, bytes] = {}
        self._held = 0  # bytes of every key and value
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._unproven = threading.BoundedSemaphore(MAX_UNPROVEN)
        self._lock = threading.Lock()
        self._proven = 0
        self._connections: set[socket.socket] = set()
        self.tampered: str | None = None
        self.refused_connections = 0  # unproven connections that sent something else
        listener.settimeout(0.2)
        self._acceptor = threading.Thread(target=self._accept, name="refit-store", daemon=True)
        self._acceptor.start()

    # -- connections ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            if not self._unproven.acquire(timeout=0.2):
                continue
            listener = self._listener
            if listener is None:  # every rank is in: nobody else is accepted
                self._unproven.release()
                break
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                self._unproven.release()
                continue
            except OSError:
                self._unproven.release()
                break
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="refit-store-conn", daemon=True).start()

    def _tamper(self, reason: str) -> None:
        with self._changed:
            if self.tampered is None:
                self.tampered = reason
                log.warning("refit store: %s", reason)
            self._changed.notify_all()

    def _prove(self, conn: socket.socket, peer) -> bool:
        conn.settimeout(HANDSHAKE_S)
        challenge = secrets.token_bytes(_CHALLENGE)
        conn.sendall(challenge)
        answer = b""
        try:
            while len(answer) < _MAC + _CHALLENGE:
                more = conn.recv(HANDSHAKE_BYTES - len(answer))
                if not more:
                    break
                answer += more
        except OSError:
            pass  # too slow: judged by what it sent
        if not answer:
            return False  # a port probe, or a connection that never spoke
        ours = _proof(self._secret, self._binding, b"client", challenge)
        if len(answer) != _MAC + _CHALLENGE or not hmac.compare_digest(answer[:_MAC], ours):
            self.refused_connections += 1
            self._tamper(f"a connection from {peer[0]}:{peer[1]} did not prove it holds the build's secret "
                         f"(it sent {len(answer)} byte(s) of something else)")
            return False
        conn.sendall(_proof(self._secret, self._binding, b"server", answer[_MAC:], challenge))
        return True

    def _serve(self, conn: socket.socket, peer) -> None:
        proven = False
        try:
            try:
                proven = self._prove(conn, peer)
            finally:
                self._unproven.release()
            if not proven:
                return
            with self._lock:
                self._proven += 1
                if self._proven >= self.world_size:  # every rank is here: nobody else gets in
                    self._stop_listening()
            conn.settimeout(None)
            while not self._closed.is_set():
                op, size = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                limit = self.limits.value_bytes + 64 * 1024 * (1 + self.world_size)
                if size > limit:
                    self._tamper(f"a rank sent a {size}-byte request, past the store's {limit}-byte limit")
                    return
                conn.sendall(self._answer(op, _parse(_recv_exact(conn, size))))
        except (OSError, ConnectionError, ValueError, struct.error):
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    # -- requests ------------------------------------------------------------------------------
    def _answer(self, op: int, items: list[bytes]) -> bytes:
        if op == _SET:
            key, value = items[0].decode(), items[1]
            return self._set(key, value)
        if op == _ADD:
            key, amount = items[0].decode(), int(items[1])
            with self._changed:  # one step: two ranks adding at once both count
                value = str(int(self._data.get(key, b"0")) + amount).encode()
                answer = self._set(key, value)
            return answer if answer[0] != _OK else bytes([_OK]) + _items(value)
        if op in (_GET, _MULTI_GET, _WAIT):
            timeout, keys = float(items[0]), [k.decode() for k in items[1:]]
            if not self._wait(keys, timeout):
                return bytes([_TIMEOUT])
            if op == _WAIT:
                return bytes([_OK])
            with self._changed:
                return bytes([_OK]) + _items(*(self._data[k] for k in keys))
        if op == _CHECK:
            with self._changed:
                return bytes([_OK, all(k.decode() in self._data for k in items)])
        if op == _DELETE:
            key = items[0].decode()
            with self._changed:
                old = self._data.pop(key, None)
                if old is not None:
                    self._held -= len(key) + len(old)
            return bytes([_OK, old is not None])
        if op == _NUM_KEYS:
            with self._changed:
                return bytes([_OK]) + _items(str(len(self._data)).encode())
        return bytes([_REFUSED]) + _items(f"unknown operation {op}".encode())

    def _set(self, key: str, value: bytes) -> bytes:
        with self._changed:
            old = self._data.get(key)
            held = self._held + len(key) + len(value) - (0 if old is None else len(key) + len(old))
            keys = len(self._data) + (old is None)
            total, most_keys = self.limits.total_bytes(self.world_size), self.limits.keys(self.world_size)
            problem = (f"a {len(value)}-byte value for {key!r}, past the {self.limits.value_bytes}-byte limit"
                       if len(value) > self.limits.value_bytes else
                       f"{held} bytes in all, past the {total}-byte limit" if held > total else
                       f"{keys} keys, past the limit of {most_keys}" if keys > most_keys else None)
            if problem is not None:
                if self.tampered is None:
                    self.tampered = f"the ranks' values would make the store hold {problem}"
                self._changed.notify_all()
                return bytes([_REFUSED]) + _items(problem.encode())
            self._data[key] = value
            self._held = held
            self._changed.notify_all()
            return bytes([_OK])

    def _wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    return False
                self._changed.wait(min(left, 0.5))
            return True

    @property
    def held_bytes(self) -> int:
        return self._held

    # -- teardown ------------------------------------------------------------------------------
    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop serving: the listener and every connection close, and waiters give up."""
        self._closed.set()
        with self._lock:
            self._stop_listening()
            conns, self._connections = list(self._connections), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        with self._changed:
            self._data.clear()
            self._held = 0
            self._changed.notify_all()


class ProvenStore(dist.Store):
    """A rank's client of a ``StoreServer``: proves the build's secret at connect, then asks.

    The connect retries until ``timeout`` (the store's host may not listen yet) and proves,
    both ways, that each side holds the secret for this ``binding``. Waits in ``get`` and
    ``wait`` give up at the store's timeout with ``DistStoreError``, as torch's do.
    """

    def __init__(self, host: str, port: int, secret: bytes, binding: bytes, *, timeout: timedelta):
        super().__init__()
        self._timeout_s = timeout.total_seconds()
        self._lock = threading.Lock()
        deadline = time.monotonic() + self._timeout_s
        last: Exception | None = None
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 5.0), 0.1))
                break
            except OSError as e:
                last = e
                if time.monotonic() >= deadline:
                    raise RefitError(f"cannot reach the rendezvous store at {host}:{port} within "
                                     f"{self._timeout_s:g}s: {last}") from None
                time.sleep(0.01)
        try:
            sock.settimeout(max(deadline - time.monotonic(), HANDSHAKE_S))
            challenge = _recv_exact(sock, _CHALLENGE)
            ours = secrets.token_bytes(_CHALLENGE)
            sock.sendall(_proof(secret, binding, b"client", challenge) + ours)
            answer = _recv_exact(sock, _MAC)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise RefitError(f"the rendezvous store at {host}:{port} closed the connection before it proved "
                             f"itself ({e}): the store of another build, or not a refit store") from None
        if not hmac.compare_digest(answer, _proof(secret, binding, b"server", ours, challenge)):
            sock.close()
            raise RendezvousTampered(f"the rendezvous store at {host}:{port} did not prove it holds the build's "
                                     "secret: something else answers on its port", key="(the store itself)")
        sock.settimeout(None)
        self._sock = sock

    def _ask(self, op: int, *parts: bytes, wait_s: float | None = None) -> list[bytes]:
        body = _items(*parts)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise RefitError("the rendezvous store connection is closed")
            try:
                sock.settimeout(None if wait_s is None else wait_s + 30.0)
                sock.sendall(_HEADER.pack(op, len(body)) + body)
                status = _recv_exact(sock, 1)[0]
                rest = b""
                if status != _TIMEOUT:
                    rest = self._rest(sock, op, len(parts), status)
            except (OSError, ConnectionError) as e:
                self._sock = None
                sock.close()
                raise dist.DistNetworkError(f"the rendezvous store went away: {e}") from None
        if status == _TIMEOUT:
            raise dist.DistStoreError(f"wait timeout after {wait_s:g}s for keys {[p.decode() for p in parts[1:]]}")
        if status == _REFUSED:
            raise RefitError(f"the rendezvous store refused the request: {rest[0].decode()}")
        return rest

    @staticmethod
    def _rest(sock: socket.socket, op: int, sent: int, status: int) -> list[bytes]:
        """The items of an answer: how many follows from the operation (one per key for a get)."""
        if status == _REFUSED:
            count = 1
        elif op in (_GET, _MULTI_GET):
            count = sent - 1
        elif op in (_ADD, _NUM_KEYS):
            count = 1
        elif op in (_CHECK, _DELETE):
            return [_recv_exact(sock, 1)]
        else:
            count = 0
        out = []
        for _ in range(count):
            (n,) = _ITEM.unpack(_recv_exact(sock, _ITEM.size))
            out.append(_recv_exact(sock, n))
        return out

    # -- torch.distributed.Store ---------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._ask(_SET, key.encode(), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._ask(_GET, repr(self._timeout_s).encode(), key.encode(), wait_s=self._timeout_s)[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._ask(_MULTI_GET, repr(self._timeout_s).encode(), *(k.encode() for k in keys),
                         wait_s=self._timeout_s)

    def add(self, key: str, amount: int) -> int:
        return int(self._ask(_ADD, key.encode(), str(int(amount)).encode())[0])

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._ask(_CHECK, *(k.encode() for k in keys))[0][0])

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._ask(_WAIT, repr(seconds).encode(), *(k.encode() for k in keys), wait_s=seconds)

    def delete_key(self, key: str) -> bool:
        return bool(self._ask(_DELETE, key.encode())[0][0])

    def num_keys(self) -> int:
        return int(self._ask(_NUM_KEYS)[0])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


__all__ = ["HANDSHAKE_BYTES", "MAX_UNPROVEN", "ProvenStore", "StoreLimits", "StoreServer"]
