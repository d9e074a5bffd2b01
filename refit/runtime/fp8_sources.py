"""A trainer rank's side of refits into FP8 engines: its shards quantized beside the wire.

When an engine keeps a param in block-scaled FP8 (its destination is ``float8_*`` and it
asks for ``<name>_scale_inv``), the trainer ranks holding that param send FP8 bytes, not
bf16, from an FP8 copy of their shard made once per build and rewritten at every refit.
The result is bit for bit what quantizing the full tensor gives (``refit.models.fp8``),
whatever the shard boundaries, in one of two ways:

Each param's way is a ``QuantizeOp`` of the rank's ``QuantizationPlan``
(``refit.plan.quant.plan_quantization``):

* **Quantize at pack** (most layouts: every shard holds whole blocks, and the scale grid's
  source is sharded like the weight, ``refit.plan.quant.scale_placements``): a rank makes
  its blocks' amaxes, scales and FP8 weight from its shard alone, when the executor first
  reaches the param. Nothing runs ahead of the wire, and no message is exchanged.
* **Partial amax then quantize** (a shard boundary inside a block): before the executor starts, each rank
  takes its shard's partial block amaxes and the ranks of the param's source mesh merge
  them (through the mesh's lowest rank, one message each way per mesh for all its params
  at once). Every one of them then holds the whole scale grid and sends it like a
  replicated tensor; the FP8 weight is made when the executor reaches it.

Nothing is quantized ahead of the executor: quantizing every shard before the first byte
moves puts all of that work ahead of the wire, and on one H200 makes the refit into FP8
engines slower than the bf16 one it halves.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from refit.models.fp8 import (
    aligned_amax,
    factors_from_amax,
    partial_amax,
    quantize_aligned_into,
    quantize_local,
    scales_from_amax,
    scales_into,
)
from refit.plan.quant import QUANTIZE_AT_PACK, QuantizationPlan, QuantizeOp, plan_quantization, scale_name
from refit.transport.base import SourceProduction
from refit.transport.casts import narrowing_casts
from refit.transport.quantize_gpu import GroupedQuantizer, QuantizeItem, block_amax_one_pass, one_pass_ready
from refit.transport.quantized import merge_max

__all__ = ["Quantization", "QuantizedSources", "plan_sources"]


class QuantizedSources:
    """The FP8 copies and scale grids of one trainer rank, made as its ``QuantizationPlan`` says."""

    def __init__(self, plan: QuantizationPlan, shards: Mapping[str, torch.Tensor]):
        self.plan, self.rank, self.fmt = plan, plan.rank, plan.fmt
        self.params = {op.name: op for op in plan.ops}
        dtype = getattr(torch, plan.fmt.dtype_name)
        self.weights = {op.name: torch.empty(shards[op.name].shape, dtype=dtype, device=shards[op.name].device)
                        for op in plan.ops}
        self.scales = {op.scale: torch.empty(plan.scale_shape(op), dtype=torch.float32,
                                             device=shards[op.name].device) for op in plan.ops}
        self.meshes = plan.merges()
        self._compiled = None
        self._grouped = GroupedQuantizer(plan.fmt)
        # per param: its slice of the scale grid (None: not one box from a block's start), worked out once
        self._block_slices = {op.name: self._blocks(op) for op in plan.ops}
        # merged params' factors, written in place at every refit: the grouped launches then read
        # the same addresses each time and replay as one captured graph
        self._factors: dict[str, torch.Tensor] = {}

    def executor_tensors(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the executor sends from: the FP8 copies in place of the quantized params, and the scales."""
        return {**local, **self.weights, **self.scales}

    def begin(self, local: Mapping[str, torch.Tensor], comm) -> Quantization:
        """Start this refit's quantization of this rank's current shards.

        Only params with cut blocks do anything now: their block amaxes are taken and
        merged over each source mesh, and their scales written (no message at all when
        there are none). Every FP8 weight, and the scales of params made from their own
        blocks, are made when the executor asks for them (``Quantization.produce``), so
        that quantizing overlaps the wire.
        """
        t0 = time.perf_counter()
        merged: dict[str, torch.Tensor] = {}
        if self.meshes:
            amax = {n: self._partial_amax(local[n], self.params[n]) for _, names in self.meshes for n in names}
            merged = self._merge(amax, comm)
            for n, grid in merged.items():
                self.scales[scale_name(n)].copy_(scales_from_amax(grid, self.fmt))
        return Quantization(self, local, merged, ahead_s=time.perf_counter() - t0)

    def quantize_alone(self, local: Mapping[str, torch.Tensor]) -> int:
        """Amax and quantize every param from this rank's shards alone, without the merge: the
        kernels a refit runs, for a benchmark to time. Returns the bytes read (the shards')."""
        self.quantize_params([(n, local[n], None if p.mode == QUANTIZE_AT_PACK else self._partial_amax(local[n], p))
                              for n, p in self.params.items()])
        return sum(local[n].numel() * local[n].element_size() for n in self.params)

    def quantize_params(self, work: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> None:
        """``quantize_param`` of each ``(name, shard, merged amax or None)``: those the one-pass kernel
        takes go to ``GroupedQuantizer`` together, which works out their launches once per set."""
        items, rest = [], []
        for name, x, amax in work:
            p = self.params[name]
            blocks = self._block_slices[name]
            if one_pass_ready(x, self.fmt) and (p.mode == QUANTIZE_AT_PACK or blocks is not None):
                own = p.mode == QUANTIZE_AT_PACK
                grid = self.scales[p.scale] if own else self._factors_of(name, amax[blocks])
                items.append(QuantizeItem(x, self.weights[name], grid, own))
            else:
                rest.append((name, x, amax))
        self._grouped(items)
        for name, x, amax in rest:
            self.quantize_param(name, x, amax)

    def _factors_of(self, name: str, amax: torch.Tensor) -> torch.Tensor:
        """``name``'s per-block factors from its merged amaxes, in a buffer kept for the build."""
        factors = factors_from_amax(amax, self.fmt)
        buf = self._factors.get(name)
        if buf is None or buf.shape != factors.shape or buf.device != factors.device:
            buf = self._factors[name] = torch.empty(factors.shape, dtype=torch.float32, device=factors.device)
        return buf.copy_(factors)

    def quantize_param(self, name: str, x: torch.Tensor, amax: torch.Tensor | None) -> None:
        """Write ``name``'s FP8 copy from its shard ``x``: given the merged amax grid, or (quantize
        at pack, ``amax`` None) with the amaxes and scales of its own blocks made here."""
        p = self.params[name]
        blocks = self._block_slices[name]
        amax_fn, quantize_fn = self._kernels(x)
        if p.mode == QUANTIZE_AT_PACK:
            own = amax_fn(x, self.fmt) if x.numel() else torch.zeros(self.scales[p.scale].shape, device=x.device)
            factors = scales_into(self.scales[p.scale], own, self.fmt)
            if x.numel():
                quantize_fn(self.weights[name], x, factors, self.fmt)
        elif blocks is None:
            self.weights[name].copy_(quantize_local(x, p.region, amax, self.fmt))
        else:
            quantize_fn(self.weights[name], x, factors_from_amax(amax[blocks], self.fmt), self.fmt)

    # A shard that starts on a block boundary (most do: even TP, FSDP's dim-0 chunks of
    # multiples of 128) is quantized block by block: one Triton pass on a GPU
    # (refit.transport.quantize_gpu), else block-shaped views of eager or compiled torch; any
    # other takes the general path, which gathers a scale per element.
    def _blocks(self, p: QuantizeOp) -> tuple[slice, ...] | None:
        """The slice of the scale grid that ``p``'s shard covers, if it is one box starting on a block."""
        if any(len(intervals) != 1 for intervals in p.region):
            return None
        starts = [intervals[0][0] for intervals in p.region]
        *lead, rows, cols = [intervals[0] for intervals in p.region]
        br, bc = self.fmt.block
        if starts[-2] % br or starts[-1] % bc:
            return None
        return (*(slice(a, b) for a, b in lead), slice(rows[0] // br, -(-rows[1] // br)),
                slice(cols[0] // bc, -(-cols[1] // bc)))

    def _partial_amax(self, x: torch.Tensor, p: QuantizeOp) -> torch.Tensor:
        blocks = self._block_slices[p.name]
        if blocks is None:
            return partial_amax(x, p.region, p.shape, self.fmt)
        grid = torch.zeros(self.fmt.scale_shape(p.shape), dtype=torch.float32, device=x.device)
        if x.numel():
            grid[blocks] = block_amax_one_pass(x, self.fmt) if one_pass_ready(x, self.fmt) \
                else self._kernels(x)[0](x, self.fmt)
        return grid

    def _kernels(self, x: torch.Tensor):
        """(amax, quantize into the FP8 copy) for block-aligned shards: compiled on a GPU, eager elsewhere."""
        if x.device.type != "cuda":
            return aligned_amax, quantize_aligned_into
        if self._compiled is None:
            self._compiled = (torch.compile(aligned_amax), torch.compile(quantize_aligned_into))
        return self._compiled

    def _merge(self, amax: dict[str, torch.Tensor], comm) -> dict[str, torch.Tensor]:
        """Every param's amax grid merged by max over its source mesh, on every rank of it
        (one message each way per mesh, for all its params at once)."""
        flat = {m: torch.cat([amax[n].reshape(-1) for n in names]) for m, names in self.meshes}
        merged = merge_max(comm, flat)
        out = {}
        for members, names in self.meshes:
            pos = 0
            for n in names:
                size = amax[n].numel()
                out[n] = merged[members][pos:pos + size].view(amax[n].shape)
                pos += size
        return out


class Quantization(SourceProduction):
    """One refit's FP8 weights of one trainer rank, made param by param as the executor reaches them."""

    def __init__(self, sources: QuantizedSources, local: Mapping[str, torch.Tensor],
                 merged: Mapping[str, torch.Tensor], *, ahead_s: float = 0.0):
        self.sources = sources
        self.tensors = sources.executor_tensors(local)
        self._local, self._merged = local, merged
        # a name the executor reads -> the param that making it makes (own blocks: the scales too)
        self._param_of = {n: n for n in sources.params}
        self._param_of.update({p.scale: n for n, p in sources.params.items() if p.mode == QUANTIZE_AT_PACK})
        self._waiting = set(self._param_of)
        self.made: list[str] = []  # in the order they were made
        # host seconds: the amaxes, their merge and the scales, before the executor starts; and
        # the FP8 weights made while it runs (on a GPU, the time to queue their kernels)
        self.ahead_s, self.beside_s = ahead_s, 0.0

    def report(self) -> dict:
        """What this refit's quantization took: seconds and the shards' bytes read."""
        nbytes = sum(t.numel() * t.element_size() for n, t in self._local.items() if n in self.sources.params)
        return {"ahead_s": self.ahead_s, "beside_s": self.beside_s, "bytes_in": nbytes,
                "bytes_out": sum(self.sources.weights[n].numel() for n in self.made)}

    def waiting(self, name: str) -> bool:
        return name in self._waiting

    def names(self) -> list[str]:
        return sorted(self._param_of)

    def produce(self, names) -> bool:
        t0 = time.perf_counter()
        work = []
        for name in names:
            if name not in self._waiting:
                continue
            n = self._param_of[name]
            self._waiting.discard(n)
            self._waiting.discard(scale_name(n))
            work.append((n, self._local[n], self._merged.get(n)))
            self.made.append(n)
        self.sources.quantize_params(work)
        self.beside_s += time.perf_counter() - t0
        return bool(work)


def plan_sources(index: Any, rank: int, local: Mapping[str, torch.Tensor], *, block: tuple[int, int],
                 label: str) -> tuple[QuantizedSources | None, dict[str, tuple[str, ...]], dict[str, torch.Tensor]]:
    """A trainer rank's sources for its plan: ``(quantized, narrowing, executor tensors)``.

    The params an engine keeps in FP8 leave this rank quantized, with their scales
    (``quantized``, whose FP8 buffers the executor sends); the others going to a dtype of
    smaller range are held to it before every transfer (``narrowing``: name -> those dtypes).
    """
    quantization = plan_quantization(index, rank, list(local), block=block, label=label)
    scaled = {op.name for op in quantization.ops} if quantization is not None else set()
    narrowing = narrowing_casts(index, rank, [n for n in local if n not in scaled])
    if quantization is None:
        return None, narrowing, dict(local)
    quantized = QuantizedSources(quantization, local)
    return quantized, narrowing, quantized.executor_tensors(local)
