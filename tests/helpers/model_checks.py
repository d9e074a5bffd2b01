"""Refit checks that drive real models on every rank of a ``refit.testing.launch.LocalFleet`` (the end-to-end tests).

``refit_check_worker`` (an HF trainer) and ``megatron_check_worker`` (a Megatron-core layout)
are top-level functions to run on every rank: the first ranks train (or hold Megatron shards),
the rest are engine shards with their own TP groups (any TP size per shard); after every step
a ``Resharder`` moves the weights shard to shard, and every engine computes logits and greedy
tokens on a fixed prompt for the caller to compare with the trainer's reference (an HF forward
of the ``full_tensor()`` weights). Tokens from a real forward catch what a byte-level checksum
cannot: a view cut in the wrong order lands every byte, but in the wrong place.

Rank mapping. A LocalFleet rank, the trainer's torch default-group rank and the trainer's
refit rank are the same number on the trainer side (``offset = 0``); engine shards sit after
the trainer ranks, shard ``k`` at ``offset = trainer_world + sum(tp of shards before k)``,
their meshes given in their own workers ``0..tp-1`` plus that offset.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit.comm.group import free_port
from refit.comm.rendezvous import new_secret
from refit.errors import LayoutError
from refit.models.megatron import Entry, MegatronLayout
from refit.models.parallel import TrainParallel
from refit.testing.engine import EngineConfig, EngineShard, EngineWorker, TorchTPComm, random_canonical_state
from refit.testing.hf import HFTrainerWorker

__all__ = ["Topology", "megatron_check_worker", "refit_check_worker"]

@dataclass(frozen=True)
class Topology:
    """Trainer ranks first, then engine shards, on one refit communicator (e.g. a LocalFleet).

    Trainer rank ``r`` is refit rank ``r``; engine shard ``k`` (``engine_tps[k]`` workers, any
    size each) starts at ``engine_offset(k)``. ``trainer_dp`` x ``trainer_tp`` is an HF
    trainer's mesh (a Megatron check sizes ``trainer_world`` from its ``TrainParallel``). The
    ports are the torch rendezvous of the trainer's default group and of every engine shard
    with ``tp > 1``; ``make`` picks free ones.
    """

    trainer_world: int
    engine_tps: tuple[int, ...]
    trainer_port: int = 0
    engine_ports: tuple[int, ...] = ()
    trainer_dp: int = 1
    trainer_tp: int = 1
    engine_secret: bytes | None = None  # authenticates the engines' TP rendezvous

    @classmethod
    def make(cls, *, engine_tps: Sequence[int], dp: int = 1, tp: int = 1,
             trainer_world: int | None = None) -> Topology:
        world = dp * tp if trainer_world is None else trainer_world
        return cls(trainer_world=world, engine_tps=tuple(engine_tps), trainer_port=free_port(),
                   engine_ports=tuple(free_port() if t > 1 else 0 for t in engine_tps), trainer_dp=dp, trainer_tp=tp,
                   engine_secret=new_secret())

    @property
    def world(self) -> int:
        return self.trainer_world + sum(self.engine_tps)

    def engine_offset(self, shard: int) -> int:
        return self.trainer_world + sum(self.engine_tps[:shard])

    def role(self, rank: int) -> tuple[str, int, int]:
        """``("trainer", rank, 0)`` or ``("engine", shard, tp_rank)``."""
        if rank < self.trainer_world:
            return ("trainer", rank, 0)
        for k, tp in enumerate(self.engine_tps):
            off = self.engine_offset(k)
            if off <= rank < off + tp:
                return ("engine", k, rank - off)
        raise LayoutError(f"rank {rank} outside the {self.world} ranks of {self}")


def _init_torch_group(port: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _destroy_torch_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _engine(topo: Topology, rank: int, config: Mapping[str, Any], qkv: str,
            tp_comm: str, expert_parallel: bool = False) -> tuple[EngineShard, int, int]:
    """This rank's engine shard: an ``EngineWorker`` (stateless TP group) or an ``EngineShard`` on a torch group."""
    _, shard, tp_rank = topo.role(rank)
    tp = topo.engine_tps[shard]
    if tp_comm == "stateless":
        port = topo.engine_ports[shard] if tp > 1 else None
        return EngineWorker(shard, tp_rank, tp, config=config, qkv=qkv, tp_port=port, tp_secret=topo.engine_secret,
                            expert_parallel=expert_parallel), shard, tp_rank
    if tp_comm != "torch":
        raise LayoutError(f"tp_comm must be 'torch' or 'stateless', got {tp_comm!r}")
    comm = None
    if tp > 1:
        _init_torch_group(topo.engine_ports[shard], tp_rank, tp)
        comm = TorchTPComm()
    return EngineShard(EngineConfig.from_hf(config), tp_size=tp, tp_rank=tp_rank, comm=comm, qkv=qkv,
                       expert_parallel=expert_parallel), shard, tp_rank


def _refit(group, src: Mapping[str, Entry], dst: Mapping[str, Entry]) -> dict:
    from refit.transport.xfer import Resharder

    t0 = time.perf_counter()
    r = Resharder(group, src=src, dst=dst)
    stats = r.run()
    return {"plan_s": r.plan_seconds, "refit_s": time.perf_counter() - t0,
            "bytes_received": stats.bytes_received, "bytes_sent": stats.bytes_sent}


