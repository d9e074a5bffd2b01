"""One factory for every executor, and the one place a build's transport is chosen.

``choose_transport`` turns what the user asked for (``TransportRequest``) and where every
rank's tensors live into a ``TransportChoice``; the controller makes it once per build and
every rank's prepare carries it, so no layer re-derives it from strings. ``make_executor``
turns a plan into its executor (the plan and the communicator decide, the caller may
insist).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import ConfigError, PlanError
from refit.plan import RankPlan, split_plan
from refit.transport.base import Executor
from refit.transport.broadcast import BroadcastExecutor, BroadcastPlan
from refit.transport.fanout import FanoutExecutor
from refit.transport.rounds import RoundsExecutor
from refit.transport.streamed import StreamedExecutor

TRANSPORTS = ("auto", "rounds", "streamed", "nixl", "ipc")
ONE_SIDED = ("nixl", "ipc")  # no collective during a transfer; the controller relays their roster entries
REQUESTABLE = (None, "auto", *ONE_SIDED)  # what a synchronizer takes as ``transport``
BACKENDS = ("auto", "gloo", "nccl")
ACROSS_NODES = ("communicator", "nixl")


@dataclass(frozen=True)
class TransportRequest:
    """What the user asked for, checked when asked (before any worker is reached).

    ``transport``: None (the communicator), ``"nixl"``, ``"ipc"`` or ``"auto"`` (pairs inside
    a node over IPC, the others over ``across_nodes``); ``backend``: the communicator's
    (``"auto"``: NCCL when every rank is on a GPU, gloo when every rank is on the host).
    """

    transport: str | None = None
    backend: str = "auto"
    across_nodes: str = "communicator"
    mode: str = "reshard"

    def __post_init__(self) -> None:
        if self.transport not in REQUESTABLE:
            raise ConfigError(f"transport must be None, 'auto', 'nixl' or 'ipc', got {self.transport!r}")
        if self.transport is not None and self.mode != "reshard":
            raise ConfigError(f"transport={self.transport!r} moves the shard-to-shard plans; "
                              "use ReshardWeightSynchronizer")
        if self.across_nodes not in ACROSS_NODES:
            raise ConfigError(f"across_nodes must be 'communicator' or 'nixl', got {self.across_nodes!r}")
        if self.across_nodes != "communicator" and self.transport != "auto":
            raise ConfigError(f"across_nodes={self.across_nodes!r} chooses how transport='auto' crosses nodes; "
                              f"transport is {self.transport!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def control_only(self) -> bool:
        """The communicator carries control only (gloo), whatever the devices: every byte moves
        one-sided, or the user chose gloo."""
        return self.transport in ONE_SIDED or self.backend == "gloo" or self.across_nodes == "nixl"

    @property
    def needs_devices(self) -> bool:
        """Whether the choice depends on where the ranks' tensors live."""
        return self.splits_by_node or not self.control_only

    @property
    def splits_by_node(self) -> bool:
        return self.transport == "auto"


@dataclass(frozen=True)
class TransportChoice:
    """How one build moves its bytes; made once by ``choose_transport``, carried to every rank.

    ``backend``: the communicator's (``"gloo"`` where it carries control only). ``channel``:
    the one-sided channel every pair moves over (``"nixl"`` or ``"ipc"``), None for the
    communicator. ``nodes`` (every rank's node) splits the plan: the pairs inside a node
    move over IPC and the others over ``across`` (``"communicator"`` or ``"nixl"``).
    """

    backend: str = "gloo"
    channel: str | None = None
    nodes: Mapping[int, str] | None = None
    across: str = "communicator"

    @property
    def split(self) -> bool:
        return self.nodes is not None

    @property
    def one_sided(self) -> bool:
        """Ranks exchange roster entries of registered or exported memory at every build."""
        return self.channel is not None or self.split

    @property
    def near_channel(self) -> str | None:
        """The one-sided channel of this rank's own pairs: every pair's, or those inside its node."""
        return "ipc" if self.split else self.channel

    @property
    def far_channel(self) -> str | None:
        """Split by node: NIXL for the pairs between nodes, or None (the communicator)."""
        return "nixl" if self.split and self.across == "nixl" else None

    def near_ranks(self, rank: int) -> set[int] | None:
        """Split by node: the ranks on ``rank``'s node."""
        if self.nodes is None:
            return None
        return {r for r, n in self.nodes.items() if n == self.nodes.get(rank)}

    @property
    def executor_transport(self) -> str:
        """What ``make_executor`` runs (``"auto"``: the communicator's own pipeline, or the split)."""
        return self.channel or "auto"


#: every byte over the communicator: what a build runs without a choice of its own
COMMUNICATOR = TransportChoice()


