"""Layout arithmetic against torch's own DTensor chunking (the oracle), and bad input."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate as TorchReplicate
from torch.distributed.tensor.placement_types import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: PLC2701 (no public name for FSDP2's)

from refit import DTensorRef, LayoutError, Replicate, Shard, shard_slices
from refit.layout import (
    StridedShard,
    intersect_regions,
    normalize_mesh,
    normalize_placements,
    shard_region,
    validate_layout,
)


def torch_local(full, mesh_shape, coords, placements):
    """What DTensor's own chunking gives a mesh position (torch's placement code as the oracle)."""
    t = full
    for mesh_dim, p in enumerate(placements):
        n, i = mesh_shape[mesh_dim], coords[mesh_dim]
        if isinstance(p, _StridedShard):
            t = p._split_tensor(t, n, with_padding=False)[0][i]
        elif isinstance(p, TorchShard):
            t = TorchShard._custom_chunk(t, n, p.dim)[i]
    return t


def gather_region(full, region):
    out = full
    for d, intervals in enumerate(region):
        out = out.index_select(d, torch.tensor([i for a, b in intervals for i in range(a, b)], dtype=torch.long))
    return out


@st.composite
def torch_layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 13)) for _ in range(ndim)]
    mesh_shape = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3)))]
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["r", "s", "ss"]))
        d = draw(st.integers(0, ndim - 1))
        placements.append(
            TorchReplicate() if kind == "r" else TorchShard(d) if kind == "s"
            else _StridedShard(d, split_factor=draw(st.integers(1, 4)))
        )
    return shape, mesh_shape, placements


@settings(max_examples=300, deadline=None)
@given(torch_layouts())
def test_shard_region_matches_torch(layout):
    shape, mesh_shape, placements = layout
    full = torch.arange(int(np.prod(shape))).reshape(shape)
    for coords in itertools.product(*[range(n) for n in mesh_shape]):
        want = torch_local(full, mesh_shape, coords, placements)
        got = gather_region(full, shard_region(shape, mesh_shape, coords, placements))
        assert got.shape == want.shape and torch.equal(got, want), (shape, mesh_shape, coords, placements)


def test_shard_slices_uneven_and_empty_trailing():
    # torch.chunk(5, 4) -> sizes 2, 2, 1, 0
    rows = [shard_slices((5, 3), (4,), (i,), [Shard(0)])[0] for i in range(4)]
    assert rows[:3] == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert rows[3].stop - rows[3].start == 0


def test_several_mesh_dims_on_one_tensor_dim_apply_in_mesh_order():
    # mesh (2, 2), both shard dim 0 of 8 rows: (i, j) holds rows [4i + 2j, 4i + 2j + 2)
    for i, j in itertools.product(range(2), range(2)):
        assert shard_slices((8,), (2, 2), (i, j), [Shard(0), Shard(0)]) == (slice(4 * i + 2 * j, 4 * i + 2 * j + 2),)


def test_fsdp_tp_strided_is_contiguous_and_right_to_left():
    placements = [_StridedShard(0, split_factor=2), TorchShard(0)]
    got = {c: shard_slices((8, 8), (2, 2), c, placements)[0] for c in itertools.product(range(2), range(2))}
    assert got == {(0, 0): slice(0, 2), (0, 1): slice(4, 6), (1, 0): slice(2, 4), (1, 1): slice(6, 8)}


def test_strided_alone_is_several_blocks():
    region = shard_region((8,), (2,), (0,), [StridedShard(0, 2)])
    assert region == (((0, 2), (4, 6)),)
    with pytest.raises(LayoutError, match="separate blocks"):
        shard_slices((8,), (2,), (0,), [StridedShard(0, 2)])


def test_torch_placements_are_accepted():
    assert normalize_placements([TorchShard(1), TorchReplicate(), _StridedShard(0, split_factor=3)]) == (
        Shard(1), Replicate(), StridedShard(0, 3))


@pytest.mark.parametrize("mesh", [[[0, 1], [2, 3]], np.array([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 3]])])
def test_mesh_inputs(mesh):
    assert normalize_mesh(mesh).tolist() == [[0, 1], [2, 3]]


def test_bad_meshes_and_placements():
    with pytest.raises(LayoutError, match=r"rank\(s\) \[1\] listed more than once"):
        normalize_mesh([[0, 1], [1, 2]])
    with pytest.raises(LayoutError, match="rectangular"):
        normalize_mesh([[0, 1], [2]])
    with pytest.raises(LayoutError, match="negative"):
        normalize_mesh([0, -1])
    with pytest.raises(LayoutError, match="w: 1 placement"):
        validate_layout((4, 4), (2, 2), [Shard(0)], param="w")
    with pytest.raises(LayoutError, match="shards dim 2 of a 2-d tensor"):
        validate_layout((4, 4), (2,), [Shard(2)], param="w")
    with pytest.raises(LayoutError, match=r"mesh rank\(s\) \[7\] outside the process group of world size 4"):
        validate_layout((4, 4), (2,), [Shard(0)], param="w", world_size=4, mesh_ranks=[0, 7])
    with pytest.raises(LayoutError, match="Partial"):
        from torch.distributed.tensor.placement_types import Partial
        normalize_placements([Partial()])


def test_intersections_carry_local_offsets():
    src = shard_region((6, 4), (2,), (1,), [Shard(0)])  # rows 3..6
    dst = shard_region((6, 4), (3,), (1,), [Shard(0)])  # rows 2..4
    (box,) = intersect_regions(src, dst)
    assert box.start == (3, 0) and box.shape == (1, 4) and box.src_start == (0, 0) and box.dst_start == (1, 0)


def test_dtensorref():
    ref = DTensorRef(torch.zeros(2, 3), (8, 3))
    assert ref.shape == torch.Size([8, 3]) and ref._local_tensor.shape == (2, 3) and ref.dtype == torch.float32
    with pytest.raises(TypeError):
        DTensorRef([1, 2], (2,))
