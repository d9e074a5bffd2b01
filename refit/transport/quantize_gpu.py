"""Block-scaled FP8 in one pass on a GPU: each 128 x 128 block read once, its scale and weight written.

Eager torch takes five passes over a shard (abs, amax, multiply, clamp, cast) and on an H200
quantized at 113 GB/s of bf16, slower than the wire it was meant to halve. One Triton
program per block (``refit.transport.triton_kernels.block_quantize_kernel``) reads the
block, takes its amax and writes the FP8 weight and the scale: the bits of
``refit.models.fp8.quantize_reference``, since every step is a max, a correctly rounded
division or one float32 multiply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from refit.plan.quant import BlockFp8
from refit.transport.copy_sum import fused_enabled, interpreted

MIN_AMAX = 1e-12  # refit.models.fp8.MIN_AMAX




def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def one_pass_ready(x: torch.Tensor, fmt: BlockFp8) -> bool:
    """Whether ``x`` takes the one-pass kernel: on a GPU with Triton (or its CPU interpreter), a
    contiguous matrix (or stack) in float32 scales, blocks of powers of two."""
    device_ok = fused_enabled(x.device) or (x.device.type == "cpu" and interpreted())
    return (device_ok and x.dim() >= 2 and x.is_contiguous() and fmt.scale_dtype == "float32"
            and all(_power_of_two(b) for b in fmt.block) and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def _launch(x: torch.Tensor, q: torch.Tensor | None, grid: torch.Tensor, fmt: BlockFp8, mode: int) -> None:
    from refit.transport.triton_kernels import block_quantize_kernel

    *lead, rows, cols = x.shape
    br, bc = fmt.block
    nr, nc = -(-rows // br), -(-cols // bc)
    n_lead = 1
    for n in lead:
        n_lead *= n
    if not x.numel():
        return
    block_quantize_kernel[(n_lead * nr, nc)](x, x if q is None else q, grid, rows, cols, nr, nc,
                                             fmt.max_value, MIN_AMAX, BR=br, BC=bc, MODE=mode, num_warps=8)


def quantize_own_blocks(x: torch.Tensor, out: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFp8) -> None:
    """``out`` and ``scale_inv`` of a shard whose blocks start at its origin, from its blocks alone.

    ``out`` is FP8, or float32 for the values before the cast (what a check of the kernel's
    arithmetic reads where the FP8 cast itself is emulated).
    """
    from refit.transport.triton_kernels import QUANTIZE_OWN

    _check(x, out, scale_inv, fmt)
    _launch(x, out, scale_inv, fmt, QUANTIZE_OWN)


def quantize_with_factors(x: torch.Tensor, factors: torch.Tensor, out: torch.Tensor, fmt: BlockFp8) -> None:
    """``out`` of a shard whose blocks start at its origin, given each block's factor (a merged amax's)."""
    from refit.transport.triton_kernels import QUANTIZE_WITH_FACTORS

    factors = factors.float().contiguous()
    _check(x, out, factors, fmt)
    _launch(x, out, factors, fmt, QUANTIZE_WITH_FACTORS)


def block_amax_one_pass(x: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """The amax of every block of a shard whose blocks start at its origin (float32 grid)."""
    from refit.transport.triton_kernels import AMAX_ONLY

    grid = torch.zeros(fmt.scale_shape(x.shape), dtype=torch.float32, device=x.device)
    _launch(x, None, grid, fmt, AMAX_ONLY)
    return grid


@dataclass(frozen=True)
class QuantizeItem:
    """One shard of a grouped launch: ``x`` into ``out``, with its scales made (``own``) or its factors given.

    ``grid`` is the scale grid written (own) or the float32 factors read (not own).
    """

    x: torch.Tensor
    out: torch.Tensor
    grid: torch.Tensor
    own: bool


_LAUNCHES_KEPT = 256  # sets of shards kept (an executor quantizes window by window: a set each)


@dataclass(frozen=True)
class QuantizeLaunch:
    """One shard's launch of ``block_quantize_kernel``: its grid, arguments and mode, worked out once."""

    grid: tuple[int, int]
    args: tuple
    mode: int


class LaunchGraphs:
    """Captures a set of launches as one CUDA graph, replayed in their place.

    Launching a few hundred Triton kernels from Python costs more host time than the GPU
    takes to run them (a quantizer that runs at 2 TB/s alone ran at about 840 GB/s inside a
    refit); one graph replay queues them all at once. Captured on a side stream in
    thread-local mode, so another thread's CUDA calls (a transport's progress thread) cannot
    void the capture. Returns None when the launches cannot be captured: they then run eagerly.
    """

    def capture(self, device: torch.device, launch) -> object | None:
        if device.type != "cuda":
            return None
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except RuntimeError:
            return None
        return graph.replay


