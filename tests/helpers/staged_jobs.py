"""Actors for the staged-refit tests, importable by the spawned worker processes (``ProcessWorker``).

``StagedEngine`` is the reference engine with staged refits on (a pointer swap at the switch,
or copies with ``device_fraction`` below 1); it can be told to SIGKILL itself as the controller
asks it to prepare the commit, after its transfer landed: a death between the two phases.
"""

from __future__ import annotations

import os
import signal

from refit.testing.engine import EngineWorker


class StagedEngine(EngineWorker):
    def __init__(self, *args, device_fraction: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.refit_configure_staging(True, device_fraction=device_fraction)
        self._die_at_prepare = False

    def die_at_prepare(self) -> None:
        self._die_at_prepare = True

    def die_at_transfer(self) -> None:
        self._die_at_transfer = True

    def on_refit_start(self) -> None:
        if getattr(self, "_die_at_transfer", False):
            os.kill(os.getpid(), signal.SIGKILL)

    def _refit_prepare(self, epoch: int) -> None:
        if self._die_at_prepare:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._refit_prepare(epoch)
