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
generate until a refit commits. ``weights_state()`` says which, worker by worker.
"""

from __future__ import annotations

import concurrent.futures as cf
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
from refit.runtime.handles import FuturePending, WorkerDied, pid_alive
from refit.runtime.protocol import Commit, EndpointCall, Transfer

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
        self._incomplete = False
        self._reason: str | None = None  # why the weights are torn, while they are
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
            call = next(iter(calls.values()))
            if isinstance(call, Transfer) and self.direct:
                # until a commit says otherwise
                self._incomplete, self._reason = True, "a refit transfer wrote into the live weights"
            if isinstance(call, Commit) and not self.direct:
                # a load that fails part way leaves some layers new
                self._incomplete, self._reason = True, "vLLM's load of the received weights did not complete"
            out = self._batch(calls)
            if isinstance(call, Commit) and all(ok for ok, _ in out):
                self._incomplete, self._reason = False, None
                self.version += 1
            elif self._incomplete and isinstance(call, (Transfer, Commit)):
                failed = next((value for ok, value in out if not ok), None)
                if failed is not None:
                    text = str(failed).strip().splitlines()
                    self._reason = f"{call.phase} failed: {text[0] if text else ''}"
            return out

    def weights_state(self) -> dict:
        """Whether this engine serves: ``consistent`` (every worker's weights whole), ``version``
        (refits committed), ``reason`` while not, and each worker's own record (``workers``)."""
        with self._lock:
            workers = self._on_every_worker(ReadWeightsState())
            consistent = not self._incomplete and all(w["consistent"] for w in workers)
            reason = self._reason or next((w["reason"] for w in workers if not w["consistent"]), None)
            return {"consistent": consistent, "version": self.version, "reason": None if consistent else reason,
                    "workers": workers}

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
        if self._incomplete:
            raise IncompleteWeights(f"this engine's last refit did not commit ({self._reason}); its weights may be "
                                    "partial, so it does not generate until a refit completes")

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

    def request_batch(self, calls: Mapping[VllmWorkerHandle, EndpointCall]) -> dict[VllmWorkerHandle, FuturePending]:
        """One round of the controller's calls to this engine's workers, sent to the host as one message.

        The answers come back together, one per worker addressed.
        """
        futures = {h: cf.Future() for h in calls}
        batch = {h.rank: (call, futures[h]) for h, call in calls.items()}
        if self.dead:
            for fut in futures.values():
                fut.set_exception(WorkerDied(f"{self.name} is dead"))
        else:
            kinds = {type(c).__name__ for c in calls.values()}
            if len(kinds) != 1:
                raise RefitError(f"{self.name}: the workers of one engine were sent different calls in one round "
                                 f"({sorted(kinds)}); an engine's workers are driven together")
            phase = next(iter(calls.values())).phase
            pending = self.host.call("refit_requests", {rank: c for rank, (c, _) in batch.items()})
            threading.Thread(target=self._deliver, args=(pending, batch), daemon=True,
                             name=f"refit-{self.name}-{phase}").start()
        return {h: FuturePending(fut, h) for h, fut in futures.items()}

    def _deliver(self, pending: Any, batch: dict) -> None:
        while True:
            try:
                answers = pending.result(0.5)
                break
            except WorkerDied as e:
                answers = e
                break
            except TimeoutError:
                if self.dead:
                    answers = WorkerDied(f"{self.name}: its process or a worker of it died")
                    break
            except BaseException as e:  # handed to every worker's call
                answers = e
                break
        for rank, (_, fut) in batch.items():
            if isinstance(answers, BaseException):
                fut.set_exception(answers)
                continue
            ok, value = answers[rank]
            fut.set_result(value) if ok else fut.set_exception(value)

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

    def request(self, call: EndpointCall) -> FuturePending:
        """This worker's call alone (the engine's other workers are not addressed)."""
        return self.engine.request_batch({self: call})[self]

    def call(self, method: str, *args: Any, **kwargs: Any) -> FuturePending:
        raise RefitError(f"{self.name}: a vLLM worker takes refit's calls only (request); call the engine's host "
                         f"for {method!r}")

    def __repr__(self) -> str:
        return f"VllmWorkerHandle({self.name}{', dead' if self.dead else ''})"
