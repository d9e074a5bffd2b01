"""Block-scaled FP8 quantization: the reference on a full tensor, and the same result shard by shard.

The definition every path must reproduce bit for bit (DeepSeek-V3's ``weight_scale_inv``
convention), per block of the last two dims:

    amax      = max |x| over the block, in float32 (0 for an all-zero block)
    scale_inv = max(amax, MIN_AMAX) / fp8_max          (float32, what the engine multiplies by)
    factor    = fp8_max / max(amax, MIN_AMAX)          (float32)
    weight    = clamp(float32(x) * factor, -fp8_max, fp8_max) cast to FP8 (round to nearest even)

The per-element step is one multiply, not a division: a compiled kernel may turn a division
into a multiply by a reciprocal, or divide approximately, and then its bits differ from an
eager reference in a few elements per million; a float32 multiply rounds the same
everywhere. The two per-block divisions run eagerly on the (small) scale grid. Every step is
elementwise once the block's factor is known, and a max is exact in any order, so a rank
that knows the scales of the blocks it touches quantizes its own elements to exactly the
bits the full tensor would give. ``partial_amax`` gives what a
rank's shard contributes to each block; merging the ranks' contributions by max (only the
cut blocks need it, ``refit.plan.quant.cut_blocks``) gives every block's amax.
"""

from __future__ import annotations

import torch

from refit.layout import Region, region_shape
from refit.plan.quant import BlockFp8

__all__ = ["MIN_AMAX", "aligned_amax", "block_amax", "dequantize", "factors_from_amax", "partial_amax",
           "quantize_aligned", "quantize_aligned_into", "quantize_aligned_with", "quantize_local", "quantize_reference",
           "scales_from_amax", "scales_into"]

MIN_AMAX = 1e-12  # an all-zero block still gets a finite, positive scale


def _fp8_dtype(fmt: BlockFp8) -> torch.dtype:
    return getattr(torch, fmt.dtype_name)


