"""Ops and buckets: one block of one param between two ranks, and a pair's ops packed into buffers.

Both ends of a transfer cut the same buckets without talking: a pair's ops are sorted by
(param, block) and packed greedily, each op aligned to its element size so it can be viewed
in place. Task ids are digests of (param, destination rank, block), so adding ranks never
renumbers the ops that already existed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from refit.layout import Box, dtype_from_name

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_DIRECT_BYTES = 64 << 10  # smaller blocks are cheaper packed than sent alone (measured on gloo)

_ITEMSIZES: dict[str, int] = {}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in rosters (cached: the planner asks per op)."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = dtype_from_name(dtype).itemsize
    return size


def wire_dtype(src: str, dst: str) -> str:
    """The narrower of the two: narrowing casts happen while packing, widening on unpack,
    so the wire never carries more bytes than the narrower side needs."""
    if src == dst:
        return src
    return dst if dtype_from_name(dst).itemsize <= dtype_from_name(src).itemsize else src


def task_id(name: str, dst: int, start: Sequence[int], shape: Sequence[int]) -> int:
    h = hashlib.blake2b(f"{name}|{dst}|{tuple(start)}|{tuple(shape)}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Cut ``box`` into row blocks of at most ``limit`` bytes (rectangular, so every piece
    stays one strided view on both sides). A piece can only exceed ``limit`` if one
    element does."""
    if box.numel * itemsize <= limit or box.numel == 0:
        return [box]
    for d in range(len(box.shape)):
        inner = math.prod(box.shape[d + 1:]) * itemsize
        if inner <= limit and box.shape[d] > 1:
            step = max(1, limit // inner)
            out = []
            for a in range(0, box.shape[d], step):
                n = min(step, box.shape[d] - a)
                out.append(_shift(box, d, a, n))
            return out
        if box.shape[d] > 1:
            return [p for a in range(box.shape[d]) for p in split_box(_shift(box, d, a, 1), itemsize, limit)]
    return [box]


def _shift(box: Box, d: int, offset: int, length: int) -> Box:
    def bump(t):
        return tuple(x + offset if i == d else x for i, x in enumerate(t))

    shape = tuple(length if i == d else n for i, n in enumerate(box.shape))
    return Box(bump(box.start), shape, bump(box.src_start), bump(box.dst_start))


@dataclass(frozen=True)
class Op:
    """One block of one param moving from ``src`` to ``dst`` (the same rank for a local copy)."""

    task_id: int
    name: str
    src: int
    dst: int
    box: Box
    src_dtype: str
    dst_dtype: str
    wire_dtype: str
    direct: bool = False  # contiguous in both local tensors, no cast: can skip staging

    @cached_property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.wire_dtype)

    @classmethod
    def planned(cls, task_id: int, name: str, src: int, dst: int, box: Box, src_dtype: str, dst_dtype: str,
                wire_dtype: str, direct: bool, nbytes: int) -> Op:
        """The planner's constructor: the same fields and ``nbytes``, set in one step. The
        dataclass's own ``__init__`` sets a frozen record's fields one at a time, and a
        1T-parameter fleet's plans make millions of ops."""
        op = object.__new__(cls)
        op.__dict__.update(task_id=task_id, name=name, src=src, dst=dst, box=box, src_dtype=src_dtype,
                           dst_dtype=dst_dtype, wire_dtype=wire_dtype, direct=direct, nbytes=nbytes)
        return op

    def sort_key(self):
        return (self.name, self.box.start)


@dataclass(frozen=True)
class Bucket:
    """Ops between one pair of ranks packed into one buffer; ``index`` is its round."""

    peer: int
    index: int
    ops: tuple[Op, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops)


def contiguous(box_shape: Sequence[int], tensor_shape: Sequence[int]) -> bool:
    """Whether a block is one contiguous run of a C-contiguous tensor of ``tensor_shape``."""
    d = 0
    while d < len(box_shape) and box_shape[d] == 1:
        d += 1
    return all(box_shape[e] == tensor_shape[e] for e in range(d + 1, len(box_shape)))


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def pack_buckets(ops: Sequence[Op], peer: int, bucket_bytes: int, direct_bytes: int | None = None) -> list[Bucket]:
    """Greedy packing of one pair's ops, in canonical order, into buckets of at most
    ``bucket_bytes``; each op aligned to its element size so it can be viewed in place.

    An op of at least ``direct_bytes`` that is contiguous on both ends with no cast gets
    a bucket of its own, after the packed ones: the transport then sends it from, and
    receives it into, the tensors themselves, and the copies in and out of staging (the
    largest cost on a CPU host) disappear for the bulk of a model's bytes. A block that
    only one end holds contiguous stays packed: alone, its staged end would take a round
    of its own, and many medium blocks would then move one round trip at a time.
    """
    direct_bytes = DEFAULT_DIRECT_BYTES if direct_bytes is None else direct_bytes
    ordered = sorted(ops, key=Op.sort_key)
    alone = [op for op in ordered if op.direct and op.nbytes >= direct_bytes]
    packed = [op for op in ordered if not (op.direct and op.nbytes >= direct_bytes)]
    buckets: list[Bucket] = []
    cur_ops: list[Op] = []
    cur_offsets: list[int] = []
    size = 0
    for op in packed:
        at = _align(size, itemsize(op.wire_dtype))
        if cur_ops and at + op.nbytes > bucket_bytes:
            buckets.append(Bucket(peer, len(buckets), tuple(cur_ops), tuple(cur_offsets), size))
            cur_ops, cur_offsets, at = [], [], 0
        cur_ops.append(op)
        cur_offsets.append(at)
        size = at + op.nbytes
    if cur_ops:
        buckets.append(Bucket(peer, len(buckets), tuple(cur_ops), tuple(cur_offsets), size))
    for op in alone:
        buckets.append(Bucket(peer, len(buckets), (op,), (0,), op.nbytes))
    return buckets


