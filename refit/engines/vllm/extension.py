"""The worker extension that puts a refit endpoint inside every vLLM worker, reached by ``collective_rpc``.

``LLM(..., worker_extension_cls=EXTENSION)`` mixes ``RefitWorkerExtension`` into vLLM's
worker class. Its one method, ``refit_dispatch``, takes a sealed batch of endpoint calls
(one per worker of the engine: every call of a refit round reaches all of an engine's
workers at once, which is the only way ``collective_rpc`` reaches them) and runs this
worker's call on its ``VllmWorkerEndpoint``.

vLLM's RPC channel carries plain data, and refit's calls carry plans and specs, so calls
and answers travel pickled; they are sealed with HMAC-SHA256 under a key that only the
process that started the engine and the workers it spawned hold (``KEY_ENV``, inherited
through the environment). A batch that does not verify is refused before it is unpickled.

A batch maps each worker's TP rank to one record: one of the controller's calls
(``refit.runtime.protocol``), or one of the host's own (``WorkerCall``: attach, start and
poll a transfer that runs while the engine steps, read a worker's state, load a reference
checkpoint). Each record's ``apply`` names what it runs, so the hop from host to worker
reads like a call, and nothing unknown is ever looked up by name on the worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import hmac
import os
import pickle
import secrets
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from refit.errors import RefitError
from refit.runtime.handles import sendable_error
from refit.runtime.protocol import Commit, EndpointCall, answer

__all__ = ["EXTENSION", "KEY_ENV", "Attach", "ConfigureStaging", "LiveWeightsDigest", "LoadCheckpoint",
           "PollTransfer", "ReadReceiveMode", "ReadWeightsState", "RefitWorkerExtension", "StartTransfer",
           "WorkerCall", "new_key", "open_sealed", "seal"]

EXTENSION = "refit.engines.vllm.extension.RefitWorkerExtension"
KEY_ENV = "REFIT_VLLM_CHANNEL_KEY"
_DIGEST = 32


def new_key() -> str:
    return secrets.token_hex(32)


def _key(key: str | None) -> bytes:
    key = key or os.environ.get(KEY_ENV)
    if not key:
        raise RefitError(f"refit's vLLM channel has no key: {KEY_ENV} is not set in this process")
    return bytes.fromhex(key)


def seal(obj: Any, key: str | None = None) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.new(_key(key), body, hashlib.sha256).digest() + body


def open_sealed(blob: bytes, key: str | None = None) -> Any:
    digest, body = blob[:_DIGEST], blob[_DIGEST:]
    if not hmac.compare_digest(digest, hmac.new(_key(key), body, hashlib.sha256).digest()):
        raise RefitError("refit's vLLM channel: a message failed authentication and was dropped unread")
    return pickle.loads(body)  # noqa: S301 - authenticated above


class WorkerCall:
    """One of the engine host's own calls to a worker of its engine; ``apply`` runs it there."""

    def apply(self, worker: RefitWorkerExtension) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Attach(WorkerCall):
    """Make the worker's refit endpoint with these options; its receive mode and pid."""

    receive_mode: str = "auto"
    check_served: bool = True
    reprocess_shared: bool = True

    def apply(self, worker: RefitWorkerExtension) -> dict:
        ep = worker.refit_endpoint(receive_mode=self.receive_mode, check_served=self.check_served,
                                   reprocess_shared=self.reprocess_shared)
        return {**ep.refit_receive_mode(), "pid": os.getpid()}


@dataclass(frozen=True)
class StartTransfer(WorkerCall):
    """Start the controller's ``transfer`` on a thread of the worker's own, and return at once."""

    transfer: EndpointCall

    def apply(self, worker: RefitWorkerExtension) -> None:
        worker.refit_transfer_start(worker.refit_endpoint(), self.transfer)


@dataclass(frozen=True)
class PollTransfer(WorkerCall):
    """``None`` while the started transfer runs, then ``{"transfer": its report}``; its error raised."""

    def apply(self, worker: RefitWorkerExtension) -> dict | None:
        return worker.refit_transfer_poll()


@dataclass(frozen=True)
class ReadReceiveMode(WorkerCall):
    def apply(self, worker: RefitWorkerExtension) -> dict:
        return worker.refit_endpoint().refit_receive_mode()


@dataclass(frozen=True)
class ReadWeightsState(WorkerCall):
    def apply(self, worker: RefitWorkerExtension) -> dict:
        return worker.refit_endpoint().refit_weights_state()


@dataclass(frozen=True)
class ConfigureStaging(WorkerCall):
    staged: bool

    def apply(self, worker: RefitWorkerExtension) -> Any:
        return worker.refit_endpoint().refit_configure_staging(self.staged)


