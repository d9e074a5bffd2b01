"""A rendezvous store that only the ranks of one build can write to, on the interface it needs.

torch's ``TCPStore`` listens on every interface and trusts every client: anyone who could
reach the port could pre-publish a rank's next value, overwrite the NCCL unique id, or
redirect gloo's pairs to an address of their own. So:

- the host binds the socket itself, on the interface of the master address, and hands
  it to the store (a loopback rendezvous stays on loopback);
- every build has a fresh secret, handed to the ranks through the launcher's own
  channel (Ray's authenticated calls, the pipe of a worker process, vLLM's engine API),
  and every value written through ``SealedStore`` carries an HMAC-SHA256 of the key and
  the value under that secret; a value that does not verify is refused, naming its key;
- gloo's pairs listen on the address that routes to the master, not on every interface.

Counters (``add``) and key existence (``check``) are not authenticated: a stranger who
can reach the port can still stall a rendezvous until its deadline (any open port can
be flooded), but cannot inject a value or make a rank run anything.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from refit.errors import RefitError

SECRET_ENV = "REFIT_RENDEZVOUS_SECRET"
SECRET_BYTES = 32
_MAC_BYTES = 32


class RendezvousTampered(RefitError):
    """A value in the rendezvous store was not written by a rank of this build.

    ``key`` is the store key that held it and ``rank`` the rank that read it (None where
    unknown). Nothing about the build can be trusted after it, so it is rebuilt from
    nothing: a fresh secret, nonce and port.
    """

    def __init__(self, message: str, *, key: str | None = None, rank: int | None = None):
        super().__init__(message)
        self.key = key
        self.rank = rank


def new_secret() -> bytes:
    """A fresh secret for one build of a communicator."""
    return secrets.token_bytes(SECRET_BYTES)


def resolve_secret(secret: bytes | str | None) -> bytes | None:
    """``secret`` as bytes (hex strings accepted, as environment variables and JSON carry them);
    without one, the ``REFIT_RENDEZVOUS_SECRET`` environment variable (hex), else None."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
    if isinstance(secret, str):
        try:
            secret = bytes.fromhex(secret)
        except ValueError:
            raise RefitError("secret: a rendezvous secret given as text must be hex") from None
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise RefitError(f"secret: a rendezvous secret is at least 16 bytes, got "
                         f"{len(secret) if isinstance(secret, (bytes, bytearray)) else type(secret).__name__}")
    return bytes(secret)


class SealedStore(dist.Store):
    """A store whose values are authenticated: HMAC-SHA256 of build, key and value under a secret.

    The key is part of the MAC, so a value cannot be replayed under another key. So is the
    build (``binding``: its epoch and a nonce drawn for it), so a value cannot be replayed
    into another build either, even when builds share a secret: a user's
    ``REFIT_RENDEZVOUS_SECRET`` does, and so does every re-init of vLLM's weight transfer.
    It is a ``torch.distributed.Store``, so gloo's own rendezvous goes through it as well.
    A value that does not verify is remembered (``tampered``): it may be read inside gloo's
    own code, which reports only that its rendezvous failed.
    """

    def __init__(self, inner: dist.Store, secret: bytes, binding: bytes = b""):
        super().__init__()
        self.inner = inner
        self._secret = secret
        self._binding = hashlib.sha256(b"refit-build\0" + binding).digest()
        self.tampered: str | None = None  # the first key whose value did not verify

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, self._binding + key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _seal(self, key: str, value: bytes | str) -> bytes:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, raw) + raw

    def _open(self, key: str, sealed: bytes) -> bytes:
        mac, raw = sealed[:_MAC_BYTES], sealed[_MAC_BYTES:]
        if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, raw)):
            if self.tampered is None:
                self.tampered = key
            raise RendezvousTampered(
                f"rendezvous key {key!r} holds a value no rank of this build wrote (it does not verify "
                "under the build's secret and nonce): something else wrote to the store, or replayed a "
                "value of another build; refusing it", key=key)
        return raw

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.inner.get(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self.inner.multi_get(list(keys)))]

    def set_unsealed(self, key: str, value: bytes) -> None:
        """Write a value as it is, for a peer that reads the store without refit (vLLM's NCCL id)."""
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self.inner.check(list(keys))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(list(keys))
        else:
            self.inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


class OpenStore(SealedStore):
    """The same interface without authentication, for a group built without a secret.

    Values are still decoded as data only, so nothing a stranger writes can run code;
    but it could be taken for a rank's value. Groups that refit builds always have a secret.
    """

    def __init__(self, inner: dist.Store):
        super().__init__(inner, b"")

    def _seal(self, key: str, value: bytes | str) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def _open(self, key: str, sealed: bytes) -> bytes:
        return sealed


def _addresses(host: str) -> list[tuple]:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RefitError(f"master_address: cannot resolve {host!r}: {e}") from None


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``'s own interface (an empty host or 0.0.0.0 means every one)."""
    family, _, _, _, addr = _addresses(host or "0.0.0.0")[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr[0], port))
        sock.listen(4096)
    except OSError as e:
        sock.close()
        raise RefitError(f"master_address/port: cannot listen on {host}:{port}: {e}") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in _addresses(host))
    except ValueError:
        return False


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent)."""
    family, _, _, _, addr = _addresses(host)[0]
    if is_loopback(host):
        return addr[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr[0], 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


__all__ = [
    "SECRET_ENV", "OpenStore", "RendezvousTampered", "SealedStore", "bind_listener", "is_loopback",
    "local_address_towards", "new_secret", "resolve_secret",
]
