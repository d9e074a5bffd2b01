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


def _args(rank: int, shape=(64, 32), block=(16, 16), src_mesh=(0, 1), dst_mesh=(2, 3)) -> dict:
    """A good call's arguments on ``rank``: bf16 rows split over ``src_mesh``, FP8 rows split over
    ``dst_mesh``, the scales replicated there."""
    fmt = BlockFp8(block)
    full = weights(shape, 1)
    sm, dm, rows = np.array(src_mesh), np.array(dst_mesh), [refit.Shard(0)]
    src, dst = local_slice(full, sm, rows, rank), local_slice(full, dm, rows, rank)
    grid = fmt.scale_shape(shape)
    q = torch.zeros(dst.shape, dtype=torch.float8_e4m3fn) if dst is not None else None
    return {"src_tensor": refit.DTensorRef(src, shape) if src is not None else None, "src_mesh": list(src_mesh),
            "src_placement": rows, "dst_mesh": list(dst_mesh), "dst_placement": rows, "quant": fmt,
            "dst_tensor": refit.DTensorRef(q, shape) if q is not None else None,
            "dst_scale": refit.DTensorRef(torch.zeros(grid), grid) if q is not None else None}


def _src(rank: int, shape, local_shape, dtype=torch.bfloat16):
    return refit.DTensorRef(torch.ones(local_shape, dtype=dtype), shape)


def _bad_args(r: int, kind: str) -> dict:  # noqa: C901, PLR0912 - one branch per case, each read alone
    """Rank ``r``'s arguments for the bad call ``kind``: mostly a good call with one argument wrong."""
    a = _args(r)
    fp8 = torch.float8_e4m3fn
    if kind == "dst_dtype":
        a["dst_tensor"] = refit.DTensorRef(torch.zeros(32, 32, dtype=torch.bfloat16), (64, 32)) if r >= 2 else None
    elif kind == "scale_shape":
        a["dst_scale"] = refit.DTensorRef(torch.zeros(4, 4), (4, 4)) if r >= 2 else None
    elif kind == "shapes_differ":  # the sources hold a [64, 32] tensor, the destinations a [64, 48] one
        a["dst_tensor"] = refit.DTensorRef(torch.zeros(32, 48, dtype=fp8), (64, 48)) if r >= 2 else None
        a["dst_scale"] = refit.DTensorRef(torch.zeros(4, 3), (4, 3)) if r >= 2 else None
    elif kind == "shapes_differ_same_ranks":  # ranks 0 and 1 pass a [300, 256] source and a [300, 384] destination
        a = _args(r, (300, 256), (128, 128), dst_mesh=(0, 1))
        a["dst_tensor"] = refit.DTensorRef(torch.zeros(150, 384, dtype=fp8), (300, 384)) if r < 2 else None
        a["dst_scale"] = refit.DTensorRef(torch.zeros(3, 3), (3, 3)) if r < 2 else None
    elif kind == "src_local_shape":  # 150-row shards cut a 128-row block: the amaxes would be merged
        a = _args(r, (300, 256), (128, 128))
        if r == 1:
            a["src_tensor"] = _src(r, (300, 256), (149, 256))
    elif kind == "dst_local_shape":
        if r == 3:
            a["dst_tensor"] = refit.DTensorRef(torch.zeros(31, 32, dtype=fp8), (64, 32))
    elif kind == "scale_local_shape":  # replicated scales, but rank 3 holds 3 of the grid's 4 block rows
        if r == 3:
            a["dst_scale"] = refit.DTensorRef(torch.zeros(3, 2), (4, 2))
    elif kind == "scale_missing":
        if r == 3:
            a["dst_scale"] = None
    elif kind == "scale_dtype":
        if r == 2:
            a["dst_scale"] = refit.DTensorRef(torch.zeros(4, 2, dtype=torch.bfloat16), (4, 2))
    elif kind == "scale_outside_mesh":  # rank 0 passes scales though scale_mesh (dst_mesh) does not hold it
        if r == 0:
            a["dst_scale"] = refit.DTensorRef(torch.zeros(4, 2), (4, 2))
    elif kind == "quant_differs":  # rank 1 would cut its amaxes on other blocks than rank 0
        a = _args(r, (60, 32))
        if r == 1:
            a["quant"] = BlockFp8((32, 16))
    elif kind == "quant_fmt_differs":
        if r == 3:
            a["quant"] = BlockFp8((16, 16), "e5m2")
    elif kind == "quant_not_blockfp8":
        if r == 2:
            a["quant"] = "e4m3"
    elif kind == "src_dtype_differs":
        if r == 1:
            a["src_tensor"] = _src(r, (64, 32), (32, 32), torch.float32)
    elif kind == "src_dtype_int":
        if r == 0:
            a["src_tensor"] = _src(r, (64, 32), (32, 32), torch.int32)
    elif kind == "src_none_in_mesh":  # blocks cut, so rank 0 would wait for rank 1's amaxes
        a = _args(r, (60, 32))
        if r == 1:
            a["src_tensor"] = None
    elif kind == "dst_none_in_mesh":
        if r == 3:
            a["dst_tensor"] = None
    elif kind == "src_mesh_differs":
        if r == 1:
            a["src_mesh"] = [1, 0]
    elif kind == "dst_placement_differs":
        if r == 3:
            a["dst_placement"] = [refit.Replicate()]
    elif kind == "scale_mesh_differs":
        if r == 2:
            a["scale_mesh"] = [3, 2]
    elif kind == "scale_placement_differs":  # a source rank, which holds no scales, reads them sharded
        if r == 0:
            a["scale_placement"] = [refit.Shard(0)]
    elif kind == "scale_mesh_outside_group":
        if r == 2:
            a["scale_mesh"] = [2, 9]
    elif kind == "unaligned_scales":  # rows 0..29 / 30..63 cut a 16-row block, but the scales are cut by blocks
        a = _args(r, (60, 32))
        a["dst_scale"] = refit.DTensorRef(torch.zeros(2, 2), (4, 2)) if r >= 2 else None
        a["scale_placement"] = [refit.Shard(0)]
    else:
        raise ValueError(kind)
    return a


def bad_call(group, kind):
    """A call every rank must refuse with the same error before anything moves: (error class, message)."""
    try:
        xferdtensor_fp8(process_group=group, **_bad_args(group.rank, kind))
    except Exception as e:  # the test compares every rank's class and message
        return type(e).__name__, str(e)
    return None
