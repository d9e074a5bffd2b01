"""Ray fleet: trainer and engine workers as Ray actors, and the handle the controller drives them by.

Ray is the orchestrator the RL ecosystem runs on, so it is the supported way to place
trainer and engine actors; it is imported here only, inside functions, so that
``import refit`` works without Ray. One generation shard is its ``workers_per_shard``
(tp x pp) engine actors; shards may differ in size. Any actor class that mixes in
``refit.TrainerEndpoint`` or ``refit.EngineEndpoint`` works (``refit.testing``
has reference ones: ``synthetic.SyntheticTrainer`` / ``SyntheticEngine``, ``hf.HFTrainerWorker``,
``engine.EngineWorker``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Sequence
from typing import Any

from refit.errors import RefitError
from refit.runtime.handles import WorkerDied, WorkerTimeout
from refit.runtime.protocol import EndpointCall

__all__ = ["RayFleet", "RayWorker", "fetch_shared"]


# -- the handle ------------------------------------------------------------------------------------

class _RayPending:
    def __init__(self, ref: Any, worker: RayWorker):
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
        """The answer; Ray's own errors become refit's (the only place that knows Ray's names).

        A worker's exception comes back as a Ray task error that wraps it (``cause``); the
        worker's own error is raised instead, so the controller reads its kind, never Ray's
        wrapper. A death, whether Ray reports it as the actor's or as the task's, is
        ``WorkerDied``.
        """
        import ray
        from ray.exceptions import (
            ActorDiedError,
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )

        try:
            return ray.get(self.ref, timeout=timeout)
        except GetTimeoutError:
            raise WorkerTimeout(f"{self.worker.name} did not answer within {timeout}s") from None
        except ActorUnavailableError as e:  # reachable again later: not a death
            raise WorkerTimeout(f"{self.worker.name} is unreachable for now: {e}") from None
        except (ActorDiedError, RayActorError) as e:
            raise WorkerDied(f"{self.worker.name} died: {str(e).strip().splitlines()[0]}") from None
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, (ActorDiedError, RayActorError)):
                raise WorkerDied(f"{self.worker.name} died: {str(cause).strip().splitlines()[0]}") from None
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    @staticmethod
    def wait_any(pendings: Sequence[_RayPending], timeout: float | None) -> list[_RayPending]:
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

    batch = None

    def __init__(self, actor: Any, name: str = "worker"):
        self.actor = actor
        self.name = name

    def call(self, method: str, *args: Any, **kwargs: Any) -> _RayPending:
        return _RayPending(getattr(self.actor, method).remote(*args, **kwargs), self)

    def request(self, call: EndpointCall) -> _RayPending:
        """One of the controller's calls, through the endpoint's one entry for them."""
        return _RayPending(self.actor.refit_request.remote(call), self)

    def is_dead(self) -> bool:
        """What Ray's control store says, without a call into the actor (which may be busy or stopped)."""
        try:
            # Ray has no public API for an actor's state that does not call into the actor
            from ray._private import state  # noqa: PLC2701

            info = state.actors(actor_id=self.actor._actor_id.hex())
            return bool(info) and info.get("State") == "DEAD"
        except Exception:  # the private API moved: fall back to "not known dead"
            return False

    @staticmethod
    def put(obj: Any) -> Any:
        import ray

        return ray.put(obj)

    def __repr__(self) -> str:
        return f"RayWorker({self.name})"


def fetch_shared(call: EndpointCall) -> EndpointCall:
    """``call`` with the Ray object references among its fields fetched.

    The controller puts a large argument (the merged index, a roster) in Ray's object store
    once, and every worker's record carries the reference. Ray resolves references passed
    as arguments of a call, not those inside one, so the worker fetches them here.
    """
    import ray

    fetched = {f.name: ray.get(value) for f in dataclasses.fields(call)
               if isinstance(value := getattr(call, f.name), ray.ObjectRef)}
    return dataclasses.replace(call, **fetched) if fetched else call


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
            except Exception:  # already gone
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
            except Exception:
                pass
        self.trainers, self.engines = [], []
