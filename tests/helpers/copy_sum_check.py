"""Run in a subprocess with ``TRITON_INTERPRET=1`` (or on a GPU): the fused copy-and-checksum kernel
against the unfused checksums of ``ChecksumLedger``, bit for bit, on blocks of every layout it takes.

Prints one line per case and ``copy_sum: ok`` at the end; any difference raises.
"""

from __future__ import annotations

import sys

import torch

from refit.transport.buckets import ChecksumLedger, flat_bytes
from refit.transport.copy_sum import CopySumBatch, NotFusable


def blocks_of(device: torch.device, gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, source view, destination view) pairs of one shape and dtype, over several layouts."""
    def rand(shape, dtype):
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype).to(device)
        return torch.randint(-(1 << 30), 1 << 30, shape, generator=gen, dtype=torch.int64).to(dtype).to(device)

    out = []
    big_src, big_dst = rand((96, 3072), torch.bfloat16), torch.zeros(96, 6144, dtype=torch.bfloat16, device=device)
    out.append(("contiguous -> column half (runs of 6 KiB)", big_src, big_dst[:, 3072:]))
    wide = rand((40, 8192), torch.bfloat16)
    out.append(("column quarter (runs of 4 KiB) -> contiguous", wide[:, 2048:4096],
                torch.zeros(40, 2048, dtype=torch.bfloat16, device=device)))
    narrow = rand((300, 512), torch.float32)
    out.append(("column slice (runs of 512 B) -> column slice", narrow[:, 128:256],
                torch.zeros(300, 384, dtype=torch.float32, device=device)[:, 256:384]))
    out.append(("row slice, odd rows -> contiguous", narrow[7:301], torch.zeros(293, 512, dtype=torch.float32,
                                                                              device=device)))
    stacked = rand((4, 48, 1024), torch.bfloat16)
    out.append(("3-d, inner dims cut -> 3-d", stacked[:, :, 256:768],
                torch.zeros(4, 48, 512, dtype=torch.bfloat16, device=device)))
    out.append(("tiny (8 bytes)", rand((4,), torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16, device=device)))
    out.append(("int8, last row partial", rand((5000,), torch.int8), torch.zeros(5000, dtype=torch.int8,
                                                                                  device=device)))
    return out


def check_blocks(device: torch.device, gen: torch.Generator) -> None:
    """Each block its own stream (the IPC form): copies and sums equal the ledger's ``blocks``."""
    pairs = blocks_of(device, gen)
    for copy in (True, False):
        batch = CopySumBatch(device)
        streams = []
        for _, src, dst in pairs:
            s = batch.stream(src.numel() * src.element_size())
            batch.add(s, 0, src, dst if copy else None)
            streams.append(s)
        for d in [dst for _, _, dst in pairs]:
            d.zero_()
        batch.launch()
        fused, plain = ChecksumLedger(), ChecksumLedger()
        fused.summed_blocks((1, 0), batch, streams, sent=False)
        plain.blocks((1, 0), [flat_bytes(src.contiguous()) for _, src, _ in pairs], sent=False)
        for (label, src, dst), s in zip(pairs, streams):
            one_f, one_p = ChecksumLedger(), ChecksumLedger()
            one_f.summed((0, 0), batch, s, sent=True)
            one_p.summer((0, 0), flat_bytes(src.contiguous()), src.numel() * src.element_size(), sent=True).upto(
                src.numel() * src.element_size())
            if one_f.settle() != one_p.settle():
                raise AssertionError(f"{label}: fused checksum {one_f.settle()} != unfused {one_p.settle()}")
            if copy and not torch.equal(dst, src):
                raise AssertionError(f"{label}: the fused copy differs from its source")
            print(f"copy={copy} {label}: equal")
        if fused.settle() != plain.settle():
            raise AssertionError(f"copy={copy}: the blocks form differs")


def check_packed(device: torch.device, gen: torch.Generator) -> None:
    """Blocks at 256-byte offsets of one packed bucket (gaps zero): sums equal the packed buffer's."""
    pairs = blocks_of(device, gen)
    offsets, pos = [], 0
    for _, src, _ in pairs:
        offsets.append(pos)
        pos = -(-(pos + src.numel() * src.element_size() + 24) // 256) * 256  # a gap after each
    nbytes = pos + 100 * 8
    buf = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)  # gaps: whatever staging held
    batch = CopySumBatch(device)
    s = batch.stream(nbytes)
    for (_, src, _), off in zip(pairs, offsets):
        n = src.numel() * src.element_size()
        batch.add(s, off, src, buf[off:off + n].view(src.dtype).view(src.shape))
    gaps = torch.ones(nbytes, dtype=torch.bool, device=device)
    for (_, src, _), off in zip(pairs, offsets):
        gaps[off:off + src.numel() * src.element_size()] = False
    buf[gaps] = 0  # a packer zeroes its gaps; the kernel sums them as zeros either way
    batch.launch()
    fused, plain = ChecksumLedger(), ChecksumLedger()
    fused.summed((0, 3), batch, s, sent=True)
    plain.summer((0, 3), buf, nbytes, sent=True).upto(nbytes)
    if fused.settle() != plain.settle():
        raise AssertionError(f"packed bucket: fused {fused.settle()} != unfused {plain.settle()}")
    for (label, src, _), off in zip(pairs, offsets):
        n = src.numel() * src.element_size()
        if not torch.equal(buf[off:off + n], flat_bytes(src.contiguous())):
            raise AssertionError(f"packed bucket: {label} landed wrong")
    print("packed bucket with gaps: equal")


def check_refusals(device: torch.device) -> None:
    batch = CopySumBatch(device)
    s = batch.stream(4096)
    odd = torch.zeros(20, dtype=torch.bfloat16, device=device)
    for label, src, dst in [("6-byte block", odd[:3], odd[3:6]), ("misaligned start", odd[1:5], odd[8:12]),
                            ("dtype differs", odd[:4], torch.zeros(4, dtype=torch.float16, device=device))]:
        try:
            batch.add(s, 0, src, dst)
        except NotFusable:
            print(f"refused: {label}")
        else:
            raise AssertionError(f"{label} was accepted")


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    gen = torch.Generator().manual_seed(7)
    check_blocks(device, gen)
    check_packed(device, gen)
    check_refusals(device)
    print("copy_sum: ok")


if __name__ == "__main__":
    main()
