"""Actors for the torn-weights tests, importable by the spawned worker processes (``ProcessWorker``).

``ReferenceTrainer`` holds the canonical weights of a step (``random_canonical_state`` seeded with
it), cut along dim 0 over the trainer ranks, for the reference engine's fused layout to receive.
It can be told to SIGKILL itself as it packs a send bucket: a real death in the middle of a
transfer, at a point the test chooses rather than a moment it guesses. ``FreezingEngine``
SIGSTOPs itself as its next transfer starts, after it has joined it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from refit.layout import Shard, shard_slices
from refit.runtime.endpoint import TrainerEndpoint
from refit.testing.engine import EngineConfig, EngineWorker, random_canonical_state
from refit.testing.synthetic import SyntheticEngine

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def canonical_state(step: int) -> dict[str, torch.Tensor]:
    return random_canonical_state(EngineConfig.from_hf(LLAMA).spec, seed=step)


class _DieAtBucket:
    """A send-bucket hook of the executor: SIGKILL this process as it packs its ``n``-th bucket."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, peer: int, index: int, buf: torch.Tensor) -> None:
        if self.n == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self.n -= 1


class ReferenceTrainer(TrainerEndpoint):
    def __init__(self, rank: int, world_size: int):
        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.params: dict[str, torch.Tensor] = {}
        self.shapes = {n: tuple(t.shape) for n, t in canonical_state(0).items()}
        self.set_step(0)

    def set_step(self, step: int) -> int:
        for name, full in canonical_state(step).items():
            local = full[shard_slices(full.shape, [self.world_size], [self.rank], [Shard(0)])].contiguous()
            if name in self.params:
                self.params[name].copy_(local)
            else:
                self.params[name] = local
        return step

    def refit_sources(self) -> dict[str, Any]:
        mesh = list(range(self.world_size))
        return {n: (t, self.shapes[n], mesh, [Shard(0)]) for n, t in self.params.items()}

    def die_at_bucket(self, n: int = 0) -> None:
        """SIGKILL this process as it packs the ``n``-th bucket of its next transfer."""
        self._refit_state().fault = _DieAtBucket(n)


class ServingEngine(EngineWorker):
    """The reference engine, with its fused weights readable from the test process."""

    def fused(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.weights.items()}


class FreezingEngine(SyntheticEngine):
    def freeze_next_transfer(self) -> None:
        self._freeze = True

    def on_refit_start(self) -> None:
        if getattr(self, "_freeze", False):
            self._freeze = False
            os.kill(os.getpid(), signal.SIGSTOP)
