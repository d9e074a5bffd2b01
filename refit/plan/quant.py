"""Block-scaled FP8 destinations: the format, and which scale blocks a shard boundary cuts.

DeepSeek-V3 and Kimi-K2 are served with FP8 weights scaled per block of 128 x 128 elements
of their last two dims: ``weight`` in ``float8_e4m3fn`` and one ``weight_scale_inv`` per
block (``dequantized = weight * weight_scale_inv``). A block's scale comes from the largest
magnitude in the block, so quantizing a trainer's shard on its own is exact only for the
blocks the shard holds whole. A shard boundary that does not fall on a block boundary
(uneven TP shards, ``_StridedShard``, a TP size that does not divide a dim into multiples
of 128) cuts blocks whose amax is spread over ranks; those, and only those, need the
ranks' partial amaxes merged before anyone quantizes.

Cuts are found per dim (a block is cut exactly when one of its dims is), so the work grows
with the number of distinct shard boundaries, not with the number of blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from refit.errors import LayoutError, PlanError
from refit.layout import Interval, Region, Replicate, normalize_mesh, normalize_placements, shard_region

__all__ = ["FP8_FORMATS", "MERGE_AMAX_THEN_QUANTIZE", "QUANTIZE_AT_PACK", "BlockFp8", "CutBlocks",
           "QuantizationPlan", "QuantizeOp", "check_fp8_destinations", "cut_blocks", "plan_quantization", "scale_name",
           "scale_placements"]

# name -> (torch dtype name, largest finite value)
FP8_FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}


@dataclass(frozen=True)
class BlockFp8:
    """A destination stored as block-scaled FP8.

    Args:
        block: rows x cols of one scale block over the last two dims.
        fmt: ``"e4m3"`` (``float8_e4m3fn``, what DeepSeek-V3 and Kimi-K2 ship) or ``"e5m2"``.
        scale_dtype: the dtype of the scales (``weight_scale_inv``).
    """

    block: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"
    scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.fmt not in FP8_FORMATS:
            raise LayoutError(f"fmt must be one of {sorted(FP8_FORMATS)}, got {self.fmt!r}")
        if len(self.block) != 2 or any(int(b) < 1 for b in self.block):
            raise LayoutError(f"block must be two positive sizes (rows, cols), got {self.block!r}")
        object.__setattr__(self, "block", (int(self.block[0]), int(self.block[1])))

    @property
    def dtype_name(self) -> str:
        return FP8_FORMATS[self.fmt][0]

    @property
    def max_value(self) -> float:
        return FP8_FORMATS[self.fmt][1]

    def check_shape(self, shape: Sequence[int], *, param: str = "shape") -> None:
        if len(shape) < 2:
            raise LayoutError(f"{param} {list(shape)}: block-scaled FP8 needs a matrix (or a stack of them); "
                              "keep 1-d tensors (norms, biases) in their own dtype")

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The scale grid of a tensor of ``shape``: its leading dims, then one entry per block."""
        self.check_shape(shape)
        *lead, rows, cols = (int(n) for n in shape)
        return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))


def scale_name(weight_name: str) -> str:
    """vLLM's name for a weight's block scales: ``...weight`` -> ``...weight_scale_inv``."""
    return f"{weight_name}_scale_inv"


@dataclass(frozen=True)
class CutBlocks:
    """The blocks of one tensor that no rank holds whole, per blocked dim.

    ``rows`` and ``cols`` are the block indices along the last two dims that some shard
    boundary falls inside; a block is cut when its row index is in ``rows`` or its col
    index is in ``cols`` (leading dims are never cut: a block spans one index of them).
    """

    grid: tuple[int, ...]  # the scale grid (``BlockFp8.scale_shape``)
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    @property
    def count(self) -> int:
        *lead, nrows, ncols = self.grid
        per_matrix = len(self.rows) * ncols + len(self.cols) * nrows - len(self.rows) * len(self.cols)
        return math.prod(lead) * per_matrix

    def is_cut(self, block: Sequence[int]) -> bool:
        return block[-2] in self.rows or block[-1] in self.cols


