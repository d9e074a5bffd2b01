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

Every rank's arguments are gathered in one exchange and compared before any amax merge:
each rank plans and quantizes from its own arguments, so a rank alone with a bad one would
raise alone (or in the middle of the merge) and leave the others waiting on it until the
group's timeout, and ranks that disagree on a shape or a block size would exchange amaxes
and bytes of different grids without an error anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from refit.comm.group import as_communicator
from refit.comm.wire import register_record
from refit.errors import LayoutError, PlanError, RefitError
from refit.layout import (
    Replicate,
    local_tensor_of,
    mesh_coords_of,
    normalize_mesh,
    region_shape,
    shard_region,
)
from refit.models.fp8 import partial_amax, quantize_aligned, quantize_local, scales_from_amax
from refit.plan.quant import BlockFp8, scale_name, scale_placements
from refit.transport.base import TransferStats
from refit.transport.xfer import (
    PARAM,
    ArgNames,
    LayoutView,
    RankRecord,
    SideMeta,
    check_agree,
    check_records,
    layout_view,
    raise_local_errors,
    rank_record,
    run_checked,
    side_meta,
)

__all__ = ["Fp8Record", "merge_max", "xferdtensor_fp8"]

SCALE_PARAM = scale_name(PARAM)
# the scales' source is made from the weight's on src_mesh; their destination is the caller's dst_scale
SCALE_SIDES = {"src": ArgNames("the scales made on src_mesh", "src_mesh", "src_placement"),
               "dst": ArgNames("dst_scale", "scale_mesh", "scale_placement")}


@dataclass(frozen=True)
class Fp8Record:
    """One rank's arguments to ``xferdtensor_fp8``, gathered once and compared on every rank.

    ``weight`` is the weight's transfer as ``xferdtensor`` compares it, its source side
    described as the FP8 copy this rank will send; ``source_dtype`` is what that copy is
    made from. ``scale`` and ``scale_view`` are ``dst_scale`` and this rank's reading of
    ``scale_mesh`` / ``scale_placement`` (defaults applied). ``error`` is this rank's
    objection to any of its arguments (None: none).
    """

    weight: RankRecord
    source_dtype: str | None
    scale: SideMeta | None
    scale_view: LayoutView | None
    quant: BlockFp8 | None
    error: str | None


for _cls in (BlockFp8, Fp8Record):
    register_record(_cls)


