"""Actors for the torn-weights tests, importable by the spawned worker processes (``ProcessWorker``).

``ReferenceTrainer`` is the reference ``CanonicalTrainer`` of the ``LLAMA`` config. It can be
told to SIGKILL itself as it packs a send bucket: a real death in the middle of a transfer, at a
point the test chooses rather than a moment it guesses. ``FreezingEngine`` SIGSTOPs itself as
its next transfer starts, after it has joined it. ``start_reference_fleet`` starts the fleet the
torn and staged tests share.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import torch

from refit.comm.group import free_port
from refit.runtime.handles import ProcessWorker
from refit.testing.engine import CanonicalTrainer, EngineConfig, EngineWorker, random_canonical_state
from refit.testing.launch import scaled
from refit.testing.synthetic import SyntheticEngine

CALL_S = scaled(120.0)

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


class ReferenceTrainer(CanonicalTrainer):
    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size, config=LLAMA)

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


def start(factory, *args, name: str, **kwargs) -> ProcessWorker:
    """``factory(*args, **kwargs)`` in a process of its own, started within ``CALL_S``."""
    return ProcessWorker(factory, *args, name=name, start_timeout_s=CALL_S, **kwargs)


def start_reference_fleet(engine) -> tuple[list[ProcessWorker], list[list[ProcessWorker]]]:
    """Two ``ReferenceTrainer`` ranks, and ``engine`` (a reference engine class) as shard 0 (TP2) and
    shard 1 (TP1) of the ``LLAMA`` model, all started at once: the trainers and the engine shards."""
    port = free_port()
    with cf.ThreadPoolExecutor(5) as pool:  # a TP2 shard's workers meet in their TP group as they start
        trainers = [pool.submit(start, ReferenceTrainer, r, 2, name=f"trainer rank {r}") for r in range(2)]
        shard0 = [pool.submit(start, engine, 0, w, 2, config=LLAMA, tp_port=port, name=f"shard 0 worker {w}")
                  for w in range(2)]
        shard1 = [pool.submit(start, engine, 1, 0, 1, config=LLAMA, name="shard 1 worker 0")]
        return [f.result() for f in trainers], [[f.result() for f in shard0], [f.result() for f in shard1]]
