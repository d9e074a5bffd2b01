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
from typing import Any

from refit.errors import RefitError
from refit.runtime.handles import sendable_error
from refit.runtime.protocol import Commit, answer

__all__ = ["EXTENSION", "KEY_ENV", "REQUESTS", "RefitWorkerExtension", "new_key", "open_sealed", "seal"]

EXTENSION = "refit.engines.vllm.extension.RefitWorkerExtension"
KEY_ENV = "REFIT_VLLM_CHANNEL_KEY"
#: the batch kind whose calls are the controller's records (``refit.runtime.protocol``), one per worker
REQUESTS = "requests"
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


class RefitWorkerExtension:
    """Mixed into vLLM's worker: ``refit_dispatch(sealed_batch) -> sealed answer``."""

    def _refit_endpoint(self, receive_mode: str = "auto", check_served: bool = True, reprocess_shared: bool = True):
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
        """Run this worker's call of a sealed batch ``(method, {tp_rank: (args, kwargs)})``."""
        try:
            method, calls = open_sealed(blob)
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            if rank not in calls:
                return seal((True, None))  # not addressed to this worker
            if method == REQUESTS:  # one of the controller's calls
                ep = self._refit_endpoint()
                call = calls[rank]
                result = answer(ep, call)
                if isinstance(call, Commit):
                    result = self._refit_switch_record(ep)
                return seal((True, result))
            args, kwargs = calls[rank]
            if method == "refit_attach":
                ep = self._refit_endpoint(**kwargs)
                return seal((True, {**ep.refit_receive_mode(), "pid": os.getpid()}))
            ep = self._refit_endpoint()
            if method == "refit_transfer_start":
                return seal((True, self._refit_transfer_start(ep, *args)))
            if method == "refit_transfer_poll":
                return seal(self._refit_transfer_poll())
            return seal((True, getattr(ep, method)(*args, **kwargs)))
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
    def _refit_transfer_start(self, ep: Any, transfer: Any) -> None:
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

    def _refit_transfer_poll(self) -> tuple[bool, Any]:
        """``(True, None)`` while the transfer runs; then its own ``(ok, result or error)``, once."""
        fut = self.__dict__.get("_refit_pending")
        if fut is None:
            return False, RefitError("no refit transfer was started on this vLLM worker")
        if not fut.done():
            return True, None
        self._refit_pending = None
        err = fut.exception()
        if err is not None:
            return False, sendable_error(err, "".join(traceback.format_exception(err)))
        return True, {"transfer": fut.result()}

    def _refit_switch_record(self, ep: Any) -> dict:
        """What the switch cut: how many tokens every request the engine holds had generated before it.

        Read between two steps, so a request's first ``n`` tokens came from the old weights
        and the rest from the new ones. ``at`` is this process's monotonic clock (the one
        vLLM stamps scheduling with), to place requests the model runner did not hold.
        """
        runner = getattr(self, "model_runner", None)
        held = getattr(runner, "requests", {}) or {}
        return {"in_flight": {rid: len(state.output_token_ids) for rid, state in held.items()},
                "at": time.monotonic(), "version": ep.weights_version, "load_s": ep.last_load_s}