def _objection(quant: BlockFp8, weight: RankRecord, source_dtype: str | None, scale: SideMeta | None,
               scale_view: LayoutView, dst_placement, scale_placement, rank: int) -> str | None:
    """This rank's objection to its FP8 arguments, in one line (None: none); its meshes already read.

    The line does not name the rank: every rank's objections are grouped by their text and
    raised with the ranks that made each, so that many ranks with one mistake read as one line.
    """
    try:
        if weight.src is not None:
            dtype = getattr(torch, source_dtype)
            if not dtype.is_floating_point or dtype.itemsize < 2:
                return f"src_tensor: holds {dtype}; quantizing needs a bf16, fp16 or fp32 source"
            quant.check_shape(weight.src.shape, param="src_tensor: global shape")
        if weight.dst is None:
            return None
        shape = weight.dst.shape
        quant.check_shape(shape, param="dst_tensor: global shape")
        if weight.dst.dtype != quant.dtype_name:
            return (f"dst_tensor: passed torch.{weight.dst.dtype}; an FP8 destination of fmt={quant.fmt!r} "
                    f"is {quant.dtype_name}")
        if scale is None:
            return "dst_scale: None passed by a rank in dst_mesh; its FP8 shard needs its scales"
        grid = quant.scale_shape(shape)
        if scale.shape != grid:
            return (f"dst_scale: global shape {list(scale.shape)} is not the scale grid "
                    f"{list(grid)} of a {list(shape)} weight in {quant.block[0]}x{quant.block[1]} blocks")
        if scale.dtype != quant.scale_dtype:
            return (f"dst_scale: passed torch.{scale.dtype}; quant's scales are {quant.scale_dtype} (in any other "
                    "dtype they would not be the reference's bits)")
        dmesh = np.array(weight.dst_view.mesh)
        weight_region = shard_region(shape, dmesh.shape, mesh_coords_of(dmesh, rank), dst_placement)
        smesh = np.array(scale_view.mesh)
        coords = mesh_coords_of(smesh, rank)
        if coords is None:
            return "scale_mesh: a rank in dst_mesh is not in scale_mesh; it would get no scales"
        scales = shard_region(grid, smesh.shape, coords, scale_placement)
        for d, (rows, blocks, size, n) in enumerate(zip(weight_region[-2:], scales[-2:], quant.block, shape[-2:])):
            need = _blocks_of(rows, size)
            if not set(need) <= {i for a, b in blocks for i in range(a, b)}:
                dim = len(shape) - 2 + d
                return (f"dst_scale: the weight shard holds {'rows' if d == 0 else 'cols'} {list(rows)} of dim {dim} "
                        f"({n} long) but the scales of blocks {list(blocks)} only; an FP8 shard needs the scales of "
                        f"every {size}-block it touches (cut the weight on block boundaries, or replicate the scales)")
    except (RefitError, TypeError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def _blocks_of(intervals, size: int) -> list[int]:
    return sorted({i // size for a, b in intervals for i in range(a, b)})


def _scale_layout(dst_mesh, scale_mesh, scale_placement) -> tuple[Any, list]:
    """``scale_mesh`` and ``scale_placement`` with their defaults: ``dst_mesh``, replicated."""
    if scale_mesh is None:
        scale_mesh = dst_mesh
    if scale_placement is None:
        scale_placement = [Replicate()] * normalize_mesh(scale_mesh, param="scale_mesh").ndim
    return scale_mesh, list(scale_placement)


def _record(world_size: int, rank: int, quant: Any, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh,
            dst_placement, dst_scale, scale_mesh, scale_placement) -> Fp8Record:
    """This rank's ``Fp8Record``: every argument read here, and what cannot be read an ``error``, never raised."""
    weight = rank_record(world_size, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement)
    if not isinstance(quant, BlockFp8):
        return Fp8Record(weight, None, None, None, None,
                         f"quant: passed a {type(quant).__name__}; a refit.plan.quant.BlockFp8 is needed")
    source_dtype = weight.src.dtype if weight.src is not None else None
    if weight.src is not None:  # what crosses the wire is the FP8 copy of the source
        weight = replace(weight, src=replace(weight.src, dtype=quant.dtype_name))
    if weight.error:
        return Fp8Record(weight, source_dtype, None, None, quant, weight.error)
    try:
        scale_mesh, scale_placement = _scale_layout(dst_mesh, scale_mesh, scale_placement)
        scale_view = layout_view(SCALE_SIDES["dst"], "dst", scale_mesh, scale_placement, world_size,
                                 param=SCALE_PARAM)
        scale = side_meta(dst_scale)
    except (RefitError, TypeError) as e:
        return Fp8Record(weight, source_dtype, None, None, quant, str(e).splitlines()[0])
    error = _objection(quant, weight, source_dtype, scale, scale_view, dst_placement, scale_placement, rank)
    return Fp8Record(weight, source_dtype, scale, scale_view, quant, error)


@dataclass(frozen=True)
class _Checked:
    """What every rank agreed on: the global shape, the weight's and the scales' merged indexes, and whether
    every source shard holds whole blocks (then it quantizes alone; otherwise the amaxes are merged first)."""

    shape: tuple[int, ...]
    weight_index: Any
    scale_index: Any
    whole_blocks: bool


def _check(records: list[Fp8Record], world_size: int, src_mesh, src_placement, dst_mesh, dst_placement, scale_mesh,
           scale_placement) -> _Checked:
    """Every rank's ``Fp8Record`` held against the others: the same result, or the same error, on every rank."""
    check_agree("quant", {r: g.quant for r, g in enumerate(records) if g.quant is not None},
                "every rank must quantize with the same block, format and scale dtype")
    raise_local_errors([g.error for g in records])
    check_agree("src_tensor: dtype", {r: g.source_dtype for r, g in enumerate(records) if g.source_dtype},
                "every source rank must hold the tensor in one dtype")
    weight_index, spec = check_records([g.weight for g in records], world_size, src_mesh, src_placement, dst_mesh,
                                       dst_placement)
    shape = tuple(spec.shape)
    quant = records[0].quant
    smesh = normalize_mesh(src_mesh)
    own = scale_placements(shape, smesh.shape, src_placement, quant.block)
    source_placement = tuple(own) if own is not None else (Replicate(),) * smesh.ndim
    grid = quant.scale_shape(shape)
    # this rank's record read them without an error (or every rank raised it above)
    scale_mesh, scale_placement = _scale_layout(dst_mesh, scale_mesh, scale_placement)
    source_view = layout_view(SCALE_SIDES["src"], "src", smesh, source_placement, world_size, param=SCALE_PARAM)
    made = {int(r): SideMeta(grid, quant.scale_dtype,
                             region_shape(shard_region(grid, smesh.shape, mesh_coords_of(smesh, int(r)),
                                                       source_placement)))
            for r in smesh.reshape(-1)}
    scale_records = [RankRecord(made.get(r), g.scale, source_view, g.scale_view, None) for r, g in enumerate(records)]
    scale_index, _ = check_records(scale_records, world_size, smesh, source_placement, scale_mesh, scale_placement,
                                   sides=SCALE_SIDES, param=SCALE_PARAM)
    return _Checked(shape, weight_index, scale_index, own is not None)


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
    ``DTensorRef`` of the scale grid, ``quant.scale_shape(shape)``, in ``quant.scale_dtype``)
    its ``weight_scale_inv``, laid out on ``scale_mesh`` (default ``dst_mesh``) as
    ``scale_placement`` (default replicated). After the call both equal ``quantize_reference``
    of the full source tensor on this rank's slice, bit for bit. Every rank of
    ``process_group`` calls it; bad input (any rank's tensors, shapes, dtypes, meshes,
    placements or ``quant`` that do not fit, or that differ from another rank's) raises the
    same ``PlanError`` or ``LayoutError`` on every rank, naming the ranks, before any amax is
    merged or any byte moves. Returns the FP8 weight's ``TransferStats``.
    """
    quant = BlockFp8() if quant is None else quant
    comm = as_communicator(process_group)
    mine = _record(comm.world_size, comm.rank, quant, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh,
                   dst_placement, dst_scale, scale_mesh, scale_placement)
    try:
        checked = _check(comm.all_gather_object(mine), comm.world_size, src_mesh, src_placement, dst_mesh,
                         dst_placement, scale_mesh, scale_placement)
    except (PlanError, LayoutError) as e:
        raise type(e)(f"xferdtensor_fp8: {e}; nothing was moved") from None

    shape, smesh = checked.shape, normalize_mesh(src_mesh)
    # source shards holding whole blocks quantize alone and send the scales of their own blocks;
    # any other layout merges the partial amaxes of the cut blocks and sends the whole grid
    src, src_scales = {}, {}
    if src_tensor is not None:
        local = local_tensor_of(src_tensor)
        region = shard_region(shape, smesh.shape, mesh_coords_of(smesh, comm.rank), src_placement)
        if checked.whole_blocks:
            q, scales = quantize_aligned(local, quant)  # an empty shard gives an empty grid shard
        else:
            sources = tuple(sorted(int(r) for r in smesh.reshape(-1)))
            amax = merge_max(comm, {sources: partial_amax(local, region, shape, quant)})[sources]
            q, scales = quantize_local(local, region, amax, quant), scales_from_amax(amax, quant)
        src, src_scales = {PARAM: q}, {SCALE_PARAM: scales}
    dst = {PARAM: local_tensor_of(dst_tensor)} if dst_tensor is not None else {}
    dst_scales = {SCALE_PARAM: local_tensor_of(dst_scale)} if dst_scale is not None else {}
    stats = run_checked(checked.weight_index, comm, src, dst, stream)
    run_checked(checked.scale_index, comm, src_scales, dst_scales, stream)
    return stats
