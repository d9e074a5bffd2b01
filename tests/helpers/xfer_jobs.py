"""Functions run on every rank of a LocalFleet by the xferdtensor tests (imported by the workers)."""

from __future__ import annotations

import numpy as np
import torch

import refit
from helpers.layouts import full_tensor, local_slice


def reshard(group, case, use_default_group=False):
    shape, seed = case["shape"], case["seed"]
    sm, sp, dm, dp = np.array(case["src_mesh"]), case["src_pl"], np.array(case["dst_mesh"]), case["dst_pl"]
    sdt, ddt = getattr(torch, case["src_dtype"]), getattr(torch, case["dst_dtype"])
    full = full_tensor(shape, seed).to(sdt)
    src_local = local_slice(full, sm, sp, group.rank)
    want = local_slice(full.to(ddt), dm, dp, group.rank)
    src = refit.DTensorRef(src_local, shape) if src_local is not None else None
    out = {}
    for fn in (refit.xferdtensor, refit.xferdtensor_golden):
        dst = refit.DTensorRef(torch.full(want.shape, float("nan"), dtype=ddt), shape) if want is not None else None
        pg = group
        if use_default_group:
            import torch.distributed as dist
            pg = dist.group.WORLD
        fn(src, case["src_mesh"], sp, dst, case["dst_mesh"], dp, pg)
        out[fn.__name__] = None if dst is None else bool(torch.equal(dst._local_tensor, want))
    return out


def bad_call(group, kind):
    S, R = refit.Shard, refit.Replicate
    r = group.rank
    t = torch.zeros(4, 4)
    ref = lambda local, shape=(8, 4): refit.DTensorRef(local, shape)  # noqa: E731
    try:
        if kind == "no_source":
            refit.xferdtensor(None, [0, 1], [S(0)], ref(t), [0, 1], [S(0)], group)
        elif kind == "shape_mismatch":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(torch.zeros(4, 5), (8, 5)) if r >= 2 else None, [2, 3], [S(0)], group)
        elif kind == "placements_count":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0), R()],
                              ref(t) if r >= 2 else None, [2, 3], [S(0)], group)
        elif kind == "shard_dim":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(t) if r >= 2 else None, [2, 3], [S(2)], group)
        elif kind == "outside_group":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(t) if r >= 2 else None, [2, 3, 9], [S(0)], group)
        elif kind == "duplicate":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(t) if r >= 2 else None, [2, 2], [S(0)], group)
        elif kind == "mesh_order_disagrees":  # ranks 2 and 3 see the destination mesh reversed
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(t) if r >= 2 else None, [2, 3] if r < 2 else [3, 2], [S(0)], group)
        elif kind == "placements_disagree":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(t) if r >= 2 else None, [2, 3], [S(0)] if r != 3 else [S(1)], group)
        elif kind == "one_rank_outside_group":  # only rank 0 passes a mesh naming rank 9
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(t) if r >= 2 else None, [2, 3] if r != 0 else [2, 9], [S(0)], group)
        elif kind == "local_shape":
            refit.xferdtensor(ref(t) if r < 2 else None, [0, 1], [S(0)],
                              ref(torch.zeros(3, 4)) if r >= 2 else None, [2, 3], [S(0)], group)
        else:
            raise ValueError(kind)
    except refit.RefitError as e:
        return type(e).__name__, str(e)
    return None


def torch_dtensor_strided(group):
    """FSDP2 x TP: a real torch DTensor with _StridedShard as the source, on the default group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard  # noqa: PLC2701 (torch: no public name)

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    full = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    coords = mesh.get_coordinate()
    local = local_slice(full, np.arange(4).reshape(2, 2), placements, dist.get_rank())
    src = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    assert torch.equal(src.full_tensor(), full), "torch agrees the local shard is right"
    dst_mesh = [3, 2, 1, 0]
    want = local_slice(full, np.array(dst_mesh), [Shard(1)], dist.get_rank())
    dst = refit.DTensorRef(torch.zeros_like(want), full.shape)
    refit.xferdtensor(src, mesh.mesh, placements, dst, dst_mesh, [Shard(1)], dist.group.WORLD)
    return coords, bool(torch.equal(dst._local_tensor, want))


def init_default_group(group, port):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group.rank, world_size=group.world_size)
    return dist.get_rank()


def destroy_default_group(group):
    import torch.distributed as dist
    dist.destroy_process_group()


def resharder_one_rank_fails(group, how: str, timeout_s: float):
    """Ranks 0-1 send, 2-3 receive; rank 1 fails before run(): inside a with-block, or without a word."""
    import time

    from refit.transport.xfer import Resharder

    S = refit.Shard
    r = group.rank
    src = {"w": (refit.DTensorRef(torch.ones(512, 64), (1024, 64)), [0, 1], [S(0)])} if r < 2 else {}
    # columns: each receiver needs rows from both senders, so both wait on rank 1
    dst = {"w": (refit.DTensorRef(torch.zeros(1024, 32), (1024, 64)), [2, 3], [S(1)])} if r >= 2 else {}
    t0 = time.monotonic()
    try:
        if how == "with":
            with Resharder(group, src, dst, timeout_s=timeout_s) as resharder:
                if r == 1:
                    raise RuntimeError("the batch was bad")
                resharder.run()
        else:
            resharder = Resharder(group, src, dst, timeout_s=timeout_s)
            if r == 1:
                raise RuntimeError("the batch was bad")
            resharder.run()
            resharder.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0
