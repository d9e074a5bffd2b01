"""Checksums taken while packing and unpacking equal the checksum of the whole bucket."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.layout import Box
from refit.plan import Bucket, Op
from refit.transport import buckets
from refit.transport.buckets import ROW, ChecksumLedger, align, checksum, pack_bucket, unpack_bucket

DTYPES = ["float32", "bfloat16", "float16", "float64"]


@st.composite
def bucket_and_sources(draw):
    """A bucket of 1-4 ops (0-d to 3-d blocks, mixed dtypes) laid out as the planner does."""
    ops, offsets, src, pos = [], [], {}, 0
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(1, 48), min_size=0, max_size=3)))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        name = f"p{i}"
        src[name] = torch.randn(shape, generator=gen, dtype=torch.float64).to(getattr(torch, dtype))
        zeros = tuple(0 for _ in shape)
        op = Op(i, name, 0, 1, Box(zeros, shape, zeros, zeros), dtype, dtype, dtype)
        offsets.append(align(pos))
        ops.append(op)
        pos = offsets[-1] + op.nbytes
    return Bucket(1, 0, tuple(ops), tuple(offsets), pos), src


@settings(max_examples=200, deadline=None)
@given(found=bucket_and_sources(), piece=st.sampled_from([256, 768, 4096, 1 << 20]), fill=st.integers(0, 255))
def test_piecewise_checksums_equal_the_whole_bucket(found, piece, fill, monkeypatch_module):
    bucket, src = found
    monkeypatch_module.setattr(buckets, "PIECE_BYTES", piece)
    buf = torch.full((bucket.nbytes,), fill, dtype=torch.uint8)  # stale staging: gaps must be zeroed
    ledger = ChecksumLedger()
    pack_bucket(bucket, src, buf, ledger=ledger, key=(1, 0))
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    unpack_bucket(bucket, buf, dst, ledger=ledger, key=(0, 0))
    sent, received = ledger.settle()
    assert sent == {(1, 0): checksum(buf)}
    assert received == {(0, 0): checksum(buf)}
    assert all(torch.equal(dst[n], src[n]) for n in src)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 5 * ROW), where=st.integers(0, 10**6), shift=st.integers(1, 4))
def test_a_flipped_byte_or_a_displaced_row_changes_the_checksum(n, where, shift):
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8)
    flipped = buf.clone()
    flipped[where % n] ^= 1 << (where % 8)
    assert checksum(flipped) != checksum(buf)
    rows = -(-n // ROW)
    if rows > 1:  # the first row swapped with another one: what a chunk written at the wrong offset does
        padded = torch.zeros(rows * ROW, dtype=torch.uint8)
        padded[:n] = buf
        target = (shift % (rows - 1) + 1) * ROW
        swapped = padded.clone()
        swapped[target: target + ROW], swapped[:ROW] = padded[:ROW], padded[target: target + ROW]
        first, other = padded[:ROW].view(torch.int64).sum(), padded[target: target + ROW].view(torch.int64).sum()
        if first != other:  # rows of equal sums swap unseen: the checksum is linear in the row sums
            assert checksum(swapped) != checksum(padded)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3 * ROW), min_size=1, max_size=4), st.data())
def test_block_checksums_agree_and_catch_a_flip_or_a_swap(sizes, data):
    """A bucket summed block by block (the IPC path packs nothing): the same bytes give the
    same value on both ends; a flipped bit, or two blocks exchanged, change it."""
    blocks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]

    def value(bufs):
        ledger = ChecksumLedger()
        ledger.blocks((1, 0), bufs, sent=True)
        ledger.blocks((0, 0), [b.clone() for b in bufs], sent=False)
        sent, received = ledger.settle()
        assert sent[(1, 0)] == received[(0, 0)]
        return sent[(1, 0)]

    base = value(blocks)
    i = data.draw(st.integers(0, len(blocks) - 1))
    j = data.draw(st.integers(0, blocks[i].numel() - 1))
    flipped = [b.clone() for b in blocks]
    flipped[i][j] ^= 1 << data.draw(st.integers(0, 7))
    assert value(flipped) != base
    if len(blocks) > 1 and not torch.equal(blocks[0], blocks[1]) and sizes[0] == sizes[1]:
        assert value([blocks[1], blocks[0], *blocks[2:]]) != base
