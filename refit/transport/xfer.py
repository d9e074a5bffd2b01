"""``xferdtensor``: reshard one tensor from a source mesh to a destination mesh.

Every rank of ``process_group`` calls it with the same meshes and placements; a rank
outside a mesh passes ``None`` for that side's tensor. The ranks first exchange a few
bytes of metadata (shape, dtype, local shape, any local error) so that every bad input
is rejected on every rank with the same message before a byte moves, then each builds
its own plan (cached on the roster digest) and executes it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from refit.comm.group import as_communicator
from refit.errors import LayoutError, PlanError, RefitError
from refit.layout import (
    dtype_name,
    local_tensor_of,
)
from refit.plan import (
    DEFAULT_BUCKET_BYTES,
    PlanCache,
    RosterEntry,
    TensorLayout,
    build_rank_plan,
    check_local_shapes,
    merge_rosters,
)
from refit.transport.base import TransferStats, device_of
from refit.transport.broadcast import BroadcastPlan
from refit.transport.factory import make_executor

PARAM = "tensor"
_plan_cache = PlanCache(max_entries=256)


def _side_meta(t: Any, side: str) -> tuple | None:
    if t is None:
        return None
    local = local_tensor_of(t)
    shape = tuple(int(s) for s in t.shape)
    dtype = getattr(t, "dtype", local.dtype)
    return (shape, dtype_name(dtype), tuple(local.shape))


def _exchange(comm, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement):
    """Gather every rank's metadata and local errors; return merged rosters or raise everywhere."""
    error = None
    meta = {}
    try:
        meta = {"src": _side_meta(src_tensor, "src"), "dst": _side_meta(dst_tensor, "dst")}
    except (TypeError, RefitError) as e:
        error = str(e)
    gathered = comm.all_gather_object({"meta": meta, "error": error})
    errors = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if errors:
        raise PlanError("; ".join(f"rank {r}: {msg}" for r, msg in errors))
    shapes = {g["meta"][s][0] for g in gathered for s in ("src", "dst") if g["meta"].get(s)}
    if len(shapes) > 1:
        holders = {}
        for r, g in enumerate(gathered):
            for s in ("src", "dst"):
                if g["meta"].get(s):
                    holders.setdefault(g["meta"][s][0], []).append(f"{s}@{r}")
        parts = "; ".join(f"{list(k)} on {v}" for k, v in holders.items())
        raise PlanError(f"{PARAM}: global shape mismatch between ranks: {parts}")
    rosters = {}
    for r, g in enumerate(gathered):
        entries = []
        for side, mesh, placement in (("src", src_mesh, src_placement), ("dst", dst_mesh, dst_placement)):
            m = g["meta"].get(side)
            if m is not None:
                entries.append(RosterEntry.make(PARAM, m[0], m[1], mesh, placement, side))
        rosters[r] = entries
    for side, mesh in (("src", src_mesh), ("dst", dst_mesh)):
        lay = TensorLayout.make(mesh, [], "float32", param=f"{PARAM} ({side})") if mesh is not None else None
        if lay is None:
            raise LayoutError(f"{side}_mesh: a mesh is required")
        bad = sorted(r for r in lay.mesh_ranks if r >= comm.world_size)
        if bad:
            raise LayoutError(f"{side}_mesh: rank(s) {bad} outside the process group of world size {comm.world_size}")
        for r in lay.mesh_ranks:
            if gathered[r]["meta"].get(side) is None:
                raise PlanError(f"{side}_tensor: rank {r} is in {side}_mesh {list(lay.mesh_ranks)} but passed None")
        for r, g in enumerate(gathered):
            if g["meta"].get(side) is not None and r not in lay.mesh_ranks:
                raise PlanError(f"{side}_tensor: rank {r} passed a tensor but is not in "
                                f"{side}_mesh {list(lay.mesh_ranks)}")
    index = merge_rosters(rosters, comm.world_size)
    spec = index.specs.get(PARAM)
    if spec is None:
        raise PlanError(f"{PARAM}: no rank holds a source tensor")
    for r, g in enumerate(gathered):
        for side in ("src", "dst"):
            m = g["meta"].get(side)
            if m is not None:
                try:
                    check_local_shapes(index, r, {side: {PARAM: m[2]}})
                except LayoutError as e:
                    raise LayoutError(f"{side}_tensor / {side}_placement: {e}") from None
    return index, spec


