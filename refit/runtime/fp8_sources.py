"""A trainer rank's side of refits into FP8 engines: its shards quantized before the wire.

When an engine keeps a param in block-scaled FP8 (its destination is ``float8_*`` and it
asks for ``<name>_scale_inv``), the trainer ranks holding that param send FP8 bytes, not
bf16: at every refit each of them computes its shard's partial block amaxes, the ranks of
the param's source mesh merge them (through the mesh's lowest rank, one message each way
per mesh for all its params at once), and each quantizes its own shard into an FP8 copy
made once per build. The merged grid gives the scales, which every one of those ranks then
holds whole and sends like a replicated tensor. The result is bit for bit what quantizing
the full tensor gives (``refit.models.fp8``), whatever the shard boundaries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from refit.errors import PlanError
from refit.layout import Region, shard_region
from refit.models.fp8 import (
    aligned_amax,
    factors_from_amax,
    partial_amax,
    quantize_aligned_with,
    quantize_local,
    scales_from_amax,
)
from refit.plan import ParamIndex
from refit.plan.quant import FP8_FORMATS, BlockFp8, scale_name
from refit.transport.quantized import merge_max

__all__ = ["QuantizedSources"]

_FORMAT_OF = {dtype: fmt for fmt, (dtype, _) in FP8_FORMATS.items()}


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    region: Region
    members: tuple[int, ...]  # the ranks of its source mesh, sorted


class QuantizedSources:
    """The FP8 copies and scale grids of one trainer rank, for the params its engines keep in FP8."""

    def __init__(self, rank: int, fmt: BlockFp8, params: list[_Param], shards: Mapping[str, torch.Tensor]):
        self.rank, self.fmt = rank, fmt
        self.params = {p.name: p for p in params}
        dtype = getattr(torch, fmt.dtype_name)
        self.weights = {p.name: torch.empty(shards[p.name].shape, dtype=dtype, device=shards[p.name].device)
                        for p in params}
        self.scales = {scale_name(p.name): torch.empty(fmt.scale_shape(p.shape), dtype=torch.float32,
                                                        device=shards[p.name].device) for p in params}
        by_mesh: dict[tuple[int, ...], list[str]] = defaultdict(list)
        for p in params:
            by_mesh[p.members].append(p.name)
        self.meshes = sorted((m, sorted(ns)) for m, ns in by_mesh.items())
        self._compiled = None

    @classmethod
    def for_index(cls, index: ParamIndex, rank: int, shards: Mapping[str, torch.Tensor], *,
                  block: tuple[int, int] = (128, 128), label: str = "trainer") -> QuantizedSources | None:
        """The params of ``shards`` that some destination keeps in FP8; None when there are none."""
        params, formats = [], set()
        for name in sorted(shards):
            spec = index.specs.get(name)
            if spec is None:
                continue
            dtypes = {d.dtype for d in spec.dsts}
            fp8 = {d for d in dtypes if d.startswith("float8")}
            if not fp8:
                continue
            if len(dtypes) > 1:
                raise PlanError(f"{label}: {name}: destinations want it as {sorted(dtypes)}; a param goes to all its "
                                "engines in FP8 or to none (one FP8 copy is made per trainer rank)")
            dtype = fp8.pop()
            if dtype not in _FORMAT_OF:
                raise PlanError(f"{label}: {name}: no block-scaled format for {dtype}")
            fmt = BlockFp8(block, _FORMAT_OF[dtype])
            formats.add(fmt)
            scales = index.specs.get(scale_name(name))
            if scales is None:
                raise PlanError(f"{label}: {name}: its engines keep it in {dtype} but none asks for "
                                f"{scale_name(name)}, so its values could not be read back")
            if tuple(scales.shape) != fmt.scale_shape(spec.shape):
                raise PlanError(f"{label}: {scale_name(name)} is {list(scales.shape)}, not the scale grid "
                                f"{list(fmt.scale_shape(spec.shape))} of {block[0]}x{block[1]} blocks of a "
                                f"{list(spec.shape)} weight")
            src = spec.src
            region = shard_region(spec.shape, src.mesh_shape, src.coords(rank), src.placements)
            params.append(_Param(name, tuple(spec.shape), region, tuple(sorted(src.mesh_ranks))))
        if not params:
            return None
        if len(formats) > 1:
            raise PlanError(f"{label}: the engines want more than one FP8 format ({sorted(f.fmt for f in formats)})")
        return cls(rank, formats.pop(), params, shards)

    def executor_tensors(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the executor sends from: the FP8 copies in place of the quantized params, and the scales."""
        return {**local, **self.weights, **self.scales}

    def refresh(self, local: Mapping[str, torch.Tensor], comm) -> dict[str, torch.Tensor]:
        """Quantize this rank's current shards (the block amaxes merged over each source mesh)."""
        amax = {n: self._partial_amax(local[n], p) for n, p in self.params.items()}
        merged = self._merge(amax, comm)
        for n, p in self.params.items():
            blocks = self._blocks(p)
            if blocks is None:
                self.weights[n].copy_(quantize_local(local[n], p.region, merged[n], self.fmt))
            else:
                factors = factors_from_amax(merged[n][blocks], self.fmt)
                self.weights[n].copy_(self._kernels(local[n])[1](local[n], factors, self.fmt))
            self.scales[scale_name(n)].copy_(scales_from_amax(merged[n], self.fmt))
        return self.executor_tensors(local)

    # A shard that starts on a block boundary (most do: even TP, FSDP's dim-0 chunks of
    # multiples of 128) is quantized in block-shaped views, two passes that torch.compile
    # fuses on a GPU; any other takes the general path, which gathers a scale per element.
    def _blocks(self, p: _Param) -> tuple[slice, ...] | None:
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

    def _partial_amax(self, x: torch.Tensor, p: _Param) -> torch.Tensor:
        blocks = self._blocks(p)
        if blocks is None:
            return partial_amax(x, p.region, p.shape, self.fmt)
        grid = torch.zeros(self.fmt.scale_shape(p.shape), dtype=torch.float32, device=x.device)
        if x.numel():
            grid[blocks] = self._kernels(x)[0](x, self.fmt)
        return grid

    def _kernels(self, x: torch.Tensor):
        """(amax, quantize) for block-aligned shards: compiled on a GPU, eager elsewhere."""
        if x.device.type != "cuda":
            return aligned_amax, quantize_aligned_with
        if self._compiled is None:
            self._compiled = (torch.compile(aligned_amax), torch.compile(quantize_aligned_with))
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
