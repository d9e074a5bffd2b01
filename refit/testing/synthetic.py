"""A synthetic tensor-parallel model: trainer and engine endpoints for demos and tests without a model library.

Weights are a pure function of (name, step), different at every step, so that a stale copy
can never pass for a fresh one and any rank can say what the trainer held at a step without
asking it. The engine's layouts are deliberately unlike the trainer's (and its dtype is
bfloat16), so every refit is a real reshard with a cast, not a copy of matching shards.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import torch

from refit.layout import Placement, Replicate, Shard, region_shape, shard_region, shard_slices
from refit.runtime.endpoint import TrainerEndpoint
from refit.runtime.engine_endpoint import EngineEndpoint

__all__ = ["SyntheticEngine", "SyntheticTrainer", "engine_placement", "synthetic_param", "synthetic_shapes",
           "trainer_placement"]


def synthetic_shapes(hidden: int = 64, layers: int = 2, vocab: int = 96) -> dict[str, tuple[int, ...]]:
    """Every tensor of the synthetic model, by name, with its global shape."""
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "qkv_proj.weight"] = (3 * hidden, hidden)
        shapes[p + "o_proj.weight"] = (hidden, hidden)
        shapes[p + "gate_up_proj.weight"] = (4 * hidden, hidden)
        shapes[p + "down_proj.weight"] = (hidden, 2 * hidden)
        shapes[p + "input_layernorm.weight"] = (hidden,)
    return shapes


def synthetic_param(name: str, shape: Sequence[int], step: int) -> torch.Tensor:
    """The full tensor of ``name`` at ``step``: deterministic, different at every step and param."""
    seed = int.from_bytes(hashlib.blake2b(f"{name}|{step}".encode(), digest_size=4).digest(), "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def trainer_placement(name: str) -> Placement:
    """How the trainer ranks cut ``name``: Megatron-style column/row parallelism."""
    if name.endswith(("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight")):
        return Shard(0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return Shard(1)
    return Replicate()


def engine_placement(name: str) -> Placement:
    """How an engine shard's workers cut ``name``: unlike the trainer, so a refit is a real reshard."""
    if name.endswith(("qkv_proj.weight", "down_proj.weight")):
        return Shard(1)
    if name.endswith(("o_proj.weight", "gate_up_proj.weight")):
        return Shard(0)
    return Replicate()


class SyntheticTrainer(TrainerEndpoint):
    """A trainer rank of a tensor-parallel synthetic model (float32, TP over the trainer ranks)."""

    def __init__(self, rank: int, world_size: int, *, hidden: int = 64, layers: int = 2, threads: int = 1,
                 device: str = "cpu"):
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.shapes = synthetic_shapes(hidden, layers)
        self.mesh = list(range(world_size))
        self.params: dict[str, torch.Tensor] = {}
        self.set_step(0)

    def set_step(self, step: int) -> int:
        """Load the weights of ``step`` (what an optimizer step would have produced)."""
        for name, shape in self.shapes.items():
            full = synthetic_param(name, shape, step)
            local = full[shard_slices(shape, [self.world_size], [self.rank], [trainer_placement(name)])]
            local = local.contiguous().to(self.device)
            if name in self.params:
                self.params[name].copy_(local)
            else:
                self.params[name] = local
        self.step = step
        return step

    def refit_sources(self):
        return {n: (t, self.shapes[n], self.mesh, [trainer_placement(n)]) for n, t in self.params.items()}


class SyntheticEngine(EngineEndpoint):
    """One worker of a generation shard (bfloat16, TP over the shard's workers, layouts unlike the trainer's).

    ``transfer_delay_s`` holds every transfer open for a while and ``load_delay_s`` does
    the same in ``on_weights_loaded``, so that tests can hit a sync in the middle.
    """

    def __init__(self, shard: int, worker: int, workers_per_shard: int, *, hidden: int = 64, layers: int = 2,
                 dtype: str = "bfloat16", transfer_delay_s: float = 0.0, load_delay_s: float = 0.0,
                 threads: int = 1, device: str = "cpu"):
        torch.set_num_threads(threads)
        self.shard, self.worker, self.workers_per_shard = shard, worker, workers_per_shard
        self.shapes = synthetic_shapes(hidden, layers)
        self.mesh = list(range(workers_per_shard))
        self.dtype = getattr(torch, dtype)
        self.transfer_delay_s = transfer_delay_s
        self.load_delay_s = load_delay_s
        self.loads = 0
        self.params = {}
        for name, shape in self.shapes.items():
            region = shard_region(shape, [workers_per_shard], [worker], [engine_placement(name)])
            self.params[name] = torch.zeros(region_shape(region), dtype=self.dtype, device=device)

    def refit_destinations(self):
        return {n: (t, self.shapes[n], self.mesh, [engine_placement(n)]) for n, t in self.params.items()}

    def on_refit_start(self) -> None:
        if self.transfer_delay_s:
            time.sleep(self.transfer_delay_s)

    def on_weights_loaded(self) -> None:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        self.loads += 1

    def check_weights(self, step: int) -> list[str]:
        """Params whose local shard differs from the trainer's weights of ``step``."""
        wrong = []
        for name, shape in self.shapes.items():
            full = synthetic_param(name, shape, step).to(self.dtype)
            want = full[shard_slices(shape, [self.workers_per_shard], [self.worker], [engine_placement(name)])]
            if not torch.equal(want, self.params[name].cpu()):
                wrong.append(name)
        return wrong

    def load_count(self) -> int:
        return self.loads
