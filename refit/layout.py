"""Layout arithmetic: placements, meshes, and which part of a global tensor a rank holds.

Pure and free of process groups, so it can be tested exhaustively. The semantics are
DTensor's: a mesh dimension with ``Shard(d)`` splits tensor dim ``d`` the way
``torch.chunk`` does (ceil-sized chunks, trailing chunks short or empty), several mesh
dims sharding one tensor dim apply in mesh-dim order, and FSDP2's ``_StridedShard``
(the right-to-left TP-then-FSDP layout) is accepted when a torch ``DTensor`` is handed in.

A rank's part of one tensor dim is kept as a list of global ``(start, stop)`` intervals
in local order. Plain ``Shard`` always yields one interval; ``_StridedShard`` without
the ``Shard`` that normally follows it yields several, and the planner handles both the
same way instead of special-casing the common one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit.errors import LayoutError

Interval = tuple[int, int]
Region = tuple[tuple[Interval, ...], ...]  # per tensor dim, intervals in local order


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` across a mesh dimension, as ``torch.chunk`` does."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh dimension holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class StridedShard:
    """FSDP2's ``_StridedShard(dim, split_factor)``: split ``dim`` into ``split_factor``
    pieces, chunk every piece across the mesh dimension, and keep the i-th chunk of each."""

    dim: int
    split_factor: int

    def __repr__(self) -> str:
        return f"StridedShard({self.dim}, sf={self.split_factor})"


Placement = Shard | Replicate | StridedShard


def normalize_placement(p: Any, *, param: str = "placement") -> Placement:
    """Map refit's and torch's placement objects to refit's own.

    torch's ``_StridedShard`` is not a subclass of its ``Shard``, so it is checked first
    by its split factor rather than by type.
    """
    if isinstance(p, (Shard, Replicate, StridedShard)):
        return p
    split_factor = getattr(p, "split_factor", None)
    if split_factor is not None and hasattr(p, "dim"):
        return StridedShard(int(p.dim), int(split_factor))
    is_shard = getattr(p, "is_shard", None)
    if callable(is_shard) and is_shard():
        return Shard(int(p.dim))
    is_replicate = getattr(p, "is_replicate", None)
    if callable(is_replicate) and is_replicate():
        return Replicate()
    raise LayoutError(
        f"{param}: unsupported placement {p!r}; refit moves Shard, Replicate and "
        "_StridedShard layouts (a Partial tensor must be reduced before a refit)"
    )


def normalize_placements(placements: Iterable[Any], *, param: str = "placements") -> tuple[Placement, ...]:
    if isinstance(placements, (Shard, Replicate, StridedShard)) or hasattr(placements, "is_shard"):
        placements = [placements]
    return tuple(normalize_placement(p, param=param) for p in placements)


def normalize_mesh(mesh: Any, *, param: str = "mesh") -> np.ndarray:
    """Turn nested lists, numpy arrays, torch tensors or a DeviceMesh into an int64 array.

    Rejects a rank listed twice: two mesh positions on one rank would make that rank
    own two different slices through a single local tensor.
    """
    if hasattr(mesh, "mesh") and not isinstance(mesh, (np.ndarray, torch.Tensor, list, tuple)):
        mesh = mesh.mesh  # torch DeviceMesh
    if isinstance(mesh, torch.Tensor):
        arr = mesh.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(mesh)
        except ValueError as e:  # ragged nested lists
            raise LayoutError(f"{param}: a mesh must be rectangular, got {mesh!r}") from e
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.size == 0:
        raise LayoutError(f"{param}: the mesh is empty")
    if not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.floor(arr)):
            arr = arr.astype(np.int64)
        else:
            raise LayoutError(f"{param}: mesh entries must be integer ranks, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise LayoutError(f"{param}: negative rank(s) {sorted(set(arr[arr < 0].tolist()))} in the mesh")
    flat = arr.reshape(-1)
    uniq, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1].tolist()
        raise LayoutError(f"{param}: rank(s) {dup} listed more than once in mesh {arr.tolist()}")
    return arr


def validate_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    param: str = "tensor",
    world_size: int | None = None,
    mesh_ranks: Iterable[int] | None = None,
) -> None:
    """Raise ``LayoutError`` naming ``param`` for any layout that cannot be laid out."""
    if any(int(s) < 0 for s in global_shape):
        raise LayoutError(f"{param}: negative size in global shape {tuple(global_shape)}")
    if len(placements) != len(mesh_shape):
        raise LayoutError(
            f"{param}: {len(placements)} placement(s) {list(placements)} for a "
            f"{len(mesh_shape)}-d mesh of shape {tuple(mesh_shape)}; give one per mesh dim"
        )
    ndim = len(global_shape)
    for p in placements:
        if isinstance(p, (Shard, StridedShard)):
            if not 0 <= p.dim < ndim:
                raise LayoutError(
                    f"{param}: {p!r} shards dim {p.dim} of a {ndim}-d tensor of shape {tuple(global_shape)}"
                )
        if isinstance(p, StridedShard) and p.split_factor < 1:
            raise LayoutError(f"{param}: {p!r} needs split_factor >= 1")
    if world_size is not None and mesh_ranks is not None:
        bad = sorted(r for r in mesh_ranks if r >= world_size)
        if bad:
            raise LayoutError(
                f"{param}: mesh rank(s) {bad} outside the process group of world size {world_size}"
            )


def chunk_bounds(length: int, num_chunks: int, index: int) -> Interval:
    """``torch.chunk`` bounds of chunk ``index``: ceil-sized, trailing ones short or empty."""
    if length <= 0:
        return (0, 0)
    size = math.ceil(length / num_chunks)
    start = min(index * size, length)
    return (start, min(start + size, length))


def take_positions(intervals: Sequence[Interval], lo: int, hi: int) -> list[Interval]:
    """Global intervals of logical positions ``[lo, hi)`` of a concatenation of intervals."""
    out: list[Interval] = []
    pos = 0
    for a, b in intervals:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
        if pos >= hi:
            break
    return out


def merge_intervals(intervals: list[Interval]) -> tuple[Interval, ...]:
    """Sorted intervals with touching neighbours joined and empty ones dropped."""
    merged: list[Interval] = []
    for a, b in intervals:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif b > a:
            merged.append((a, b))
    return tuple(merged)


def shard_region(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    mesh_coords: Sequence[int],
    placements: Sequence[Any],
) -> Region:
    """Per tensor dim, the global intervals (in local order) that a mesh position holds."""
    placements = normalize_placements(placements)
    region = [[(0, int(n))] if int(n) > 0 else [] for n in global_shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        n, i = int(mesh_shape[mesh_dim]), int(mesh_coords[mesh_dim])
        cur = region[p.dim]
        length = sum(b - a for a, b in cur)
        if isinstance(p, Shard):
            region[p.dim] = take_positions(cur, *chunk_bounds(length, n, i))
        else:
            pieces: list[Interval] = []
            for j in range(p.split_factor):
                ps, pe = chunk_bounds(length, p.split_factor, j)
                cs, ce = chunk_bounds(pe - ps, n, i)
                pieces.extend(take_positions(cur, ps + cs, ps + ce))
            region[p.dim] = pieces
    return tuple(merge_intervals(r) for r in region)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in dim) for dim in region)


def region_numel(region: Region) -> int:
    return math.prod(region_shape(region))


def shard_slices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    mesh_coords: Sequence[int],
    placements: Sequence[Any],
) -> tuple[slice, ...]:
    """The slice of the global tensor that the rank at ``mesh_coords`` owns.

    ``global_tensor[shard_slices(...)]`` equals that rank's DTensor local tensor. A
    ``_StridedShard`` that is not followed by the ``Shard`` that makes it contiguous owns
    several blocks, which no single slice can name: use ``shard_region`` for those.
    """
    region = shard_region(global_shape, mesh_shape, mesh_coords, placements)
    out = []
    for d, intervals in enumerate(region):
        if len(intervals) > 1:
            raise LayoutError(
                f"dim {d} of this shard is {len(intervals)} separate blocks {list(intervals)}; "
                "use refit.layout.shard_region for strided layouts"
            )
        a, b = intervals[0] if intervals else (0, 0)
        out.append(slice(a, b))
    return tuple(out)


@dataclass(frozen=True)
class Box:
    """A rectangular block of the global tensor and where it sits in two local tensors."""

    start: tuple[int, ...]  # global
    shape: tuple[int, ...]
    src_start: tuple[int, ...]  # local offsets in the source rank's tensor
    dst_start: tuple[int, ...]  # local offsets in the destination rank's tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def src_slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.src_start, self.shape))

    def dst_slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.dst_start, self.shape))


def dim_overlaps(a: Sequence[Interval], b: Sequence[Interval]) -> list[tuple[int, int, int, int]]:
    """(global start, length, offset in a, offset in b) of every overlap of two interval lists."""
    out = []
    oa = 0
    for a0, a1 in a:
        ob = 0
        for b0, b1 in b:
            s, e = max(a0, b0), min(a1, b1)
            if s < e:
                out.append((s, e - s, oa + s - a0, ob + s - b0))
            ob += b1 - b0
        oa += a1 - a0
    return out


def region_overlap_numel(a: Region, b: Region) -> int:
    total = 1
    for da, db in zip(a, b):
        n = sum(length for _, length, _, _ in dim_overlaps(da, db))
        if n == 0:
            return 0
        total *= n
    return total


def intersect_regions(src: Region, dst: Region) -> list[Box]:
    """Blocks of ``src`` ∩ ``dst``, each contiguous in the global tensor and in both local tensors.

    A zero-dim tensor has one empty-shaped box.
    """
    per_dim = [dim_overlaps(a, b) for a, b in zip(src, dst)]
    if any(not d for d in per_dim):
        return []
    boxes = []
    for combo in itertools.product(*per_dim):
        boxes.append(
            Box(
                start=tuple(c[0] for c in combo),
                shape=tuple(c[1] for c in combo),
                src_start=tuple(c[2] for c in combo),
                dst_start=tuple(c[3] for c in combo),
            )
        )
    return boxes


def mesh_coords_of(mesh: np.ndarray, rank: int) -> tuple[int, ...] | None:
    hit = np.argwhere(mesh == rank)
    if len(hit) == 0:
        return None
    return tuple(int(x) for x in hit[0])


class DTensorRef:
    """A DTensor-shaped handle on a rank's local shard, for code that holds plain tensors.

    ``.shape`` is the GLOBAL shape and ``._local_tensor`` the local shard (source side) or
    the buffer to fill (destination side), which is what ``xferdtensor`` reads. A
    Megatron parameter is a TP-local shard with no DTensor around it; wrapping it here
    lets it be moved without a TP gather or a PP broadcast.
    """

    def __init__(self, local_tensor: torch.Tensor, global_shape, dtype=None, device=None):
        if not isinstance(local_tensor, torch.Tensor):
            raise TypeError(f"DTensorRef: local_tensor must be a torch.Tensor, got {type(local_tensor).__name__}")
        self._local_tensor = local_tensor
        self.shape = torch.Size(int(s) for s in global_shape)
        self.dtype = dtype if dtype is not None else local_tensor.dtype
        self.device = torch.device(device) if device is not None else local_tensor.device

    def to_local(self) -> torch.Tensor:
        return self._local_tensor

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __repr__(self) -> str:
        return (
            f"DTensorRef(global_shape={tuple(self.shape)}, local_shape={tuple(self._local_tensor.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )


def local_tensor_of(t: Any) -> torch.Tensor:
    """The local shard of a DTensorRef, a torch DTensor, or a plain (unsharded) tensor."""
    if isinstance(t, DTensorRef):
        return t._local_tensor
    if hasattr(t, "_local_tensor"):
        return t._local_tensor
    if isinstance(t, torch.Tensor):
        return t
    raise TypeError(f"expected a DTensorRef, a torch DTensor or a tensor, got {type(t).__name__}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r}")
    return dt
