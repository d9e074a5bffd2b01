"""Triton kernels of the GPU paths: a copy and its checksum in one pass over memory.

Imported only where Triton is (``refit.transport.copy_sum`` decides); the CPU paths never
load it. The kernels also run under ``TRITON_INTERPRET=1`` on the CPU, which is how the
suite checks them bit for bit against the unfused checksums on a machine without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

# one row of a checksum stream (refit.transport.buckets.ROW), as 512 int64 words
ROW_BYTES: tl.constexpr = tl.constexpr(4096)
ROW_WORDS: tl.constexpr = tl.constexpr(512)
# a descriptor of one block: int64 fields, in this order
DESC_FIELDS = 10


@triton.jit
def _byte_offsets(p0, j8, run, stride, SHORT_RUNS: tl.constexpr):
    """Byte offsets, in one side's memory, of the words at block positions ``p0 + j8``.

    The side holds the block as runs of ``run`` contiguous bytes, ``stride`` bytes apart (a
    contiguous side has one run longer than the block). When every run is at least a row
    long, a row of the stream crosses at most one run boundary, so one division per row
    suffices; blocks with shorter runs take the kernel built with ``SHORT_RUNS``, which
    divides per word.
    """
    if SHORT_RUNS:
        p = tl.maximum(p0[:, None] + j8[None, :], 0)
        out = (p // run) * stride + p % run
    else:
        pc = tl.maximum(p0, 0)
        c = (pc % run)[:, None] + (p0 - pc)[:, None] + j8[None, :]
        wrap = (c >= run).to(tl.int64)
        out = ((pc // run)[:, None] + wrap) * stride + c - wrap * run
    return out


@triton.jit
def copy_sum_kernel(desc_ptr, tile_block_ptr, tile_row_ptr, sums_ptr, ROWS: tl.constexpr,
                    SHORT_RUNS: tl.constexpr):
    """One tile: ``ROWS`` rows of one block's checksum stream, copied (a block with a destination) and summed.

    A block sits at byte ``lo`` of its stream (a packed bucket, or the block alone); its
    words are read once, written once, and each row's int64 sum is added atomically into
    the stream's row sums (a row shared by two blocks gets both; a gap adds nothing), so
    every word is summed exactly as ``torch.sum`` over the packed bytes sums it.
    """
    tile = tl.program_id(0)
    block = tl.load(tile_block_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_row_ptr + tile)
    d = desc_ptr + block * 10
    src = tl.load(d + 0).to(tl.pointer_type(tl.int64))
    dst_address = tl.load(d + 1)
    lo = tl.load(d + 2)
    nbytes = tl.load(d + 3)
    src_run = tl.load(d + 4)
    src_stride = tl.load(d + 5)
    dst_run = tl.load(d + 6)
    dst_stride = tl.load(d + 7)
    sums_base = tl.load(d + 8)
    rows_end = tl.load(d + 9)
    rows = row0 + tl.arange(0, ROWS)
    j8 = tl.arange(0, ROW_WORDS).to(tl.int64) * 8
    p0 = rows * ROW_BYTES - lo
    p = p0[:, None] + j8[None, :]
    mask = (p >= 0) & (p < nbytes)
    words = tl.load(src + (_byte_offsets(p0, j8, src_run, src_stride, SHORT_RUNS) >> 3), mask=mask, other=0)
    if dst_address != 0:
        dst = dst_address.to(tl.pointer_type(tl.int64))
        tl.store(dst + (_byte_offsets(p0, j8, dst_run, dst_stride, SHORT_RUNS) >> 3), words, mask=mask)
    tl.atomic_add(sums_ptr + sums_base + rows, tl.sum(words, axis=1), mask=rows < rows_end, sem="relaxed")




# what block_quantize_kernel does with a block (MODE)
QUANTIZE_OWN = 0  # amax, scale and FP8 weight from the block alone
QUANTIZE_WITH_FACTORS = 1  # FP8 weight from a given factor per block (a merged amax)
AMAX_ONLY = 2  # the block's amax alone


@triton.jit
def block_quantize_kernel(x_ptr, q_ptr, grid_ptr, rows, cols, n_block_rows, n_block_cols,
                          fp8_max, min_amax, BR: tl.constexpr, BC: tl.constexpr, MODE: tl.constexpr):
    """One block of a contiguous ``[lead, rows, cols]`` shard whose blocks start at its origin.

    The block is read once: its amax (exact in any order), then ``scale_inv = max(amax,
    MIN_AMAX) / fp8_max`` and ``factor = fp8_max / max(amax, MIN_AMAX)``, each one correctly
    rounded division, and every element ``clamp(x * factor)`` cast to FP8 with rounding to
    nearest even: the bits ``refit.models.fp8.quantize_reference`` gives. ``grid`` is the
    scale grid written (own blocks), the factors read (given factors), or the amaxes written.
    """
    lead_block_row = tl.program_id(0)
    block_col = tl.program_id(1)
    lead = lead_block_row // n_block_rows
    block_row = lead_block_row % n_block_rows
    r = block_row * BR + tl.arange(0, BR)
    c = block_col * BC + tl.arange(0, BC)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    offs = lead.to(tl.int64) * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
    g = (lead.to(tl.int64) * n_block_rows + block_row) * n_block_cols + block_col
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:
        factor = tl.load(grid_ptr + g)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        if MODE == 2:
            tl.store(grid_ptr + g, amax)
        else:
            clamped = tl.maximum(amax, min_amax)
            tl.store(grid_ptr + g, tl.math.div_rn(clamped, fp8_max))
            factor = tl.math.div_rn(fp8_max, clamped)
    if MODE != 2:
        q = tl.minimum(tl.maximum(x * factor, -fp8_max), fp8_max)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


__all__ = ["AMAX_ONLY", "DESC_FIELDS", "QUANTIZE_OWN", "QUANTIZE_WITH_FACTORS", "block_quantize_kernel",
           "copy_sum_kernel"]