def _cut_indices(length: int, block: int, holders: Sequence[Sequence[Interval]]) -> tuple[int, ...]:
    """Block indices along one dim that some holder's interval starts or stops inside of."""
    cut = set()
    for intervals in holders:
        for a, b in intervals:
            for edge in (a, b):
                if 0 < edge < length and edge % block:
                    cut.add(edge // block)
    return tuple(sorted(cut))


def cut_blocks(shape: Sequence[int], mesh: Any, placements: Sequence[Any], fmt: BlockFp8) -> CutBlocks:
    """The blocks of a tensor laid out as ``placements`` over ``mesh`` that no rank holds whole."""
    mesh = normalize_mesh(mesh)
    grid = fmt.scale_shape(shape)
    regions: list[Region] = [shard_region(shape, mesh.shape, coords, placements)
                             for coords in np.ndindex(*mesh.shape)]
    rows = _cut_indices(int(shape[-2]), fmt.block[0], [r[-2] for r in regions])
    cols = _cut_indices(int(shape[-1]), fmt.block[1], [r[-1] for r in regions])
    return CutBlocks(grid, rows, cols)


def scale_placements(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any],
                     block: Sequence[int]) -> tuple[Any, ...] | None:
    """The weight's own placements, when laid over its scale grid they give every source rank the
    scales of exactly the blocks it holds, all of them whole; None when some shard cuts a block.

    Then each rank makes the scales of its own blocks from its shard alone, beside the wire,
    and sends them sharded like the weight: no amax merge, nothing ahead of the first byte.
    Most trainer layouts qualify (even TP over dims of multiples of 128, FSDP's dim-0 chunks,
    experts sharded over their leading dim). A cut block (uneven shards, a TP size that does
    not divide a dim into whole blocks, ``_StridedShard``) needs the merge, and the grid is
    then replicated over the source ranks.
    """
    key = (tuple(int(n) for n in shape), tuple(int(n) for n in mesh_shape), normalize_placements(placements),
           (int(block[0]), int(block[1])))
    try:
        return key[2] if _holds_whole_blocks(*key) else None
    except TypeError:  # a placement that cannot key the cache: taken as cutting blocks
        return None


