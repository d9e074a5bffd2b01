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

import hashlib
import hmac
import os
import pickle
import secrets
import traceback
from typing import Any

from refit.errors import RefitError
from refit.runtime.handles import sendable_error

__all__ = ["EXTENSION", "KEY_ENV", "RefitWorkerExtension", "new_key", "open_sealed", "seal"]

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


class RefitWorkerExtension:
    """Mixed into vLLM's worker: ``refit_dispatch(sealed_batch) -> sealed answer``."""

    def _refit_endpoint(self, receive_mode: str = "auto"):
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
                                    quantized=cfg.quantization is not None)
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
            args, kwargs = calls[rank]
            if method == "refit_attach":
                ep = self._refit_endpoint(**kwargs)
                return seal((True, {**ep.refit_receive_mode(), "pid": os.getpid()}))
            ep = self._refit_endpoint()
            return seal((True, getattr(ep, method)(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller, sealed
            return seal((False, sendable_error(e, traceback.format_exc())))
