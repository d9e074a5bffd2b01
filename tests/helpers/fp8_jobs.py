"""Functions run on every rank of a LocalFleet by the FP8 tests (imported by the workers)."""

from __future__ import annotations

import numpy as np
import torch

import refit
from helpers.layouts import local_slice
from refit.layout import mesh_coords_of, shard_region
from refit.models.fp8 import partial_amax, quantize_local, quantize_reference, scales_from_amax
from refit.plan.quant import BlockFp8


def weights(shape, seed: int) -> torch.Tensor:
    """bf16 values whose magnitude varies by row and column, with an all-zero block row sometimes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape[:-1] + (1,), generator=g))
    x = x * torch.exp(torch.randn((1,) * (len(shape) - 1) + (shape[-1],), generator=g))
    if seed % 3 == 0:
        x[..., : min(shape[-2], 5), :] = 0
    return x.to(torch.bfloat16)


def merged_amax(group, partial: torch.Tensor) -> torch.Tensor:
    """Every rank's partial amax grid merged by max (each rank broadcasts its own in turn)."""
    out = partial.clone()
    for root in range(group.world_size):
        buf = partial.clone() if root == group.rank else torch.empty_like(partial)
        group.broadcast(buf, root)
        out = torch.maximum(out, buf)
    return out


def quantize_and_move(group, case):
    """Sources quantize their own shards (partial amax merged over the group), FP8 weights and scales
    move shard to shard with xferdtensor, and every destination compares bits with the reference."""
    fmt = BlockFp8(tuple(case["block"]), case["fmt"])
    shape = tuple(case["shape"])
    sm, sp, dm, dp = np.array(case["src_mesh"]), case["src_pl"], np.array(case["dst_mesh"]), case["dst_pl"]
    full = weights(shape, case["seed"])
    want_q, want_s = quantize_reference(full, fmt)
    grid = fmt.scale_shape(shape)

    coords = mesh_coords_of(sm, group.rank)
    partial = torch.zeros(grid, dtype=torch.float32)
    q_src = None
    if coords is not None:
        region = shard_region(shape, sm.shape, coords, sp)
        partial = partial_amax(local_slice(full, sm, sp, group.rank), region, shape, fmt)
    amax = merged_amax(group, partial)
    scale_inv = scales_from_amax(amax, fmt)
    if coords is not None:
        q_src = quantize_local(local_slice(full, sm, sp, group.rank), region, amax, fmt)

    want_local = local_slice(want_q.view(torch.uint8), dm, dp, group.rank)
    dst = None
    if want_local is not None:
        dst = refit.DTensorRef(torch.zeros(want_local.shape, dtype=want_q.dtype), shape)
    refit.xferdtensor(refit.DTensorRef(q_src, shape) if q_src is not None else None, case["src_mesh"], sp,
                      dst, case["dst_mesh"], dp, group)
    # the scales: every source holds the whole grid after the merge; destinations take theirs
    scale_pl = [refit.Replicate()] * sm.ndim
    dst_scale_mesh = case["dst_mesh"]
    s_want = local_slice(want_s, dm, case["scale_pl"], group.rank)
    s_dst = refit.DTensorRef(torch.full(s_want.shape, float("nan")), grid) if s_want is not None else None
    refit.xferdtensor(refit.DTensorRef(scale_inv, grid) if coords is not None else None, case["src_mesh"], scale_pl,
                      s_dst, dst_scale_mesh, case["scale_pl"], group)
    if dst is None:
        return None
    return {"weight": bool(torch.equal(dst._local_tensor.view(torch.uint8), want_local)),
            "scale": bool(torch.equal(s_dst._local_tensor, s_want)),
            "bytes": int(dst._local_tensor.numel())}
