"""Fault injection a test asks a worker for (``refit_inject_fault``): what verification must catch."""

from __future__ import annotations

import torch

from refit.transport.broadcast import BROADCAST

__all__ = ["OneShotCorruption"]


class OneShotCorruption:
    """Fault injection: flip one byte of the first matching bucket this rank sends."""

    def __init__(self, peer: int | None, byte: int):
        self.peer = peer
        self.byte = byte
        self.fired = False

    def __call__(self, peer: int, index: int, buf: torch.Tensor) -> None:
        if self.fired or buf.numel() == 0:
            return
        if self.peer is not None and peer not in (self.peer, BROADCAST):
            return
        i = self.byte % buf.numel()
        buf[i] = buf[i] ^ 0xFF
        self.fired = True
