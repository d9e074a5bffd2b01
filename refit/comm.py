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
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from refit.errors import RefitError, TransportError

log = logging.getLogger(__name__)



class GroupAborted(TransportError):
    """The communicator was aborted while this rank waited on it."""


class Communicator(Protocol):
    """What the transport needs from a process group. Peers are ranks of this group."""

    rank: int
    world_size: int

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


def _wait_work(work: Any, aborted: threading.Event, deadline: float | None, what: str) -> None:
    """Wait for ``work``, giving up at ``deadline`` (a ``time.monotonic()`` value).

    Gloo's works only learn they completed inside ``wait()`` (``is_completed`` stays
    False until then, measured), and its ``abort()`` does not release a waiter, so the
    deadline is passed into the wait itself: a timed-out gloo wait closes the pair,
    which is exactly the release an abort should give.
    """
    if aborted.is_set():
        raise GroupAborted(f"{what}: the communicator was aborted")
    if deadline is None:
        work.wait()
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


class StatelessProcessGroup:
    """A process group with its own rendezvous, independent of ``torch.distributed``'s world.

    ``backend="gloo"`` moves CPU tensors; ``backend="nccl"`` is provided by
    ``refit.nccl`` when a GPU and NCCL are present (see ``init_nccl_communicator``).
    """

    def __init__(
        self,
        master_address: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        name: str = "refit",
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise RefitError(f"StatelessProcessGroup: rank {rank} is outside world size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise RefitError(f"StatelessProcessGroup: backend must be 'gloo' or 'nccl', got {backend!r}")
        self.master_address = master_address
        self.port = port
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.name = name
        self.children: list[StatelessProcessGroup] = []
        self._aborted = threading.Event()
        self._abort_lock = threading.Lock()
        self._seq = 0
        self._deadline: float | None = None
        self._pg = None
        self.store = None
        self._connect()

    def _connect(self) -> None:
        try:
            self.store = dist.TCPStore(
                self.master_address, self.port, self.world_size, self.rank == 0,
                timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False,
            )
        except Exception as e:  # torch raises RuntimeError/DistNetworkError subclasses
            raise RefitError(
                f"StatelessProcessGroup rank {self.rank}/{self.world_size}: cannot "
                f"{'host' if self.rank == 0 else 'reach'} the rendezvous store at "
                f"{self.master_address}:{self.port}: {e}"
            ) from e
        if self.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{self.name}/gloo", self.store), self.rank, self.world_size,
                timedelta(seconds=self.timeout_s),
            )

    # -- state -----------------------------------------------------------------------
    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def _check(self, what: str) -> None:
        if self._aborted.is_set():
            raise GroupAborted(f"{what} on an aborted communicator (rank {self.rank})")
        if self._pg is None:
            raise RefitError(f"{what}: this group has no {self.backend} communicator yet")

    # -- object exchange over the store ---------------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank, through the store (no tensor collective)."""
        if self._aborted.is_set():
            raise GroupAborted(f"all_gather_object on an aborted communicator (rank {self.rank})")
        self._seq += 1
        prefix = f"{self.name}/ago/{self._seq}"
        self.store.set(f"{prefix}/{self.rank}", pickle.dumps(obj))
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        try:
            values = self.store.multi_get(keys)
        except Exception as e:
            raise TransportError(
                f"all_gather_object rank {self.rank}: a peer did not publish within {self.timeout_s}s: {e}"
            ) from e
        if self.store.add(f"{prefix}/read", 1) == self.world_size:
            for k in keys + [f"{prefix}/read"]:
                self.store.delete_key(k)
        return [pickle.loads(v) for v in values]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return self.all_gather_object(obj if self.rank == src else None)[src]

    # -- tensors ------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        self._check("isend")
        return self._pg.send([tensor], peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        self._check("irecv")
        return self._pg.recv([tensor], peer, tag)

    def set_deadline(self, deadline: float | None) -> None:
        """Make every wait on this group give up at ``deadline`` (``time.monotonic()``)."""
        self._deadline = deadline
        for child in self.children:
            child.set_deadline(deadline)

    def wait(self, work: Any) -> None:
        _wait_work(work, self._aborted, self._deadline, f"rank {self.rank}")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._check("broadcast")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.wait(self._pg.broadcast([tensor], opts))

    def barrier(self) -> None:
        self.all_gather_object(None)

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
            except Exception:  # noqa: BLE001 - abort must not raise on a dying fleet
                log.exception("aborting a child communicator failed")
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001
                log.debug("process group abort raised", exc_info=True)
        self.store = None

    shutdown = abort

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "live"
        return (f"StatelessProcessGroup({self.backend}, rank={self.rank}/{self.world_size}, "
                f"{self.master_address}:{self.port}, {state})")


class TorchGroupComm:
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

    def set_deadline(self, deadline: float | None) -> None:
        self._deadline = deadline

    def isend(self, tensor, peer, tag=0):
        return dist.isend(tensor, group=self.group, group_dst=peer, tag=tag)

    def irecv(self, tensor, peer, tag=0):
        return dist.irecv(tensor, group=self.group, group_src=peer, tag=tag)

    def wait(self, work) -> None:
        _wait_work(work, self._aborted, self._deadline, f"rank {self.rank}")

    def broadcast(self, tensor, src) -> None:
        dist.broadcast(tensor, group=self.group, group_src=src)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

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
