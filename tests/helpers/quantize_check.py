"""Run in a subprocess with ``TRITON_INTERPRET=1`` (or on a GPU): the one-pass FP8 kernel against
``quantize_reference``, bit for bit, for whole and ragged blocks, stacks and given factors.

Prints one line per case and ``quantize: ok`` at the end; any difference raises.
"""

from __future__ import annotations

import sys

import torch

from refit.models.fp8 import block_amax, factors_from_amax, quantize_reference
from refit.plan.quant import BlockFp8
from refit.transport.quantize_gpu import (
    GroupedQuantizer,
    LaunchGraphs,
    QuantizeItem,
    block_amax_one_pass,
    one_pass_ready,
    quantize_own_blocks,
    quantize_with_factors,
)


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    gen = torch.Generator().manual_seed(3)
    cases = [((256, 384), torch.bfloat16, BlockFp8()), ((300, 200), torch.bfloat16, BlockFp8()),
             ((2, 130, 260), torch.float32, BlockFp8()), ((128, 128), torch.bfloat16, BlockFp8(fmt="e5m2")),
             ((64, 96), torch.bfloat16, BlockFp8(block=(32, 32)))]
    for shape, dtype, fmt in cases:
        x = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) * 4).to(dtype)
        x[..., :3, :5] = 0  # an all-zero corner, and blocks of very different ranges
        x[..., -1, -1] = 448.0 * 3
        x = x.to(device)
        assert one_pass_ready(x, fmt), f"{shape} {dtype} should take the one-pass kernel"
        want_q, want_s = quantize_reference(x.cpu(), fmt)
        # Triton's CPU interpreter emulates the FP8 cast without rounding to nearest even (10.5 -> 11,
        # 126.9 -> 64), so there the kernel writes the float32 values it would cast and torch casts
        # them; on a GPU the kernel's own cast is checked
        exact = device.type == "cuda"
        q = torch.empty(shape, dtype=want_q.dtype if exact else torch.float32, device=device)
        s = torch.empty(want_s.shape, dtype=torch.float32, device=device)
        quantize_own_blocks(x, q, s, fmt)
        q = q if exact else q.to(want_q.dtype)
        if not torch.equal(s.cpu(), want_s):
            raise AssertionError(f"{shape} {dtype} {fmt}: the scales differ from quantize_reference")
        differ = q.cpu().view(torch.uint8) != want_q.view(torch.uint8)
        if differ.any():
            raise AssertionError(f"{shape} {dtype} {fmt}: {int(differ.sum())} FP8 elements differ")
        amax = block_amax_one_pass(x, fmt)
        if not torch.equal(amax.cpu(), block_amax(x.cpu(), fmt)):
            raise AssertionError(f"{shape}: the one-pass amax differs from block_amax")
        q2 = torch.empty(shape, dtype=want_q.dtype if exact else torch.float32, device=device)
        quantize_with_factors(x, factors_from_amax(amax, fmt), q2, fmt)
        q2 = q2 if exact else q2.to(want_q.dtype)
        if not torch.equal(q2.view(torch.uint8), q.view(torch.uint8)):
            raise AssertionError(f"{shape}: the given-factors pass differs from the own-blocks pass")
        print(f"{list(shape)} {dtype} {fmt.fmt} {fmt.block}: equal to quantize_reference")
    check_grouped(device, gen)
    check_replay(device, gen)
    print("quantize: ok")


def check_grouped(device: torch.device, gen: torch.Generator) -> None:
    """Shards of several shapes in one grouped launch, own scales and given factors mixed."""
    fmt = BlockFp8()
    quantizer = GroupedQuantizer(fmt)
    exact = device.type == "cuda"
    shapes = [(256, 384), (300, 200), (2, 130, 260), (128, 128)]
    xs = [(torch.randn(s, generator=gen) * 3).to(torch.bfloat16).to(device) for s in shapes]
    want = [quantize_reference(x.cpu(), fmt) for x in xs]
    outs = [torch.empty(s, dtype=torch.float8_e4m3fn if exact else torch.float32, device=device) for s in shapes]
    grids = []
    for i, x in enumerate(xs):
        own = i % 2 == 0
        grids.append(torch.empty(fmt.scale_shape(x.shape), dtype=torch.float32, device=device) if own
                     else factors_from_amax(block_amax(x, fmt), fmt).contiguous())
    items = [QuantizeItem(x, o, g, i % 2 == 0) for i, (x, o, g) in enumerate(zip(xs, outs, grids))]
    for _ in range(2):  # the second launch reuses the tables
        quantizer(items)
    for i, (o, g, (wq, ws)) in enumerate(zip(outs, grids, want)):
        q = o if exact else o.to(wq.dtype)
        if not torch.equal(q.cpu().view(torch.uint8), wq.view(torch.uint8)):
            raise AssertionError(f"grouped shard {i} {shapes[i]}: FP8 elements differ")
        if i % 2 == 0 and not torch.equal(g.cpu(), ws):
            raise AssertionError(f"grouped shard {i} {shapes[i]}: scales differ")
    print(f"grouped launch of {len(items)} shards (own scales and given factors): equal to quantize_reference")