def _serve(group, topo: Topology, engine: EngineShard, shard: int, tp_rank: int, steps: int, ids: torch.Tensor,
           new_tokens: int) -> list[dict]:
    """The engine side of a check: receive every refit into the views, then logits and greedy tokens."""
    reports = []
    dst = engine.destinations(topo.engine_offset(shard))
    for step in range(steps + 1):
        refit = _refit(group, {}, dst)
        engine.on_weights_loaded()
        logits, tokens = engine.forward(ids), engine.generate(ids, new_tokens)
        rep = {"step": step, "role": "engine", "rank": group.rank, "shard": shard, "refit": refit,
               "version": engine.version}
        if tp_rank == 0:
            rep.update(logits=logits, tokens=tokens)
        reports.append(rep)
    return reports


def refit_check_worker(group, topo: Topology, config: Mapping[str, Any], *, steps: int = 2, prompt: Sequence[int],
                       new_tokens: int = 4, seed: int = 0, lr: float = 1e-2, tp_comm: str = "stateless",
                       engine_ep: bool = False) -> list[dict]:
    """Run on every rank of a LocalFleet: HF trainer (TP x FSDP2) -> engine shards, refit after every step.

    ``group`` is the fleet's refit communicator (``StatelessProcessGroup``); ``config`` an HF
    config's ``to_dict()`` (engine ranks never import transformers). Trainer ranks are
    ``HFTrainerWorker`` s on their own torch default group; engine ranks ``EngineWorker`` s
    (``tp_comm="stateless"``) or ``EngineShard`` s on a torch group per shard (``"torch"``).
    Step 0 refits the initial weights, then each step is one AdamW step and a refit.
    ``engine_ep`` splits the routed experts whole across each shard's workers (engine EP).

    Returns per-step dicts: trainer rank 0 adds the reference ``logits`` / ``tokens`` (an HF
    forward of the ``full_tensor()`` weights), ``loss`` and, at step 0, ``placements``; TP rank
    0 of every engine shard adds its own ``logits`` / ``tokens``. Every dict has ``refit``
    (plan and transfer seconds, bytes).
    """
    role = topo.role(group.rank)[0]
    ids = torch.tensor([list(prompt)])
    engine = None
    try:
        if role != "trainer":
            engine, shard, tp_rank = _engine(topo, group.rank, config, "plain", tp_comm, engine_ep)
            return _serve(group, topo, engine, shard, tp_rank, steps, ids, new_tokens)
        trainer = HFTrainerWorker(group.rank, topo.trainer_world, config=config, dp=topo.trainer_dp,
                                  tp=topo.trainer_tp, master_port=topo.trainer_port, seed=seed, lr=lr)
        reports = []
        for step in range(steps + 1):
            loss = trainer.train_step() if step else None
            refit = _refit(group, trainer.sources(0), {})
            logits, tokens = trainer.reference(ids, new_tokens)
            rep = {"step": step, "role": role, "rank": group.rank, "refit": refit, "loss": loss}
            if group.rank == 0:
                rep.update(logits=logits, tokens=tokens)
                if step == 0:
                    rep["placements"] = trainer.placements()
            reports.append(rep)
        return reports
    finally:
        if isinstance(engine, EngineWorker):
            engine.close()
        _destroy_torch_group()



def megatron_check_worker(group, topo: Topology, config: Mapping[str, Any], parallel: TrainParallel, *,
                          steps: int = 2, prompt: Sequence[int], new_tokens: int = 4, seed: int = 0,
                          expert_layout: str = "te", tp_comm: str = "torch") -> list[dict]:
    """Run on every rank of a LocalFleet: Megatron-core-shaped trainer ranks -> engine shards (grouped q/k/v).

    The trainer ranks hold the Megatron local state of ``random_canonical_state(spec, seed +
    step)`` (cut by the plain reference conversion, updated in place every step) and expose it
    through ``MegatronLayout.to_canonical`` views. Engine TP rank 0 of every shard returns its
    logits and tokens per step; the caller compares them with an HF forward of the same state.
    """
    role = topo.role(group.rank)[0]
    ids = torch.tensor([list(prompt)])
    engine = None
    try:
        if role != "trainer":
            engine, shard, tp_rank = _engine(topo, group.rank, config, "grouped", tp_comm)
            return _serve(group, topo, engine, shard, tp_rank, steps, ids, new_tokens)
        spec = EngineConfig.from_hf(config).spec
        layout = MegatronLayout(spec, parallel, expert_layout=expert_layout)
        local = layout.from_canonical(random_canonical_state(spec, seed=seed), group.rank)
        src = layout.to_canonical(local, group.rank)
        reports = []
        for step in range(steps + 1):
            if step:
                new = layout.from_canonical(random_canonical_state(spec, seed=seed + step), group.rank)
                for k, t in new.items():
                    local[k].copy_(t)
            reports.append({"step": step, "role": role, "rank": group.rank, "refit": _refit(group, src, {})})
        return reports
    finally:
        if isinstance(engine, EngineWorker):
            engine.close()
        _destroy_torch_group()

