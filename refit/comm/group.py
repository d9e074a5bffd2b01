"""Communicators: refit's own process group, and an adapter for torch's.

``StatelessProcessGroup`` rendezvouses on a TCP store of its own (rank 0 hosts it, and
every rebuild uses a fresh port), so it lives beside the trainer's and the engines' own
process groups instead of hijacking torch's default one. Teardown is ``abort()``, never
a destroy: a destroy is a collective that a dead peer can never join.

Waits are deadline-aware. A gloo receive blocked on a peer that froze is not released
by the process group's own ``abort()`` (measured: only the peer's death or a timed-out
wait closes the pair), so a watchdog arms the group with its deadline
(``set_deadline``) and every wait on a gloo group gives up there. On NCCL, ``abort()``
itself releases a blocked rank.

``backend="nccl"`` builds an NCCL communicator over refit's own binding (``refit.comm.nccl``;
``docs/comm.md`` says why not torch's ``ProcessGroupNCCL`` or ``nccl4py``): the unique id
goes through this group's store under the key of the chosen peer protocol, init is
non-blocking with a deadline, and operations are enqueued on CUDA streams. CUDA tensors
then travel over NCCL and CPU tensors over gloo, behind the same methods.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import pickle
import sys
import threading
import time
import types
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit.comm import nccl, wire
from refit.comm.base import Communicator, GroupAborted, free_port
from refit.comm.rendezvous import (
    OpenStore,
    RendezvousTampered,
    SealedStore,
    bind_listener,
    local_address_towards,
    resolve_secret,
)
from refit.comm.store import ProvenStore, StoreServer
from refit.errors import RefitError, TransportError

log = logging.getLogger(__name__)

_NEMO_UNIQUE_ID_KEY = "nccl_unique_id"
_VLLM_UNIQUE_ID_KEY = "broadcast_from/0/0"
_VLLM_NCCL_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"
_VLLM_PICKLE_LOCK = threading.Lock()
PEERS = ("nemo", "vllm")


class _VllmNcclUniqueId(ctypes.Structure):
    """The layout of vLLM's ``ncclUniqueId`` (128 opaque bytes)."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


def pickle_vllm_unique_id(unique_id_bytes: bytes) -> bytes:
    """Serialize an NCCL unique id in vLLM's metadata wire format.

    A vLLM rank reads the id with ``pickle.loads`` of its own ``ncclUniqueId`` ctypes
    structure. This is the one value refit writes for a reader that unpickles it, and
    only because vLLM's protocol requires it; refit itself never reads it. Trainers do
    not install vLLM, so the same structure is pickled under its
    canonical module name, which is put in ``sys.modules`` only while pickling (under a
    lock, and removed again unless vLLM itself is loaded).
    """
    if len(unique_id_bytes) != 128:
        raise RefitError(f"an NCCL unique id is 128 bytes, got {len(unique_id_bytes)}")
    with _VLLM_PICKLE_LOCK:
        real = sys.modules.get(_VLLM_NCCL_MODULE)
        if real is not None and getattr(real, "ncclUniqueId", None) is not None:
            uid = real.ncclUniqueId()  # vLLM itself is loaded here: use its own type
            ctypes.memmove(ctypes.addressof(uid), unique_id_bytes, 128)
            return pickle.dumps(uid)
        cls = _VllmNcclUniqueId
        parts = _VLLM_NCCL_MODULE.split(".")
        added = [n for n in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if n not in sys.modules]
        for n in added:
            sys.modules[n] = types.ModuleType(n)
        module = sys.modules[_VLLM_NCCL_MODULE]
        saved = (cls.__module__, cls.__qualname__, cls.__name__)
        try:
            cls.__module__, cls.__qualname__, cls.__name__ = _VLLM_NCCL_MODULE, "ncclUniqueId", "ncclUniqueId"
            module.ncclUniqueId = cls
            uid = cls()
            ctypes.memmove(ctypes.addressof(uid), unique_id_bytes, 128)
            return pickle.dumps(uid)
        finally:
            cls.__module__, cls.__qualname__, cls.__name__ = saved
            if getattr(module, "ncclUniqueId", None) is cls:
                del module.ncclUniqueId
            for n in reversed(added):
                sys.modules.pop(n, None)


