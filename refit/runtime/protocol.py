"""The calls between the controller and an endpoint, their replies, and how failures come back.

Every call the controller makes on a worker is one record below; ``apply`` names the
endpoint method it runs, so a reader (or a static tool) follows the hop from the
controller's ``worker.request(Transfer(...))`` to ``refit_transfer``. A worker handle
carries the record whole (a thread, a pipe, a Ray actor's ``refit_request``, a vLLM
engine's sealed batch) and the worker runs it with ``answer``.

A call that fails comes back as ``EndpointFailed``, whose ``kind`` says what the
controller does about it. The controller decides between "refuse", "rebuild without the
dead" and "rebuild with everyone" from that field alone: an exception class reaches the
controller renamed (a Ray task error wraps it, a pickle that fails turns it into text),
and a decision made by matching class names broke whenever a name moved.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refit.comm.rendezvous import RendezvousTampered
from refit.errors import (
    ConfigError,
    InconsistentWeights,
    LateCall,
    LayoutError,
    PlanError,
    RefitAborted,
    RefitError,
    TransportError,
)
from refit.runtime.shards import ConnectSpec
from refit.transport.factory import TransportChoice

__all__ = ["CastOverflows", "Commit", "CommitReadiness", "Connect", "Device", "EndpointCall", "EndpointFailed",
           "FailureKind", "PeerEntry", "PeerMembership", "Ping", "Prepare", "PrepareCommit", "Prepared",
           "Rendezvous", "Teardown", "Transfer", "TransferReport", "WeightsState", "answer", "failure_kind"]


class FailureKind(enum.Enum):
    """What a failed call means to the controller."""

    #: the worker refused its configuration (a plan, layout or setting error): recovering
    #: over fewer shards would only fail the same way
    REFUSED = "refused"
    #: a rendezvous value no rank of the build wrote: nothing about the build is trusted
    TAMPERED = "tampered"
    #: the call started past its deadline and was abandoned: the worker was busy, not frozen
    LATE = "late"
    #: the refit watchdog fired on the worker (a peer died or froze under it)
    ABORTED = "aborted"
    #: the worker's live weights are torn and it says so
    INCONSISTENT = "inconsistent"
    #: the transport failed under the worker (a peer's socket closed, a copy failed)
    TRANSPORT = "transport"
    #: anything else the worker raised
    FAILED = "failed"


def failure_kind(error: BaseException) -> FailureKind:
    """The kind of a worker's own exception (the most specific class wins)."""
    if isinstance(error, RendezvousTampered):
        return FailureKind.TAMPERED
    if isinstance(error, LateCall):
        return FailureKind.LATE
    if isinstance(error, (PlanError, LayoutError, ConfigError)):
        return FailureKind.REFUSED
    if isinstance(error, RefitAborted):
        return FailureKind.ABORTED
    if isinstance(error, InconsistentWeights):
        return FailureKind.INCONSISTENT
    if isinstance(error, TransportError):
        return FailureKind.TRANSPORT
    return FailureKind.FAILED


class EndpointFailed(RefitError):
    """A call failed on its worker: ``kind`` for the controller, the worker's own words for people.

    Attributes:
        kind: a ``FailureKind``.
        error_type: the name of the exception the worker raised (for messages only).
        message: its text.
        details: plain values the kind carries (``key`` and ``rank`` of a tampered value).
    """

    def __init__(self, kind: FailureKind, error_type: str, message: str, details: Mapping[str, Any] | None = None):
        super().__init__(f"{error_type}: {message}" if message else error_type)
        self.kind = kind
        self.error_type = error_type
        self.message = message
        self.details = dict(details or {})

    @classmethod
    def from_error(cls, error: BaseException) -> EndpointFailed:
        if isinstance(error, EndpointFailed):
            return error
        kind = failure_kind(error)
        details = {"key": error.key, "rank": error.rank} if isinstance(error, RendezvousTampered) else {}
        return cls(kind, type(error).__name__, str(error).strip(), details)

    def brief(self) -> str:
        """``Type: first line`` of the worker's error."""
        lines = self.message.splitlines()
        return f"{self.error_type}: {lines[0]}" if lines else self.error_type

    def __reduce__(self):
        return type(self), (self.kind, self.error_type, self.message, self.details)


# -- replies -----------------------------------------------------------------------------------

BucketKey = tuple[int, int]  # (peer rank, bucket index)


@dataclass(frozen=True)
class Prepared:
    """What a rank's plan moves, once per build: its bytes and the params each bucket carries
    (kept by the controller for the verification reports, which then carry checksums only)."""

    rank: int
    bytes_to_send: int
    bytes_to_receive: int
    plan_s: float
    send_params: Mapping[BucketKey, list[str]]
    recv_params: Mapping[BucketKey, list[str]]


@dataclass(frozen=True)
class TransferReport:
    """What one rank's transfer moved, and the checksum of every bucket it sent and received."""

    rank: int
    bytes_sent: int
    bytes_received: int
    local_bytes: int
    seconds: float
    sent: Mapping[BucketKey, int]
    received: Mapping[BucketKey, int]
    quantize: Mapping[str, Any] | None = None  # the FP8 quantizer's timing, on a trainer rank that ran it
    cast_overflows: tuple[str, ...] = ()


