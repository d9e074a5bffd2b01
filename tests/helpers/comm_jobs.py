"""Functions run on every rank of a fleet by the communicator and transport tests.

Device-agnostic: the same jobs run over gloo on CPU (``refit.testing.launch.LocalFleet``) and
over NCCL on GPUs (``refit.testing.launch.DeviceFleet``), so the streamed transport is
checked with the same plans on both.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from helpers.layouts import full_tensor, local_slice, rosters_for
from refit import Replicate, Shard
from refit.plan import build_rank_plan, merge_rosters
from refit.testing.launch import abort_blocked_recv
from refit.transport.base import SourceProduction
from refit.transport.factory import make_executor

S, R = Shard, Replicate


def mixed_params(world: int) -> list[tuple]:
    """(name, shape, (src mesh, placements, dtype), [(dst mesh, placements, dtype), ...])."""
    if world == 2:
        return [
            ("a", (12, 8), ([0, 1], [S(0)], "float32"), [([1, 0], [S(1)], "bfloat16")]),
            ("b", (16, 4), ([0], [R()], "bfloat16"), [([1], [R()], "bfloat16")]),
            ("c", (6,), ([1], [R()], "float32"), [([0, 1], [R()], "float32")]),
            ("d", (8, 8), ([1], [R()], "float64"), [([0], [R()], "float32")]),
            ("e", (10, 6), ([0, 1], [S(0)], "float32"), [([1, 0], [S(0)], "float32")]),
            ("f", (64, 32), ([1], [R()], "float32"), [([0], [R()], "float32")]),
            ("g", (40, 16), ([0], [R()], "bfloat16"), [([1], [S(0)], "float32")]),
        ]
    return [
        ("a", (12, 8), ([0, 1], [S(0)], "float32"), [([2, 3], [S(1)], "bfloat16")]),
        ("b", (16, 4), ([0, 1], [S(0)], "bfloat16"), [([2, 3], [R()], "bfloat16")]),
        ("c", (6,), ([0], [R()], "float32"), [([1, 2, 3], [R()], "float32")]),
        ("d", (8, 8), ([2, 3], [S(1)], "float64"), [([0, 1], [S(0)], "float32")]),
        ("e", (10, 6), ([0, 1, 2, 3], [S(0)], "float32"), [([3, 2, 1, 0], [S(0)], "float32")]),
        ("f", (64, 32), ([1], [R()], "float32"), [([0], [R()], "float32")]),
        ("g", (40, 16), ([[0, 1], [2, 3]], [R(), S(0)], "bfloat16"), [([3, 1], [S(1)], "float32")]),
    ]


def _strided_like(shape, dtype, device):
    """A destination buffer that is NOT contiguous (every other column of a wider one)."""
    if len(shape) < 2 or shape[-1] == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    wide = torch.empty(*shape[:-1], shape[-1] * 2, dtype=dtype, device=device)
    return wide[..., ::2]


class FillOnDemand(SourceProduction):
    """Source tensors written only when the executor asks for them, as a trainer's FP8 copies are.

    Every made tensor is filled from ``fresh`` (until then it holds NaN, so a block sent
    before its tensor was made lands wrong); each call that made something records how many
    sends the rank had posted by then, to show the making overlaps the wire.
    """

    def __init__(self, src: dict, fresh: dict, posted: list[int]):
        self.src, self.fresh, self.posted = src, fresh, posted
        self._waiting = set(fresh)
        self.calls: list[dict] = []
        for n in fresh:
            src[n].fill_(float("nan"))

    def waiting(self, name: str) -> bool:
        return name in self._waiting

    def names(self) -> list[str]:
        return sorted(self.fresh)

    def produce(self, names) -> bool:
        made = [n for n in names if n in self._waiting]
        for n in made:
            self._waiting.discard(n)
            self.src[n].copy_(self.fresh[n])
        if made:
            self.calls.append({"made": made, "sends_posted": self.posted[0]})
        return bool(made)


def _count_sends(group) -> list[int]:
    """Instrument the real communicator: how many sends this rank has posted (a one-item list)."""
    posted = [0]
    isend, p2p_group = group.isend, group.p2p_group

    def counted_isend(tensor, peer, *args, **kwargs):
        posted[0] += 1
        return isend(tensor, peer, *args, **kwargs)

    def counted_group(recvs, sends, *args, **kwargs):
        posted[0] += len(sends)
        return p2p_group(recvs, sends, *args, **kwargs)

    group.isend, group.p2p_group = counted_isend, counted_group
    return posted


def reshard_model(group, cfg: dict) -> dict:
    """Plan ``cfg['params']`` (default: mixed_params) and run it ``cfg['iters']`` times with fresh
    data each time; report per-iteration exactness and the executor's stats. With
    ``cfg['produced']`` those source tensors are made during each run (``FillOnDemand``)."""
    device = torch.device(cfg.get("device", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = group.device
    world = group.world_size
    params = cfg.get("params") or mixed_params(world)
    rosters = rosters_for(params, world)
    index = merge_rosters(rosters, world)
    plan = build_rank_plan(index, group.rank, bucket_bytes=cfg.get("bucket_bytes", 256))
    src, dst, meta = {}, {}, {}
    for name, shape, (sm, sp, sdt), dsts in params:
        meta[name] = (shape, np.array(sm), sp, getattr(torch, sdt), dsts)
        probe = local_slice(torch.zeros(shape), np.array(sm), sp, group.rank)
        if probe is not None:
            src[name] = torch.empty(probe.shape, dtype=getattr(torch, sdt), device=device)
        for dm, dp, ddt in dsts:
            probe = local_slice(torch.zeros(shape), np.array(dm), dp, group.rank)
            if probe is not None:
                if cfg.get("strided_dst") and name in cfg["strided_dst"]:
                    dst[name] = _strided_like(probe.shape, getattr(torch, ddt), device)
                else:
                    dst[name] = torch.empty(probe.shape, dtype=getattr(torch, ddt), device=device)
    out = {"rank": group.rank, "ok": [], "stats": [], "rounds": plan.num_rounds,
           "sends": len(plan.sends), "recvs": len(plan.recvs)}
    options = {k: cfg[k] for k in ("staging_budget_bytes", "group_bytes") if k in cfg}
    run_kwargs = {"verify": cfg.get("verify", False)}
    corrupt_at = cfg.get("corrupt")  # (sender rank, peer, bucket index)

    def corrupt(peer, index, buf):
        if corrupt_at and (group.rank, peer, index) == tuple(corrupt_at) and buf.numel():
            buf[0:1].add_(1)

    if corrupt_at:
        run_kwargs["corrupt"] = corrupt
    produced = set(cfg.get("produced", ()))
    posted = _count_sends(group) if produced else [0]
    out["productions"] = []
    # one executor for every iteration: it is made with the plan and reused, as in a refit loop
    executor = make_executor(plan, group, transport=cfg.get("pipeline", "auto"), device=device, **options)
    for it in range(cfg.get("iters", 3)):
        expect, fresh = {}, {}
        for name, (shape, sm, sp, sdt, dsts) in meta.items():
            full = full_tensor(shape, 1000 * it + sum(map(ord, name)))
            if name in src:
                mine = local_slice(full.to(sdt), sm, sp, group.rank).to(device)
                if name in produced:
                    fresh[name] = mine
                else:
                    src[name].copy_(mine)
            for dm, dp, ddt in dsts:
                want = local_slice(full.to(sdt).to(getattr(torch, ddt)), np.array(dm), dp, group.rank)
                if want is not None:
                    expect[name] = want
        for t in dst.values():
            t.fill_(float("nan"))
        production = FillOnDemand(src, fresh, posted) if produced else None
        posted[0] = 0
        stats = executor.run(src, dst, production=production, **run_kwargs)
        if production is not None:
            out["productions"].append({"calls": production.calls,
                                       "left": [n for n in production.names() if production.waiting(n)]})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["ok"].append(all(torch.equal(dst[n].cpu(), expect[n]) for n in expect))
        out["stats"].append({
            "alloc": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
            "peak_staging": stats.peak_staging_bytes, "capacity": stats.staging_capacity_bytes,
            "groups": stats.groups, "zero_copy": stats.zero_copy_buckets, "sent": stats.bytes_sent,
            "received": stats.bytes_received, "sums_sent": dict(stats.checksums_sent),
            "sums_received": dict(stats.checksums_received),
        })
    executor.close()
    return out


def gloo_basics(group) -> dict:
    r, n = group.rank, group.world_size
    out = {"gathered": group.all_gather_object({"rank": r})}
    t = torch.full((3,), float(r))
    group.broadcast(t, src=n - 1)
    out["broadcast"] = t.tolist()
    recv = torch.empty(4)
    works = group.p2p_group([(recv, (r - 1) % n)], [(torch.full((4,), 10.0 + r), (r + 1) % n)], tag=5)
    for w in works:
        group.wait(w)
    out["ring"] = recv.tolist()
    return out


def split_and_abort(group) -> dict:
    """Split into two children by parity; the child abort order and the result of using them."""
    child = group.split(group.rank % 2)
    out = {"child_rank": child.rank, "child_world": child.world_size, "members": child.parent_ranks,
           "gathered": child.all_gather_object(group.rank)}
    t = torch.full((2,), float(group.rank))
    child.broadcast(t, src=0)
    out["child_broadcast"] = t.tolist()
    # every rank's broadcast has returned before any rank aborts: an abort tears down what a
    # slower rank's broadcast still reads
    group.all_gather_object("broadcast done")
    order = []
    orig = child.abort

    def traced():
        order.append("child")
        orig()

    child.abort = traced
    group.abort()
    order.append("parent-done")
    out["order"] = order
    out["child_aborted"] = child.aborted
    group.abort()  # idempotent
    return out


# -- GPU-only jobs ----------------------------------------------------------------------------

def blocked_recv_released_by_abort(group, delay_s: float = 0.3) -> dict:
    """Rank 1 waits on a receive that rank 0 never sends; another thread aborts the group."""
    return {"rank": group.rank, **abort_blocked_recv(group, delay_s=delay_s)}


def split_child_abort(group, delay_s: float = 0.3) -> dict:
    """A rank blocked on a split child is released by aborting the parent."""
    child = group.split(0)
    out = {"rank": group.rank, "child_world": child.world_size,
           **abort_blocked_recv(group, child, delay_s=delay_s, nbytes=1 << 16)}
    out["child_aborted"] = child.aborted
    return out


def nccl_roundtrip(group) -> dict:
    """isend/irecv, broadcast and a bidirectional p2p group on NCCL."""
    dev = group.device
    r, n = group.rank, group.world_size
    out = {}
    t = torch.full((1000,), float(r), device=dev)
    group.broadcast(t, src=n - 1)
    out["broadcast"] = float(t.sum().item())
    recv = torch.empty(1 << 20, device=dev)
    send = torch.full((1 << 20,), 10.0 + r, device=dev)
    group.p2p_group([(recv, (r - 1) % n)], [(send, (r + 1) % n)])
    out["ring"] = float(recv[0].item())
    peer = 1 - r if n == 2 else (r + 1) % n
    if n == 2:
        x = torch.full((5,), 3.0 + r, device=dev)
        y = torch.empty(5, device=dev)
        works = [group.irecv(y, peer)] if r == 1 else [group.isend(x, peer)]
        for w in works:
            group.wait(w)
        out["p2p"] = y.tolist() if r == 1 else None
    return out


def init_alone(group, port: int, timeout_s: float) -> dict:
    """Rank 0 of a new 2-rank NCCL group whose rank 1 never comes: init must raise in time."""
    from refit.comm.group import StatelessProcessGroup
    from refit.errors import TransportError

    t0 = time.monotonic()
    try:
        g = StatelessProcessGroup("127.0.0.1", port, 0, 2, backend="nccl", device=group.device,
                                  init_timeout_s=timeout_s, timeout_s=30)
        g.abort()
        return {"error": None, "elapsed": time.monotonic() - t0}
    except TransportError as e:
        return {"error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - t0}


def idle(group, *args) -> None:
    return None


def vllm_key(group) -> dict:
    """What a vLLM rank would read from this group's store (rank 0 only has it published)."""
    import ctypes
    import pickle
    import sys
    import types

    name = "vllm.distributed.device_communicators.pynccl_wrapper"
    parts = name.split(".")
    saved = {n: sys.modules.get(n) for n in (".".join(parts[:i]) for i in range(1, len(parts) + 1))}
    for n in saved:
        sys.modules[n] = types.ModuleType(n)

    class ncclUniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = name, "ncclUniqueId"
    sys.modules[name].ncclUniqueId = ncclUniqueId
    try:
        uid = pickle.loads(group.store.get("broadcast_from/0/0"))
        return {"same": bytes(uid.internal) == group.store.get("nccl_unique_id")}
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def xfer_cuda(group, cases: list[dict]) -> list:
    """xferdtensor vs xferdtensor_golden with CUDA tensors, over this (NCCL) group."""
    import refit

    out = []
    dev = group.device
    for case in cases:
        shape = tuple(case["shape"])
        sm, dm = np.array(case["src_mesh"]), np.array(case["dst_mesh"])
        sdt, ddt = getattr(torch, case["src_dtype"]), getattr(torch, case["dst_dtype"])
        full = full_tensor(shape, case["seed"]).to(sdt)
        src_local = local_slice(full, sm, case["src_pl"], group.rank)
        want = local_slice(full.to(ddt), dm, case["dst_pl"], group.rank)
        src = refit.DTensorRef(src_local.to(dev), shape) if src_local is not None else None
        res = {}
        for fn in (refit.xferdtensor, refit.xferdtensor_golden):
            dst = refit.DTensorRef(torch.full(want.shape, float("nan"), dtype=ddt, device=dev), shape) \
                if want is not None else None
            fn(src, case["src_mesh"], case["src_pl"], dst, case["dst_mesh"], case["dst_pl"], group)
            torch.cuda.synchronize()
            res[fn.__name__] = None if dst is None else bool(torch.equal(dst._local_tensor.cpu(), want))
        out.append(res)
    return out