def _wait_work(work: Any, aborted: threading.Event, deadline: float | None, what: str,
               timeout_s: float | None = None) -> None:
    """Wait for ``work``, giving up at ``deadline`` (a ``time.monotonic()`` value).

    Gloo's works only learn they completed inside ``wait()`` (``is_completed`` stays
    False until then, measured), and its ``abort()`` does not release a waiter, so the
    deadline is passed into the wait itself: a timed-out gloo wait closes the pair,
    which is exactly the release an abort should give. Without a deadline a gloo wait
    gets ``timeout_s``: the group's own timeout, not the shorter one its connect ran under.
    """
    if aborted.is_set():
        raise GroupAborted(f"{what}: the communicator was aborted")
    if getattr(work, "polled", False):  # an NCCL work: the host polls its CUDA event
        work.wait(deadline=deadline, aborted=aborted)
        return
    if deadline is None:
        work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
        return
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError("deadline already passed")
        work.wait(timedelta(seconds=left))
    except Exception as e:
        if aborted.is_set() or time.monotonic() >= deadline - 1e-3:
            raise GroupAborted(f"{what}: released at the refit deadline ({e})") from e
        raise


class _AbortAndDeadline:
    """What every wait of a communicator watches: the flag ``abort()`` sets and the deadline
    ``set_deadline`` arms."""

    _aborted: threading.Event
    _deadline: float | None

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    @property
    def abort_event(self) -> threading.Event:
        """Set by ``abort()``: a thread polling work of this group watches it to give up at once."""
        return self._aborted

    @property
    def deadline(self) -> float | None:
        """When every wait on this group gives up (``time.monotonic()``), as armed by ``set_deadline``."""
        return self._deadline

    def set_deadline(self, deadline: float | None) -> None:
        """Make every wait on this group give up at ``deadline`` (``time.monotonic()``)."""
        self._deadline = deadline


