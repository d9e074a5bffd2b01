"""The fleets the bench scenarios run on: trainer ranks and engine shards, as threads, processes or Ray actors.

Every scenario that drives a synchronizer makes its fleet here, so a scenario differs from
another only in its actors (the pattern-holding trainer and engines of ``--path sync``, the
reference engines that generate of ``--path staged``), never in how they are started, placed
and stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from refit.runtime.handles import ProcessWorker

__all__ = ["Fleet", "FleetLayout"]


@dataclass(frozen=True)
class FleetLayout:
    """Trainer ranks (TP), engine shards, and workers (TP) per shard."""

    trainer_tp: int
    engine_tp: int
    engines: int

    @property
    def world_size(self) -> int:
        return self.trainer_tp + self.engine_tp * self.engines

    def describe(self) -> str:
        return f"trainer TP{self.trainer_tp} -> {self.engines} engine shard(s) of TP{self.engine_tp}"


class Fleet:
    """One bench run's trainer ranks and engine shards.

    ``kind``: ``local`` (objects of this process, each driven by the synchronizer on a thread of
    its own), ``process`` (a ``ProcessWorker`` each, one intra-op thread per rank: the ranks
    already share the cores) or ``ray`` (a Ray actor each, through ``RayFleet``). Trainer rank
    ``r`` is ``trainer_cls(r, trainer_tp, **trainer_kwargs)``; worker ``w`` of engine shard ``s``
    is ``engine_cls(s, w, engine_tp, **engine_kwargs, **shard_kwargs(s))``. With ``device``
    (``"cpu"`` or ``"cuda"``) every rank is told where its tensors live, rank ``i`` of the
    communicator order on ``cuda:i % GPUs``.
    """

    def __init__(self, kind: str, layout: FleetLayout, trainer_cls: type, engine_cls: type, *,
                 trainer_kwargs: Mapping[str, Any] | None = None, engine_kwargs: Mapping[str, Any] | None = None,
                 shard_kwargs: Callable[[int], Mapping[str, Any]] | None = None, device: str | None = None,
                 start_timeout_s: float = 120.0):
        self.kind = kind
        self.ray_fleet = None
        self.ray_started = False
        self.processes: list[ProcessWorker] = []
        trainer_kwargs, engine_kwargs = dict(trainer_kwargs or {}), dict(engine_kwargs or {})
        if kind == "ray":
            if shard_kwargs is not None:
                raise ValueError("a Ray fleet gives every engine worker the same arguments (no shard_kwargs)")
            self._start_ray(layout, trainer_cls, engine_cls, trainer_kwargs, engine_kwargs, device, start_timeout_s)
            return
        rank = iter(range(layout.world_size))  # communicator order; over NCCL one GPU per rank
        gpus = 1
        if device == "cuda":
            import torch

            gpus = max(torch.cuda.device_count(), 1)

        def make(cls, name: str, *args, **kwargs):
            if device is not None:
                kwargs.update(device=f"cuda:{next(rank) % gpus}" if device == "cuda" else "cpu")
            if kind == "local":
                return cls(*args, **kwargs)
            self.processes.append(ProcessWorker(cls, *args, name=name, threads=1, start_timeout_s=start_timeout_s,
                                                **kwargs))
            return self.processes[-1]

        try:
            self.trainers = [make(trainer_cls, f"trainer rank {r}", r, layout.trainer_tp, **trainer_kwargs)
                             for r in range(layout.trainer_tp)]
            self.engines = [[make(engine_cls, f"shard {s} worker {w}", s, w, layout.engine_tp, **engine_kwargs,
                                  **(shard_kwargs(s) if shard_kwargs is not None else {}))
                             for w in range(layout.engine_tp)] for s in range(layout.engines)]
        except BaseException:
            self.close()
            raise

    def _start_ray(self, layout: FleetLayout, trainer_cls: type, engine_cls: type, trainer_kwargs: dict,
                   engine_kwargs: dict, device: str | None, start_timeout_s: float) -> None:
        import ray

        from refit.runtime.ray import RayFleet

        if not ray.is_initialized():
            ray.init(num_cpus=layout.world_size, include_dashboard=False, log_to_driver=False)
            self.ray_started = True
        extra = {"threads": 1} | ({"device": device} if device is not None else {})
        self.ray_fleet = RayFleet(
            trainer_cls, engine_cls, train_world_size=layout.trainer_tp, num_shards=layout.engines,
            workers_per_shard=layout.engine_tp, trainer_kwargs={**trainer_kwargs, **extra},
            engine_kwargs={**engine_kwargs, **extra},
            actor_options={"num_gpus": 1} if device == "cuda" else None, start_timeout_s=start_timeout_s)
        self.trainers, self.engines = self.ray_fleet.trainers, self.ray_fleet.engines

    @property
    def workers(self) -> list[Any]:
        return [*self.trainers, *(w for shard in self.engines for w in shard)]

    def close(self) -> None:
        for p in self.processes:
            p.close()
        self.processes = []
        if self.ray_fleet is not None:
            self.ray_fleet.shutdown()
            self.ray_fleet = None
        if self.ray_started:
            import ray

            ray.shutdown()
            self.ray_started = False