def block_amax(full: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """max |x| per block of the last two dims (float32), over the elements that exist."""
    fmt.check_shape(full.shape)
    *lead, rows, cols = full.shape
    br, bc = fmt.block
    grid = fmt.scale_shape(full.shape)
    padded = torch.zeros((*lead, grid[-2] * br, grid[-1] * bc), dtype=torch.float32, device=full.device)
    padded[..., :rows, :cols] = full.float().abs()
    blocks = padded.reshape(*lead, grid[-2], br, grid[-1], bc)
    return blocks.amax(dim=(-3, -1))


def _divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` correctly rounded on every device: both operands tensors of one shape.

    With a Python number on either side torch may multiply by a reciprocal instead (CPU
    kernels do for ``number / tensor``, CUDA ones for ``tensor / number``), and the scales
    of the same block then differ in the last bit between a CPU and a GPU.
    """
    return torch.div(a, b)


def scales_from_amax(amax: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """``scale_inv`` per block from its amax."""
    amax = amax.float().clamp_min(MIN_AMAX)
    return _divide(amax, torch.full_like(amax, fmt.max_value)).to(getattr(torch, fmt.scale_dtype))


def factors_from_amax(amax: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """What every element of a block is multiplied by before the cast (float32)."""
    amax = amax.float().clamp_min(MIN_AMAX)
    return _divide(torch.full_like(amax, fmt.max_value), amax)


def _expand(scale_inv: torch.Tensor, index: list[torch.Tensor], fmt: BlockFp8) -> torch.Tensor:
    """The scale of every element whose global indices per dim are ``index`` (an open grid)."""
    *lead, rows, cols = index
    br, bc = fmt.block
    grid_index = [*lead, rows // br, cols // bc]
    ndim = len(grid_index)
    shaped = [ix.reshape([-1 if d == k else 1 for d in range(ndim)]) for k, ix in enumerate(grid_index)]
    return scale_inv.float()[tuple(shaped)]


def _quantize(x: torch.Tensor, factor: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    q = (x.float() * factor).clamp(-fmt.max_value, fmt.max_value)
    return q.to(_fp8_dtype(fmt))


def quantize_reference(full: torch.Tensor, fmt: BlockFp8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, weight_scale_inv)`` of a full tensor: the result every refit path must equal."""
    amax = block_amax(full, fmt)
    index = [torch.arange(n, device=full.device) for n in full.shape]
    return _quantize(full, _expand(factors_from_amax(amax, fmt), index, fmt), fmt), scales_from_amax(amax, fmt)


def _region_index(region: Region, device: torch.device) -> list[torch.Tensor]:
    """Per dim, the global index of every local position (intervals in local order)."""
    out = []
    for intervals in region:
        parts = [torch.arange(a, b, device=device) for a, b in intervals]
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device))
    return out


def _check_local(local: torch.Tensor, region: Region) -> None:
    if tuple(local.shape) != region_shape(region):
        raise ValueError(f"local shard shape {list(local.shape)} is not its region's {list(region_shape(region))}")


def partial_amax(local: torch.Tensor, region: Region, shape: tuple[int, ...], fmt: BlockFp8) -> torch.Tensor:
    """What one shard contributes to every block's amax: a scale-grid tensor, 0 where it holds nothing.

    ``region`` is where ``local`` sits in the global tensor of ``shape``
    (``refit.layout.shard_region``). The elementwise max of every shard's result is
    ``block_amax`` of the full tensor.
    """
    _check_local(local, region)
    grid = fmt.scale_shape(shape)
    out = torch.zeros(grid, dtype=torch.float32, device=local.device)
    if local.numel() == 0:
        return out
    *lead, rows, cols = _region_index(region, local.device)
    br, bc = fmt.block
    # a rank's blocks: scatter |x| into (lead..., row block, col block) with amax
    ndim = local.dim()
    idx = [ix.reshape([-1 if d == k else 1 for d in range(ndim)]).expand(local.shape)
           for k, ix in enumerate([*lead, rows // br, cols // bc])]
    flat = sum(idx[k] * out.stride(k) for k in range(ndim))
    out.view(-1).scatter_reduce_(0, flat.reshape(-1), local.float().abs().reshape(-1), reduce="amax",
                                 include_self=True)
    return out


def quantize_local(local: torch.Tensor, region: Region, amax: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """One shard's FP8 weight, given the merged amax grid of the whole tensor (its own blocks' at least)."""
    _check_local(local, region)
    return _quantize(local, _expand(factors_from_amax(amax, fmt), _region_index(region, local.device), fmt), fmt)


def aligned_amax(x: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """``block_amax`` of a shard whose blocks start at its origin, in block-shaped views (no gathers)."""
    fmt.check_shape(x.shape)
    *lead, rows, cols = x.shape
    br, bc = fmt.block
    nr, nc = -(-rows // br), -(-cols // bc)
    xa = x.abs()
    if rows % br or cols % bc:
        xa = torch.nn.functional.pad(xa, (0, nc * bc - cols, 0, nr * br - rows))
    return xa.reshape(*lead, nr, br, nc, bc).amax(dim=(-3, -1)).float()


def quantize_aligned_into(out: torch.Tensor, x: torch.Tensor, factor: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """Write the FP8 weight of a shard whose blocks start at its origin into ``out``, given each
    block's factor; returns ``out``.

    The cast to FP8 happens in the copy into ``out``, so no FP8 temporary is made and copied
    again: compiled, the multiply, clamp, cast and store are one pass over the shard.
    """
    *lead, rows, cols = x.shape
    br, bc = fmt.block
    nr, nc = factor.shape[-2:]
    xf = x.float()
    if rows % br or cols % bc:
        xf = torch.nn.functional.pad(xf, (0, nc * bc - cols, 0, nr * br - rows))
    blocks = xf.reshape(*lead, nr, br, nc, bc) * factor.reshape(*lead, nr, 1, nc, 1)
    q = blocks.clamp(-fmt.max_value, fmt.max_value)
    out.copy_(q.reshape(*lead, nr * br, nc * bc)[..., :rows, :cols])
    return out


def quantize_aligned_with(x: torch.Tensor, factor: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """The FP8 weight of a shard whose blocks start at its origin, given each block's factor."""
    return quantize_aligned_into(torch.empty(x.shape, dtype=_fp8_dtype(fmt), device=x.device), x, factor, fmt)


def scales_into(out: torch.Tensor, amax: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """``factors_from_amax`` of ``amax``, with its ``scales_from_amax`` written into ``out`` on the
    way (the clamp shared, the division written in place): fewer kernels per tensor."""
    amax = amax.float().clamp_min(MIN_AMAX)
    fp8_max = torch.full_like(amax, fmt.max_value)
    if out.dtype == torch.float32:
        torch.div(amax, fp8_max, out=out)
    else:
        out.copy_(_divide(amax, fp8_max))
    return _divide(fp8_max, amax)


def quantize_aligned(x: torch.Tensor, fmt: BlockFp8, *, amax_fn=aligned_amax,
                     quantize_fn=quantize_aligned_with) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, scale_inv)`` of a shard that holds its blocks whole: two passes over it (the
    amax, then the multiply and cast), each of which ``torch.compile`` fuses (pass compiled
    ``amax_fn`` and ``quantize_fn``); the per-block divisions between them run eagerly."""
    amax = amax_fn(x, fmt)
    return quantize_fn(x, factors_from_amax(amax, fmt), fmt), scales_from_amax(amax, fmt)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    """float32 values of a full FP8 weight and its scale grid (an engine's forward on CPU)."""
    index = [torch.arange(n, device=weight.device) for n in weight.shape]
    return weight.float() * _expand(scale_inv, index, fmt)
