"""An engine that dies (SIGKILL, by its own hand) a moment into its next rendezvous.

A process dying inside ``refit_connect`` is what left every survivor wedged in gloo's
connect; timing a kill from outside lands there only by luck, so the victim arms it itself.
"""

from __future__ import annotations

import os
import signal
import threading

from refit.testing.synthetic import SyntheticEngine


class DyingEngine(SyntheticEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.die_after_s: float | None = None

    def die_in_next_connect(self, after_s: float) -> None:
        self.die_after_s = after_s

    def refit_connect(self, spec):
        if self.die_after_s is not None:
            threading.Timer(self.die_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return super().refit_connect(spec)
