"""Exceptions raised by refit.

Every error that bad input can cause is raised before any byte moves, on every rank
that takes part, with a message naming the parameter and the ranks involved: a rank
that raised alone would leave its peers blocked in the transfer it never joined.
"""


class RefitError(Exception):
    """Base class of every error refit raises on purpose."""


class LayoutError(RefitError, ValueError):
    """A mesh, a placement or a shape that cannot describe a sharded tensor."""


class PlanError(RefitError, ValueError):
    """Rosters that cannot be turned into a transfer plan (missing source, mismatch...)."""


class ConfigError(RefitError, ValueError):
    """A model config or a setting that cannot describe a run, named by its file and key or its flag."""


class TransportError(RefitError, RuntimeError):
    """A transfer that failed while bytes were moving."""


class RefitAborted(RefitError, RuntimeError):
    """The refit missed its deadline and this rank's communicators were aborted.

    Raised even when the guarded block went on to return normally: once the abort has
    run, some transfers may have been cut short, and the communicator is unusable
    until it is rebuilt. Transports raise it too, for a peer that is gone.
    """


class InconsistentWeights(RefitError, RuntimeError):
    """An engine was asked to serve while its weights are torn.

    A refit wrote part of its bytes into the live weights (or a load of them failed part
    way) and did not complete: some params are new, some old, some half of each. Serving
    them would look like a model and be none; the engine refuses until a refit completes.
    """


class LateCall(TransportError):
    """A call reached its worker after the deadline of the build or transfer it belongs to.

    The worker was busy (an earlier call, a long step) while the controller waited, gave up
    and moved on. Running the call then would wait out a rendezvous whose peers are gone and
    hold every later call behind it, so it is abandoned at once; the worker is late, not
    frozen or dead.
    """


class CastOverflowWarning(UserWarning):
    """Source values beyond their destination dtype's range were cast anyway (they land as inf,
    NaN or wrapped); pass ``strict_casts=True`` to refuse such a transfer instead."""


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of ``e``'s message (its type's name when it has none), cut at ``limit`` characters.

    A message that quotes another error takes only its first line: a traceback or a tensor
    printed whole in a peer's error would bury the names of the ranks the caller needs.
    """
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


def error_summary(e: BaseException, limit: int | None = None) -> str:
    """``Type: first line`` of ``e``, for a message that wraps an error of another type."""
    line = first_line(e, limit)
    return line if line == type(e).__name__ else f"{type(e).__name__}: {line}"