def torch_group_nccl(group, port: int, cases: list[dict]) -> list:
    """The same, on torch's default process group with the NCCL backend (TorchGroupComm)."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=group.rank,
                            world_size=group.world_size)
    try:
        import refit

        out = []
        dev = group.device
        for case in cases:
            shape = tuple(case["shape"])
            sm, dm = np.array(case["src_mesh"]), np.array(case["dst_mesh"])
            full = full_tensor(shape, case["seed"]).to(getattr(torch, case["src_dtype"]))
            src_local = local_slice(full, sm, case["src_pl"], group.rank)
            want = local_slice(full.to(getattr(torch, case["dst_dtype"])), dm, case["dst_pl"], group.rank)
            src = refit.DTensorRef(src_local.to(dev), shape) if src_local is not None else None
            dst = refit.DTensorRef(torch.full(want.shape, float("nan"), dtype=want.dtype, device=dev), shape) \
                if want is not None else None
            st = refit.xferdtensor(src, case["src_mesh"], case["src_pl"], dst, case["dst_mesh"], case["dst_pl"],
                                   dist.group.WORLD)
            torch.cuda.synchronize()
            out.append({"ok": None if dst is None else bool(torch.equal(dst._local_tensor.cpu(), want)),
                        "groups": st.groups})
        return out
    finally:
        dist.destroy_process_group()
