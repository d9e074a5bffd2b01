"""The fan-out job every rank of a LocalFleet runs, and the engine-like layouts it is run on."""

from __future__ import annotations

import numpy as np
import torch

from helpers.layouts import full_tensor, local_slice, rosters_for
from refit import Replicate, Shard
from refit.plan import build_rank_plan, merge_rosters


def fanout_job(group, params, seed, plan_kwargs):
    """Every rank: build its fan-out plan from the shared params, run it, check each element."""
    from refit.transport.factory import make_executor

    index = merge_rosters(rosters_for(params, group.world_size), group.world_size)
    plan = build_rank_plan(index, group.rank, fanout=True, **plan_kwargs)
    src, dst, want = {}, {}, {}
    for i, (name, shape, (sm, sp, sdt), dsts) in enumerate(params):
        full = full_tensor(shape, seed + i)
        mine = local_slice(full.to(getattr(torch, sdt)), np.asarray(sm), sp, group.rank)
        if mine is not None:
            src[name] = mine
        for dm, dp, ddt in dsts:
            w = local_slice(full.to(getattr(torch, sdt)).to(getattr(torch, ddt)), np.asarray(dm), dp, group.rank)
            if w is not None:
                want[name] = w
                dst[name] = torch.full(w.shape, float("nan"), dtype=w.dtype)
    with make_executor(plan, group, depth=2) as executor:
        stats = executor.run(src, dst)
        gather = executor.last_gather
    ok = {name: bool(torch.equal(dst[name], want[name])) for name in want}
    return {"ok": ok, "gather_received": gather.bytes_received, "gather_sent": gather.bytes_sent,
            "received": stats.bytes_received - gather.bytes_received, "sent": stats.bytes_sent - gather.bytes_sent}


def engine_params():
    """Two training ranks; four engine ranks as two TP2 replicas (2,3) and (4,5)."""
    reps = [np.array([2, 3]), np.array([4, 5])]
    return [
        ("qkv", (24, 10), (np.array([0, 1]), [Shard(0)], "float32"), [(m, [Shard(0)], "bfloat16") for m in reps]),
        ("o", (10, 24), (np.array([0, 1]), [Shard(1)], "float32"), [(m, [Shard(1)], "bfloat16") for m in reps]),
        ("norm", (10,), (np.array([[0, 1]]), [Replicate(), Replicate()], "float32"),
         [(m, [Replicate()], "float32") for m in reps]),
        # KV heads shared: one engine layout over all four ranks, [heads, ranks per head]
        ("k", (8, 6), (np.array([0, 1]), [Shard(0)], "float32"),
         [(np.array([[2, 3], [4, 5]]), [Shard(0), Replicate()], "float32")]),
        # colocated: rank 1 is also a destination and copies locally
        ("bias", (9,), (np.array([0, 1]), [Replicate()], "bfloat16"),
         [(np.array([1]), [Replicate()], "bfloat16"), (np.array([2]), [Replicate()], "bfloat16"),
          (np.array([3, 4, 5]), [Shard(0)], "bfloat16")]),
        ("scalar", (), (np.array([0]), [Replicate()], "float32"),
         [(np.array([r]), [Replicate()], "float32") for r in (2, 3, 4, 5)]),
    ]
