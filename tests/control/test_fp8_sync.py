"""Refits into FP8 engines through ``ReshardWeightSynchronizer``: quantized on the trainer ranks, bit-exact.

Trainer ranks hold bf16 shards whose boundaries cut scale blocks (uneven row and column
splits over three ranks); the engines keep two of the weights in block-scaled FP8 (with
their ``_scale_inv`` grids, which no trainer reports) and a norm in bf16. Every engine
element must equal the reference quantizer on the full tensor, refit after refit, and only
FP8 bytes and scales may cross the wire for the quantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from helpers.layouts import local_region
from hypothesis import event, given, settings
from hypothesis import strategies as st

import refit
from refit.control import RefitRefused
from refit.layout import Replicate, Shard, region_shape, shard_region
from refit.models.fp8 import quantize_reference
from refit.plan.quant import MERGE_AMAX_THEN_QUANTIZE, QUANTIZE_AT_PACK, BlockFp8, scale_name, scale_placements
from refit.runtime.endpoint import TrainerEndpoint
from refit.runtime.engine_endpoint import EngineEndpoint
from refit.transport.nixl import nixl_available

FMT = BlockFp8((16, 16))
SHAPES = {"w1": (64, 40), "w2": (48, 50), "w3": (96, 40), "norm": (40,)}
# 3 ranks: w1 22/22/20 rows and w2 17/17/16 cols cut blocks; w3's 32 rows a rank hold whole ones
TRAIN = {"w1": Shard(0), "w2": Shard(1), "w3": Shard(0), "norm": Shard(0)}
ENGINE = {"w1": Shard(0), "w2": Replicate(), "w3": Shard(0), "norm": Replicate()}  # on block boundaries
QUANTIZED = ("w1", "w2", "w3")


@dataclass(frozen=True)
class Layouts:
    """The params, how the trainer ranks and the engine workers each lay them out (one mesh dim),
    which the engines keep in FP8, and the block."""

    shapes: dict = field(default_factory=lambda: dict(SHAPES))
    train: dict = field(default_factory=lambda: dict(TRAIN))
    engine: dict = field(default_factory=lambda: dict(ENGINE))
    quantized: tuple = QUANTIZED
    fmt: BlockFp8 = FMT


def full(name: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    x = torch.randn(shape, generator=g)
    if len(shape) == 2:  # magnitudes that differ by row, so cut blocks' amaxes differ between ranks
        x = x * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    return x.to(torch.bfloat16)


class Trainer(TrainerEndpoint):
    def __init__(self, rank: int, world: int, layouts: Layouts = Layouts()):
        self.rank, self.world, self.layouts = rank, world, layouts
        self.refit_fp8_block = layouts.fmt.block
        self.params = {}
        self.set_step(1)

    def set_step(self, step: int) -> None:
        for n, shape in self.layouts.shapes.items():
            region = shard_region(shape, [self.world], [self.rank], [self.layouts.train[n]])
            self.params[n] = local_region(full(n, step, shape), region).contiguous()

    def refit_sources(self):
        return {n: (t, self.layouts.shapes[n], list(range(self.world)), [self.layouts.train[n]])
                for n, t in self.params.items()}


class Fp8Engine(EngineEndpoint):
    def __init__(self, worker: int, workers: int, layouts: Layouts = Layouts()):
        self.worker, self.workers, self.layouts = worker, workers, layouts
        self.refit_fp8_block = layouts.fmt.block
        self.mesh = list(range(workers))
        self.tensors = {}
        fmt = layouts.fmt
        for n, shape in layouts.shapes.items():
            placement = layouts.engine[n]
            region = shard_region(shape, [workers], [worker], [placement])
            dtype = getattr(torch, fmt.dtype_name) if n in layouts.quantized else torch.bfloat16
            self.tensors[n] = (torch.zeros(region_shape(region), dtype=dtype), placement)
            if n in layouts.quantized:
                sregion = shard_region(fmt.scale_shape(shape), [workers], [worker], [placement])
                self.tensors[scale_name(n)] = (torch.full(region_shape(sregion), float("nan")), placement)

    def refit_destinations(self):
        lay = self.layouts
        shapes = {**lay.shapes, **{scale_name(n): lay.fmt.scale_shape(lay.shapes[n]) for n in lay.quantized}}
        return {n: (t, shapes[n], self.mesh, [p]) for n, (t, p) in self.tensors.items()}

    def wrong(self, step: int) -> list[str]:
        bad = []
        for n, shape in self.layouts.shapes.items():
            placement = self.layouts.engine[n]
            region = shard_region(shape, [self.workers], [self.worker], [placement])
            got = self.tensors[n][0]
            if n in self.layouts.quantized:
                q, s = quantize_reference(full(n, step, shape), self.layouts.fmt)
                sregion = shard_region(s.shape, [self.workers], [self.worker], [placement])
                if not torch.equal(got.view(torch.uint8), local_region(q.view(torch.uint8), region)):
                    bad.append(n)
                if not torch.equal(self.tensors[scale_name(n)][0], local_region(s, sregion)):
                    bad.append(scale_name(n))
            elif not torch.equal(got, local_region(full(n, step, shape), region)):
                bad.append(n)
        return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("synchronizer", [
    "reshard", "broadcast", "ipc",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"))])
def test_fp8_engines_get_bit_exact_weights_and_scales_refit_after_refit(synchronizer):
    """Shard to shard over the communicator, through the broadcast baseline (whose full source
    shards carry FP8 too), and over the one-sided transports (the FP8 copies made up front)."""
    trainers = [Trainer(r, 3) for r in range(3)]
    engines = [[Fp8Engine(w, 2) for w in range(2)], [Fp8Engine(0, 1)]]
    if synchronizer == "broadcast":
        sync = refit.CollectiveWeightSynchronizer(trainers, engines, refit_timeout_s=30.0)
    else:
        transport = None if synchronizer == "reshard" else synchronizer
        sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0, transport=transport)
    try:
        for step in (1, 2, 3):
            for t in trainers:
                t.set_step(step)
            result = sync.sync_weights()
            assert result.verified
            assert {id(e): e.wrong(step) for shard in engines for e in shard} == \
                {id(e): [] for shard in engines for e in shard}
        if synchronizer != "reshard":
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


@st.composite
def random_layouts(draw):
    """A weight of often whole blocks and a norm, laid out at random on 1-3 trainer ranks and 1-2
    engine workers per shard (their shards holding whole blocks or cutting them)."""
    block = draw(st.sampled_from([(8, 8), (16, 8), (8, 16)]))
    rows = block[0] * draw(st.integers(1, 6)) - draw(st.sampled_from([0, 0, 3]))
    cols = block[1] * draw(st.integers(1, 6)) - draw(st.sampled_from([0, 0, 5]))
    choice = st.sampled_from([Shard(0), Shard(1), Replicate()])
    return {"layouts": Layouts(shapes={"w": (rows, cols), "norm": (cols,)},
                               train={"w": draw(choice), "norm": draw(st.sampled_from([Shard(0), Replicate()]))},
                               # engines replicate more often: an engine that cuts blocks is refused anyway
                               engine={"w": draw(st.sampled_from([Shard(0), Shard(1), Replicate(), Replicate()])),
                                       "norm": Replicate()}, quantized=("w",),
                               fmt=BlockFp8(block, draw(st.sampled_from(["e4m3", "e5m2"])))),
            "trainers": draw(st.integers(1, 3)), "workers": [draw(st.integers(1, 2)) for _ in range(draw(
                st.integers(1, 2)))]}


@pytest.mark.timeout(600)
@settings(max_examples=30, deadline=None)
@given(random_layouts())
def test_any_layout_lands_bit_exact_or_is_refused_before_a_byte_moves(case):
    """Whatever the trainer's and the engines' layouts, every engine holds the reference bits of
    the full tensor and its scales after each refit, whichever way each trainer rank quantized;
    an engine whose shards cut blocks (its scale shard then misses some) is refused up front."""
    lay = case["layouts"]
    trainers = [Trainer(r, case["trainers"], lay) for r in range(case["trainers"])]
    engines = [[Fp8Engine(w, n, lay) for w in range(n)] for n in case["workers"]]
    cuts = any(scale_placements(lay.shapes["w"], [n], [lay.engine["w"]], lay.fmt.block) is None
               for n in case["workers"])
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0)
    try:
        if cuts:
            event("refused: an engine's shards cut blocks")
            with pytest.raises(RefitRefused, match="its FP8 shard needs the scale of every"):
                sync.sync_weights()
            assert all(not e.tensors["w"][0].view(torch.uint8).any() for shard in engines for e in shard)
            return
        for step in (1, 2):
            for t in trainers:
                t.set_step(step)
            assert sync.sync_weights().verified
            assert [e.wrong(step) for shard in engines for e in shard] == [[] for shard in engines for _ in shard]
        at_pack = scale_placements(lay.shapes["w"], [case["trainers"]], [lay.train["w"]], lay.fmt.block) is not None
        modes = {op.mode for t in trainers for op in t._refit_state().quantized.plan.ops}
        assert modes == {QUANTIZE_AT_PACK if at_pack else MERGE_AMAX_THEN_QUANTIZE}
        event(f"landed: {modes.pop()}")
    finally:
        sync.shutdown()
