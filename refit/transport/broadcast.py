"""The collective baseline: every source shard broadcast to every rank, which keeps its part.

This is what most RL frameworks do at every refit (gather each full tensor, broadcast it
to every engine rank), and it is the reference every shard-to-shard result is checked
against: simple on purpose. It is one executor like the others, so the synchronizers and
``xferdtensor_golden`` run it through the same contract.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from refit.layout import Region, dtype_from_name, intersect_regions, region_shape
from refit.plan import ParamIndex, source_shards
from refit.transport.base import Corruption, Executor, TensorMap, TransferStats, device_of
from refit.transport.buckets import ChecksumLedger, flat_bytes

BROADCAST = -1  # the "peer" of a bucket that is sent to every rank at once


@dataclass(frozen=True)
class BroadcastItem:
    """One broadcast: one source shard of one param, from its root (the shard's first replica)."""

    index: int
    name: str
    root: int
    region: Region
    shape: tuple[int, ...]
    dtype: str
    dst_region: Region | None  # this rank's part, when it is a destination of the param

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class BroadcastPlan:
    """Every rank's copy of one canonical schedule: params by name, source shards in mesh order."""

    rank: int
    items: tuple[BroadcastItem, ...]

    @staticmethod
    def build(index: ParamIndex, rank: int) -> BroadcastPlan:
        items: list[BroadcastItem] = []
        for name in sorted(index.specs):
            spec = index.specs[name]
            dst_region = None
            for lay in spec.dsts:
                if lay.coords(rank) is not None:
                    dst_region = lay.region(spec.shape, rank)
            # a param every engine keeps in FP8 leaves its trainer ranks quantized: FP8 on the wire
            wire = spec.src.dtype
            dst_dtypes = {lay.dtype for lay in spec.dsts}
            if len(dst_dtypes) == 1 and min(dst_dtypes).startswith("float8"):
                wire = min(dst_dtypes)
            for root, region in source_shards(spec):
                shape = region_shape(region)
                if math.prod(shape) == 0:
                    continue
                items.append(BroadcastItem(len(items), name, root, region, shape, wire, dst_region))
        return BroadcastPlan(rank, tuple(items))

    @property
    def bytes_sent(self) -> int:
        return sum(it.nbytes for it in self.items if it.root == self.rank)

    @property
    def bytes_received(self) -> int:
        return sum(it.nbytes for it in self.items if it.root != self.rank)

    def params_by_bucket(self) -> tuple[dict[tuple[int, int], list[str]], dict[tuple[int, int], list[str]]]:
        """(params of each bucket this rank sends, of each it receives), keyed as the checksums are."""
        sent, received = {}, {}
        for it in self.items:
            if it.root == self.rank:
                sent[(BROADCAST, it.index)] = [it.name]
            else:
                received[(it.root, it.index)] = [it.name]
        return sent, received


class BroadcastExecutor(Executor):
    """Runs a ``BroadcastPlan``: one broadcast per source shard, each rank keeping its part."""

    transport = "broadcast"

    def __init__(self, plan: BroadcastPlan, comm):
        super().__init__(plan, comm)
        self._device = torch.device("cpu")

    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        self._device = device_of(src, dst)

    def _run(self, *, verify: bool, corrupt: Corruption | None) -> TransferStats:
        stats = TransferStats()
        ledger = ChecksumLedger() if verify else None
        t0 = time.perf_counter()
        rank = self.comm.rank
        for item in self.plan.items:
            root = rank == item.root
            dtype = dtype_from_name(item.dtype)
            if root:
                buf = self.src[item.name].to(dtype).contiguous()  # FP8 of a plain cast: narrowed here
                if corrupt is not None:
                    buf = buf.clone()
            else:
                buf = torch.empty(item.shape, dtype=dtype, device=self._device)
            raw = flat_bytes(buf)
            if root:
                if ledger is not None:
                    ledger.sent((BROADCAST, item.index), raw)
                if corrupt is not None:
                    corrupt(BROADCAST, item.index, raw)
            self.comm.broadcast(raw, item.root)  # as bytes: gloo has no FP8 dtypes
            if root:
                stats.bytes_sent += raw.numel()
                stats.buckets_sent += 1
            else:
                if ledger is not None:
                    ledger.received((item.root, item.index), raw)
                stats.bytes_received += raw.numel()
                stats.buckets_received += 1
            if item.dst_region is not None:
                out = self.dst[item.name]
                for box in intersect_regions(item.region, item.dst_region):
                    out[box.dst_slices()].copy_(buf[box.src_slices()])
        if ledger is not None:
            stats.checksums_sent, stats.checksums_received = ledger.settle()
        stats.seconds = time.perf_counter() - t0
        return stats


__all__ = ["BROADCAST", "BroadcastExecutor", "BroadcastItem", "BroadcastPlan"]
