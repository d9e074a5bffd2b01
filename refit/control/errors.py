"""Errors of the control plane; each names the workers, ranks, shards and params involved."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from refit.comm.rendezvous import RendezvousTampered
from refit.errors import RefitError
from refit.membership import NoSurvivingShards
from refit.runtime.protocol import FailureKind

__all__ = ["EveryShardLost", "NoAbsentShard", "NoSurvivingShards", "RecoveryDeadlineExceeded", "RefitRefused",
           "RefitTampered", "RefitVerificationError", "RefitWorkerError", "WorkersLate"]


class RefitWorkerError(RefitError):
    """A refit step failed on one or more workers (raised, died, or did not answer in time).

    Attributes:
        phase: the step (``connect``, ``prepare``, ``transfer``, ``commit``...).
        failures: worker label -> what it raised.
        timed_out: labels of workers that did not answer within the controller's bound.
        died: labels of workers whose process was gone.
        inconsistent: labels of engine workers whose live weights the failed refit left torn
            (they refuse to serve until a refit completes); filled in by ``sync_weights``.
        kinds: worker label -> the ``FailureKind`` of what it raised (a worker's own failures only).
    """

    def __init__(self, message: str, *, phase: str = "", failures: dict[str, str] | None = None,
                 timed_out: Sequence[str] = (), died: Sequence[str] = (), inconsistent: Sequence[str] = (),
                 kinds: Mapping[str, FailureKind] | None = None):
        super().__init__(message)
        self.phase = phase
        self.failures = dict(failures or {})
        self.kinds = dict(kinds or {})
        self.timed_out = list(timed_out)
        self.died = list(died)
        self.inconsistent = list(inconsistent)
        # what the controller itself lost to being stopped or starved while it waited (seconds)
        self.controller_stalled_s = 0.0
        self.late: list[str] = []  # workers that started a call past its deadline and abandoned it


class NoAbsentShard(RefitWorkerError):
    """A refit failed, but every generation worker is still alive: nothing can be excluded.

    The signature of a frozen rank (stopped, wedged in a driver, swapping): it does not
    answer, yet it is not dead, and a rebuild that kept it would hang exactly as the
    failed attempt did.
    """


class WorkersLate(NoAbsentShard):
    """A refit step failed because workers answered it late, and each of them is alive and answers.

    ``late`` names them. A worker busy with an earlier call (a long step, a call of a build
    the controller gave up on) starts the next one late; it is neither dead nor frozen, so
    nothing is excluded. The next sync rebuilds with it: the calls it was late for abandon
    themselves (``LateCall``) instead of holding every later call behind them.
    """

    def __init__(self, message: str, *, late: Sequence[str] = (), **kwargs):
        super().__init__(message, **kwargs)
        self.late = list(late)


class RefitTampered(RefitWorkerError, RendezvousTampered):
    """Something that is not a rank of the build wrote a value the build read: the headline of the sync.

    ``key`` is the store key, ``rank``/``seen_by`` the rank and worker that read the forged
    value. Recovery by excluding shards would blame the workers that waited for that rank,
    so nothing is excluded; the next sync rebuilds with a fresh secret, nonce and port.
    """

    def __init__(self, message: str, *, key: str | None = None, rank: int | None = None, seen_by: str = "",
                 **kwargs):
        super().__init__(message, **kwargs)
        self.key, self.rank, self.seen_by = key, rank, seen_by


class RecoveryDeadlineExceeded(RefitWorkerError):
    """A sync kept losing engine workers and its deadline passed before a retry could verify.

    Each loss excludes the dead worker's shard and retries over the rest, but a fleet that
    keeps dying must not hold the trainer for ever: past the sync's deadline no further
    recovery starts. ``died`` names every worker the sync lost, not only the last round's,
    so the caller knows every shard to replace.
    """


class EveryShardLost(NoSurvivingShards, RefitWorkerError):
    """A sync lost workers until no generation shard was left to retry over.

    A ``NoSurvivingShards`` that also carries the losses (``died``: every worker lost in
    the sync, in the order they were found), since the shards were alive when it began.
    """


class RefitRefused(RefitWorkerError):
    """Workers refused the refit's layouts, settings or tensors.

    A failing worker raised a configuration error (``PlanError``, ``LayoutError``,
    ``ConfigError``) while connecting, preparing, or at the start of a transfer (an engine
    whose tensor changed shape since the build), and none died or froze: the input is wrong,
    not an engine lost, so nothing is excluded, rebuilt or retried. The refusing worker heads
    the error even when its peers' failures (a transfer it left, a rendezvous it broke) came
    first: read as lost engines, they made a ``NoAbsentShard`` that blamed a trainer.
    Refused while connecting or preparing, nothing moved; at a transfer, the other ranks'
    bytes may have landed (``inconsistent`` names the engines left torn).
    """


class RefitVerificationError(RefitError):
    """The bytes a receiver got differ from what its sender sent (checksum per bucket).

    Attributes:
        mismatches: ``(src_rank, dst_rank, bucket, params, where)`` for every bad bucket.
        shards: the generation shards that received bad bytes.
        inconsistent: labels of engine workers whose live weights the refit left torn (bytes
            land in place before they are checked); filled in by ``sync_weights``.
    """

    def __init__(self, message: str, mismatches: list[tuple], shards: list[int], inconsistent: Sequence[str] = ()):
        super().__init__(message)
        self.mismatches = mismatches
        self.shards = shards
        self.inconsistent = list(inconsistent)

