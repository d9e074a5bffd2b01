"""Copies and their checksums in one pass on a GPU: a fixed batch of blocks, one kernel per refit.

Summing a bucket after copying it reads every byte a second time; on an H200 that pass,
launched block by block, cost a verified refit more than twice the copy itself. Here a
plan's blocks are described once (at its first verified refit), and each refit is one launch
of ``refit.transport.triton_kernels.copy_sum_kernel``: every word is read once, written once
(when copying) and added to its 4 KiB row's sum. The row sums are the ones
``ChecksumLedger`` takes from the same bytes (int64 additions wrap the same in any order), so
a fused end and an unfused end of one bucket agree bit for bit.

A block is fused when both of its sides are runs of whole int64 words at a fixed stride
and its dtype is the same on both; anything else (casts, odd sizes or alignment) stays on
the unfused path. Triton is needed, and ``REFIT_FUSED=0`` turns the fused path off.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch

from refit.transport.buckets import ROW

CONTIGUOUS_RUN = 1 << 62  # a contiguous side: one run longer than any block
TILE_ROWS = 2  # stream rows per kernel program (8 KiB: the fastest of 2 to 16 rows, 4 or 8 warps, on an H200)


@functools.cache
def _triton_present() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_enabled(device: torch.device) -> bool:
    """Whether copies and checksums on ``device`` take the fused kernel: a CUDA device, Triton
    importable, and ``REFIT_FUSED`` not set to 0 (the unfused path, kept for comparison)."""
    if os.environ.get("REFIT_FUSED", "1") == "0":
        return False
    return device.type == "cuda" and _triton_present()


def interpreted() -> bool:
    """Whether Triton runs its interpreter on the CPU (``TRITON_INTERPRET=1``): the kernels on host tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1" and _triton_present()


@dataclass(frozen=True)
class SideLayout:
    """One side of a block: its first byte's address, then runs of ``run`` bytes ``stride`` apart."""

    address: int
    run: int
    stride: int


def side_layout(view: torch.Tensor) -> SideLayout | None:
    """How ``view``'s bytes lie in row-major order, if they are runs of whole int64 words at one stride."""
    if view.numel() == 0:
        return SideLayout(view.data_ptr(), CONTIGUOUS_RUN, 0)  # nothing to read
    size = view.element_size()
    shape = [n for n in view.shape if n != 1]
    strides = [s for n, s in zip(view.shape, view.stride()) if n != 1]
    if view.data_ptr() % 8:
        return None
    run, k = 1, len(shape)
    while k and strides[k - 1] == run:
        run *= shape[k - 1]
        k -= 1
    if k == 0:
        return SideLayout(view.data_ptr(), CONTIGUOUS_RUN, 0)
    if any(strides[i] != strides[i + 1] * shape[i + 1] for i in range(k - 1)):
        return None
    if (run * size) % 8 or (strides[k - 1] * size) % 8:
        return None
    return SideLayout(view.data_ptr(), run * size, strides[k - 1] * size)


class NotFusable(ValueError):
    """A block the fused kernel cannot take (its caller keeps the unfused path)."""


