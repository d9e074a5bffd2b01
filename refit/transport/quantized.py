"""``xferdtensor_fp8``: one tensor from high-precision shards to block-scaled FP8 shards, quantized before the wire.

Each source rank quantizes its own shard, so only FP8 bytes and the small scale grid cross
the links, shard to shard, without a gather. When every source shard holds whole blocks,
each rank makes the scales of its own blocks alone and sends them laid out like the weight
(``refit.plan.quant.scale_placements``). A block that a source shard boundary cuts has its
amax spread over ranks: then the source ranks merge their partial amaxes of the scale grid
(a 1/16384 share of the weight's elements for 128 x 128 blocks) before anyone quantizes,
and the scales travel as a tensor every source rank holds whole, so replicas share their
sending as for any tensor. Either way every element gets exactly the bits that quantizing
the full tensor gives (``refit.models.fp8.quantize_reference``).
"""

from __future__ import annotations

from typing import Any

import torch

from refit.comm.group import as_communicator
from refit.errors import PlanError, RefitError
from refit.layout import DTensorRef, Replicate, local_tensor_of, mesh_coords_of, normalize_mesh, shard_region
from refit.models.fp8 import partial_amax, quantize_aligned, quantize_local, scales_from_amax
from refit.plan.quant import BlockFp8, scale_placements
from refit.transport.base import TransferStats
from refit.transport.xfer import xferdtensor

__all__ = ["merge_max", "xferdtensor_fp8"]


def _global_shape(t: Any) -> tuple[int, ...] | None:
    if t is None:
        return None
    shape = getattr(t, "global_shape", None) or getattr(t, "shape", None)
    return tuple(int(n) for n in shape)


