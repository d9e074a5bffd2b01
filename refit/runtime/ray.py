"""Ray fleet: trainer and engine workers as Ray actors, and the handle the controller drives them by.

Ray is the orchestrator the RL ecosystem runs on, so it is the supported way to place
trainer and engine actors; it is imported here only, inside functions, so that
``import refit`` works without Ray. One generation shard is its ``workers_per_shard``
(tp x pp) engine actors; shards may differ in size. Any actor class that mixes in ``refit.runtime.endpoint.TrainerEndpoint``
or ``EngineEndpoint`` works; ``SyntheticTrainer`` / ``SyntheticEngine`` are a small
synthetic model for demos and tests, with weights that change every step so that a
stale copy can never pass for a fresh one.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any, Sequence

import torch

from refit.errors import RefitError
from refit.layout import Replicate, Shard, shard_region
from refit.runtime.endpoint import EngineEndpoint, TrainerEndpoint, WorkerDied, WorkerTimeout

__all__ = ["RayFleet", "RayWorker", "SyntheticEngine", "SyntheticTrainer", "synthetic_param", "synthetic_shapes"]


# -- the handle ------------------------------------------------------------------------------------

class _RayPending:
    def __init__(self, ref: Any, worker: "RayWorker"):
        self.ref = ref
        self.worker = worker
        self._done = False

    def done(self) -> bool:
        if not self._done:
            import ray

            ready, _ = ray.wait([self.ref], timeout=0)
            self._done = bool(ready)
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

        try:
            return ray.get(self.ref, timeout=timeout)
        except GetTimeoutError:
            raise WorkerTimeout(f"{self.worker.name} did not answer within {timeout}s") from None
        except ActorUnavailableError as e:  # reachable again later: not a death
            raise WorkerTimeout(f"{self.worker.name} is unreachable for now: {e}") from None
        except (ActorDiedError, RayActorError) as e:
            raise WorkerDied(f"{self.worker.name} died: {str(e).strip().splitlines()[0]}") from None

    @staticmethod
    def wait_any(pendings: Sequence["_RayPending"], timeout: float | None) -> list["_RayPending"]:
        import ray

        by_ref = {p.ref: p for p in pendings}
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout)
        if ready:  # collect everything else that is ready too, without waiting
            more, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
            ready = list({*ready, *more})
        for r in ready:
            by_ref[r]._done = True
        return [by_ref[r] for r in ready]


class RayWorker:
    """Drives one Ray actor that mixes in a refit endpoint."""

    def __init__(self, actor: Any, name: str = "worker"):
        self.actor = actor
        self.name = name

    def call(self, method: str, *args: Any, **kwargs: Any) -> _RayPending:
        return _RayPending(getattr(self.actor, method).remote(*args, **kwargs), self)

    def is_dead(self) -> bool:
        """What Ray's control store says, without a call into the actor (which may be busy or stopped)."""
        try:
            from ray._private import state

            info = state.actors(actor_id=self.actor._actor_id.hex())
            return bool(info) and info.get("State") == "DEAD"
        except Exception:  # noqa: BLE001 - the private API moved: fall back to "not known dead"
            return False

    @staticmethod
    def put(obj: Any) -> Any:
        import ray

        return ray.put(obj)

    def __repr__(self) -> str:
        return f"RayWorker({self.name})"


# -- the fleet ---------------------------------------------------------------------------------------

