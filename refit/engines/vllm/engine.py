"""vLLM engines as generation shards of ``ReshardWeightSynchronizer``.

``VllmEngineHost`` owns one ``vllm.LLM`` (put it in a process of its own with
``refit.runtime.handles.ProcessWorker``, or make it the body of a Ray actor). Its workers
carry refit's worker extension, so each holds a ``VllmWorkerEndpoint``. ``VllmEngine``
turns a handle to the host into one shard of worker handles for the synchronizer::

    host = ProcessWorker(VllmEngineHost, model=path, tensor_parallel_size=2, dtype="float32")
    sync = ReshardWeightSynchronizer(trainers, [VllmEngine(host, tp=2).workers])

vLLM reaches its workers only all at once (``collective_rpc``). The engine's worker
handles share it as their ``batch``, so the controller sends a round's calls to them (one
``refit.runtime.protocol`` record per worker) as one message, which the host seals and
hands to every worker at once.

Generation never sees partial weights. Calls to a host run one at a time, so nothing
generates while a refit moves bytes; in loader mode the live weights change only at the
commit, after the controller verified every byte; and an engine whose refit started but
was not committed (direct mode writes in place), or whose load failed part way, refuses to
generate until a refit commits. The workers' own records say which (``weights_state()``):
the host keeps no second account of them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from refit.engines.vllm.extension import (
    EXTENSION,
    KEY_ENV,
    Attach,
    LiveWeightsDigest,
    LoadCheckpoint,
    ReadReceiveMode,
    ReadWeightsState,
    WorkerCall,
    new_key,
    open_sealed,
    seal,
)
from refit.errors import InconsistentWeights, RefitError
from refit.runtime.handles import WatchedPending, WorkerDied, failed_call, pid_alive
from refit.runtime.protocol import Commit, EndpointCall

__all__ = ["IncompleteWeights", "VllmEngine", "VllmEngineHost", "fetched"]

TEARDOWN_GRACE_S = 1.0


class IncompleteWeights(InconsistentWeights):
    """This engine's last refit did not commit, so its weights may be partial: it does not generate."""


def fetched(calls: Mapping[int, EndpointCall]) -> dict[int, EndpointCall]:
    """The controller's calls with the Ray object references among their fields fetched.

    A host run as a Ray actor gets the controller's large arguments (the merged index, the
    rosters) as references into Ray's object store; the engine's own workers are no Ray
    actors and could not fetch them.
    """
    if "ray" not in sys.modules:
        return dict(calls)
    from refit.runtime.ray import fetch_shared

    return {rank: fetch_shared(call) for rank, call in calls.items()}


