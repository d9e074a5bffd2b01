"""Reference engines holding their linear layers in block-scaled FP8, fed through ``sync_weights()``.

A float32 trainer of three ranks (uneven row and column shards, so its boundaries cut scale
blocks) refits two FP8 engine shards (TP2 and TP1, vLLM's fused layout: ``qkv_proj``,
``gate_up_proj``, experts ``w13`` / ``w2``, each with a fused scale grid that the canonical
``_scale_inv`` names view). The engines' FP8 bytes and scales must equal the reference
quantizer's on the full tensors, and their logits those of an unquantized engine holding the
dequantized weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import refit
from refit.errors import LayoutError
from refit.layout import Shard, mesh_coords_of, shard_slices
from refit.models.fp8 import dequantize, quantize_reference
from refit.models.fused import FusedLayout
from refit.plan.quant import BlockFp8, scale_name
from refit.runtime.endpoint import TrainerEndpoint
from refit.testing.engine import EngineConfig, EngineShard, ThreadTPComm, on_tp_threads, random_canonical_state
from refit.testing.hf import tiny_llama_config, tiny_qwen3_moe_config

FMT = BlockFp8((8, 8))
PROMPT = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 23]])
CONFIGS = {"llama": tiny_llama_config, "qwen3-moe": tiny_qwen3_moe_config}


def quantized(name: str) -> bool:
    return name.endswith("_proj.weight") and "embed" not in name


class CanonicalTrainer(TrainerEndpoint):
    """Full canonical float32 weights cut over ``world`` ranks: rows, or columns for the row-parallel ones."""

    refit_fp8_block = FMT.block

    def __init__(self, rank: int, world: int, state: dict[str, torch.Tensor]):
        self.rank, self.world = rank, world
        self.placements = {n: Shard(1 if n.endswith(("o_proj.weight", "down_proj.weight")) else 0) for n in state}
        self.shapes = {n: tuple(t.shape) for n, t in state.items()}
        self.state = {n: t[shard_slices(t.shape, [world], [rank], [self.placements[n]])].contiguous()
                      for n, t in state.items()}

    def refit_sources(self):
        return {n: (t, self.shapes[n], list(range(self.world)), [self.placements[n]]) for n, t in self.state.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_fp8_engines_hold_the_reference_bits_and_compute_the_dequantized_models_logits(model):
    econf = EngineConfig.from_hf(CONFIGS[model]())
    state = random_canonical_state(econf.spec, seed=3)
    trainers = [CanonicalTrainer(r, 3, state) for r in range(3)]
    comms = ThreadTPComm.group(2)
    engines = [[EngineShard(econf, tp_size=2, tp_rank=r, comm=comms[r], fp8=FMT) for r in range(2)],
               [EngineShard(econf, fp8=FMT)]]
    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=30.0)
    try:
        result = sync.sync_weights()
    finally:
        sync.shutdown()
    assert result.verified
    reference = {n: quantize_reference(t, FMT) if quantized(n) else (t, None) for n, t in state.items()}
    for shard in engines:
        for e in shard:
            for name, (ref, mesh, placements) in e.refit_destinations().items():
                weight = name.removesuffix("_scale_inv")
                q, s = reference[weight]
                want = s if name.endswith("_scale_inv") else q
                coords = mesh_coords_of(np.asarray(mesh), e.rank)
                want = want[shard_slices(want.shape, np.asarray(mesh).shape, coords, placements)]
                got = ref._local_tensor
                if got.element_size() == 1:
                    got, want = got.view(torch.uint8), want.view(torch.uint8)
                assert torch.equal(got, want), (name, e.rank)
    # the FP8 engines compute the model of the dequantized weights (and not the unquantized one)
    dequantized = {n: dequantize(q, s, FMT) if s is not None else q for n, (q, s) in reference.items()}
    plain = EngineShard(econf)
    plain.load_canonical(dequantized)
    want = plain.forward(PROMPT)
    for shard in engines:
        got = on_tp_threads(shard, lambda e: e.forward(PROMPT))[0]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    unquantized = EngineShard(econf)
    unquantized.load_canonical(state)
    assert (unquantized.forward(PROMPT) - want).abs().max() > 1e-4


def test_an_fp8_engine_whose_tp_shards_cut_blocks_is_refused_by_name():
    spec = EngineConfig.from_hf(tiny_llama_config()).spec
    FusedLayout(spec, tp_size=2, fp8=FMT)  # 32 q rows a rank: whole 8-row blocks
    with pytest.raises(LayoutError, match=r"at engine tp=2: the q rows of a rank, 32, are not a whole number of "
                                          r"64-element FP8 blocks; this engine cannot pad them"):
        FusedLayout(spec, tp_size=2, fp8=BlockFp8((64, 64)))
    assert scale_name("lm_head.weight") == "lm_head.weight_scale_inv"