class _Launches:
    """One set of shards' launches, and the graph that replays them once captured."""

    __slots__ = ("launches", "replay", "runs")

    def __init__(self, launches: list[QuantizeLaunch]):
        self.launches, self.replay, self.runs = launches, None, 0


def launch_key(items: list[QuantizeItem]) -> tuple:
    """What a set of launches depends on: every tensor's address, shape and dtype, and each item's mode.

    A graph replays the addresses it was captured with; it stands in for the launches only
    for tensors at those same addresses, of the same shapes and dtypes.
    """
    return tuple((it.x.data_ptr(), it.out.data_ptr(), it.grid.data_ptr(), tuple(it.x.shape), tuple(it.out.shape),
                  tuple(it.grid.shape), it.x.dtype, it.out.dtype, it.grid.dtype, it.x.device, it.own) for it in items)


class GroupedQuantizer:
    """Many shards quantized one launch each, with every launch's arguments worked out once, and
    from the second time the same set comes, replayed as one captured CUDA graph.

    A rank of an 8B model has a few hundred linear shards; the host time of a launch from
    Python is what limits it, not the GPU (which quantizes at about 2 TB/s of bf16). One
    launch over all shards, through a table of their addresses, measured four times slower
    on an H200: addresses read from memory carry no alignment, so its loads are not vectorized.
    So the launches stay one per shard and a graph queues them in one call. A set is captured
    only once its launches have run eagerly (Triton compiles at a kernel's first launch,
    which a capture cannot hold), and a set seen for the first time, or whose capture
    failed, runs eagerly.
    """

    def __init__(self, fmt: BlockFp8, graphs: LaunchGraphs | None = None):
        self.fmt = fmt
        self.graphs = LaunchGraphs() if graphs is None else graphs
        self._sets: dict[tuple, _Launches] = {}

    def __call__(self, items: list[QuantizeItem]) -> None:
        if not items:
            return
        key = launch_key(items)
        got = self._sets.get(key)
        if got is None:
            if len(self._sets) >= _LAUNCHES_KEPT:  # the sources of an older build
                self._sets.clear()
            got = self._sets[key] = _Launches(self._launches(items))
        elif got.replay is None and got.runs == 1 and len({it.x.device for it in items}) == 1:
            got.replay = self.graphs.capture(items[0].x.device, lambda: self._run(got.launches))
        got.runs += 1
        if got.replay is not None:
            got.replay()
        else:
            self._run(got.launches)

    def _launches(self, items: list[QuantizeItem]) -> list[QuantizeLaunch]:
        from refit.transport.triton_kernels import QUANTIZE_OWN, QUANTIZE_WITH_FACTORS

        br, bc = self.fmt.block
        launches = []
        for it in items:
            if not it.x.numel():
                continue
            _check(it.x, it.out, it.grid, self.fmt)
            *lead, rows, cols = it.x.shape
            nr, nc = -(-rows // br), -(-cols // bc)
            launches.append(QuantizeLaunch((math.prod(lead) * nr, nc), (it.x, it.out, it.grid, rows, cols, nr, nc),
                                           QUANTIZE_OWN if it.own else QUANTIZE_WITH_FACTORS))
        return launches

    def _run(self, launches: list[QuantizeLaunch]) -> None:
        from refit.transport.triton_kernels import block_quantize_kernel

        fp8_max = self.fmt.max_value
        br, bc = self.fmt.block
        for launch in launches:
            block_quantize_kernel[launch.grid](*launch.args, fp8_max, MIN_AMAX, BR=br, BC=bc, MODE=launch.mode,
                                               num_warps=8)


def _check(x: torch.Tensor, out: torch.Tensor, grid: torch.Tensor, fmt: BlockFp8) -> None:
    if tuple(out.shape) != tuple(x.shape) or not out.is_contiguous():
        raise ValueError(f"the FP8 output {list(out.shape)} must be contiguous and of the shard's shape "
                         f"{list(x.shape)}")
    if tuple(grid.shape) != fmt.scale_shape(x.shape) or not grid.is_contiguous() or grid.dtype != torch.float32:
        raise ValueError(f"the scale grid {list(grid.shape)} {grid.dtype} must be contiguous float32 of shape "
                         f"{list(fmt.scale_shape(x.shape))}")


__all__ = ["GroupedQuantizer", "LaunchGraphs", "QuantizeItem", "QuantizeLaunch", "block_amax_one_pass", "launch_key",
           "one_pass_ready", "quantize_own_blocks", "quantize_with_factors"]