def choose_transport(request: TransportRequest, devices: Mapping[int, Mapping[str, Any]] | None,
                     labels: Mapping[int, str]) -> TransportChoice:
    """The transport of one build, from the request and every rank's ``refit_device()`` (by rank).

    ``devices`` may be None when ``request.needs_devices`` is false. Refuses, naming the
    ranks, a communicator over a mix of host and GPU tensors, and two ranks on one GPU under
    NCCL: NCCL allows one rank per GPU in a communicator and says so only as "invalid usage"
    from inside the rendezvous, on every rank at once.
    """
    nodes = None
    if request.splits_by_node:
        if devices is None:
            raise ConfigError("transport='auto' splits the plan by node: every rank's device report is needed")
        nodes = {rank: node_of(d) for rank, d in devices.items()}
    choice = {"channel": request.transport if request.transport in ONE_SIDED else None, "nodes": nodes,
              "across": request.across_nodes}
    if request.control_only:
        return TransportChoice("gloo", **choice)
    if devices is None:
        raise ConfigError(f"backend={request.backend!r}: every rank's device report is needed to choose it")
    if nodes is not None and len(set(nodes.values())) == 1:
        return TransportChoice("gloo", **choice)  # every pair moves over IPC: control only
    kinds: dict[str, list[str]] = {}
    for rank, d in sorted(devices.items()):
        kinds.setdefault(d["type"], []).append(f"{labels.get(rank, 'rank')} (rank {rank})")
    if request.backend == "auto" and set(kinds) == {"cpu"}:
        return TransportChoice("gloo", **choice)
    if set(kinds) != {"cuda"}:
        where = "; ".join(f"on {k}: {', '.join(v)}" for k, v in sorted(kinds.items()))
        raise PlanError(f"backend={request.backend!r}: one communicator moves tensors of one kind of device, "
                        f"every rank's on a GPU (NCCL) or every rank's on the host (gloo); {where}")
    seen: dict[tuple[str, str], str] = {}
    for rank, d in sorted(devices.items()):
        key = (d["host"], d["uuid"])
        who = f"{labels.get(rank, 'rank')} (rank {rank})"
        if key in seen:
            raise PlanError(f"{seen[key]} and {who} are both on GPU {d['index']} ({d['uuid']}) of host "
                            f"{d['host']}: NCCL allows one rank per GPU in a communicator; give every trainer "
                            "rank and engine worker its own GPU")
        seen[key] = who
    return TransportChoice("nccl", **choice)


class Channels:
    """A rank's one-sided channels, kept across builds: ``near`` carries every pair (``"nixl"``,
    ``"ipc"``) or, split by node, the pairs inside the node (IPC); ``far`` the pairs between
    nodes over NIXL. Registering memory and loading peers is paid once, so a build keeps a
    channel of the kind it needs and opens or closes only what changed. They have no
    deadline of their own: the refit watchdog hands them the deadline of each transfer.
    """

    def __init__(self) -> None:
        self.near: Any = None
        self.far: Any = None

    def update(self, choice: TransportChoice, rank: int, device: torch.device) -> None:
        """Keep, open or close the channels ``choice`` needs on this rank."""
        want = choice.near_channel
        if self.near is not None and self.near.transport != want:
            self.near.close()
            self.near = None
        if want is not None and self.near is None:
            self.near = _open_channel(want, rank, device)
        if self.far is not None and choice.far_channel is None:
            self.far.close()
            self.far = None
        if choice.far_channel is not None and self.far is None:
            self.far = _open_channel(choice.far_channel, rank, device)

    def executor(self, choice: TransportChoice, plan: RankPlan | BroadcastPlan, comm: Any, rank: int,
                 device: torch.device) -> Executor:
        """The executor of ``plan`` over these channels (and ``comm``), as ``choice`` says."""
        near = choice.near_channel
        return make_executor(plan, comm, transport=choice.executor_transport, device=device,
                             nixl=self.near if near == "nixl" else self.far, ipc=self.near if near == "ipc" else None,
                             near=choice.near_ranks(rank))

    def abortable(self) -> list[Any]:
        return [c for c in (self.near, self.far) if c is not None]

    def close(self) -> None:
        for channel in self.abortable():
            channel.close()
        self.near = self.far = None


def _open_channel(kind: str, rank: int, device: torch.device) -> Any:
    if kind == "nixl":
        from refit.transport.nixl import NixlChannel

        return NixlChannel(rank, device=device, timeout_s=None)
    from refit.transport.ipc import IpcChannel

    return IpcChannel(rank, device=device, timeout_s=None)


def node_of(device: Mapping[str, Any]) -> str:
    """The node a rank's ``refit_device()`` report places it on (its host where no node is given)."""
    return device.get("node") or device["host"]


def make_executor(plan: RankPlan | BroadcastPlan, comm: Any = None, *, transport: str = "auto",
                  device: torch.device | str | None = None, nixl: Any = None, ipc: Any = None,
                  near: Collection[int] | None = None, **options: Any) -> Executor:
    """The executor of ``plan`` on this rank; made once per plan and reused every refit.

    ``transport``: ``"rounds"`` (host-driven rounds, gloo), ``"streamed"`` (the CUDA-stream
    pipeline over NCCL; on CPU tensors it runs on the host), ``"nixl"`` (one-sided writes
    through ``nixl``, a ``refit.transport.nixl.NixlChannel``), ``"ipc"`` (reads straight
    from the peers' memory on one node through ``ipc``, a ``refit.transport.ipc.IpcChannel``),
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
            raise PlanError("transport='nixl' needs nixl=<NixlChannel>")
        if plan.fanout:
            raise PlanError("transport='nixl' does not run fan-out plans")
        return NixlExecutor(plan, nixl)
    if transport == "ipc":
        from refit.transport.ipc import IpcExecutor

        if ipc is None:
            raise PlanError("transport='ipc' needs ipc=<IpcChannel>")
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


__all__ = ["COMMUNICATOR", "ONE_SIDED", "TRANSPORTS", "Channels", "TransportChoice", "TransportRequest",
           "choose_transport", "make_executor", "node_of"]