def _stream_ctx(stream):
    if stream is not None and torch.cuda.is_available():
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def xferdtensor(src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, process_group, stream=None):
    """Move ``src_tensor`` (sharded on ``src_mesh``) into ``dst_tensor`` (sharded on ``dst_mesh``).

    Shard to shard: each destination block comes from one source rank (replicas share
    the load), without a full gather. Returns this rank's ``TransferStats``.
    """
    comm = as_communicator(process_group)
    index, _ = _exchange(comm, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement)
    plan = _plan_cache.get(index, comm.rank)
    src = {PARAM: local_tensor_of(src_tensor)} if src_tensor is not None else {}
    dst = {PARAM: local_tensor_of(dst_tensor)} if dst_tensor is not None else {}
    with _stream_ctx(stream):
        with make_executor(plan, comm, device=device_of(src, dst)) as executor:
            return executor.run(src, dst)


def xferdtensor_golden(src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement, process_group):
    """The broadcast-based reference: rebuild the full tensor everywhere, then slice.

    One broadcast per distinct source shard, from that shard's first replica; a fully
    replicated source needs a single broadcast. Simple on purpose: it is the reference
    ``xferdtensor`` is tested against, and the cost every rank pays in the naive refit.
    The full tensor is never materialised: each rank keeps the part of every broadcast
    shard that falls in its destination region.
    """
    comm = as_communicator(process_group)
    index, _ = _exchange(comm, src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement)
    src = {PARAM: local_tensor_of(src_tensor)} if src_tensor is not None else {}
    dst = {PARAM: local_tensor_of(dst_tensor)} if dst_tensor is not None else {}
    with make_executor(BroadcastPlan.build(index, comm.rank), comm) as executor:
        return executor.run(src, dst)


class Resharder:
    """Many tensors at once: rosters exchanged and checked once, the plan built once.

    ``src`` and ``dst`` map a param name to ``(tensor, mesh, placements)`` for what this
    rank holds and needs; every rank of ``process_group`` constructs one (possibly with
    empty maps). Bad rosters raise on every rank here, before any byte moves.
    """

    def __init__(self, process_group, src=None, dst=None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 depth: int = 2):
        self.comm = as_communicator(process_group)
        src, dst = dict(src or {}), dict(dst or {})
        entries, local_shapes, error = [], {"src": {}, "dst": {}}, None
        try:
            for role, side in (("src", src), ("dst", dst)):
                for name, (t, mesh, placements) in side.items():
                    entries.append(RosterEntry.make(name, tuple(t.shape), dtype_name(t.dtype), mesh, placements, role))
                    local_shapes[role][name] = tuple(local_tensor_of(t).shape)
        except (TypeError, RefitError) as e:
            error = f"rank {self.comm.rank}: {e}"
        gathered = self.comm.all_gather_object((entries, local_shapes, error))
        errors = [err for _, _, err in gathered if err]
        if errors:
            raise PlanError("; ".join(errors))
        self.index = merge_rosters({r: e for r, (e, _, _) in enumerate(gathered)}, self.comm.world_size)
        for r, (_, shapes, _) in enumerate(gathered):  # every rank raises the same error, naming the rank
            check_local_shapes(self.index, r, shapes)
        self.src = {n: local_tensor_of(t) for n, (t, _, _) in src.items()}
        self.dst = {n: local_tensor_of(t) for n, (t, _, _) in dst.items()}
        t0 = time.perf_counter()
        self.plan = build_rank_plan(self.index, self.comm.rank, bucket_bytes=bucket_bytes)
        self.plan_seconds = time.perf_counter() - t0
        self.executor = make_executor(self.plan, self.comm, device=device_of(self.src, self.dst), depth=depth)
        self.executor.prepare(self.src, self.dst)

    def run(self, *, verify: bool = False) -> TransferStats:
        """Move every tensor once; returns this rank's ``TransferStats``."""
        return self.executor.run(verify=verify)

    def close(self) -> None:
        """Release the executor's staging."""
        self.executor.close()


__all__ = ["Resharder", "xferdtensor", "xferdtensor_golden"]
