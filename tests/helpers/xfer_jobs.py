"""Functions run on every rank of a LocalFleet by the xferdtensor tests (imported by the workers)."""

from __future__ import annotations

import numpy as np
import torch

import refit
from helpers.layouts import full_tensor, local_slice
from refit.comm.group import StatelessProcessGroup


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
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def _outcome(fn):
    """What ``fn()`` raised, as (type name, message); ("ok", result) when it returned."""
    try:
        return "ok", fn()
    except Exception as e:  # reported to the test, whatever it is
        return type(e).__name__, str(e)


def extra_bad_call(group, kind):
    """Bad input beyond ``bad_call``'s: lossy casts and settings that differ between ranks."""
    S = refit.Shard
    r = group.rank
    ref = lambda local, shape=(8, 4): refit.DTensorRef(local, shape)  # noqa: E731
    src_dtype, dst_dtype, strict = torch.float32, torch.float32, False
    if kind == "complex_to_real":
        src_dtype = torch.complex64
    elif kind == "float_to_int":
        dst_dtype = torch.int8
    elif kind == "strict_casts_disagree":
        strict = r == 3
    else:
        raise ValueError(kind)
    src = ref(torch.ones(4, 4, dtype=src_dtype)) if r < 2 else None
    dst = ref(torch.zeros(4, 4, dtype=dst_dtype)) if r >= 2 else None
    try:
        refit.xferdtensor(src, [0, 1], [S(0)], dst, [2, 3], [S(0)], group, strict_casts=strict)
    except refit.RefitError as e:
        return type(e).__name__, str(e)
    return None


_CASE_GROUPS: dict = {}


def bad_call_on_a_group_whose_store_host_leaves(group, caller, kind, port, secret):
    """Every rank makes a bad call on a fresh group whose rank 0 hosts the store; rank 0 then closes
    its group, which takes the store down as its process's exit would. Returns each rank's outcome."""
    import gc

    g = StatelessProcessGroup("127.0.0.1", port, group.rank, group.world_size, timeout_s=30, secret=secret,
                              name=f"case/{kind}")
    _CASE_GROUPS[port] = g
    out = _outcome(lambda: caller(g, kind))
    if g.rank == 0:
        g.abort()
        del _CASE_GROUPS[port], g
        gc.collect()
    return out


def call_again_without_the_store_host(group, caller, kind, port):
    """Ranks 1.. make the call once more on that group, its store gone with rank 0 (which returns None)."""
    g = _CASE_GROUPS.pop(port, None)
    if g is None:
        return None
    try:
        return _outcome(lambda: caller(g, kind))
    finally:
        g.abort()


def resharder_bad_call(group, kind):
    """A Resharder where one rank's arguments differ from the others'; each rank's (error type, message)."""
    from refit.transport.xfer import Resharder

    S = refit.Shard
    r = group.rank
    src = {"w": (refit.DTensorRef(torch.ones(4, 4), (8, 4)), [0, 1], [S(0)])} if r < 2 else {}
    dst = {"w": (refit.DTensorRef(torch.zeros(4, 4), (8, 4)), [2, 3], [S(0)])} if r >= 2 else {}
    kw = {}
    if kind == "bucket_bytes" and r == 3:
        kw["bucket_bytes"] = 1024
    elif kind == "timeout_disagree" and r == 2:
        kw["timeout_s"] = 5.0
    elif kind == "timeout_inf" and r == 1:
        kw["timeout_s"] = float("inf")
    elif kind == "strict_casts_disagree" and r == 0:
        kw["strict_casts"] = True
    elif kind == "none_tensor" and r == 1:
        src = {"w": (None, [0, 1], [S(0)])}
    elif kind == "not_a_triple" and r == 2:
        dst = {"w": dst["w"][0]}
    elif kind == "float_to_int" and r >= 2:
        dst = {"w": (refit.DTensorRef(torch.zeros(4, 4, dtype=torch.int8), (8, 4)), [2, 3], [S(0)])}
    try:
        with Resharder(group, src, dst, **kw) as resharder:
            resharder.run()
    except refit.RefitError as e:
        return type(e).__name__, str(e)
    return None


