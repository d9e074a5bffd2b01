"""The one executor contract every transport implements: made with its plan, reused every refit.

An executor is built when a plan is built and lives as long as it. ``prepare`` binds it
to this rank's tensors once: it checks them against the plan, finds the blocks that go
straight from or into the tensors, sizes staging, registers memory. ``run`` moves one
refit. ``close`` gives staging and registrations back.

Executors outlive a refit so that staging pools and cached views survive between steps:
an executor made afresh for every refit makes a CPU refit cost 3-5x its steady state. A
``run`` checks only that it is handed the very tensors it was bound to (their identity and
storage); anything else rebinds first, so a trainer that replaces its parameters between
steps still works.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from refit.errors import PlanError

TensorMap = Mapping[str, torch.Tensor]
Corruption = Callable[[int, int, torch.Tensor], None]  # (peer, bucket index, packed bytes), for fault tests


@dataclass
class TransferStats:
    """What one rank moved in one refit."""

    bytes_sent: int = 0
    bytes_received: int = 0
    local_bytes: int = 0
    buckets_sent: int = 0
    buckets_received: int = 0
    zero_copy_buckets: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    staging_capacity_bytes: int = 0  # staging memory held (streamed path: the arena, <= its budget)
    groups: int = 0  # streamed path: NCCL groups (windows of rounds) issued
    timing: dict = field(default_factory=dict)  # streamed path with timing=True: host and CUDA-event marks
    checksums_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    checksums_received: dict[tuple[int, int], int] = field(default_factory=dict)
    # source values beyond their destination dtype's range, cast anyway (refit.transport.casts.CastOverflow)
    cast_overflows: list = field(default_factory=list)


@dataclass(frozen=True)
class Binding:
    """The identity of the tensors an executor was prepared with (names, objects, storage)."""

    src: tuple[tuple[str, int, int], ...]
    dst: tuple[tuple[str, int, int], ...]

    @staticmethod
    def of(src: TensorMap, dst: TensorMap) -> Binding:
        return Binding(tensor_identity(src), tensor_identity(dst))


def tensor_identity(tensors: Mapping[str, torch.Tensor | None]) -> tuple[tuple[str, int, int], ...]:
    """Each tensor's name, object and storage: what an executor bound to them reads and writes."""
    return tuple((n, 0, 0) if t is None else (n, id(t), t.data_ptr()) for n, t in tensors.items())


def device_of(src: TensorMap, dst: TensorMap) -> torch.device:
    for t in (*src.values(), *dst.values()):
        return t.device
    return torch.device("cpu")


def require_tensors(plan, src: TensorMap, dst: TensorMap) -> None:
    """Every tensor a ``RankPlan`` reads and writes is given; the missing ones are named."""
    local = {op.name for op in plan.local}
    needed = {"src": {op.name for b in plan.sends for op in b.ops} | local,
              "dst": {op.name for b in plan.recvs for op in b.ops} | local}
    for side, tensors in (("src", src), ("dst", dst)):
        missing = sorted(needed[side] - set(tensors))
        if missing:
            raise PlanError(f"rank {plan.rank}: {side} tensor(s) {missing} are in this rank's plan but were not given")


class SourceProduction(abc.ABC):
    """Source tensors that are made while a refit runs, not before it (e.g. FP8 copies of a trainer's shards).

    Quantizing every shard before the first byte moves put the whole quantization ahead of
    the wire. An executor that streams its plan asks for the tensors a group of its sends
    reads just before packing or posting them, so making the next group overlaps the wire
    of this one; any other executor makes them all first. ``produce`` is called from the
    executor's thread (on its pack lane on a GPU); a name is made once per refit.
    """

    @abc.abstractmethod
    def waiting(self, name: str) -> bool:
        """Whether ``name`` is made by this production and not made yet in this refit."""

    @abc.abstractmethod
    def produce(self, names: Iterable[str]) -> bool:
        """Make those of ``names`` still waiting; True when anything was made (or queued)."""

    def produce_all(self) -> None:
        """Make every tensor still waiting."""
        self.produce(self.names())

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Every tensor this production makes."""


def op_names(buckets) -> list[str]:
    """The tensors the ops of ``buckets`` read or write, each once, in order."""
    return list(dict.fromkeys(op.name for b in buckets for op in b.ops))


class Executor(abc.ABC):
    """Runs one rank's plan over one transport; see the module docstring.

    Subclasses implement ``_bind`` (called by ``prepare`` and on a rebind), ``_run`` and
    ``_release``. ``verify`` records per-bucket checksums (computed while packing and
    unpacking) in the returned stats; ``corrupt`` is fault injection for tests: it flips
    bytes of a packed send bucket after its checksum was taken.
    """

    transport: ClassVar[str] = ""
    # whether ``_run`` takes a ``SourceProduction`` and makes its tensors as it goes; the
    # others have it made whole before ``_run``
    streams_production: ClassVar[bool] = False

    def __init__(self, plan, comm=None):
        self.plan = plan
        self.comm = comm
        self.binding: Binding | None = None
        self.src: TensorMap = {}
        self.dst: TensorMap = {}
        self.runs = 0
        self.closed = False

    def prepare(self, src: TensorMap | None = None, dst: TensorMap | None = None) -> None:
        """Bind this rank's source and destination tensors (once; again only if they change)."""
        if self.closed:
            raise PlanError(f"{type(self).__name__}: prepare() after close()")
        src, dst = dict(src or {}), dict(dst or {})
        self._bind(src, dst)
        self.src, self.dst = src, dst
        self.binding = Binding.of(src, dst)

    def run(self, src: TensorMap | None = None, dst: TensorMap | None = None, *, verify: bool = False,
            corrupt: Corruption | None = None, production: SourceProduction | None = None) -> TransferStats:
        """Move one refit. Tensors given here that are not the bound ones rebind first.

        ``production`` makes some of the source tensors during this refit (see
        ``SourceProduction``); they are bound like any other tensor, and read only once made.
        """
        if self.closed:
            raise PlanError(f"{type(self).__name__}: run() after close()")
        if src is not None or dst is not None:
            src = self.src if src is None else src
            dst = self.dst if dst is None else dst
            if self.binding is None or Binding.of(src, dst) != self.binding:
                self.prepare(src, dst)
        elif self.binding is None:
            self.prepare({}, {})
        if production is not None and not self.streams_production:
            production.produce_all()
        if self.streams_production:
            stats = self._run(verify=verify, corrupt=corrupt, production=production)
        else:
            stats = self._run(verify=verify, corrupt=corrupt)
        self.runs += 1
        return stats

    def close(self) -> None:
        """Give back staging and registrations (idempotent)."""
        if not self.closed:
            self.closed = True
            self._release()
            self.src, self.dst, self.binding = {}, {}, None

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abc.abstractmethod
    def _bind(self, src: TensorMap, dst: TensorMap) -> None: ...

    @abc.abstractmethod
    def _run(self, *, verify: bool, corrupt: Corruption | None) -> TransferStats: ...

    def _release(self) -> None:  # noqa: B027 - most executors hold nothing to give back
        return None


__all__ = ["Binding", "Corruption", "Executor", "SourceProduction", "TensorMap", "TransferStats", "device_of",
           "op_names", "require_tensors", "tensor_identity"]
