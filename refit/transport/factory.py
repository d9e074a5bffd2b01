"""One factory for every executor: the plan and the communicator decide, the caller may insist."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from refit.errors import PlanError
from refit.plan import RankPlan, split_plan
from refit.transport.base import Executor
from refit.transport.broadcast import BroadcastExecutor, BroadcastPlan
from refit.transport.fanout import FanoutExecutor
from refit.transport.rounds import RoundsExecutor
from refit.transport.streamed import StreamedExecutor

TRANSPORTS = ("auto", "rounds", "streamed", "nixl", "ipc")
ONE_SIDED = ("nixl", "ipc")  # no collective during a transfer; the controller relays their roster entries


def make_executor(plan: RankPlan | BroadcastPlan, comm: Any = None, *, transport: str = "auto",
                  device: torch.device | str | None = None, nixl: Any = None, ipc: Any = None,
                  near: Collection[int] | None = None, **options: Any) -> Executor:
    """The executor of ``plan`` on this rank; made once per plan and reused every refit.

    ``transport``: ``"rounds"`` (host-driven rounds, gloo), ``"streamed"`` (the CUDA-stream
    pipeline over NCCL; on CPU tensors it runs on the host), ``"nixl"`` (one-sided writes
    through ``nixl``, a ``refit.transport.nixl.NixlTransport``), ``"ipc"`` (reads straight
    from the peers' memory on one node through ``ipc``, a ``refit.transport.ipc.IpcTransport``),
    or ``"auto"``: with ``ipc`` and ``near`` (the other ranks of this node), the pairs
    with ``near`` ranks over IPC and the rest over ``nixl`` when given, else as below, both
    at once (``SplitExecutor``); otherwise streamed
    when ``device`` is a GPU and the communicator is stream-ordered (NCCL), rounds
    otherwise. A ``BroadcastPlan`` always gets the broadcast executor and a fan-out plan
    runs its two parts on the chosen transport. ``options`` go to the executor
    (``depth``; ``staging_budget_bytes``, ``group_bytes``, ``sync``, ``timing``).
    """
    if transport not in TRANSPORTS:
        raise PlanError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if isinstance(plan, BroadcastPlan):
        if options:
            raise PlanError(f"the broadcast executor takes no options, got {sorted(options)}")
        return BroadcastExecutor(plan, comm)
    device = torch.device(device) if device is not None else None
    if transport == "nixl":
        from refit.transport.nixl import NixlExecutor

        if nixl is None:
            raise PlanError("transport='nixl' needs nixl=<NixlTransport>")
        if plan.fanout:
            raise PlanError("transport='nixl' does not run fan-out plans")
        return NixlExecutor(plan, nixl)
    if transport == "ipc":
        from refit.transport.ipc import IpcExecutor

        if ipc is None:
            raise PlanError("transport='ipc' needs ipc=<IpcTransport>")
        if plan.fanout:
            raise PlanError("transport='ipc' does not run fan-out plans")
        if options:
            raise PlanError(f"the ipc executor takes no options, got {sorted(options)}")
        return IpcExecutor(plan, ipc)
    if transport == "auto" and ipc is not None and near is not None:
        from refit.transport.ipc import IpcExecutor
        from refit.transport.split import SplitExecutor

        near_plan, far_plan = split_plan(plan, near)
        if nixl is not None:  # across nodes: NIXL's one-sided writes
            from refit.transport.nixl import NixlExecutor

            return SplitExecutor(plan, near_plan, far_plan, lambda p: IpcExecutor(p, ipc),
                                 lambda p: NixlExecutor(p, nixl))
        return SplitExecutor(plan, near_plan, far_plan, lambda p: IpcExecutor(p, ipc),
                             lambda p: make_executor(p, comm, transport="auto", device=device, **options))
    if transport == "auto":
        ordered = bool(getattr(comm, "stream_ordered", False))
        transport = "streamed" if device is not None and device.type == "cuda" and ordered else "rounds"
    part_options = _options_for(transport, options)

    def make_part(part: RankPlan) -> Executor:
        if transport == "streamed":
            return StreamedExecutor(part, comm, device=device, **part_options)
        return RoundsExecutor(part, comm, device=device, **part_options)

    if plan.fanout:
        return FanoutExecutor(plan, comm, make_part)
    return make_part(plan)


def _options_for(transport: str, options: dict[str, Any]) -> dict[str, Any]:
    allowed = {"rounds": {"depth"},
               "streamed": {"staging_budget_bytes", "group_bytes", "sync", "timing", "arena"}}[transport]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise PlanError(f"the {transport} executor does not take {unknown}; it takes {sorted(allowed)}")
    return {k: v for k, v in options.items() if v is not None}


__all__ = ["ONE_SIDED", "TRANSPORTS", "make_executor"]
