"""A vLLM engine that keeps generating while refits land, and switches weights between two steps.

``VllmServingHost`` owns one ``AsyncLLM`` (vLLM's online engine) on an event loop of its
own. Requests stream through it the whole time; the synchronizer reaches its workers the
same way as ``VllmEngineHost``'s (``VllmEngine(host).workers``).

Staged (the default): a transfer runs on a thread of every worker and lands in side buffers
(loader mode) or staging copies (direct mode) while the engine keeps stepping on version N;
the commit is one ``collective_rpc``, which vLLM runs between two engine steps on every
worker at the same point of the step sequence, so the switch to N+1 is atomic across the
engine's workers and generation stalls only for it. Blocking (``refit="blocking"``): the
engine pauses (``pause_generation(mode="keep")``) from the transfer's first byte to the
commit, the baseline most frameworks run.

What a request records (``collect``): its tokens and ``spans``, ``[[version, n_tokens],
...]``, the weights version each run of its tokens was generated under. A request in flight
across a switch keeps the KV cache its earlier tokens computed under N; its later tokens
come from N+1 over that cache (in-flight weight update, as asynchronous RL runs it).
Prefix caching is refused: a cached block computed under N would be reused by a request of
N+1, a mix of versions nobody would see.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refit.engines.vllm.engine import TEARDOWN_GRACE_S, VllmEngineHost, fetched
from refit.engines.vllm.extension import EXTENSION, ConfigureStaging, PollTransfer, StartTransfer
from refit.errors import InconsistentWeights, RefitError
from refit.runtime.protocol import Commit, EndpointCall, Transfer

__all__ = ["REFIT_MODES", "VllmServingHost", "median_gap", "token_gaps"]

REFIT_MODES = ("staged", "blocking")
_POLL_S = 0.02


@dataclass
class _Request:
    id: str
    prompt: list[int]
    max_tokens: int
    submitted: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # host clock, when each token arrived
    scheduled_ts: float | None = None  # engine core clock, when the request was first scheduled
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False


@dataclass(frozen=True)
class _Switch:
    version: int
    at: float  # engine core clock (monotonic), read between the two steps
    in_flight: dict[str, int]  # request id -> tokens it had generated under the previous version


class VllmServingHost(VllmEngineHost):
    """One vLLM ``AsyncLLM`` generating while refits land.

    Args:
        model: path of the model (``load_format="dummy"`` starts an engine that waits for
            its first refit).
        refit: ``"staged"`` (switch between two steps) or ``"blocking"`` (pause, transfer,
            commit, resume).
        require_version: refuse requests until a refit has committed a version, so that an
            engine started (or restarted) with weights of no run answers nothing.
        **engine_kwargs: passed to vLLM's ``AsyncEngineArgs`` (``tensor_parallel_size``,
            ``dtype``, ...).
    """

    def __init__(self, model: str, *, refit: str = "staged", receive_mode: str = "auto",
                 require_version: bool = True, env: dict[str, str] | None = None, **engine_kwargs: Any):
        if refit not in REFIT_MODES:
            raise RefitError(f"refit must be one of {REFIT_MODES}, got {refit!r}")
        if engine_kwargs.get("enable_prefix_caching"):
            raise RefitError("VllmServingHost needs enable_prefix_caching=False: a cached KV block computed under "
                             "one weights version would be reused by requests of the next")
        if engine_kwargs.get("disable_log_stats"):
            raise RefitError("VllmServingHost needs vLLM's request stats (disable_log_stats=False): they place "
                             "every request against the weight switches")
        engine_kwargs.update(enable_prefix_caching=False, disable_log_stats=False)
        self.refit_mode = refit
        self.require_version = require_version
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._switches: list[_Switch] = []
        self._paused_at: float | None = None
        self.stalls: list[dict] = []  # per committed refit: what generation stopped for, on this host
        self._load: dict[str, Any] | None = None
        super().__init__(model, receive_mode=receive_mode, env=env, **engine_kwargs)
        if self.refit_mode == "staged" and self.direct:
            # direct mode writes the live fused weights; staged, it writes copies of them
            self._on_every_worker(ConfigureStaging(True))

    # -- the engine, on a loop of its own -------------------------------------------------
    def _start_engine(self, model: str, engine_kwargs: dict[str, Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="refit-vllm-serving", daemon=True)
        self._thread.start()

        async def start():
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, worker_extension_cls=EXTENSION,
                                                             **engine_kwargs))

        self.llm = self._run(start())

    def _run(self, coro: Any, timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _rpc(self, blob: bytes) -> list[bytes]:
        return self._run(self.llm.collective_rpc("refit_dispatch", args=(blob,)))

    def refit_teardown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.shutdown(timeout=TEARDOWN_GRACE_S)
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- refits -------------------------------------------------------------------------
    def refit_requests(self, calls: dict[int, EndpointCall]) -> list[tuple[bool, Any]]:
        calls = fetched(calls)
        with self._lock:
            call = next(iter(calls.values()))
            if isinstance(call, Transfer):
                if self.refit_mode == "blocking":
                    self._pause()
                    out = self._batch(calls)
                else:
                    out = self._transfer_while_serving(calls)
                if not all(ok for ok, _ in out):
                    self._resume()
                return out
            if isinstance(call, Commit):
                t0 = time.perf_counter()
                try:
                    out = self._batch(calls)
                finally:
                    commit_s = time.perf_counter() - t0
                    stalled = self._resume()
                if all(ok for ok, _ in out):
                    self._record_switch(out, commit_s if stalled is None else stalled)
                return out
            out = self._batch(calls)
            if self._paused_at is not None and not all(ok for ok, _ in out):
                self._resume()  # the refit failed before its commit: serve version N again
            return out

    def _transfer_while_serving(self, calls: dict[int, EndpointCall]) -> list[tuple[bool, Any]]:
        """Start the transfer on every worker's thread, then poll (between steps) until each ended."""
        started = self._batch({r: StartTransfer(c) for r, c in calls.items()})
        answers: dict[int, tuple[bool, Any]] = {}
        running = []
        for rank, (ok, value) in zip(sorted(calls), (started[r] for r in sorted(calls))):
            if ok:
                running.append(rank)
            else:
                answers[rank] = (ok, value)
        while running:
            time.sleep(_POLL_S)
            polled = self._batch(dict.fromkeys(running, PollTransfer()))
            for rank in list(running):
                ok, value = polled[rank]
                if ok and value is None:
                    continue
                answers[rank] = (True, value["transfer"]) if ok else (False, value)
                running.remove(rank)
        return [answers.get(r, (True, None)) for r in range(self.tp_size)]

    def _pause(self) -> None:
        if self._paused_at is None:
            self._run(self.llm.pause_generation(mode="keep", clear_cache=False))
            self._paused_at = time.perf_counter()

    def _resume(self) -> float | None:
        """Resume a paused engine; how long it was paused (None: it was not)."""
        if self._paused_at is None:
            return None
        self._run(self.llm.resume_generation())
        paused, self._paused_at = time.perf_counter() - self._paused_at, None
        return paused

    def _record_switch(self, answers: list[tuple[bool, Any]], stall_s: float) -> None:
        record = answers[0][1] or {}
        version = record.get("version")
        self.version = version if version is not None else self.version + 1
        in_flight = {rid.rsplit("-", 1)[0]: n for rid, n in record.get("in_flight", {}).items()}
        # every worker switched at the same point of the step sequence: they hold the same requests
        # with the same token counts, or the engine served a mix of versions for a step
        agree = all((a[1] or {}).get("in_flight") == record.get("in_flight") for a in answers)
        self._switches.append(_Switch(self.version, float(record.get("at", time.monotonic())), in_flight))
        self.stalls.append({"version": self.version, "mode": self.refit_mode, "seconds": stall_s,
                            "load_s": max(float((a[1] or {}).get("load_s", 0.0)) for a in answers),
                            "at": time.monotonic(), "workers_agree": agree, "in_flight": len(in_flight)})

    # -- generation -----------------------------------------------------------------------
    def _check_serving(self) -> None:
        self._check_complete()
        if self.require_version and self.version == 0:
            raise InconsistentWeights("this engine has not been brought to the current weights version yet (no "
                                      "refit committed to it), so it answers no request")

    def submit(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[str]:
        """Start greedy continuations of token-id prompts; their request ids, for ``collect``."""
        with self._lock:
            self._check_serving()
            ids = []
            for p in prompts:
                req = _Request(f"refit-{next(self._ids)}", [int(t) for t in p], int(max_tokens), time.monotonic())
                self._requests[req.id] = req
                asyncio.run_coroutine_threadsafe(self._generate(req), self._loop)
                ids.append(req.id)
            return ids

    async def _generate(self, req: _Request) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=req.prompt), params, req.id):
                now = time.monotonic()
                new = list(out.outputs[0].token_ids)
                req.tokens.extend(new)
                req.times.extend([now] * len(new))
                metrics = getattr(out, "metrics", None)
                if req.scheduled_ts is None and metrics is not None and getattr(metrics, "scheduled_ts", 0.0):
                    req.scheduled_ts = float(metrics.scheduled_ts)
                if out.finished:
                    req.finish_reason = out.outputs[0].finish_reason
        except BaseException as e:  # recorded with the request
            req.error = f"{type(e).__name__}: {e}"
        finally:
            req.done = True

    def collect(self, ids: Sequence[str] | None = None, *, forget: bool = True) -> list[dict | None]:
        """The finished requests among ``ids`` (all finished ones by default), None for the others.

        Each is ``{"id", "prompt", "tokens", "spans", "times", "finish_reason", "error"}``;
        ``spans`` gives the weights version of every run of tokens, in order.
        """
        with self._lock:
            ids = list(ids) if ids is not None else [r.id for r in self._requests.values() if r.done]
            out = []
            for rid in ids:
                req = self._requests.get(rid)
                if req is None or not req.done:
                    out.append(None)
                    continue
                if forget:
                    del self._requests[rid]
                out.append({"id": req.id, "prompt": req.prompt, "tokens": req.tokens, "spans": self._spans(req),
                            "times": req.times, "finish_reason": req.finish_reason, "error": req.error})
            return out

    def _spans(self, req: _Request) -> list[list[int]]:
        """Split a request's tokens by the switches that cut it.

        A switch that found the request in the model runner says how many tokens came before
        it. One that did not either came before the request was scheduled (it starts on that
        version) or after it finished (no later switch touches it).
        """
        scheduled = req.scheduled_ts if req.scheduled_ts is not None else req.submitted
        version = max([0, *(s.version for s in self._switches if s.at <= scheduled)])
        spans, pos = [], 0
        for s in self._switches:
            if s.at <= scheduled:
                continue
            if req.id not in s.in_flight:
                break
            cut = min(s.in_flight[req.id], len(req.tokens))
            if cut > pos:
                spans.append([version, cut - pos])
                pos = cut
            version = s.version
        if len(req.tokens) > pos:
            spans.append([version, len(req.tokens) - pos])
        return spans

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, timeout_s: float = 300.0
                 ) -> list[list[int]]:
        ids = self.submit(prompts, max_tokens)
        deadline = time.monotonic() + timeout_s
        while not all(self._requests[i].done for i in ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"generate: {len(ids)} requests did not finish within {timeout_s} s")
            time.sleep(0.005)
        return [r["tokens"] for r in self.collect(ids)]

    # -- a closed-loop load, for tests and benchmarks ---------------------------------------
    def start_load(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16, concurrency: int = 4) -> None:
        """Keep ``concurrency`` requests in flight, cycling over ``prompts``, until ``stop_load``."""
        with self._lock:
            self._check_serving()
            if self._load is not None:
                raise RefitError("a load is already running on this engine")
            self._load = {"stop": False, "ids": [], "started": time.monotonic()}
            prompts = [list(p) for p in prompts]
            for lane in range(concurrency):
                asyncio.run_coroutine_threadsafe(self._lane(lane, prompts, max_tokens), self._loop)

    async def _lane(self, lane: int, prompts: list[list[int]], max_tokens: int) -> None:
        load = self._load
        for i in itertools.count(lane, 1):
            if load["stop"]:
                break
            req = _Request(f"refit-{next(self._ids)}", prompts[i % len(prompts)], max_tokens, time.monotonic())
            self._requests[req.id] = req
            load["ids"].append(req.id)
            await self._generate(req)
            if req.error is not None:
                break

    def load_progress(self) -> dict:
        """How many requests of the running load finished, and the version served."""
        load = self._load
        if load is None:
            raise RefitError("no load is running on this engine")
        done = sum(1 for i in load["ids"] if i in self._requests and self._requests[i].done)
        return {"finished": done, "version": self.version}

    def stop_load(self, timeout_s: float = 300.0) -> dict:
        """Stop submitting, wait for the requests in flight, and return them all with the refits' stalls."""
        load = self._load
        if load is None:
            raise RefitError("no load is running on this engine")
        load["stop"] = True
        deadline = time.monotonic() + timeout_s
        while not all(self._requests[i].done for i in load["ids"] if i in self._requests):
            if time.monotonic() > deadline:
                raise TimeoutError(f"stop_load: requests still running after {timeout_s} s")
            time.sleep(0.01)
        with self._lock:
            self._load = None
            records = [r for r in self.collect(load["ids"]) if r is not None]
            return {"requests": records, "started": load["started"], "stopped": time.monotonic(),
                    "stalls": [s for s in self.stalls if s["at"] >= load["started"]]}


def token_gaps(records: Sequence[dict]) -> list[tuple[float, float]]:
    """``(start, end)`` of every gap between two consecutive tokens of one request (host clock)."""
    return [(a, b) for r in records for a, b in zip(r["times"], r["times"][1:])]


def median_gap(records: Sequence[dict]) -> float:
    """The median time from one token of a request to its next: a decode step, as the host sees it."""
    gaps = [b - a for a, b in token_gaps(records)]
    return statistics.median(gaps) if gaps else 0.0