class CountingGraphs(LaunchGraphs):
    """On a GPU real CUDA graphs, counted; on the CPU a stand-in whose replay runs the captured
    launches (no graphs there), so the choice between replay and eager launches is checked alike."""

    def __init__(self, fail: bool = False):
        self.captures, self.replays, self.fail = 0, 0, fail

    def capture(self, device, launch):
        self.captures += 1
        if self.fail:
            return None
        replay = super().capture(device, launch) if device.type == "cuda" else launch
        if replay is None:
            raise AssertionError("the launches could not be captured as a CUDA graph")

        def counted():
            self.replays += 1
            replay()
        return counted


def check_replay(device: torch.device, gen: torch.Generator) -> None:
    """A set of shards runs eagerly first, is captured at its second call and replayed from then on,
    with the bits of the reference for inputs rewritten in place between calls; tensors at other
    addresses (or of another shape) run eagerly, and a set whose capture failed is never replayed."""
    fmt = BlockFp8()
    exact = device.type == "cuda"
    out_dtype = torch.float8_e4m3fn if exact else torch.float32
    shapes = [(256, 384), (2, 130, 260)]
    xs = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    outs = [torch.empty(s, dtype=out_dtype, device=device) for s in shapes]
    grids = [torch.empty(fmt.scale_shape(s), dtype=torch.float32, device=device) for s in shapes]
    graphs = CountingGraphs()
    quantizer = GroupedQuantizer(fmt, graphs)

    def refit(items, xs, outs, grids):
        for x in xs:  # new weights in the same tensors, as after an optimizer step
            x.copy_((torch.randn(x.shape, generator=gen) * torch.rand(x.shape, generator=gen) * 8).to(x.dtype))
        quantizer(items)
        if exact:
            torch.cuda.synchronize(device)
        for i, (x, o, g) in enumerate(zip(xs, outs, grids)):
            wq, ws = quantize_reference(x.cpu(), fmt)
            q = o if exact else o.to(wq.dtype)
            if not torch.equal(q.cpu().view(torch.uint8), wq.view(torch.uint8)) or not torch.equal(g.cpu(), ws):
                raise AssertionError(f"replayed shard {i} {list(x.shape)}: differs from quantize_reference")

    items = [QuantizeItem(x, o, g, True) for x, o, g in zip(xs, outs, grids)]
    refit(items, xs, outs, grids)
    if (graphs.captures, graphs.replays) != (0, 0):
        raise AssertionError("a set seen for the first time must run eagerly (its kernels compile then)")
    for n in range(1, 4):
        refit(items, xs, outs, grids)
        if (graphs.captures, graphs.replays) != (1, n):
            raise AssertionError(f"call {n + 1}: {graphs.captures} captures, {graphs.replays} replays; want 1, {n}")
    # the same shapes at other addresses: not the captured set, so eager (then captured in turn)
    xs2, outs2 = [x.clone() for x in xs], [o.clone() for o in outs]
    grids2 = [g.clone() for g in grids]
    refit([QuantizeItem(x, o, g, True) for x, o, g in zip(xs2, outs2, grids2)], xs2, outs2, grids2)
    if (graphs.captures, graphs.replays) != (1, 3):
        raise AssertionError("tensors at other addresses replayed a graph captured for others")
    # one shard of another shape at the captured addresses: eager as well
    short = [xs[0][:128]]
    refit([QuantizeItem(short[0], outs[0][:128], grids[0][:1], True)], short, [outs[0][:128]], [grids[0][:1]])
    if (graphs.captures, graphs.replays) != (1, 3):
        raise AssertionError("a shard of another shape at a captured address replayed the graph")
    failing = CountingGraphs(fail=True)
    quantizer = GroupedQuantizer(fmt, failing)
    for _ in range(3):
        refit(items, xs, outs, grids)
    if (failing.captures, failing.replays) != (1, 0):
        raise AssertionError("a set whose capture failed must run eagerly, and not be captured again")
    print(f"replay: captured at the second call, {graphs.replays} replays equal to quantize_reference")


if __name__ == "__main__":
    main()