class RayFleet:
    """Trainer actors and generation shards of engine actors, started on the current Ray cluster.

    ``trainer_cls`` is built with ``rank=, world_size=`` and ``engine_cls`` with
    ``shard=, worker=, workers_per_shard=``, plus the given kwargs. ``workers_per_shard``
    is one size for every shard or a list of one per shard (e.g. ``[2, 2, 1]``). Actors are not
    restarted by Ray (``max_restarts=0``): a lost shard is the synchronizer's to handle,
    and ``restart_shard`` starts a fresh one that the next sync re-admits.
    """

    def __init__(self, trainer_cls: type, engine_cls: type, *, train_world_size: int, num_shards: int,
                 workers_per_shard: int | Sequence[int], trainer_kwargs: dict | None = None,
                 engine_kwargs: dict | None = None,
                 actor_options: dict | None = None, start_timeout_s: float = 120.0):
        import ray

        if not ray.is_initialized():
            raise RefitError("RayFleet: call ray.init() first")
        opts = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 1}
        opts.update(actor_options or {})
        self._trainer_cls = ray.remote(trainer_cls).options(**opts)
        self._engine_cls = ray.remote(engine_cls).options(**opts)
        self.train_world_size = train_world_size
        self.num_shards = num_shards
        sizes = [workers_per_shard] * num_shards if isinstance(workers_per_shard, int) else list(workers_per_shard)
        if len(sizes) != num_shards or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise RefitError(f"RayFleet: workers_per_shard must be an int >= 1 or one per shard ({num_shards}), "
                             f"got {workers_per_shard!r}")
        self.shard_sizes = sizes
        self.trainer_kwargs = dict(trainer_kwargs or {})
        self.engine_kwargs = dict(engine_kwargs or {})
        self.start_timeout_s = start_timeout_s
        self.trainers = [self._trainer_cls.remote(rank=r, world_size=train_world_size, **self.trainer_kwargs)
                         for r in range(train_world_size)]
        self.engines = [self._start_shard(s) for s in range(num_shards)]
        self._pids: dict[Any, int] = {}
        self._wait_ready([*self.trainers, *(a for s in self.engines for a in s)])

    def _start_shard(self, shard: int) -> list:
        n = self.shard_sizes[shard]
        return [self._engine_cls.remote(shard=shard, worker=w, workers_per_shard=n, **self.engine_kwargs)
                for w in range(n)]

    def _wait_ready(self, actors: Sequence[Any]) -> None:
        import ray

        infos = ray.get([a.refit_ping.remote() for a in actors], timeout=self.start_timeout_s)
        for a, info in zip(actors, infos):
            self._pids[a] = info["pid"]

    def pid(self, actor: Any) -> int:
        return self._pids[actor]

    def engine_pids(self, shard: int) -> list[int]:
        return [self._pids[a] for a in self.engines[shard]]

    def signal_worker(self, shard: int, worker: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one engine worker's process (SIGKILL, SIGSTOP, SIGCONT); returns its pid."""
        pid = self._pids[self.engines[shard][worker]]
        os.kill(pid, sig)
        return pid

    def restart_shard(self, shard: int, workers: Sequence[int] | None = None) -> list:
        """Start ``shard`` afresh (or only its ``workers``), killing what is left of the old ones.

        Returns the shard's handles, to give to ``sync.replace_shard(shard, ...)``.
        """
        import ray

        workers = range(self.shard_sizes[shard]) if workers is None else workers
        actors = list(self.engines[shard])
        for w in workers:
            try:
                ray.kill(actors[w], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._pids.pop(actors[w], None)
            actors[w] = self._engine_cls.remote(shard=shard, worker=w, workers_per_shard=self.shard_sizes[shard],
                                                **self.engine_kwargs)
        self.engines[shard] = actors
        self._wait_ready([actors[w] for w in workers])
        return list(actors)

    def shutdown(self) -> None:
        import ray

        for a in [*self.trainers, *(a for s in self.engines for a in s)]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.trainers, self.engines = [], []


# -- a synthetic model ----------------------------------------------------------------------------------

def synthetic_shapes(hidden: int = 64, layers: int = 2, vocab: int = 96) -> dict[str, tuple[int, ...]]:
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


def _local_part(full: torch.Tensor, region) -> torch.Tensor:
    return full[tuple(slice(iv[0][0], iv[-1][1]) if iv else slice(0, 0) for iv in region)]


def _trainer_placement(name: str):
    if name.endswith(("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight")):
        return Shard(0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return Shard(1)
    return Replicate()


def _engine_placement(name: str):
    # deliberately unlike the trainer's: a real reshard, not a copy of matching shards
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
            region = shard_region(shape, [self.world_size], [self.rank], [_trainer_placement(name)])
            local = _local_part(full, region).contiguous().to(self.device)
            if name in self.params:
                self.params[name].copy_(local)
            else:
                self.params[name] = local
        self.step = step
        return step

    def refit_sources(self):
        return {n: (t, self.shapes[n], self.mesh, [_trainer_placement(n)]) for n, t in self.params.items()}


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
            region = shard_region(shape, [workers_per_shard], [worker], [_engine_placement(name)])
            self.params[name] = torch.zeros([sum(b - a for a, b in iv) for iv in region], dtype=self.dtype,
                                            device=device)

    def refit_destinations(self):
        return {n: (t, self.shapes[n], self.mesh, [_engine_placement(n)]) for n, t in self.params.items()}

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
            region = shard_region(shape, [self.workers_per_shard], [self.worker], [_engine_placement(name)])
            want = _local_part(full, region)
            if not torch.equal(want, self.params[name].cpu()):
                wrong.append(name)
        return wrong

    def load_count(self) -> int:
        return self.loads
