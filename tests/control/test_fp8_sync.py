"""Refits into FP8 engines through ``ReshardWeightSynchronizer``: quantized on the trainer ranks, bit-exact.

Trainer ranks hold bf16 shards whose boundaries cut scale blocks (uneven row and column
splits over three ranks); the engines keep two of the weights in block-scaled FP8 (with
their ``_scale_inv`` grids, which no trainer reports) and a norm in bf16. Every engine
element must equal the reference quantizer on the full tensor, refit after refit, and only
FP8 bytes and scales may cross the wire for the quantized weights.
"""

from __future__ import annotations

import pytest
import torch

import refit
from refit.control import RefitRefused
from refit.layout import Replicate, Shard, region_shape, shard_region
from refit.models.fp8 import quantize_reference
from refit.plan.quant import MERGE_AMAX_THEN_QUANTIZE, QUANTIZE_AT_PACK, BlockFp8, scale_name
from refit.runtime.endpoint import EngineEndpoint, TrainerEndpoint

FMT = BlockFp8((16, 16))
SHAPES = {"w1": (64, 40), "w2": (48, 50), "w3": (96, 40), "norm": (40,)}
# 3 ranks: w1 22/22/20 rows and w2 17/17/16 cols cut blocks; w3's 32 rows a rank hold whole ones
TRAIN = {"w1": Shard(0), "w2": Shard(1), "w3": Shard(0), "norm": Shard(0)}
ENGINE = {"w1": Shard(0), "w2": Replicate(), "w3": Shard(0), "norm": Replicate()}  # on block boundaries
QUANTIZED = ("w1", "w2", "w3")