class VllmEngineHost:
    """One vLLM engine (an ``LLM``) whose workers take refit's shard-to-shard transfers.

    Args:
        model: path of the model (a directory with ``config.json``; ``load_format="dummy"``
            starts without checkpoint files, as an engine waiting for its first refit).
        receive_mode: ``"auto"``, ``"loader"`` or ``"direct"`` (see ``refit.engines.vllm.worker``).
        check_served, reprocess_shared: the workers' served check and re-processing of layers that
            share a loaded parameter (``VllmWorkerEndpoint``); both on by default.
        env: environment variables for vLLM, set in this process before the engine starts
            (for example ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_KVCACHE_SPACE`` on the host).
        **llm_kwargs: passed to ``vllm.LLM`` (``tensor_parallel_size``, ``dtype``, ...).
    """

    def __init__(self, model: str, *, receive_mode: str = "auto", env: dict[str, str] | None = None,
                 check_served: bool = True, reprocess_shared: bool = True, **llm_kwargs: Any):
        if "worker_extension_cls" in llm_kwargs:
            raise RefitError("VllmEngineHost sets worker_extension_cls itself (refit's worker extension)")
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        self._key = new_key()
        os.environ[KEY_ENV] = self._key  # the workers this engine spawns inherit it
        self._start_engine(model, llm_kwargs)
        self.tp_size = int(llm_kwargs.get("tensor_parallel_size", 1))
        self._lock = threading.RLock()
        self.version = 0  # refits committed
        self.workers_info = self._on_every_worker(Attach(receive_mode, check_served, reprocess_shared))
        self.worker_pids = [w["pid"] for w in self.workers_info]
        # loader mode touches the live weights only at the commit; direct mode writes them in place
        self.direct = any(w["mode"] == "direct" for w in self.workers_info)

    def _start_engine(self, model: str, llm_kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=model, worker_extension_cls=EXTENSION, **llm_kwargs)

    # -- refit ------------------------------------------------------------------------
    def _rpc(self, blob: bytes) -> list[bytes]:
        return self.llm.collective_rpc("refit_dispatch", args=(blob,))

    def _batch(self, calls: Mapping[int, EndpointCall | WorkerCall]) -> list[tuple[bool, Any]]:
        """Each worker's call (by TP rank) in one sealed message; each worker's ``(ok, result or error)``."""
        return [open_sealed(a, self._key) for a in self._rpc(seal(dict(calls), self._key))]

    def _on_every_worker(self, call: WorkerCall) -> list[Any]:
        """``call`` on every worker of the engine; the answers, the first failure raised."""
        return [_unwrap(x) for x in self._batch(dict.fromkeys(range(self.tp_size), call))]

    def refit_requests(self, calls: dict[int, EndpointCall]) -> list[tuple[bool, Any]]:
        """Run one round of the controller's calls, one per worker (by TP rank); ``(ok, result or error)`` each."""
        calls = fetched(calls)
        with self._lock:
            out = self._batch(calls)
            if isinstance(next(iter(calls.values())), Commit) and all(ok for ok, _ in out):
                self.version += 1
            return out

    def weights_state(self) -> dict:
        """Whether this engine serves: ``consistent`` (every worker's weights whole), ``version``
        (refits committed), ``reason`` while not, and each worker's own record (``workers``).

        The workers' records are the one account of torn weights: a worker marks itself torn
        before a byte lands in its live weights and whole only once a verified refit is loaded,
        and it knows this even when the controller or a peer died mid-refit. A worker that died
        cannot answer, and its engine cannot generate either.
        """
        with self._lock:
            workers = self._on_every_worker(ReadWeightsState())
            consistent = all(w["consistent"] for w in workers)
            reason = next((w["reason"] for w in workers if not w["consistent"]), None)
            return {"consistent": consistent, "version": self.version, "reason": reason, "workers": workers}

    def refit_ping(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "worker_pids": self.worker_pids}

    def refit_teardown(self) -> None:
        """Stop the engine's processes (the engine core and its workers) now.

        Left to interpreter exit, they outlive a host that is killed or slow to exit,
        each holding its share of host memory.
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            # a short grace: the engine core is SIGKILLed after it (its weights are of no use now)
            llm.llm_engine.engine_core.shutdown(timeout=TEARDOWN_GRACE_S)

    def receive_modes(self) -> list[dict]:
        """Each worker's receive mode, its share of the weights in bytes, and its load count."""
        return self._on_every_worker(ReadReceiveMode())

    # -- generation -------------------------------------------------------------------
    def _check_complete(self) -> None:
        state = self.weights_state()
        if not state["consistent"]:
            raise IncompleteWeights(f"this engine's last refit did not complete ({state['reason']}); its weights may "
                                    "be partial, so it does not generate until a refit completes")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[list[int]]:
        """Greedy continuations of token-id prompts."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with self._lock:
            self._check_complete()
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                     SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """vLLM's own loaders over whole checkpoint tensors (by checkpoint name), on every worker.

        The reference a refit is checked against (``VllmWorkerEndpoint.load_checkpoint``);
        every worker receives every tensor, so it is for tests and small models.
        """
        with self._lock:
            self._on_every_worker(LoadCheckpoint(state))

    def live_weights_digest(self) -> list[dict[str, str]]:
        """Each worker's digest of its live parameters (``VllmWorkerEndpoint.live_weights_digest``)."""
        with self._lock:
            return self._on_every_worker(LiveWeightsDigest())

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """The log-probability of every prompt token after the first, given the ones before it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with self._lock:
            self._check_complete()
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                     SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
            return [[lp[tok].logprob for tok, lp in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(prompts, outs)]


def _unwrap(answer: tuple[bool, Any]) -> Any:
    ok, value = answer
    if not ok:
        raise value
    return value


class VllmEngine:
    """One generation shard: a handle to a ``VllmEngineHost`` seen as ``tp`` worker handles.

    Args:
        host: a worker handle (``ProcessWorker``, ``RayWorker``, ``LocalWorker``) to a
            ``VllmEngineHost``, or a Ray actor handle of one.
        name: for error messages.
    """

    def __init__(self, host: Any, *, name: str = "vllm engine", start_timeout_s: float = 600.0):
        from refit.runtime.workers import as_worker

        self.host = as_worker(host, name)
        self.name = name
        info = self.host.call("refit_ping").result(start_timeout_s)
        self.worker_pids = list(info["worker_pids"])
        self.tp = len(self.worker_pids)
        # worker processes on this machine are watched directly: the host answers one call at
        # a time, so asking it would wait behind the very refit whose worker died
        self._local = info["host"] == socket.gethostname()
        self.workers = [VllmWorkerHandle(self, r) for r in range(self.tp)]

    @property
    def dead(self) -> bool:
        if self.host.is_dead():
            return True
        return self._local and not all(pid_alive(p) for p in self.worker_pids)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A call to the host itself (``generate``, ``prompt_logprobs``, ``receive_modes``)."""
        return self.host.call(method, *args, **kwargs)

    def weights_state(self, timeout_s: float = 60.0) -> dict:
        """The host's ``weights_state()``: whether the engine serves, and each worker's record."""
        return self.host.call("weights_state").result(timeout_s)

    def request_batch(self, calls: Mapping[VllmWorkerHandle, EndpointCall]) -> WatchedPending:
        """One round of the controller's calls to this engine's workers, sent to the host as one message.

        Its answer holds every addressed worker's ``(ok, result or error)`` by TP rank. It is
        watched from here: a worker that dies mid-refit ends the call as ``WorkerDied``.
        """
        if self.dead:
            inner = failed_call(WorkerDied(f"{self.name} is dead"), self.host)
        else:
            kinds = {type(c).__name__ for c in calls.values()}
            if len(kinds) != 1:
                raise RefitError(f"{self.name}: the workers of one engine were sent different calls in one round "
                                 f"({sorted(kinds)}); an engine's workers are driven together")
            inner = self.host.call("refit_requests", {h.rank: c for h, c in calls.items()})
        return WatchedPending(inner, lambda: self.dead, self.name)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.dead and time.monotonic() < deadline:
            time.sleep(0.05)


class VllmWorkerHandle:
    """The synchronizer's handle to one worker of a ``VllmEngine`` (``call`` / ``is_dead``)."""

    def __init__(self, engine: VllmEngine, rank: int):
        self.engine = engine
        self.batch = engine  # the controller's round reaches the engine's workers as one message
        self.rank = rank
        self.name = f"{engine.name} worker {rank}"

    @property
    def dead(self) -> bool:
        return self.engine.dead

    def is_dead(self) -> bool:
        return self.engine.dead

    def request(self, call: EndpointCall) -> WatchedPending:
        """This worker's call alone (the engine's other workers are not addressed)."""
        batch = self.engine.request_batch({self: call})
        return WatchedPending(batch.inner, batch.is_dead, self.name, pick=self.rank)

    def call(self, method: str, *args: Any, **kwargs: Any) -> WatchedPending:
        raise RefitError(f"{self.name}: a vLLM worker takes refit's calls only (request); call the engine's host "
                         f"for {method!r}")

    def __repr__(self) -> str:
        return f"VllmWorkerHandle({self.name}{', dead' if self.dead else ''})"