def overflowing_casts(group, how: str):
    """fp32 sources on ranks 0-1 holding 1e5 (beyond fp16's 65504) into fp16 destinations on 2-3.

    ``how``: "xfer" / "xfer_strict" (``xferdtensor``), "resharder" / "resharder_strict". Returns
    per rank: the outcome, the overflows listed (or the error), the warnings' texts, whether the
    destination was left untouched (all NaN) or holds an inf; for "resharder_strict", after the
    refusal the value is fixed and the same Resharder runs again: what it listed and whether the
    destination then holds the source's values.
    """
    import warnings

    from refit.transport.xfer import Resharder

    S = refit.Shard
    r = group.rank
    local = torch.ones(4, 4)
    local[1, 2] = 1e5
    src_ref = refit.DTensorRef(local, (8, 4)) if r < 2 else None
    dst_local = torch.full((4, 4), float("nan"), dtype=torch.float16)
    dst_ref = refit.DTensorRef(dst_local, (8, 4)) if r >= 2 else None
    strict = how.endswith("_strict")
    after = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how.startswith("xfer"):
            kind, value = _outcome(lambda: refit.xferdtensor(src_ref, [0, 1], [S(0)], dst_ref, [2, 3], [S(0)], group,
                                                             strict_casts=strict).cast_overflows)
        else:
            src = {"w": (src_ref, [0, 1], [S(0)])} if r < 2 else {}
            dst = {"w": (dst_ref, [2, 3], [S(0)])} if r >= 2 else {}
            with Resharder(group, src, dst, strict_casts=strict) as resharder:
                kind, value = _outcome(lambda: resharder.run().cast_overflows)
                untouched_then = bool(torch.isnan(dst_local).all())
                if strict and kind == "PlanError":
                    local[1, 2] = 2.0
                    again = resharder.run()
                    after = {"listed": again.cast_overflows, "untouched_before": untouched_then,
                             "arrived": bool(torch.equal(dst_local.float(), local)) if r >= 2 else None}
    return {"outcome": kind, "listed": [str(o) for o in value] if kind == "ok" else value,
            "warnings": [str(w.message) for w in caught if w.category.__name__ == "CastOverflowWarning"],
            "untouched": bool(torch.isnan(dst_local).all()) if r >= 2 else None,
            "inf": bool(torch.isinf(dst_local).any()) if r >= 2 else None, "after": after}


def resharder_rank_dies(group, out_dir: str):
    """Ranks 0-1 send to 2; rank 3, which moves nothing itself, is killed (SIGKILL, by its own hand) once
    every Resharder is built, so the others' own parts all complete. They write their outcome of
    ``run()`` to ``out_dir/rank<r>.json`` (the fleet loses rank 3's answer, and with it everyone's)."""
    import json
    import os
    import signal
    from pathlib import Path

    from refit.transport.xfer import Resharder

    S = refit.Shard
    r = group.rank
    src = {"w": (refit.DTensorRef(torch.ones(64, 16), (128, 16)), [0, 1], [S(0)])} if r < 2 else {}
    dst = {"w": (refit.DTensorRef(torch.zeros(128, 16), (128, 16)), [2], [S(1)])} if r == 2 else {}
    resharder = Resharder(group, src, dst, timeout_s=60.0)
    group.barrier()  # every rank has built its Resharder (rank 3's death must not land in another's build)
    if r == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    kind, msg = _outcome(lambda: resharder.run() and "finished")
    arrived = bool((dst["w"][0]._local_tensor == 1).all()) if r == 2 else None
    resharder.close()
    Path(out_dir, f"rank{r}.json").write_text(json.dumps([kind, msg, arrived]))
    return kind
