"""Functions run on every rank of a LocalFleet by the FP8 tests (imported by the workers)."""

from __future__ import annotations

import numpy as np
import torch

import refit
from helpers.layouts import local_slice
from refit.models.fp8 import quantize_reference
from refit.plan.quant import BlockFp8
from refit.transport.quantized import xferdtensor_fp8


def weights(shape, seed: int) -> torch.Tensor:
    """bf16 values whose magnitude varies by row and column, with an all-zero block row sometimes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape[:-1] + (1,), generator=g))
    x = x * torch.exp(torch.randn((1,) * (len(shape) - 1) + (shape[-1],), generator=g))
    if seed % 3 == 0:
        x[..., : min(shape[-2], 5), :] = 0
    return x.to(torch.bfloat16)


def quantize_and_move(group, case):
    """``xferdtensor_fp8`` from a random source layout to a random FP8 destination layout; every
    destination compares its weight and scales with the reference quantizer's, bit for bit."""
    fmt = BlockFp8(tuple(case["block"]), case["fmt"])
    shape = tuple(case["shape"])
    sm, sp, dm, dp = np.array(case["src_mesh"]), case["src_pl"], np.array(case["dst_mesh"]), case["dst_pl"]
    full = weights(shape, case["seed"])
    want_q, want_s = quantize_reference(full, fmt)
    grid = fmt.scale_shape(shape)
    src_local = local_slice(full, sm, sp, group.rank)
    want_local = local_slice(want_q.view(torch.uint8), dm, dp, group.rank)
    s_want = local_slice(want_s, dm, case["scale_pl"], group.rank)
    dst = refit.DTensorRef(torch.zeros(want_local.shape, dtype=want_q.dtype), shape) if want_local is not None else None
    s_dst = refit.DTensorRef(torch.full(s_want.shape, float("nan")), grid) if s_want is not None else None
    from refit.errors import PlanError

    try:
        xferdtensor_fp8(refit.DTensorRef(src_local, shape) if src_local is not None else None, case["src_mesh"],
                        sp, dst, case["dst_mesh"], dp, group, quant=fmt, dst_scale=s_dst,
                        scale_placement=case["scale_pl"])
    except PlanError as e:
        return {"refused": str(e)}
    if dst is None:
        return None
    return {"weight": bool(torch.equal(dst._local_tensor.view(torch.uint8), want_local)),
            "scale": bool(torch.equal(s_dst._local_tensor, s_want)),
            "bytes": int(dst._local_tensor.numel())}


def bad_call(group, kind):
    """A call every rank must refuse with the same error before anything moves."""
    from refit.errors import PlanError

    fmt = BlockFp8((16, 16))
    r = group.rank
    src = refit.DTensorRef(weights((64, 32), 1)[r * 32:(r + 1) * 32], (64, 32)) if r < 2 else None
    q = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    scale = refit.DTensorRef(torch.zeros(4, 2), (4, 2))
    dst = refit.DTensorRef(q, (64, 32)) if r >= 2 else None
    kw = {"quant": fmt, "dst_scale": scale if r >= 2 else None}
    if kind == "dst_dtype":
        dst = refit.DTensorRef(torch.zeros(32, 32, dtype=torch.bfloat16), (64, 32)) if r >= 2 else None
    elif kind == "scale_shape":
        kw["dst_scale"] = refit.DTensorRef(torch.zeros(4, 4), (4, 4)) if r >= 2 else None
    elif kind == "shapes_differ":  # the sources hold a [64, 32] tensor, the destinations a [64, 48] one
        dst = refit.DTensorRef(torch.zeros(32, 48, dtype=torch.float8_e4m3fn), (64, 48)) if r >= 2 else None
        kw["dst_scale"] = refit.DTensorRef(torch.zeros(4, 3), (4, 3)) if r >= 2 else None
    elif kind == "unaligned_scales":  # rows 0..29 / 30..63 cut a 16-row block, but the scales are cut by blocks
        src = refit.DTensorRef(weights((60, 32), 1)[r * 30:(r + 1) * 30], (60, 32)) if r < 2 else None
        dst = refit.DTensorRef(torch.zeros(30, 32, dtype=torch.float8_e4m3fn), (60, 32)) if r >= 2 else None
        kw["dst_scale"] = refit.DTensorRef(torch.zeros(2, 2), (4, 2)) if r >= 2 else None
        kw["scale_placement"] = [refit.Shard(0)]
    try:
        xferdtensor_fp8(src, [0, 1], [refit.Shard(0)], dst, [2, 3], [refit.Shard(0)], group, **kw)
    except PlanError as e:
        return str(e)
    return None