@dataclass(frozen=True)
class CommitReadiness:
    """Phase one of a commit on one engine rank: the version it serves now, and whether the
    transfer waits in staging."""

    version: int | None
    staged: bool


# -- calls -------------------------------------------------------------------------------------

class EndpointCall:
    """One call of the controller on an endpoint; ``apply`` runs it there."""

    #: the phase an error of this call is reported under
    phase = "call"

    def apply(self, endpoint: Any) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Ping(EndpointCall):
    """Is the worker there? ``{"pid", "host"}``."""

    phase = "ping"

    def apply(self, endpoint: Any) -> dict:
        return endpoint.refit_ping()


@dataclass(frozen=True)
class Device(EndpointCall):
    """Where the worker's tensors live (``refit_device``)."""

    phase = "devices"

    def apply(self, endpoint: Any) -> dict:
        return endpoint.refit_device()


@dataclass(frozen=True)
class Rendezvous(EndpointCall):
    """Open this build's rendezvous on the root worker: ``(address, port)``."""

    phase = "rendezvous"

    def apply(self, endpoint: Any) -> tuple[str, int]:
        return endpoint.refit_rendezvous()


@dataclass(frozen=True)
class Connect(EndpointCall):
    """Join the communicator of one build; the worker's roster groups come back."""

    spec: ConnectSpec
    phase = "connect"

    def apply(self, endpoint: Any) -> list:
        return endpoint.refit_connect(self.spec)


@dataclass(frozen=True)
class Prepare(EndpointCall):
    """Build this rank's plan and executor from the merged rosters."""

    index: Any  # refit.plan.ParamIndex, or a Ray object reference to one
    epoch: int
    mode: str
    bucket_bytes: int
    transport: TransportChoice
    phase = "prepare"

    def apply(self, endpoint: Any) -> Prepared:
        return endpoint.refit_prepare(self.index, epoch=self.epoch, mode=self.mode, bucket_bytes=self.bucket_bytes,
                                      transport=self.transport)


@dataclass(frozen=True)
class PeerEntry(EndpointCall):
    """One-sided transports: this rank's roster entry for the memory it registered."""

    epoch: int
    phase = "handshake"

    def apply(self, endpoint: Any) -> Any:
        return endpoint.refit_peer_entry(self.epoch)


@dataclass(frozen=True)
class PeerMembership(EndpointCall):
    """One-sided transports: install every rank's entry."""

    roster: Any  # {rank: entry}, or a Ray object reference to it
    epoch: int
    phase = "membership"

    def apply(self, endpoint: Any) -> None:
        return endpoint.refit_peer_membership(self.roster, self.epoch)


@dataclass(frozen=True)
class Transfer(EndpointCall):
    """Move this rank's share of the weights; its checksums come back."""

    epoch: int
    timeout_s: float | None
    verify: bool = True
    sent_at: float | None = None
    phase = "transfer"

    def apply(self, endpoint: Any) -> TransferReport:
        return endpoint.refit_transfer(self.epoch, timeout_s=self.timeout_s, verify=self.verify,
                                       sent_at=self.sent_at)


@dataclass(frozen=True)
class CastOverflows(EndpointCall):
    """A trainer rank's values beyond the range of their destination dtype."""

    epoch: int
    phase = "cast check"

    def apply(self, endpoint: Any) -> list[str]:
        return endpoint.refit_cast_overflows(self.epoch)


@dataclass(frozen=True)
class PrepareCommit(EndpointCall):
    """Phase one of the commit: can this rank switch to the transfer of ``epoch``?"""

    epoch: int
    phase = "prepare commit"

    def apply(self, endpoint: Any) -> CommitReadiness:
        return endpoint.refit_prepare_commit(self.epoch)


@dataclass(frozen=True)
class Commit(EndpointCall):
    """The transfer of ``epoch`` was verified: serve it as ``version``."""

    epoch: int
    version: int | None = None
    phase = "commit"

    def apply(self, endpoint: Any) -> None:
        return endpoint.refit_commit(self.epoch, version=self.version)


@dataclass(frozen=True)
class WeightsState(EndpointCall):
    """Whether the worker's live weights are whole (``refit_weights_state``)."""

    phase = "weights state"

    def apply(self, endpoint: Any) -> dict:
        return endpoint.refit_weights_state()


@dataclass(frozen=True)
class Teardown(EndpointCall):
    """Abort the worker's communicator and drop its build."""

    phase = "teardown"

    def apply(self, endpoint: Any) -> None:
        return endpoint.refit_teardown()


def answer(endpoint: Any, call: EndpointCall) -> Any:
    """Run ``call`` on ``endpoint``; a failure is raised as ``EndpointFailed``, kind and words kept.

    Only records of this module run: a worker never runs a method a peer names.
    """
    if not isinstance(call, EndpointCall):
        raise RefitError(f"a refit worker takes the calls of refit.runtime.protocol, got {type(call).__name__}")
    try:
        return call.apply(endpoint)
    except Exception as e:
        raise EndpointFailed.from_error(e) from e