class StatelessProcessGroup(_AbortAndDeadline):
    """A process group with its own rendezvous, independent of ``torch.distributed``'s world.

    ``backend="gloo"`` moves CPU tensors. ``backend="nccl"`` builds an NCCL communicator
    on ``device`` (default: the current CUDA device) with the metadata and warm-up of
    ``peer`` (``"nemo"`` or ``"vllm"``), within ``init_timeout_s``; a gloo group can also
    add one later with ``init_nccl_communicator``. CUDA tensors then go over NCCL, CPU
    tensors over gloo (when the group has one).

    ``secret`` (bytes, or hex text; default: the ``REFIT_RENDEZVOUS_SECRET`` environment
    variable) authenticates every value exchanged through the store: pass the same fresh
    secret to every rank of one build, through a channel you trust (refit's controller
    does, every build). Without one, values are still decoded as data only, never
    unpickled, but a stranger on the port could pass one off as a rank's. The store and
    gloo listen on the interface of ``master_address`` only. ``binding`` (the same bytes on
    every rank: refit's controller passes the epoch and a nonce drawn for the build) ties
    each value to this build, so a value of another build under the same secret is
    refused; without one, the group's name, address, port and size are bound.

    NCCL operations are stream-ordered: ``broadcast`` and ``p2p_group`` return once the
    work is queued on the stream (the current one unless ``stream`` is given), and work
    queued on that stream afterwards sees the result. ``isend``/``irecv`` return a work
    whose ``wait`` blocks the host, deadline- and abort-aware.
    """

    def __init__(
        self,
        master_address: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        name: str = "refit",
        device: Any = None,
        peer: str = "nemo",
        init_timeout_s: float | None = None,
        secret: bytes | str | None = None,
        binding: bytes | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise RefitError(f"StatelessProcessGroup: rank {rank} is outside world size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise RefitError(f"StatelessProcessGroup: backend must be 'gloo' or 'nccl', got {backend!r}")
        if peer not in PEERS:
            raise RefitError(f"StatelessProcessGroup: peer must be one of {PEERS}, got {peer!r}")
        self._init_state(name, rank, world_size, backend, timeout_s)
        self.master_address = master_address
        self.port = port
        self.peer = peer
        self.init_timeout_s = init_timeout_s if init_timeout_s is not None else min(timeout_s, 120.0)
        if binding is None:  # what tells this build from another on the same secret, without a nonce
            binding = f"{name}\0{master_address}:{port}\0{world_size}".encode()
        try:
            self._connect(resolve_secret(secret), bytes(binding), time.monotonic() + self.init_timeout_s)
            if backend == "nccl":
                self.init_nccl_communicator(device, peer=peer)
        except BaseException:
            self.abort()  # nothing of a failed build stays listening
            raise

    def _init_state(self, name: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.children: list[StatelessProcessGroup] = []
        self.parent_ranks: list[int] | None = None  # for a split child: its members' ranks in the parent
        self.device = None
        self._aborted = threading.Event()
        self._abort_lock = threading.Lock()
        self._seq = 0
        self._splits = 0
        self._deadline: float | None = None
        self._pg = None
        self._nccl = None
        self.store: SealedStore | None = None
        self._store_server: StoreServer | None = None  # rank 0 of a group with a secret hosts it
        self._store_client: ProvenStore | None = None
        self.authenticated = False

    def _connect(self, secret: bytes | None, binding: bytes, deadline: float) -> None:
        """The store, then gloo, both within ``deadline`` (``time.monotonic()``).

        With a secret the store is refit's own (``refit.comm.store``): only a rank that proves
        the secret gets in, and what it may store is bounded. vLLM's NCCL peers join with
        torch's own store client, so a group for them keeps torch's ``TCPStore``.
        """
        hosting = self.rank == 0
        listener = bind_listener(self.master_address, self.port) if hosting else None
        if secret is not None and self.peer != "vllm":
            self._connect_proven(listener, secret, binding, deadline)
            return
        try:
            extra = {"master_listen_fd": listener.fileno()} if hosting else {}
            # A client retries its connect for the store's whole timeout: bounded by the connect
            # budget, not the group's, so a worker joining a build whose host is gone gives up
            # at its deadline (under the group's 8s timeout it took 21s, and the calls queued
            # behind it on the worker missed the next build too).
            tcp = dist.TCPStore(
                self.master_address, self.port, self.world_size, hosting,
                timeout=timedelta(seconds=max(min(self.timeout_s, deadline - time.monotonic()), 0.1)),
                wait_for_workers=False, **extra,
            )
        except Exception as e:  # torch raises RuntimeError/DistNetworkError subclasses
            if listener is not None:
                listener.close()
            raise RefitError(
                f"StatelessProcessGroup rank {self.rank}/{self.world_size}: cannot "
                f"{'host' if hosting else 'reach'} the rendezvous store at "
                f"{self.master_address}:{self.port}: {e}"
            ) from e
        if listener is not None:
            listener.detach()  # the store owns the socket now, and closes it
        self.store = SealedStore(tcp, secret, binding) if secret is not None else OpenStore(tcp)
        self.authenticated = secret is not None
        if self.backend == "gloo":
            self._connect_gloo(deadline)
        else:
            self.store.set_timeout(timedelta(seconds=self.timeout_s))

    def _connect_proven(self, listener, secret: bytes, binding: bytes, deadline: float) -> None:
        if listener is not None:
            self._store_server = StoreServer(listener, secret, binding, self.world_size)
        try:
            client = ProvenStore(self.master_address, self.port, secret, binding,
                                 timeout=timedelta(seconds=max(min(self.timeout_s, deadline - time.monotonic()), 0.1)))
        except RendezvousTampered as e:
            self._close_store()
            raise RendezvousTampered(f"StatelessProcessGroup rank {self.rank}/{self.world_size}: {e}", key=e.key,
                                     rank=self.rank) from None
        except Exception as e:
            self._close_store()
            raise RefitError(f"StatelessProcessGroup rank {self.rank}/{self.world_size}: cannot "
                             f"{'host' if listener is not None else 'reach'} the rendezvous store at "
                             f"{self.master_address}:{self.port}: {e}") from e
        self._store_client = client
        self.store = SealedStore(client, secret, binding)
        self.authenticated = True
        if self.backend == "gloo":
            self._connect_gloo(deadline)
        else:
            self.store.set_timeout(timedelta(seconds=self.timeout_s))

    def _check_store_server(self) -> None:
        """On the store's host: ``RendezvousTampered`` once the store has seen a stranger or a flood."""
        server = self._store_server
        if server is not None and server.tampered is not None:
            raise RendezvousTampered(f"StatelessProcessGroup rank {self.rank}/{self.world_size} (the store's host): "
                                     f"{server.tampered}; refusing the build", rank=self.rank)

    def _close_store(self) -> None:
        client, self._store_client = self._store_client, None
        if client is not None:
            client.close()
        server, self._store_server = self._store_server, None
        if server is not None:
            server.close()

    def _connect_gloo(self, deadline: float) -> None:
        """Build the gloo group, giving up at ``deadline`` even if a peer dies half-way through.

        Gloo waits five times its timeout for a peer to connect in (measured: a peer killed
        during connectFullMesh held the others 30s under a 6s timeout). So every rank first
        announces itself on the store and waits, abortable and naming the missing ranks,
        until all have; only then is gloo built, with a fifth of what is left, which bounds
        its full-mesh connect by the deadline. Operations get the group's own timeout back.
        """
        limit = self.init_timeout_s
        arrived = [f"{self.name}/arrived/{r}" for r in range(self.world_size)]
        self.store.set(arrived[self.rank], b"1")
        while True:
            self._check_store_server()
            try:
                if self.store.check(arrived):
                    break
                problem = None
            except Exception as e:  # rank 0, the store's host, is gone: wait for the deadline
                problem = e
            if self._aborted.is_set() or time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(arrived) if not self._has_key(k)]
                why = (f"the store at {self.master_address}:{self.port} failed: {problem}" if problem is not None
                       else f"rank(s) {missing} never arrived within {limit:g}s")
                if self._aborted.is_set():
                    raise GroupAborted(f"rank {self.rank}: aborted while connecting: {why}")
                raise TransportError(f"StatelessProcessGroup rank {self.rank}/{self.world_size}: {why}")
            time.sleep(0.01)
        left = max(deadline - time.monotonic(), 0.5)
        self.store.set_timeout(timedelta(seconds=left))
        try:
            self._pg = self._gloo_group(f"{self.name}/gloo", self.rank, self.world_size, timeout_s=left / 5)
        except Exception as e:
            self._raise_if_tampered(e)
            raise
        self._pg._set_default_timeout(timedelta(seconds=self.timeout_s))
        self.store.set_timeout(timedelta(seconds=self.timeout_s))

    def _raise_if_tampered(self, error: BaseException) -> None:
        """``RendezvousTampered`` naming the key and this rank, when a value read under ``error`` did not verify.

        Gloo reads its peers' addresses through this store from inside its own code, and
        what reaches Python then is only that its rendezvous failed; the store remembers
        which key held the forged value.
        """
        self._check_store_server()
        key = getattr(self.store, "tampered", None)
        if key is not None:
            raise RendezvousTampered(
                f"StatelessProcessGroup rank {self.rank}/{self.world_size}: the rendezvous key {key!r} held a "
                f"value no rank of this build wrote ({type(error).__name__} in the connect); refusing the build",
                key=key, rank=self.rank) from error

    def _gloo_group(self, prefix: str, rank: int, world_size: int, *, timeout_s: float | None = None):
        """A gloo group whose pairs listen on the interface that routes to the master only."""
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(self.master_address))]
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank, world_size, opts)

    # -- NCCL ---------------------------------------------------------------------------------
    def init_nccl_communicator(self, device: Any = None, *, peer: str = "nemo", timeout_s: float | None = None) -> None:
        """Initialize NCCL using the metadata and warm-up protocol of the peer.

        ``peer="nemo"`` publishes the raw 128-byte unique id under ``nccl_unique_id`` and
        warms up with a broadcast from rank 0. ``peer="vllm"`` also publishes vLLM's
        pickled ``ncclUniqueId`` under ``broadcast_from/0/0`` and warms up with an
        all-reduce, as vLLM's ``PyNcclCommunicator`` does. The receiver's protocol is not
        negotiable, so a generation backend must select the one it implements.

        Init never blocks past ``timeout_s`` (default ``init_timeout_s``): a rank that never
        arrives makes every other rank raise, naming the missing ranks.
        """
        if peer not in PEERS:
            raise RefitError(f"init_nccl_communicator: peer must be one of {PEERS}, got {peer!r}")
        if self._aborted.is_set():
            raise GroupAborted(f"init_nccl_communicator on an aborted communicator (rank {self.rank})")
        if self._nccl is not None:
            raise RefitError(f"rank {self.rank}: this group already has an NCCL communicator")
        if not torch.cuda.is_available():
            raise RefitError("StatelessProcessGroup: backend 'nccl' needs a CUDA device, and torch sees none")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise RefitError(f"init_nccl_communicator: device must be a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        limit = self.init_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        deadline = t0 + limit
        lib = nccl.library()
        if self.rank == 0:
            uid = lib.unique_id()
            self.store.set(_NEMO_UNIQUE_ID_KEY, uid)
            if peer == "vllm":  # vLLM's ranks read this key raw and unpickle it: its protocol, not ours
                self.store.set_unsealed(_VLLM_UNIQUE_ID_KEY, pickle_vllm_unique_id(uid))
        else:
            self._wait_keys([_NEMO_UNIQUE_ID_KEY], deadline, limit, "rank 0 never published the NCCL unique id")
            uid = self.store.get(_NEMO_UNIQUE_ID_KEY)
        arrived = [f"{self.name}/nccl/arrived/{r}" for r in range(self.world_size)]
        self.store.set(arrived[self.rank], b"1")
        try:
            comm = nccl.NcclComm.init_rank(uid, self.rank, self.world_size, dev.index,
                                           deadline=deadline, aborted=self._aborted, lib=lib)
        except nccl.NcclTimeout as e:
            missing = [r for r, k in enumerate(arrived) if not self._has_key(k)]
            who = (f"rank(s) {missing} never arrived" if missing else
                   "every refit rank arrived, but a peer (or NCCL's bootstrap) never completed")
            raise TransportError(
                f"StatelessProcessGroup rank {self.rank}/{self.world_size}: NCCL init did not complete "
                f"within {limit:g}s: {who}"
            ) from e
        self._nccl = comm
        self.device = dev
        try:
            with torch.cuda.device(dev):
                stream = torch.cuda.current_stream()
                t = torch.zeros(1, dtype=torch.float32, device=dev)
                if peer == "nemo":
                    if self.rank == 0:
                        t.fill_(1.0)
                    comm.broadcast(t.data_ptr(), 1, 0, stream.cuda_stream, deadline=deadline, dtype=nccl.FLOAT32)
                else:
                    comm.all_reduce_f32(t.data_ptr(), 1, stream.cuda_stream, deadline=deadline)
                ev = torch.cuda.Event()
                ev.record(stream)
                nccl.NcclWork(ev, comm, "NCCL warm-up", keep=t).wait(deadline=deadline, aborted=self._aborted)
        except nccl.NcclTimeout as e:
            raise TransportError(
                f"StatelessProcessGroup rank {self.rank}/{self.world_size}: the NCCL warm-up "
                f"({'broadcast' if peer == 'nemo' else 'all-reduce'}) did not finish within {limit:g}s; "
                "a peer joined the communicator but never ran it (a peer protocol mismatch?)"
            ) from e
        log.debug("rank %d: NCCL %s up on %s in %.2fs", self.rank, lib.version, dev, time.monotonic() - t0)

    def _has_key(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _wait_keys(self, keys: list[str], deadline: float, limit: float, what: str) -> None:
        while not all(self._has_key(k) for k in keys):
            if self._aborted.is_set():
                raise GroupAborted(f"rank {self.rank}: aborted while waiting: {what}")
            if time.monotonic() >= deadline:
                raise TransportError(f"StatelessProcessGroup rank {self.rank}/{self.world_size}: {what} "
                                     f"within {limit:g}s")
            time.sleep(0.01)

    @property
    def nccl_comm(self):
        """The ``refit.comm.nccl.NcclComm`` of this group, or None."""
        return self._nccl

    @property
    def stream_ordered(self) -> bool:
        """True when CUDA tensors travel over NCCL on CUDA streams (the transport's fast path)."""
        return self._nccl is not None

    # -- state -----------------------------------------------------------------------
    def _check(self, what: str) -> None:
        if self._aborted.is_set():
            raise GroupAborted(f"{what} on an aborted communicator (rank {self.rank})")
        if self._pg is None:
            raise RefitError(f"{what}: this group has no gloo communicator for CPU tensors "
                             f"(backend {self.backend!r})")

    def _nccl_for(self, tensor: torch.Tensor, what: str):
        """The NCCL communicator if ``tensor`` should travel over it, else None."""
        if not tensor.is_cuda:
            return None
        if self._aborted.is_set():
            raise GroupAborted(f"{what} on an aborted communicator (rank {self.rank})")
        if self._nccl is None:
            raise RefitError(f"{what}: a CUDA tensor needs an NCCL communicator; build the group with "
                             "backend='nccl' or call init_nccl_communicator()")
        if not tensor.is_contiguous():
            raise RefitError(f"{what}: NCCL needs a contiguous tensor, got strides {tuple(tensor.stride())}")
        return self._nccl

    # -- object exchange over the store ---------------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one value from every rank, through the store (no tensor collective).

        Values travel in ``refit.comm.wire``'s data-only format (numbers, strings, bytes,
        lists, tuples, dicts, numeric arrays, registered records) and, with a secret,
        authenticated: what a rank reads can neither run code nor come from a stranger.
        """
        if self._aborted.is_set():
            raise GroupAborted(f"all_gather_object on an aborted communicator (rank {self.rank})")
        payload = wire.pack(obj)  # before the sequence moves: a value that is not data fails alone
        self._seq += 1
        prefix = f"{self.name}/ago/{self._seq}"
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        try:
            self.store.set(keys[self.rank], payload)
            values = self.store.multi_get(keys)
        except RendezvousTampered as e:
            raise RendezvousTampered(f"all_gather_object rank {self.rank}: {e}", key=e.key, rank=self.rank) from None
        except Exception as e:
            raise self.store_failure("all_gather_object", e) from e
        try:
            if self.store.add(f"{prefix}/read", 1) == self.world_size:
                for k in keys + [f"{prefix}/read"]:
                    self.store.delete_key(k)
        except Exception:  # every value was read: the store's host may have gone since, its keys with it
            pass
        return [wire.unpack(v) for v in values]

    def store_failure(self, what: str, e: BaseException) -> TransportError:
        """A refit error for a failed call to the store, naming its host when the store is gone.

        Rank 0 hosts the store: once it has raised on bad input and its process exited, the
        others' next call fails with torch's own network error, which named neither the rank
        nor the store. A timeout says that a peer did not publish; anything else that the
        store is unreachable.
        """
        host = "rank 0" if self.parent_ranks is None else f"rank {self.parent_ranks[0]} of the parent group"
        if isinstance(e, dist.DistStoreError) and "timeout" in str(e).lower():
            why = f"a peer did not publish within {self.timeout_s:g}s"
        else:
            why = (f"the store at {self.master_address}:{self.port} is gone: {host}, which hosts it, "
                   "exited or closed its group")
        text = str(e).strip().splitlines()
        return TransportError(f"{what} rank {self.rank}: {why} ({type(e).__name__}: {text[0] if text else ''})")

    def confirm(self) -> None:
        """Return once every rank of this group has called it (after a transfer: every rank finished).

        Over gloo, an all-reduce of one element: a peer that died fails it at once, since
        its pairs are closed, and a live one that is late is waited for until the deadline;
        through the store, a peer that died is only seen at the store's timeout. A transfer
        without it let ranks that had sent their part report success while a receiver died.
        """
        if self._aborted.is_set():
            raise GroupAborted(f"confirm on an aborted communicator (rank {self.rank})")
        if self._pg is None:
            self.barrier()
            return
        self.wait(self._pg.allreduce([torch.zeros(1, dtype=torch.int32)]))

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return self.all_gather_object(obj if self.rank == src else None)[src]

    # -- tensors ------------------------------------------------------------------------
    def _stream(self, stream):
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def _nccl_p2p(self, comm, recvs, sends, what: str, stream=None):
        s = self._stream(stream)
        comm.group([(t.data_ptr(), t.numel() * t.element_size(), p) for t, p in recvs],
                   [(t.data_ptr(), t.numel() * t.element_size(), p) for t, p in sends],
                   s.cuda_stream, deadline=self._deadline)
        ev = torch.cuda.Event()
        ev.record(s)
        return nccl.NcclWork(ev, comm, f"rank {self.rank}: {what}", keep=[t for t, _ in recvs + sends])

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        comm = self._nccl_for(tensor, "isend")
        if comm is not None:
            return self._nccl_p2p(comm, [], [(tensor, peer)], f"send to {peer}")
        self._check("isend")
        return self._pg.send([tensor], peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        comm = self._nccl_for(tensor, "irecv")
        if comm is not None:
            return self._nccl_p2p(comm, [(tensor, peer)], [], f"recv from {peer}")
        self._check("irecv")
        return self._pg.recv([tensor], peer, tag)

    def p2p_group(self, recvs: Sequence[tuple[torch.Tensor, int]], sends: Sequence[tuple[torch.Tensor, int]],
                  *, stream=None, tag: int = 0) -> list[Any]:
        """Post receives then sends as one group; return the works the host must wait on.

        On NCCL the group is one ``ncclGroupStart/End`` on ``stream`` (the current stream by
        default) and nothing is returned: work queued on that stream afterwards is ordered
        after it. On gloo each is posted asynchronously and the works are returned.
        """
        if not recvs and not sends:
            return []
        first = (list(recvs) + list(sends))[0][0]
        if first.is_cuda:
            comm = self._nccl_for(first, "p2p_group")
            for t, _ in list(recvs) + list(sends):
                self._nccl_for(t, "p2p_group")
            s = self._stream(stream)
            comm.group([(t.data_ptr(), t.numel() * t.element_size(), p) for t, p in recvs],
                       [(t.data_ptr(), t.numel() * t.element_size(), p) for t, p in sends],
                       s.cuda_stream, deadline=self._deadline)
            return []
        self._check("p2p_group")
        works = [self._pg.recv([t], p, tag) for t, p in recvs]
        works += [self._pg.send([t], p, tag) for t, p in sends]
        return works

    def p2p_group_raw(self, recvs: Sequence[tuple[int, int, int]], sends: Sequence[tuple[int, int, int]],
                      *, stream) -> None:
        """``p2p_group`` on device addresses: ``(ptr, nbytes, peer)`` triples, one NCCL group on
        ``stream``. For callers that keep the memory alive and ordered themselves (the transport)."""
        if self._aborted.is_set():
            raise GroupAborted(f"p2p_group on an aborted communicator (rank {self.rank})")
        if self._nccl is None:
            raise RefitError("p2p_group_raw: this group has no NCCL communicator")
        if recvs or sends:
            self._nccl.group(recvs, sends, stream.cuda_stream, deadline=self._deadline)

    def connect_peers(self, peers: Sequence[int]) -> None:
        """Open NCCL's p2p connections to ``peers`` now, in one group (every rank of a plan calls
        it with its peers, a symmetric set). NCCL otherwise connects inside the first group that
        names a peer, a pairwise rendezvous whose order would then depend on each rank's windows."""
        comm = self._nccl
        if comm is None:
            return
        done = comm.connected
        todo = sorted(set(int(p) for p in peers) - done - {self.rank})
        if not todo:
            return
        a = torch.zeros(2 * len(todo), dtype=torch.uint8, device=self.device)
        s = torch.cuda.current_stream(self.device)
        comm.group([(a.data_ptr() + i, 1, p) for i, p in enumerate(todo)],
                   [(a.data_ptr() + len(todo) + i, 1, p) for i, p in enumerate(todo)], s.cuda_stream,
                   deadline=self._deadline)
        ev = torch.cuda.Event()
        ev.record(s)
        self.wait(nccl.NcclWork(ev, comm, f"rank {self.rank}: connecting to {todo}", keep=a))
        done.update(todo)

    def set_deadline(self, deadline: float | None) -> None:
        """Make every wait on this group and its split children give up at ``deadline``."""
        super().set_deadline(deadline)
        for child in self.children:
            child.set_deadline(deadline)

    def wait(self, work: Any) -> None:
        _wait_work(work, self._aborted, self._deadline, f"rank {self.rank}", self.timeout_s)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        """Broadcast ``tensor`` from ``src``. Over gloo this blocks until done; over NCCL it is
        queued on ``stream`` (default: the current stream)."""
        comm = self._nccl_for(tensor, "broadcast")
        if comm is not None:
            s = self._stream(stream)
            comm.broadcast(tensor.data_ptr(), tensor.numel() * tensor.element_size(), src, s.cuda_stream,
                           deadline=self._deadline)
            return
        if self._pg is None and self._nccl is not None and not self._aborted.is_set():
            # a CPU tensor on an NCCL-only group: bounce it through the group's device
            dev_t = tensor.contiguous().to(self.device)
            s = self._stream(stream)
            self._nccl.broadcast(dev_t.data_ptr(), dev_t.numel() * dev_t.element_size(), src, s.cuda_stream,
                                 deadline=self._deadline)
            ev = torch.cuda.Event()
            ev.record(s)
            self.wait(nccl.NcclWork(ev, self._nccl, f"rank {self.rank}: broadcast", keep=dev_t))
            tensor.copy_(dev_t.cpu())
            return
        self._check("broadcast")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.wait(self._pg.broadcast([tensor], opts))

    def barrier(self) -> None:
        self.all_gather_object(None)

    # -- split children -----------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> StatelessProcessGroup | None:
        """A child group of the ranks that pass the same ``color`` (ordered by ``key``, then rank).

        Every rank of this group calls it; a rank passing ``color=None`` joins no child and
        gets None. The child has its own communicator (an ``ncclCommSplit`` sharing this
        one's resources, and/or a gloo group) but no store of its own: it uses this
        group's store under a prefix. It is listed in ``children`` and aborted first.
        """
        if self._aborted.is_set():
            raise GroupAborted(f"split on an aborted communicator (rank {self.rank})")
        key = self.rank if key is None else int(key)
        gathered = self.all_gather_object((color, key))
        self._splits += 1
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(gathered)
                                         if color is not None and c == color)]
        child = None
        if color is not None:
            child = object.__new__(type(self))
            child._init_state(f"{self.name}/split{self._splits}/{color}", members.index(self.rank), len(members),
                              self.backend, self.timeout_s)
            child.parent_ranks = members
            child.master_address, child.port, child.peer = self.master_address, self.port, self.peer
            child.init_timeout_s = self.init_timeout_s
            child.store = self.store
            child._deadline = self._deadline
        if self._nccl is not None:
            deadline = time.monotonic() + self.init_timeout_s
            aborted = child.abort_event if child is not None else threading.Event()
            sub = self._nccl.split(color, members.index(self.rank) if child is not None else 0,
                                   deadline=deadline, aborted=aborted)
            if child is not None:
                sub.rank, sub.world_size = child.rank, child.world_size
                child._nccl, child.device = sub, self.device
        if child is not None:
            if self._pg is not None:
                child._pg = self._gloo_group(f"{child.name}/gloo", child.rank, child.world_size)
            self.children.append(child)
        return child

    # -- teardown -------------------------------------------------------------------------
    def abort(self) -> None:
        """Release every rank blocked on this group, now, whether or not peers are alive.

        Idempotent and safe on a group never built. Split children go first: a child has
        its own abort flag, and a rank blocked on a child would never be released by
        aborting the parent alone. The store is dropped too, so a worker that recovers
        many times does not keep one bound store per recovery.
        """
        with self._abort_lock:
            if self._aborted.is_set():
                return
            self._aborted.set()
        for child in self.children:
            try:
                child.abort()
            except Exception:  # abort must not raise on a dying fleet
                log.exception("aborting a child communicator failed")
        comm, self._nccl = self._nccl, None
        pg, self._pg = self._pg, None
        for what, part in (("NCCL abort", comm), ("process group abort", pg)):
            if part is not None:
                try:
                    part.abort()
                except Exception:
                    log.debug("%s raised", what, exc_info=True)
        self.store = None
        if self.parent_ranks is None:  # a split child shares its parent's store
            self._close_store()

    shutdown = abort

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "live"
        backend = self.backend + ("+nccl" if self._nccl is not None and self.backend != "nccl" else "")
        where = f"{getattr(self, 'master_address', '?')}:{getattr(self, 'port', '?')}"
        child = f", child of ranks {self.parent_ranks}" if self.parent_ranks is not None else ""
        return f"StatelessProcessGroup({backend}, rank={self.rank}/{self.world_size}, {where}{child}, {state})"