def full(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    shape = SHAPES[name]
    x = torch.randn(shape, generator=g)
    if len(shape) == 2:  # magnitudes that differ by row, so cut blocks' amaxes differ between ranks
        x = x * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    return x.to(torch.bfloat16)


def take(t: torch.Tensor, region) -> torch.Tensor:
    for d, intervals in enumerate(region):
        t = t.index_select(d, torch.tensor([i for a, b in intervals for i in range(a, b)], dtype=torch.long))
    return t


class Trainer(TrainerEndpoint):
    refit_fp8_block = FMT.block

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.step = 0
        self.params = {}
        self.set_step(1)

    def set_step(self, step: int) -> None:
        for n, shape in SHAPES.items():
            region = shard_region(shape, [self.world], [self.rank], [TRAIN[n]])
            self.params[n] = take(full(n, step), region).contiguous()

    def refit_sources(self):
        return {n: (t, SHAPES[n], list(range(self.world)), [TRAIN[n]]) for n, t in self.params.items()}


class Fp8Engine(EngineEndpoint):
    refit_fp8_block = FMT.block

    def __init__(self, worker: int, workers: int):
        self.worker, self.workers = worker, workers
        self.mesh = list(range(workers))
        self.tensors = {}
        for n, shape in SHAPES.items():
            region = shard_region(shape, [workers], [worker], [ENGINE[n]])
            dtype = getattr(torch, FMT.dtype_name) if n in QUANTIZED else torch.bfloat16
            self.tensors[n] = (torch.zeros(region_shape(region), dtype=dtype), ENGINE[n])
            if n in QUANTIZED:
                grid = FMT.scale_shape(shape)
                sregion = shard_region(grid, [workers], [worker], [ENGINE[n]])
                self.tensors[scale_name(n)] = (torch.full(region_shape(sregion), float("nan")), ENGINE[n])

    def refit_destinations(self):
        shapes = {**SHAPES, **{scale_name(n): FMT.scale_shape(SHAPES[n]) for n in QUANTIZED}}
        return {n: (t, shapes[n], self.mesh, [p]) for n, (t, p) in self.tensors.items()}

    def wrong(self, step: int) -> list[str]:
        bad = []
        for n, shape in SHAPES.items():
            region = shard_region(shape, [self.workers], [self.worker], [ENGINE[n]])
            got = self.tensors[n][0]
            if n in QUANTIZED:
                q, s = quantize_reference(full(n, step), FMT)
                sregion = shard_region(s.shape, [self.workers], [self.worker], [ENGINE[n]])
                if not torch.equal(got.view(torch.uint8), take(q.view(torch.uint8), region)):
                    bad.append(n)
                if not torch.equal(self.tensors[scale_name(n)][0], take(s, sregion)):
                    bad.append(scale_name(n))
            elif not torch.equal(got, take(full(n, step), region)):
                bad.append(n)
        return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("synchronizer", ["reshard", "broadcast"])
def test_fp8_engines_get_bit_exact_weights_and_scales_refit_after_refit(synchronizer):
    """Shard to shard, and through the broadcast baseline (whose full source shards carry FP8 too)."""
    trainers = [Trainer(r, 3) for r in range(3)]
    engines = [[Fp8Engine(w, 2) for w in range(2)], [Fp8Engine(0, 1)]]
    cls = refit.ReshardWeightSynchronizer if synchronizer == "reshard" else refit.CollectiveWeightSynchronizer
    sync = cls(trainers, engines, refit_timeout_s=30.0)
    try:
        for step in (1, 2, 3):
            for t in trainers:
                t.set_step(step)
            result = sync.sync_weights()
            assert result.verified
            assert {id(e): e.wrong(step) for shard in engines for e in shard} == \
                {id(e): [] for shard in engines for e in shard}
        if synchronizer == "broadcast":
            return
        # what crossed: one byte per FP8 element, four per scale, two per bf16 norm element. Every
        # engine worker of shard 0 takes half of w1 and w3 and all of w2, shard 1's worker all of them
        fp8_bytes = 2 * 64 * 40 + 3 * 48 * 50 + 2 * 96 * 40
        scale_bytes = 4 * (2 * 4 * 3 + 3 * 3 * 4 + 2 * 6 * 3)  # w1's and w3's grids once a shard, w2's to every worker
        norm_bytes = 3 * 2 * 40
        assert result.bytes == fp8_bytes + scale_bytes + norm_bytes
        # w3's trainer ranks made the scales of their own blocks, each from its shard alone (its
        # grid's source is sharded like it); w1's and w2's merged the amaxes of their cut blocks
        for t in trainers:
            plan = t._refit_state().quantized.plan
            merged = MERGE_AMAX_THEN_QUANTIZE
            assert {op.name: op.mode for op in plan.ops} == {"w1": merged, "w2": merged, "w3": QUANTIZE_AT_PACK}
            assert plan.merged_amax_bytes == 4 * (4 * 3 + 3 * 4)  # w1's and w2's grids, not w3's
    finally:
        sync.shutdown()


@pytest.mark.timeout(120)
def test_an_fp8_shard_cut_inside_a_block_beside_scales_cut_on_blocks_is_refused_before_any_byte_moves():
    trainers = [Trainer(r, 3) for r in range(3)]
    engines = [[Fp8Engine(w, 3) for w in range(3)]]  # w1's 64 rows as 22/22/20: inside blocks 1 and 2
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0)
    try:
        # workers 1 and 2 (ranks 4, 5) both lack a scale: rows 22..44 beside the grid's rows 2..4, 44..64 beside none
        with pytest.raises(RefitRefused, match=r"w1: rank (4 receives rows \[\(22, 44\)\] of dim 0 \(64 long\) "
                                               r"but the scales of blocks \[\(2, 4\)\]|5 receives rows "
                                               r"\[\(44, 64\)\] of dim 0 \(64 long\) but the scales of blocks "
                                               r"\[\]) only; its FP8 shard needs the scale of every 16-block") as info:
            sync.sync_weights()
        # a configuration error, said as one: not a hunt for a frozen engine
        message = str(info.value)
        assert "A configuration error, not a lost engine" in message and "could be identified" not in message
        assert info.value.phase == "prepare" and not info.value.died
        assert all(not e.tensors["w1"][0].view(torch.uint8).any() for e in engines[0])  # nothing landed
    finally:
        sync.shutdown()
