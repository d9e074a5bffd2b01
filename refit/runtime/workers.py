"""One worker handle for whatever the user hands the controller."""

from __future__ import annotations

from typing import Any

from refit.errors import RefitError
from refit.runtime.handles import LocalWorker

__all__ = ["as_worker"]


def as_worker(handle: Any, name: str) -> Any:
    """Wrap a Ray actor handle or a bare endpoint object; pass worker handles through."""
    if hasattr(handle, "request") and hasattr(handle, "is_dead"):
        return handle
    if type(handle).__module__.startswith("ray."):
        from refit.runtime.ray import RayWorker  # Ray is imported only when Ray handles are given

        return RayWorker(handle, name)
    if hasattr(handle, "refit_request"):
        return LocalWorker(handle, name)
    raise RefitError(f"{name}: expected a Ray actor handle, a worker handle or a refit endpoint, "
                     f"got {type(handle).__name__}")
