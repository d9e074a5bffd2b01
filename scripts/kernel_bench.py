"""The GPU kernels of a verified refit, alone, on the 8B model's bytes: copy, checksum, FP8 quantize.

    python scripts/kernel_bench.py [--json]

Times, on one GPU, a trainer TP2 shard set of Llama-3-8B (bf16) copied into an engine's TP1
tensors as an IPC receiver copies them (every block its own checksum stream): the flat copy
of the same bytes (the limit), the copy then a checksum pass per block (unfused), the copy
and checksum in one kernel (fused), the checksum alone; and the FP8 quantization of the
same linear weights in eager torch, compiled, and in one Triton pass. Median of 10 after 2
warm-ups, CUDA events.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from refit.models.fp8 import quantize_aligned
from refit.models.specs import get_model
from refit.plan.quant import BlockFp8
from refit.transport.buckets import ChecksumLedger, flat_bytes
from refit.transport.copy_sum import CopySumBatch
from refit.transport.quantize_gpu import GroupedQuantizer, QuantizeItem, quantize_own_blocks


def timed(fn, iters: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def llama_blocks(device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """(source shard, destination view) of rank 0 of a TP2 trainer into a TP1 engine, and the linear weights."""
    spec = get_model("llama3-8b")
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    kv = spec.num_kv_heads * spec.head_dim
    pairs, linears = [], []
    shapes = [((h + 2 * kv, h), 0), ((h, h), 1), ((2 * i, h), 0), ((h, i), 1)]  # qkv, o, gate_up, down
    for _ in range(spec.num_layers):
        for (rows, cols), dim in shapes:
            full = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
            shard = torch.randn((rows // 2, cols) if dim == 0 else (rows, cols // 2), dtype=torch.bfloat16,
                                device=device)
            dst = full[: rows // 2] if dim == 0 else full[:, : cols // 2]
            pairs.append((shard, dst))
            linears.append(shard)
    for rows in (v, v):  # embedding and head, vocab-parallel
        full = torch.empty(rows, h, dtype=torch.bfloat16, device=device)
        shard = torch.randn(rows // 2, h, dtype=torch.bfloat16, device=device)
        pairs.append((shard, full[: rows // 2]))
    return pairs, linears


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    pairs, linears = llama_blocks(dev)
    nbytes = sum(s.numel() * 2 for s, _ in pairs)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    out = {"device": torch.cuda.get_device_name(0), "bytes": nbytes}
    out["flat_copy_s"] = timed(lambda: flat_dst.copy_(flat_src))

    def copies():
        for s, d in pairs:
            d.copy_(s)
    out["block_copies_s"] = timed(copies)

    def unfused():
        ledger = ChecksumLedger()
        copies()
        ledger.blocks((0, 0), [flat_bytes(s) for s, _ in pairs], sent=False)
        ledger.settle()
    out["copy_then_sum_s"] = timed(unfused)
    fused = CopySumBatch(dev)
    read = CopySumBatch(dev)
    streams = []
    for s, d in pairs:
        n = s.numel() * 2
        k = fused.stream(n)
        fused.add(k, 0, s, d)
        read.add(read.stream(n), 0, s)
        streams.append(k)
    fused.build()
    read.build()

    def fused_settled():
        fused.launch()
        ledger = ChecksumLedger()
        ledger.summed_blocks((0, 0), fused, streams, sent=False)
        ledger.settle()
    out["fused_copy_sum_s"] = timed(fused.launch)
    out["fused_copy_sum_settled_s"] = timed(fused_settled)
    out["sum_only_s"] = timed(read.launch)
    sweep = {}
    for rows in (2, 4, 8, 16):
        for warps in (4, 8):
            f2, r2 = CopySumBatch(dev, tile_rows=rows, num_warps=warps), CopySumBatch(dev, tile_rows=rows,
                                                                                      num_warps=warps)
            for s, d in pairs:
                n = s.numel() * 2
                f2.add(f2.stream(n), 0, s, d)
                r2.add(r2.stream(n), 0, s)
            f2.build()
            r2.build()
            sweep[f"{rows}x{warps}"] = (timed(f2.launch), timed(r2.launch))
            del f2, r2
    out["tile_sweep"] = sweep
    # the fused sums equal the unfused ones
    fused.launch()
    a, b = ChecksumLedger(), ChecksumLedger()
    a.summed_blocks((0, 0), fused, streams, sent=False)
    b.blocks((0, 0), [flat_bytes(s) for s, _ in pairs], sent=False)
    out["fused_sums_equal"] = a.settle() == b.settle()
    out["fused_copies_equal"] = all(torch.equal(s, d) for s, d in pairs)

    # a staged switch: the engine's whole tensors from their staging copies
    live = {id(d): d._base if d._base is not None else d for _, d in pairs}
    lives = list(live.values())
    stagings = [torch.randn_like(t) for t in lives]
    out["switch_bytes"] = sum(t.numel() * 2 for t in lives)
    out["switch_per_tensor_s"] = timed(lambda: [t.copy_(s) for t, s in zip(lives, stagings)])
    flat2 = torch.empty(out["switch_bytes"], dtype=torch.uint8, device=dev)
    flat3 = torch.empty_like(flat2)
    out["switch_flat_s"] = timed(lambda: flat3.copy_(flat2))

    fmt = BlockFp8()
    qbytes = sum(x.numel() * 2 for x in linears)
    outs = [torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=dev) for x in linears]
    scales = [torch.empty(fmt.scale_shape(x.shape), dtype=torch.float32, device=dev) for x in linears]
    out["quantize_bytes_in"] = qbytes
    out["quantize_eager_s"] = timed(lambda: [quantize_aligned(x, fmt) for x in linears], iters=3, warmup=1)

    def one_pass():
        for x, q, s in zip(linears, outs, scales):
            quantize_own_blocks(x, q, s, fmt)
    out["quantize_one_pass_s"] = timed(one_pass)
    grouped = GroupedQuantizer(fmt)
    items = [QuantizeItem(x, q, s, True) for x, q, s in zip(linears, outs, scales)]
    out["quantize_grouped_s"] = timed(lambda: grouped(items))

    def host_then_gpu(fn):  # wall time including the host's launches (what a refit waits for)
        import time as _t
        fn()
        torch.cuda.synchronize()
        t0 = _t.perf_counter()
        fn()
        torch.cuda.synchronize()
        return _t.perf_counter() - t0
    out["quantize_one_pass_wall_s"] = statistics.median(host_then_gpu(one_pass) for _ in range(5))
    out["quantize_grouped_wall_s"] = statistics.median(host_then_gpu(lambda: grouped(items)) for _ in range(5))
    amax_c = torch.compile(__import__("refit.models.fp8", fromlist=["aligned_amax"]).aligned_amax)
    qc = torch.compile(__import__("refit.models.fp8", fromlist=["quantize_aligned_with"]).quantize_aligned_with)
    out["quantize_compiled_s"] = timed(lambda: [quantize_aligned(x, fmt, amax_fn=amax_c, quantize_fn=qc)
                                                for x in linears])
    ref = [quantize_aligned(x, fmt) for x in linears[:8]]
    one_pass()
    out["quantize_equal"] = all(torch.equal(q.view(torch.uint8), r[0].view(torch.uint8)) and torch.equal(s, r[1])
                                for q, s, r in zip(outs, scales, ref))
    if args.json:
        print(json.dumps(out))
        return
    gb = nbytes / 1e9
    print(f"{out['device']}: {gb:.2f} GB of an 8B TP2 shard set into TP1 tensors")
    for k in ("flat_copy_s", "block_copies_s", "copy_then_sum_s", "fused_copy_sum_s", "fused_copy_sum_settled_s",
              "sum_only_s"):
        print(f"  {k:26} {out[k] * 1e3:8.2f} ms {gb / out[k]:8.0f} GB/s  {out['flat_copy_s'] / out[k]:.2f} of flat")
    print(f"  fused sums equal unfused: {out['fused_sums_equal']}, copies equal: {out['fused_copies_equal']}")
    print("  tiles (rows x warps): fused copy+sum ms / sum only ms: " + ", ".join(
        f"{k} {a * 1e3:.2f}/{b * 1e3:.2f}" for k, (a, b) in out["tile_sweep"].items()))
    sgb = out["switch_bytes"] / 1e9
    for k in ("switch_flat_s", "switch_per_tensor_s"):
        print(f"  {k:26} {out[k] * 1e3:8.2f} ms {sgb / out[k]:8.0f} GB/s  ({sgb:.2f} GB)")
    qgb = qbytes / 1e9
    for k in ("quantize_eager_s", "quantize_compiled_s", "quantize_one_pass_s", "quantize_grouped_s",
              "quantize_one_pass_wall_s", "quantize_grouped_wall_s"):
        print(f"  {k:26} {out[k] * 1e3:8.2f} ms {qgb / out[k]:8.0f} GB/s of bf16 in")
    print(f"  one-pass FP8 equals the eager quantizer: {out['quantize_equal']}")


if __name__ == "__main__":
    main()