def _check(quant: BlockFp8, src_tensor, dst_tensor, dst_scale, src_mesh, dst_mesh, dst_placement, scale_mesh,
           scale_placement, rank: int) -> str | None:
    """This rank's objection to the call, in one line (None: none)."""
    try:
        if src_tensor is not None:
            dtype = local_tensor_of(src_tensor).dtype
            if not dtype.is_floating_point or dtype.itemsize < 2:
                return f"src_tensor: rank {rank} holds {dtype}; quantizing needs a bf16, fp16 or fp32 source"
        if dst_tensor is None:
            return None
        shape = _global_shape(dst_tensor)
        quant.check_shape(shape, param="dst_tensor: global shape")
        got = local_tensor_of(dst_tensor).dtype
        if got != getattr(torch, quant.dtype_name):
            return (f"dst_tensor: rank {rank} passed {got}; an FP8 destination of fmt={quant.fmt!r} "
                    f"is {quant.dtype_name}")
        if dst_scale is None:
            return f"dst_scale: rank {rank} is in dst_mesh but passed no scale tensor"
        grid = quant.scale_shape(shape)
        if _global_shape(dst_scale) != grid:
            return (f"dst_scale: rank {rank}'s global shape {list(_global_shape(dst_scale))} is not the scale grid "
                    f"{list(grid)} of a {list(shape)} weight in {quant.block[0]}x{quant.block[1]} blocks")
        weight = shard_region(shape, normalize_mesh(dst_mesh).shape, mesh_coords_of(normalize_mesh(dst_mesh), rank),
                              dst_placement)
        smesh = normalize_mesh(scale_mesh)
        coords = mesh_coords_of(smesh, rank)
        if coords is None:
            return f"scale_mesh: rank {rank} is in dst_mesh but not in scale_mesh; it would get no scales"
        scales = shard_region(grid, smesh.shape, coords, scale_placement)
        for d, (rows, blocks, size, n) in enumerate(zip(weight[-2:], scales[-2:], quant.block, shape[-2:])):
            need = _blocks_of(rows, size)
            if not set(need) <= {i for a, b in blocks for i in range(a, b)}:
                dim = len(shape) - 2 + d
                return (f"dst_scale: rank {rank} holds weight {'rows' if d == 0 else 'cols'} {list(rows)} of dim {dim} "
                        f"({n} long) but the scales of blocks {list(blocks)} only; an FP8 shard needs the scales of "
                        f"every {size}-block it touches (cut the weight on block boundaries, or replicate the scales)")
    except (RefitError, TypeError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def _blocks_of(intervals, size: int) -> list[int]:
    return sorted({i // size for a, b in intervals for i in range(a, b)})


def merge_max(comm, grids: dict[tuple[int, ...], torch.Tensor]) -> dict[tuple[int, ...], torch.Tensor]:
    """Each tensor merged by elementwise max over its group of ranks, on every rank of the group.

    ``grids`` maps a group (its ranks, sorted) to this rank's tensor for it; every rank of a
    group passes a tensor of the same shape, and every rank posts its groups in the same
    order. Two phases over all groups at once: members send to the group's lowest rank,
    which sends the max back. Over a communicator without NCCL (ranks sharing a GPU under
    NIXL) CUDA tensors travel through host memory; block-amax grids are 1/16384 of a
    weight's elements.
    """
    groups = sorted(grids)
    device = {g: grids[g].device for g in groups}
    flat = {g: grids[g].contiguous() for g in groups}
    if not getattr(comm, "stream_ordered", False):
        flat = {g: t.cpu() if t.is_cuda else t for g, t in flat.items()}
    flat = {g: t.clone() for g, t in flat.items()}
    incoming: dict[tuple[int, ...], list[torch.Tensor]] = {}
    works = []
    for members in groups:
        if len(members) == 1:
            continue
        if comm.rank == members[0]:
            incoming[members] = [torch.empty_like(flat[members]) for _ in members[1:]]
            works += [comm.irecv(buf, peer) for buf, peer in zip(incoming[members], members[1:])]
        else:
            works.append(comm.isend(flat[members], members[0]))
    for w in works:
        comm.wait(w)
    works = []
    for members in groups:
        if len(members) == 1:
            continue
        if comm.rank == members[0]:
            for buf in incoming[members]:
                torch.maximum(flat[members], buf, out=flat[members])
            works += [comm.isend(flat[members], peer) for peer in members[1:]]
        else:
            works.append(comm.irecv(flat[members], members[0]))
    for w in works:
        comm.wait(w)
    return {g: flat[g].to(device[g]) for g in groups}


def xferdtensor_fp8(src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, process_group, *,
                    quant: BlockFp8 | None = None, dst_scale=None, scale_mesh=None, scale_placement=None,
                    stream=None) -> TransferStats:
    """Quantize ``src_tensor``'s shards to block-scaled FP8 and move them into ``dst_tensor``'s, scales included.

    As ``xferdtensor``, with the destination in FP8 (``quant``, default 128 x 128 blocks of
    ``float8_e4m3fn``): ``dst_tensor`` holds this rank's FP8 shard and ``dst_scale`` (a
    ``DTensorRef`` of the scale grid, ``quant.scale_shape(shape)``) its ``weight_scale_inv``,
    laid out on ``scale_mesh`` (default ``dst_mesh``) as ``scale_placement`` (default
    replicated). After the call both equal ``quantize_reference`` of the full source tensor
    on this rank's slice, bit for bit. Every rank of ``process_group`` calls it; bad input
    raises on every rank before any byte moves. Returns the FP8 weight's ``TransferStats``.
    """
    quant = quant or BlockFp8()
    comm = as_communicator(process_group)
    smesh = normalize_mesh(src_mesh, param="src_mesh")
    dmesh = normalize_mesh(dst_mesh, param="dst_mesh")
    scale_mesh = dmesh if scale_mesh is None else normalize_mesh(scale_mesh, param="scale_mesh")
    scale_placement = list(scale_placement or [Replicate()] * scale_mesh.ndim)
    error = _check(quant, src_tensor, dst_tensor, dst_scale, smesh, dmesh, dst_placement, scale_mesh,
                   scale_placement, comm.rank)
    # with the objections, every rank learns the global shape (a rank holding neither side has none)
    mine = _global_shape(dst_tensor if dst_tensor is not None else src_tensor)
    gathered = comm.all_gather_object((error, list(mine) if mine is not None else None))
    errors = [e for e, _ in gathered]
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        ranks = [r for r, _ in bad]
        raise PlanError(f"xferdtensor_fp8: {bad[0][1]} (on rank(s) {ranks}); nothing was moved")

    sources = sorted(int(r) for r in smesh.reshape(-1))
    shapes = {r: tuple(s) for r, (_, s) in enumerate(gathered) if s is not None}
    if len(set(shapes.values())) > 1:
        seen: dict[tuple[int, ...], list[int]] = {}
        for r, s in shapes.items():
            seen.setdefault(s, []).append(r)
        raise PlanError("xferdtensor_fp8: src_tensor / dst_tensor global shapes differ: "
                        + "; ".join(f"{list(s)} on rank(s) {rs}" for s, rs in seen.items()) + "; nothing was moved")
    shape = next(iter(shapes.values()))
    # source shards holding whole blocks quantize alone and send the scales of their own blocks;
    # any other layout merges the partial amaxes of the cut blocks and sends the whole grid
    own = scale_placements(shape, smesh.shape, src_placement, quant.block)
    q_ref = scale_ref = None
    if src_tensor is not None:
        local = local_tensor_of(src_tensor)
        coords = mesh_coords_of(smesh, comm.rank)
        region = shard_region(shape, smesh.shape, coords, src_placement)
        if own is not None:  # an empty shard gives an empty grid shard, as its region under ``own``
            q, scales = quantize_aligned(local, quant)
        else:
            amax = merge_max(comm, {tuple(sources): partial_amax(local, region, shape, quant)})[tuple(sources)]
            q, scales = quantize_local(local, region, amax, quant), scales_from_amax(amax, quant)
        q_ref = DTensorRef(q, shape)
        scale_ref = DTensorRef(scales, quant.scale_shape(shape))
    stats = xferdtensor(q_ref, smesh, src_placement, dst_tensor, dmesh, dst_placement, comm, stream=stream)
    xferdtensor(scale_ref, smesh, own if own is not None else [Replicate()] * smesh.ndim, dst_scale, scale_mesh,
                scale_placement, comm, stream=stream)
    return stats