class TorchGroupComm(_AbortAndDeadline):
    """Adapts a plain torch process group (the default one, or any ``new_group``)."""

    def __init__(self, group: Any = None):
        if not dist.is_initialized():
            raise RefitError("process_group: torch.distributed is not initialized; call "
                             "init_process_group first or pass a refit.StatelessProcessGroup")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._aborted = threading.Event()
        self._deadline: float | None = None
        try:
            backend = str(dist.get_backend(self.group)).lower()
        except Exception:
            backend = ""
        self.stream_ordered = "nccl" in backend

    def isend(self, tensor, peer, tag=0):
        return dist.isend(tensor, dst=dist.get_global_rank(self.group, peer), group=self.group, tag=tag)

    def irecv(self, tensor, peer, tag=0):
        return dist.irecv(tensor, src=dist.get_global_rank(self.group, peer), group=self.group, tag=tag)

    def p2p_group(self, recvs, sends, *, stream=None, tag: int = 0) -> list[Any]:
        """``batch_isend_irecv``; on NCCL the works are joined into ``stream`` (nothing to wait on)."""
        ops = [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, p), self.group, tag) for t, p in recvs]
        ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, p), self.group, tag) for t, p in sends]
        if not ops:
            return []
        if not self.stream_ordered:
            return dist.batch_isend_irecv(ops)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            works = dist.batch_isend_irecv(ops)
            for w in works:
                w.wait()  # NCCL: makes the current stream wait; the host does not block
        return []

    def wait(self, work) -> None:
        _wait_work(work, self._aborted, self._deadline, f"rank {self.rank}")

    def broadcast(self, tensor, src, stream=None) -> None:
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)

    def all_gather_object(self, obj):
        """Gather one value from every rank in ``refit.comm.wire``'s format, as bytes in tensors.

        Not torch's ``all_gather_object``: that one unpickles what every peer sent.
        """
        payload = torch.frombuffer(bytearray(wire.pack(obj)), dtype=torch.uint8)
        device = torch.device("cuda", torch.cuda.current_device()) if self.stream_ordered else torch.device("cpu")
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload.to(device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        return [wire.unpack(g[: int(n.item())].cpu().numpy().tobytes()) for g, n in zip(gathered, sizes)]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def confirm(self) -> None:
        """Return once every rank of the group has called it; waits end at the deadline."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.stream_ordered else torch.device("cpu")
        self.wait(dist.all_reduce(torch.zeros(1, dtype=torch.int32, device=device), group=self.group, async_op=True))

    def abort(self) -> None:
        self._aborted.set()


def as_communicator(process_group: Any) -> Communicator:
    """Accept a ``StatelessProcessGroup``, a refit communicator, or a torch process group."""
    if isinstance(process_group, (StatelessProcessGroup, TorchGroupComm)):
        return process_group
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return TorchGroupComm(process_group)
    needed = ("rank", "world_size", "isend", "irecv", "wait", "broadcast", "all_gather_object")
    if all(hasattr(process_group, a) for a in needed):
        return process_group
    raise RefitError(
        f"process_group: expected a refit.StatelessProcessGroup or a torch ProcessGroup, "
        f"got {type(process_group).__name__}"
    )


def ranks_in_group(comm: Communicator, ranks: Sequence[int], *, param: str) -> None:
    bad = sorted(r for r in ranks if not 0 <= r < comm.world_size)
    if bad:
        raise RefitError(f"{param}: rank(s) {bad} outside the process group of world size {comm.world_size}")


__all__ = [
    "PEERS", "Communicator", "GroupAborted", "StatelessProcessGroup", "TorchGroupComm", "as_communicator",
    "free_port", "pickle_vllm_unique_id", "ranks_in_group",
]
