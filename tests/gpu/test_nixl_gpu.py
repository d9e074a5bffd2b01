"""The NIXL transport with every rank's tensors on one GPU (ranks in processes of their own).

Run on the lent GPU machine by ``scripts/gpu_refit_speed.sh``. On a GPU a chunk is packed and
unpacked by one fused kernel, verified or not; these refits check that an unverified refit's
fused copies land exactly as a verified one's, with staged and in-place buckets both taken.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import nixl_jobs as J

from refit import Replicate as R
from refit import Shard as S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORLD = 4
_membership = functools.partial(J.relay_membership, transport="nixl", device="cuda")
_epochs = itertools.count(1)

CASE = {"world": WORLD, "bucket_bytes": 1 << 16, "chunk_bytes": 1 << 17, "params": [
    # strided destinations (staged, runs shorter and longer than a checksum row), a contiguous
    # one large enough to go in place, and one that casts (staged, packed op by op)
    {"name": "w", "shape": (256, 192), "seed": 6, "src_mesh": [0, 1], "src_pl": [S(0)], "src_dtype": "bfloat16",
     "dst_mesh": [2, 3], "dst_pl": [S(1)], "dst_dtype": "bfloat16"},
    {"name": "u", "shape": (96, 4096), "seed": 7, "src_mesh": [0, 1], "src_pl": [S(1)], "src_dtype": "bfloat16",
     "dst_mesh": [2, 3], "dst_pl": [S(0)], "dst_dtype": "bfloat16"},
    {"name": "big", "shape": (512, 1024), "seed": 9, "src_mesh": [0, 1], "src_pl": [S(0)], "src_dtype": "bfloat16",
     "dst_mesh": [[2], [3]], "dst_pl": [R(), R()], "dst_dtype": "bfloat16"},
    {"name": "c", "shape": (64, 48), "seed": 1, "src_mesh": [0, 1], "src_pl": [S(0)], "src_dtype": "float32",
     "dst_mesh": [2, 3], "dst_pl": [S(1)], "dst_dtype": "bfloat16"},
]}


@pytest.fixture(scope="module")
def procs():
    with J.Procs(WORLD) as P:
        yield P


@pytest.mark.timeout(240)
def test_unverified_and_verified_nixl_refits_on_a_gpu_land_exactly(procs):
    members = list(range(WORLD))
    _membership(procs, CASE, members, next(_epochs))
    for step in range(6):
        verify = step % 2 == 0
        results = procs.ok(J.refit_step, step, replace_src=step == 3, verify=verify)
        J.check_refits(results)
        assert sum(res["zero_copy"] for res in results.values()) > 0  # some buckets went in place
        for r, res in results.items():
            if verify:
                for (peer, idx), value in res["sent"].items():
                    assert results[peer]["received"][(r, idx)] == value
            else:
                assert not res["sent"] and not res["received"], (step, r)
