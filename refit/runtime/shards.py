"""What an actor hands refit: its local shards and their layouts, and where one build connects."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.errors import LateCall, LayoutError
from refit.layout import DTensorRef

__all__ = ["ConnectSpec", "LocalShard", "as_local_shard", "call_deadline"]


@dataclass(frozen=True)
class LocalShard:
    """One param as one rank holds it: the local tensor and the layout it is a shard of.

    ``mesh`` holds ranks of the refit communicator as the actor sees them: a trainer
    gives its trainer ranks (``0 .. train_world_size-1``); an engine gives its shard's
    own workers (``0 .. workers_per_shard-1``) and the controller moves them to wherever
    the shard sits in the current membership.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    mesh: Any
    placements: tuple


def as_local_shard(name: str, value: Any) -> LocalShard:
    """Accept ``LocalShard``, ``(local, global_shape, mesh, placements)`` or ``(DTensorRef, mesh, placements)``."""
    if isinstance(value, LocalShard):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 4:
        local, shape, mesh, placements = value
    elif isinstance(value, (tuple, list)) and len(value) == 3:
        ref, mesh, placements = value
        if not (isinstance(ref, DTensorRef) or hasattr(ref, "_local_tensor")):
            raise LayoutError(f"{name}: a 3-tuple must start with a DTensorRef or DTensor, got {type(ref).__name__}")
        local, shape = ref._local_tensor, tuple(ref.shape)
    else:
        raise LayoutError(
            f"{name}: expected (local_tensor, global_shape, mesh, placements) or "
            f"(DTensorRef, mesh, placements), got {type(value).__name__}"
        )
    if not isinstance(local, torch.Tensor):
        raise LayoutError(f"{name}: the local tensor is a {type(local).__name__}, not a torch.Tensor")
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        placements = (placements,)
    return LocalShard(local, tuple(int(s) for s in shape), mesh, tuple(placements))


@dataclass(frozen=True)
class ConnectSpec:
    """Where one rank joins the refit communicator of one build (``epoch``)."""

    address: str
    port: int
    rank: int
    world_size: int
    epoch: int
    timeout_s: float
    mesh_offset: int = 0  # added to every rank of this actor's meshes
    mesh_size: int | None = None  # an engine's meshes must stay within its own shard
    label: str = ""
    backend: str = "gloo"
    # authenticates every value of this build's rendezvous; new every build, and handed over
    # only through the controller's own channel to the worker (an actor call, a pipe)
    secret: bytes | None = field(default=None, repr=False)
    # the controller's wall clock when it sent this call: a worker that starts it later than the
    # rendezvous lasts abandons it (``LateCall``), and one that starts it late waits only what is left
    sent_at: float | None = None
    # binds this build's sealed values to it: with the epoch, what a value's MAC covers besides
    # key and secret, so a value of another build under the same secret is refused
    nonce: bytes = b""


def call_deadline(sent_at: float | None, budget_s: float, what: str) -> float:
    """The ``time.monotonic()`` deadline of a call the controller sent at ``sent_at`` (its
    ``time.time()``) with ``budget_s`` to run; ``LateCall`` when that has already passed.

    A worker answers one call at a time, so a call can start long after it was sent; counting
    its budget from its start made a worker that was late once late for every build after.
    The hosts' clocks are assumed to agree to well under a rendezvous timeout (NTP does); a
    clock running behind the controller's only lengthens the wait to the full budget.
    """
    now = time.monotonic()
    if sent_at is None:
        return now + budget_s
    lag = time.time() - sent_at
    if lag > budget_s:
        raise LateCall(f"{what} started {lag:.1f}s after the controller sent it, past its {budget_s:g}s budget: "
                       "its peers have given up, so it is abandoned (this worker was busy, not frozen)")
    return now + budget_s - max(lag, 0.0)