@functools.lru_cache(maxsize=4096)
def _holds_whole_blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
                        block: tuple[int, int]) -> bool:
    grid = BlockFp8(block).scale_shape(shape)
    for coords in np.ndindex(*mesh_shape):
        weight = shard_region(shape, mesh_shape, coords, placements)
        scales = shard_region(grid, mesh_shape, coords, placements)
        if weight[:-2] != scales[:-2]:
            return False
        for w, g, size, n in zip(weight[-2:], scales[-2:], block, shape[-2:]):
            if not w:
                if g:
                    return False
                continue
            if len(w) != 1 or len(g) != 1:
                return False
            (a, b), = w
            if a % size or (b % size and b != n) or g[0] != (a // size, -(-b // size)):
                return False
    return True


QUANTIZE_AT_PACK = "quantize at pack"
MERGE_AMAX_THEN_QUANTIZE = "partial amax then quantize"
_FORMAT_OF = {dtype: fmt for fmt, (dtype, _) in FP8_FORMATS.items()}


@dataclass(frozen=True)
class QuantizeOp:
    """How one source rank makes the FP8 copy and the scales of one param it sends.

    ``mode`` is ``QUANTIZE_AT_PACK`` when its shard holds whole blocks and its scale grid is
    sourced sharded like it: the rank makes its blocks' amaxes, scales and FP8 from its shard
    alone, when the executor first packs it. ``MERGE_AMAX_THEN_QUANTIZE`` when a shard
    boundary cuts a block: before the transfer the ranks of ``members`` merge their partial
    block amaxes (each then holds the whole grid, sent like a replicated tensor), and the
    FP8 is made at pack.
    """

    name: str
    shape: tuple[int, ...]  # the weight's global shape
    region: Region  # where this rank's shard sits in it
    members: tuple[int, ...]  # the weight's source ranks, sorted
    mode: str

    @property
    def scale(self) -> str:
        return scale_name(self.name)


@dataclass(frozen=True)
class QuantizationPlan:
    """What one source rank quantizes at every refit: one ``QuantizeOp`` per param an engine keeps in FP8."""

    rank: int
    fmt: BlockFp8
    ops: tuple[QuantizeOp, ...]

    def scale_shape(self, op: QuantizeOp) -> tuple[int, ...]:
        """The scales this rank holds for ``op``: those of its own blocks, or the whole grid."""
        if op.mode == MERGE_AMAX_THEN_QUANTIZE:
            return self.fmt.scale_shape(op.shape)
        *lead, rows, cols = (sum(b - a for a, b in d) for d in op.region)
        br, bc = self.fmt.block
        return (*lead, -(-rows // br), -(-cols // bc))

    def merges(self) -> list[tuple[tuple[int, ...], list[str]]]:
        """The amax merges, one per source mesh (its ranks, its params' names), sorted alike on every rank."""
        by_mesh: dict[tuple[int, ...], list[str]] = {}
        for op in self.ops:
            if op.mode == MERGE_AMAX_THEN_QUANTIZE:
                by_mesh.setdefault(op.members, []).append(op.name)
        return sorted((m, sorted(ns)) for m, ns in by_mesh.items())

    @property
    def merged_amax_bytes(self) -> int:
        """float32 bytes of amax grid this rank sends to be merged (0 when every op quantizes at pack)."""
        return sum(4 * math.prod(self.fmt.scale_shape(op.shape)) for op in self.ops
                   if op.mode == MERGE_AMAX_THEN_QUANTIZE and len(op.members) > 1)


def plan_quantization(index: Any, rank: int, names: Sequence[str], *, block: tuple[int, int] = (128, 128),
                      label: str = "trainer") -> QuantizationPlan | None:
    """The quantization of the params ``names`` that ``rank`` sends and some destination keeps in
    FP8 (None: none). Pure: every source rank derives its own from the merged index.

    Refuses, naming the param: destinations wanting one param in FP8 and in another dtype, a
    scale grid no engine asks for or of the wrong shape, more than one FP8 format, and a
    scale grid sourced sharded by engines whose block differs from ``block``.
    """
    ops, formats = [], set()
    for name in sorted(names):
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
        # at pack when the grid is laid out as the weight and its shards hold whole blocks (a
        # replicated weight always does); a grid sharded otherwise was derived for another block
        own = scale_placements(spec.shape, src.mesh_shape, src.placements, block)
        grid_placements = normalize_placements(scales.src.placements)
        if own is None and any(not isinstance(p, Replicate) for p in grid_placements):
            raise PlanError(f"{label}: {scale_name(name)}: its source is sharded like {name}, whose shards do not "
                            f"hold whole {block[0]}x{block[1]} blocks; the engines and the trainer disagree on "
                            "the block size (set refit_fp8_block alike on both)")
        ops.append(QuantizeOp(name, tuple(spec.shape), region, tuple(sorted(src.mesh_ranks)),
                              QUANTIZE_AT_PACK if own == grid_placements else MERGE_AMAX_THEN_QUANTIZE))
    if not ops:
        return None
    if len(formats) > 1:
        raise PlanError(f"{label}: the engines want more than one FP8 format ({sorted(f.fmt for f in formats)})")
    return QuantizationPlan(rank, formats.pop(), tuple(ops))


def check_fp8_destinations(index: Any, rank: int, block: tuple[int, int], *, label: str = "engine") -> None:
    """Refuse an FP8 destination of ``rank`` that could not be read back, before any byte moves.

    Every FP8 weight a rank receives needs its ``_scale_inv`` on the same rank, holding the
    scale of every block its weight shard touches: a shard cut inside a block beside a scale
    shard cut on block boundaries would leave elements without their scale (an engine that
    cannot pad needs its TP shards on block boundaries, or its scales replicated).
    """
    for name in index.by_rank.get(rank, ()):
        spec = index.specs[name]
        mine = [d for d in spec.dsts if d.coords(rank) is not None]
        if not mine or not mine[0].dtype.startswith("float8"):
            continue
        scales = index.specs.get(scale_name(name))
        held = [d for d in scales.dsts if d.coords(rank) is not None] if scales is not None else []
        if not held:
            raise PlanError(f"{label}: {name}: rank {rank} receives it in {mine[0].dtype} but not "
                            f"{scale_name(name)}, so it could not read the values back")
        fmt = BlockFp8(block)
        if tuple(scales.shape) != fmt.scale_shape(spec.shape):
            raise PlanError(f"{label}: {scale_name(name)} is {list(scales.shape)}, not the scale grid "
                            f"{list(fmt.scale_shape(spec.shape))} of {block[0]}x{block[1]} blocks of a "
                            f"{list(spec.shape)} weight")
        weight = mine[0].region(spec.shape, rank)
        grid = held[0].region(scales.shape, rank)
        for d, size in zip((-2, -1), block):
            need = {i // size for a, b in weight[d] for i in range(a, b)}
            have = {i for a, b in grid[d] for i in range(a, b)}
            if not need <= have:
                axis = "rows" if d == -2 else "cols"
                raise PlanError(f"{label}: {name}: rank {rank} receives {axis} {list(weight[d])} of dim "
                                f"{len(spec.shape) + d} ({spec.shape[d]} long) but the scales of blocks "
                                f"{list(grid[d])} only; its FP8 shard needs the scale of every {size}-block it "
                                "touches (cut it on block boundaries, or replicate its scales)")
