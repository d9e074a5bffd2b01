"""What one ``sync_weights()`` did: phases with their timings, bytes, and recovery figures."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["SyncEvent", "SyncResult"]


@dataclass
class SyncEvent:
    """One step of a sync: ``at_s`` from the start of ``sync_weights``, its duration, a note.

    Phases (``check``, ``build``, ``transfer``, ``verify``, ``commit``, ``recover``) have a
    duration; point events (``round``: one round of calls and its slowest worker,
    ``failure``, ``probe``, ``absent``) have none.
    """

    kind: str
    at_s: float
    duration_s: float = 0.0
    detail: str = ""


@dataclass
class SyncResult:
    """What one ``sync_weights()`` did, for logs, dashboards and the recovery figures.

    ``bytes`` counts what crossed the communicator (received bytes over all ranks);
    ``gbps`` is that over the transfer time. ``recovery_s`` runs from the first failure the
    controller saw to the verified end of the retry; None when nothing failed.
    ``inconsistent`` names the engine workers a recovered sync left with torn weights (a shard
    left out after its transfer started); they refuse to serve until a refit completes.
    ``recoveries`` counts the rebuilds over fewer shards that ended in the verified transfer
    (one per retried transfer), and ``lost`` names every worker the sync found dead on the way.
    ``cast_overflows`` names each trainer value beyond the range of its destination's dtype
    (``strict_casts`` refuses them instead).
    """

    step: int
    verified: bool = False
    shards: list[int] = field(default_factory=list)
    absent_shards: list[int] = field(default_factory=list)
    world_size: int = 0
    bytes: int = 0
    seconds: float = 0.0
    transfer_s: float = 0.0
    gbps: float = 0.0
    rebuilt: bool = False
    recovered: bool = False
    recovery_s: float | None = None
    recoveries: int = 0
    lost: list[str] = field(default_factory=list)  # engine workers found dead during this sync
    failure: str | None = None
    inconsistent: list[str] = field(default_factory=list)  # after a recovery: engine workers left torn
    version: int | None = None  # the weights version the engines serve after this refit
    # trainer values beyond the range of their engine's dtype, cast anyway ("<trainer>: <param>: ..."), one a line
    cast_overflows: list[str] = field(default_factory=list)
    events: list[SyncEvent] = field(default_factory=list)


class Recorder:
    """Builds the ``SyncResult`` of one sync as its phases run."""

    def __init__(self, step: int, on_phase: Callable[[str], None] | None):
        self.t0 = time.monotonic()
        self.result = SyncResult(step=step)
        self.on_phase = on_phase

    def now(self) -> float:
        return time.monotonic() - self.t0

    @contextlib.contextmanager
    def phase(self, kind: str, detail: str = ""):
        if self.on_phase is not None:
            self.on_phase(kind)
        start = self.now()
        try:
            yield
        finally:
            self.result.events.append(SyncEvent(kind, start, self.now() - start, detail))

    def note(self, kind: str, detail: str = "") -> None:
        self.result.events.append(SyncEvent(kind, self.now(), 0.0, detail))