@dataclass(frozen=True)
class LoadCheckpoint(WorkerCall):
    """vLLM's own loaders over whole checkpoint tensors: the reference a refit is checked against."""

    state: dict

    def apply(self, worker: RefitWorkerExtension) -> None:
        worker.refit_endpoint().load_checkpoint(self.state)


@dataclass(frozen=True)
class LiveWeightsDigest(WorkerCall):
    def apply(self, worker: RefitWorkerExtension) -> dict[str, str]:
        return worker.refit_endpoint().live_weights_digest()


class RefitWorkerExtension:
    """Mixed into vLLM's worker: ``refit_dispatch(sealed_batch) -> sealed answer``."""

    def refit_endpoint(self, receive_mode: str = "auto", check_served: bool = True, reprocess_shared: bool = True):
        ep = self.__dict__.get("_refit_vllm_endpoint")
        if ep is None:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            from refit.engines.vllm.worker import VllmWorkerEndpoint, check_parallel_layout

            check_parallel_layout(self.vllm_config.parallel_config)
            cfg = self.vllm_config.model_config
            ep = VllmWorkerEndpoint(self.model_runner.get_model(), cfg,
                                    tp_rank=get_tensor_model_parallel_rank(),
                                    tp_size=get_tensor_model_parallel_world_size(),
                                    device=self.device, receive_mode=receive_mode,
                                    quantized=cfg.quantization is not None, check_served=check_served,
                                    reprocess_shared=reprocess_shared)
            self._refit_vllm_endpoint = ep
        return ep

    def refit_dispatch(self, blob: bytes) -> bytes:
        """Run this worker's record of a sealed batch ``{tp_rank: call}``; ``(ok, result or error)``, sealed."""
        try:
            calls = open_sealed(blob)
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            if rank not in calls:
                return seal((True, None))  # not addressed to this worker
            call = calls[rank]
            if isinstance(call, WorkerCall):
                return seal((True, call.apply(self)))
            if not isinstance(call, EndpointCall):
                raise RefitError(f"refit's vLLM channel: a {type(call).__name__} is not a call")
            ep = self.refit_endpoint()
            result = answer(ep, call)
            if isinstance(call, Commit):
                result = self.refit_switch_record(ep)
            return seal((True, result))
        except BaseException as e:  # every failure goes back to the caller, sealed
            return seal((False, sendable_error(e, traceback.format_exc())))

    # -- refits while the engine keeps stepping ------------------------------------------
    # ``collective_rpc`` runs on the engine core's loop, between two engine steps, so a call
    # that moved a whole refit would stop generation for the transfer. A transfer started
    # here runs on a thread of its own (the live weights are not what it writes: in loader
    # mode it lands in side buffers), the engine keeps stepping, and the host polls for its
    # end. Only the commit, which loads the buffers into the live weights, runs between two
    # steps: that is the switch, and every worker of the engine makes it at the same point
    # of the step sequence, because vLLM hands the RPC to all of them in that order.
    def refit_transfer_start(self, ep: Any, transfer: EndpointCall) -> None:
        pending = self.__dict__.get("_refit_pending")
        if pending is not None and not pending.done():
            raise RefitError("a refit transfer is still running on this vLLM worker; one runs at a time")
        fut: cf.Future = cf.Future()

        def run() -> None:
            try:
                fut.set_result(answer(ep, transfer))
            except BaseException as e:  # handed to the poll
                fut.set_exception(e)

        self._refit_pending = fut
        threading.Thread(target=run, name="refit-transfer", daemon=True).start()

    def refit_transfer_poll(self) -> dict | None:
        """``None`` while the transfer runs; then ``{"transfer": its report}``, or its error raised, once."""
        fut = self.__dict__.get("_refit_pending")
        if fut is None:
            raise RefitError("no refit transfer was started on this vLLM worker")
        if not fut.done():
            return None
        self._refit_pending = None
        err = fut.exception()
        if err is not None:
            raise err
        return {"transfer": fut.result()}

    def refit_switch_record(self, ep: Any) -> dict:
        """What the switch cut: how many tokens every request the engine holds had generated before it.

        Read between two steps, so a request's first ``n`` tokens came from the old weights
        and the rest from the new ones. ``at`` is this process's monotonic clock (the one
        vLLM stamps scheduling with), to place requests the model runner did not hold.
        """
        runner = getattr(self, "model_runner", None)
        held = getattr(runner, "requests", {}) or {}
        return {"in_flight": {rid: len(state.output_token_ids) for rid, state in held.items()},
                "at": time.monotonic(), "version": ep.weights_version, "load_s": ep.last_load_s}
