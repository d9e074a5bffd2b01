"""Where a layout's shards lie: per tensor dim, the intervals of the mesh coordinates sharding it."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import NamedTuple

from refit.layout import Placement, Region, Replicate, dim_overlaps, shard_region
from refit.plan.roster import TensorLayout


class GeometryTables(NamedTuple):
    """A geometry's tables, shared by every mesh of one shape and placements."""

    dims_of: dict[int, list[int]]  # tensor dim -> the mesh dims sharding it, in mesh order
    by_dim: dict[int, list[tuple[tuple[int, ...], tuple]]]  # tensor dim -> (sub-mesh coords, intervals)


class LayoutGeometry:
    """Per tensor dim, the intervals of every coordinate of the mesh dims sharding it.

    Finding which shards of a layout overlap a region then costs a filter per tensor dim
    over that dim's sharding coordinates, not a walk over every rank of the layout.
    """

    def __init__(self, shape: tuple[int, ...], layout: TensorLayout, tables: GeometryTables | None = None):
        self.shape = shape
        self.layout = layout
        if tables is not None:  # the same shape on another mesh of the same shape and placements
            self.dims_of, self.by_dim = tables
            return
        self.dims_of: dict[int, list[int]] = defaultdict(list)
        for m, p in enumerate(layout.placements):
            if not isinstance(p, Replicate):
                self.dims_of[p.dim].append(m)
        self.by_dim: dict[int, list[tuple[tuple[int, ...], tuple]]] = {}
        for t, mdims in self.dims_of.items():
            sub_shape = [layout.mesh_shape[m] for m in mdims]
            sub_places = [layout.placements[m] for m in mdims]
            entries = []
            for sub in itertools.product(*[range(n) for n in sub_shape]):
                one_dim = shard_region((shape[t],), sub_shape, sub, [_retarget(p) for p in sub_places])
                entries.append((sub, one_dim[0]))
            self.by_dim[t] = entries

    @property
    def tables(self) -> GeometryTables:
        return GeometryTables(self.dims_of, self.by_dim)

    def overlapping_keys(self, region: Region) -> list[tuple[int, ...]]:
        """Shard keys (coords on the sharding mesh dims, in their order) overlapping ``region``."""
        if any(not iv for iv in region):
            return []
        per_t: list[tuple[list[int], list[tuple[int, ...]]]] = []
        for t, entries in self.by_dim.items():
            hits = [sub for sub, iv in entries if dim_overlaps(iv, region[t])]
            if not hits:
                return []
            per_t.append((self.dims_of[t], hits))
        order = self.layout.sharding_dims
        keys = []
        for combo in itertools.product(*[hits for _, hits in per_t]):
            coords = {}
            for (mdims, _), sub in zip(per_t, combo):
                coords.update(zip(mdims, sub))
            keys.append(tuple(coords[m] for m in order))
        keys.sort()
        return keys

    def key_ranks(self, key: tuple[int, ...]) -> list[int]:
        return self.layout.replicas(key)


def _retarget(p: Placement) -> Placement:
    """The same placement acting on dim 0 of a one-dim view of its tensor dim."""
    return type(p)(0) if not hasattr(p, "split_factor") else type(p)(0, p.split_factor)




class GeometryCache:
    """Geometry and shard regions, shared by every mesh of one shape and placements."""

    def __init__(self):
        self._geometry: dict[tuple, LayoutGeometry] = {}
        self._tables: dict[tuple, GeometryTables] = {}
        self._regions: dict[tuple, Region] = {}

    def geometry(self, shape, layout: TensorLayout) -> LayoutGeometry:
        key = (shape, layout)
        geo = self._geometry.get(key)
        if geo is None:
            tkey = (shape, layout.mesh_shape, layout.placements)
            tables = self._tables.get(tkey)
            geo = self._geometry[key] = LayoutGeometry(shape, layout, tables)
            if tables is None:
                self._tables[tkey] = geo.tables
        return geo

    def region(self, shape, layout: TensorLayout, rank: int) -> Region:
        """``layout.region(shape, rank)``, shared by every mesh of one shape and placements."""
        coords = layout.coords(rank)
        key = (shape, layout.mesh_shape, layout.placements, coords)
        reg = self._regions.get(key)
        if reg is None:
            reg = self._regions[key] = shard_region(shape, layout.mesh_shape, coords, layout.placements)
        return reg
