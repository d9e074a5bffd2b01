"""An engine worker that SIGKILLs itself inside a later transfer: the n-th from when it is armed.

Repeated recovery needs a second (and third) death inside the RETRIED transfer, after a
rebuild whose length the test does not control; a kill timed from outside lands there only
by luck, so the victim counts its own transfers and dies in the one it was told.
"""

from __future__ import annotations

import os
import signal
import time

from refit.testing.synthetic import SyntheticEngine


class DoomedEngine(SyntheticEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.transfers = 0
        self.doomed_at: int | None = None
        self.past_watchdog_s: float | None = None
        self.watchdog_s: float | None = None

    def die_in_transfer(self, nth: int, past_watchdog_s: float | None = None) -> None:
        """Die as the ``nth`` transfer from now starts; with ``past_watchdog_s``, first stall
        until that long after the transfer's own watchdog fired (a worker wedged, then lost)."""
        self.doomed_at = self.transfers + nth
        self.past_watchdog_s = past_watchdog_s

    def refit_transfer(self, epoch, *, timeout_s, verify=True, sent_at=None):
        self.watchdog_s = timeout_s
        return super().refit_transfer(epoch, timeout_s=timeout_s, verify=verify, sent_at=sent_at)

    def on_refit_start(self) -> None:
        self.transfers += 1
        if self.transfers == self.doomed_at:
            if self.past_watchdog_s is not None:
                time.sleep(self.watchdog_s + self.past_watchdog_s)
            os.kill(os.getpid(), signal.SIGKILL)
        super().on_refit_start()
