"""The one check of a rank's local tensors against the merged rosters."""

import pytest

from refit.errors import LayoutError
from refit.layout import Replicate, Shard
from refit.plan import RosterEntry, check_local_shapes, merge_rosters


def _index():
    # a [6, 4] param: ranks 0-1 hold it as Shard(0), ranks 2-3 need it as Shard(1)
    src = [RosterEntry.make("w", (6, 4), "float32", [0, 1], [Shard(0)], "src")]
    dst = [RosterEntry.make("w", (6, 4), "float32", [2, 3], [Shard(1)], "dst")]
    return merge_rosters({0: src, 1: src, 2: dst, 3: dst}, 4)


def test_right_local_shapes_pass():
    index = _index()
    check_local_shapes(index, 1, {"src": {"w": (3, 4)}})
    check_local_shapes(index, 3, {"dst": {"w": [6, 2]}})


def test_wrong_local_shape_names_param_rank_layout_and_shapes():
    with pytest.raises(LayoutError) as err:
        check_local_shapes(_index(), 2, {"dst": {"w": (6, 4)}})
    msg = str(err.value)
    for part in ("w:", "rank 2", "[6, 4]", "Shard(1)", "mesh [2, 3]", "[6, 2]"):
        assert part in msg, (part, msg)


def test_tensor_without_a_layout_in_the_rosters():
    with pytest.raises(LayoutError, match="no src layout"):
        check_local_shapes(_index(), 2, {"src": {"w": (3, 4)}})
    with pytest.raises(LayoutError, match="no dst layout"):
        check_local_shapes(_index(), 0, {"dst": {"other": (1,)}})


def test_replicated_layout_wants_the_whole_tensor():
    entries = {r: [RosterEntry.make("b", (5,), "float32", [0, 1], [Replicate()], "src")] for r in (0, 1)}
    index = merge_rosters(entries, 2)
    check_local_shapes(index, 0, {"src": {"b": (5,)}})
    with pytest.raises(LayoutError):
        check_local_shapes(index, 1, {"src": {"b": (3,)}})