class CopySumBatch:
    """A fixed set of blocks copied (those given a destination) or only read, and summed into checksum streams.

    A stream is the bytes one checksum covers: a packed bucket (its blocks at their offsets,
    gaps zero) or a block alone. Build the batch once; each ``launch`` runs one kernel on
    the current stream, and ``stream_values()`` is every stream's checksum afterwards (on the
    device; ``ChecksumLedger.summed`` reads it at settle).
    """

    def __init__(self, device: torch.device, *, tile_rows: int = TILE_ROWS, num_warps: int = 4):
        self.device = torch.device(device)
        self.tile_rows, self.num_warps = tile_rows, num_warps
        self._streams: list[int] = []  # nbytes of each
        self._blocks: list[tuple[int, int, int, SideLayout, SideLayout | None]] = []  # stream, lo, nbytes, src, dst
        self._built = False

    def stream(self, nbytes: int) -> int:
        self._streams.append(int(nbytes))
        return len(self._streams) - 1

    def add(self, stream: int, lo: int, src: torch.Tensor, dst: torch.Tensor | None = None) -> None:
        """``src``'s bytes at byte ``lo`` of ``stream`` (and copied into ``dst``, of the same shape and dtype)."""
        nbytes = src.numel() * src.element_size()
        if lo % 8 or nbytes % 8:
            raise NotFusable(f"a block of {nbytes} bytes at stream offset {lo} is not whole int64 words")
        if not nbytes:
            return
        if lo + nbytes > self._streams[stream]:
            raise ValueError(f"a block of {nbytes} bytes at offset {lo} overruns its stream of {self._streams[stream]}")
        s = side_layout(src)
        if s is None:
            raise NotFusable(f"source block {list(src.shape)} {src.dtype} is not runs of int64 words at one stride")
        d = None
        if dst is not None:
            if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
                raise NotFusable("a fused copy needs a destination of the source's shape and dtype")
            d = side_layout(dst)
            if d is None:
                raise NotFusable(f"destination block {list(dst.shape)} {dst.dtype} is not runs of int64 words "
                                 "at one stride")
        self._blocks.append((stream, int(lo), nbytes, s, d))

    def build(self) -> CopySumBatch:
        """The descriptors and the tile table, on the device (once).

        The batch holds addresses, not tensors: its owner keeps the memory alive and makes a
        new batch when the tensors change (a launch over freed memory reads or writes
        whatever lives there now).
        """
        rows = [-(-n // ROW) for n in self._streams]
        base = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        desc = np.zeros((len(self._blocks), 10), dtype=np.int64)
        tiles: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}  # short runs -> (blocks, rows)
        for i, (stream, lo, nbytes, s, d) in enumerate(self._blocks):
            d = d or SideLayout(0, CONTIGUOUS_RUN, 0)
            desc[i] = (s.address, d.address, lo, nbytes, s.run, s.stride, d.run, d.stride, base[stream], rows[stream])
            first, last = lo // ROW, (lo + nbytes - 1) // ROW
            starts = np.arange(first, last + 1, self.tile_rows, dtype=np.int64)
            blocks, tile_rows = tiles[min(s.run, d.run) < ROW]
            blocks.append(np.full(len(starts), i, dtype=np.int32))
            tile_rows.append(starts)
        self._desc = torch.from_numpy(desc).to(self.device)
        self._tiles = {}  # short runs -> (tile -> block, tile -> first row), for the blocks of that kernel
        for short, (blocks, tile_rows) in tiles.items():
            if blocks:
                self._tiles[short] = (torch.from_numpy(np.concatenate(blocks)).to(self.device),
                                      torch.from_numpy(np.concatenate(tile_rows)).to(self.device))
        self._row_sums = torch.zeros(int(base[-1]), dtype=torch.int64, device=self.device)
        # row i of a stream of R rows weighs 2 (R - i) + 1 (refit.transport.buckets._Summer)
        row_stream = np.repeat(np.arange(len(rows), dtype=np.int64), rows)
        row_weight = 2 * (np.repeat(np.asarray(rows, dtype=np.int64), rows) - (np.arange(int(base[-1]))
                                                                                 - base[row_stream])) + 1
        self._row_stream = torch.from_numpy(row_stream).to(self.device)
        self._row_weight = torch.from_numpy(row_weight).to(self.device)
        self._stream_nbytes = torch.tensor(self._streams, dtype=torch.int64, device=self.device)
        self._base = base
        self._built = True
        return self

    def launch(self) -> None:
        """Copy and sum every block: one kernel (two when some runs are shorter than a row), queued
        on the current stream."""
        if not self._built:
            self.build()
        self._row_sums.zero_()
        from refit.transport.triton_kernels import copy_sum_kernel

        for short, (tile_block, tile_row) in self._tiles.items():
            copy_sum_kernel[(tile_block.numel(),)](self._desc, tile_block, tile_row, self._row_sums,
                                                   ROWS=self.tile_rows, SHORT_RUNS=short, num_warps=self.num_warps)

    def stream_values(self) -> torch.Tensor:
        """Every stream's checksum after the last launch (int64, on the device; two kernels for all)."""
        return self._stream_nbytes.index_add(0, self._row_stream, self._row_sums * self._row_weight)


__all__ = ["CopySumBatch", "NotFusable", "SideLayout", "fused_enabled", "interpreted", "side_layout"]
