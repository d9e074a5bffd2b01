"""Shared helpers for tests: random layouts (hypothesis strategies) and roster construction."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import strategies as st

from refit.layout import Replicate, Shard, shard_region
from refit.plan import RosterEntry


@st.composite
def meshes(draw, ranks: list[int], max_ndim: int = 3):
    """A mesh over a random non-empty subset of ``ranks``, 1-d to ``max_ndim``-d."""
    n = draw(st.integers(1, len(ranks)))
    chosen = draw(st.permutations(ranks))[:n]
    ndim = draw(st.integers(1, max_ndim))
    dims = []
    left = n
    for _dim in range(ndim - 1):
        divisors = [d for d in range(1, left + 1) if left % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        left //= d
    dims.append(left)
    return np.array(chosen).reshape(dims)


@st.composite
def placements_for(draw, mesh_ndim: int, tensor_ndim: int):
    choices = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return [draw(st.sampled_from(choices)) for _ in range(mesh_ndim)]


@st.composite
def shapes(draw, max_ndim: int = 3, max_size: int = 9):
    ndim = draw(st.integers(0, max_ndim))
    return tuple(draw(st.integers(0, max_size)) for _ in range(ndim))


def full_tensor(shape, seed: int) -> torch.Tensor:
    """The whole tensor a test's sources hold a slice of: float64 noise from ``seed`` (a 0-d one is ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) if len(shape) else torch.tensor(float(seed))


def local_region(full: torch.Tensor, region) -> torch.Tensor:
    """The elements of ``full`` that ``region`` (``refit.layout.shard_region``) names, in local order."""
    out = full
    for d, intervals in enumerate(region):
        idx = torch.tensor([i for a, b in intervals for i in range(a, b)], dtype=torch.long, device=full.device)
        out = out.index_select(d, idx)
    return out


def local_slice(full: torch.Tensor, mesh: np.ndarray, placements, rank: int) -> torch.Tensor | None:
    hit = np.argwhere(mesh == rank)
    if len(hit) == 0:
        return None
    return local_region(full, shard_region(full.shape, mesh.shape, tuple(hit[0]), placements)).clone()


def rosters_for(params: list[tuple], world_size: int) -> dict[int, list[RosterEntry]]:
    """``params``: (name, shape, (src_mesh, src_pl, src_dtype), [(dst_mesh, dst_pl, dst_dtype), ...])."""
    rosters: dict[int, list[RosterEntry]] = {r: [] for r in range(world_size)}
    for name, shape, (sm, sp, sdt), dsts in params:
        for r in np.asarray(sm).reshape(-1):
            rosters[int(r)].append(RosterEntry.make(name, shape, sdt, sm, sp, "src"))
        for dm, dp, ddt in dsts:
            for r in np.asarray(dm).reshape(-1):
                rosters[int(r)].append(RosterEntry.make(name, shape, ddt, dm, dp, "dst"))
    return rosters


def numel(shape) -> int:
    return math.prod(shape)
