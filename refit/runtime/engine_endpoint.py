"""The engine side of a refit: the mixin an inference engine's workers take.

Bytes land before they are checked, so the endpoint keeps the worker's served weights
(``refit.runtime.weights_state.WeightsState``) torn from the first byte of a transfer that
writes them until a verified transfer is committed and loaded, and a staged refit lands
beside them and switches between two engine steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from refit.errors import InconsistentWeights, RefitError, error_summary
from refit.runtime.endpoint import RefitEndpointBase
from refit.runtime.protocol import CommitReadiness
from refit.runtime.shards import LocalShard, as_local_shard
from refit.runtime.weights_state import Staging, allocate_staging, copy_staged_into_live

__all__ = ["EngineEndpoint"]

log = logging.getLogger(__name__)


class EngineEndpoint(RefitEndpointBase):
    """Mix into an inference engine worker; implement ``refit_destinations``.

    ``refit_destinations()`` returns the tensors the weights land in, in place, laid out
    over the shard's own workers ``0 .. workers_per_shard-1``. ``on_weights_loaded()``
    runs after every transfer that the controller has verified.

    Bytes land before they are checked, so a transfer that fails or is cut short leaves the
    live weights torn (some params new, some old, some half of each). The endpoint marks
    itself inconsistent before the first byte can land and consistent again only when the
    controller commits a verified transfer and ``on_weights_loaded`` returns, so even a
    worker whose controller or peers died knows. ``on_weights_inconsistent(reason)`` tells
    the engine; ``refit_weights_state()`` and ``check_weights_consistent()`` ask. An endpoint
    whose transfers land in side buffers, loaded at commit, says so by returning False from
    ``_refit_in_place`` and marks itself while its load runs (``mark_weights_inconsistent``).

    Staged refit (``refit_configure_staging``): a transfer lands in a staging copy of every
    destination while the engine keeps serving its live weights, and the commit switches
    between two engine steps (``serving_step``), by a copy or a pointer swap. Generation
    then stalls for the switch, not for the transfer, and a transfer that fails leaves the
    live weights whole. Every commit gives the live weights a version (``weights_version``).
    """

    _refit_role = "dst"

    def refit_destinations(self) -> Mapping[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement refit_destinations()")

    def refit_staging_destinations(self) -> Mapping[str, Any] | None:
        """A second set of weights laid out as ``refit_destinations()``, for a pointer swap; None: copy.

        An engine that can serve from either of two sets of tensors returns the set it does
        not serve from now, and swaps the two in ``on_weights_swap``.
        """
        return None

    def on_weights_swap(self) -> None:
        """Serve from the set ``refit_staging_destinations()`` returned (called between two steps)."""
        raise NotImplementedError(f"{type(self).__name__} returned staging destinations but cannot swap them")

    def on_weights_loaded(self) -> None:
        """Called after new weights landed and were verified (e.g. to re-process them)."""

    def on_weights_inconsistent(self, reason: str) -> None:
        """Called each time the live weights are marked torn, with why; an engine stops serving them.

        It may come again while they are already torn, with a more precise reason (a transfer
        started, then failed). They are whole again once ``on_weights_loaded`` has returned.
        """

    # -- staging ---------------------------------------------------------------------------
    def refit_configure_staging(self, staged: bool = True, *, device_fraction: float = 1.0,
                                require_version: bool = True) -> dict:
        """Land later transfers beside the live weights (``staged``) or in them; from the next build on.

        The staging copies are made once and kept while the live tensors stay the same
        objects, so every refit reuses them. Returns what ``refit_weights_state`` says.
        """
        if not 0.0 <= device_fraction <= 1.0:
            raise RefitError(f"device_fraction must be within [0, 1], got {device_fraction!r}")
        st = self._refit_state()
        w = st.weights
        with st.lock:
            w.staging = Staging(float(device_fraction), bool(require_version)) if staged else None
            w.staging_buffers, w.staged_epoch, w.prepared_epoch = {}, -1, -1
        return self.refit_weights_state()

    def _refit_swaps(self) -> bool:
        w = self._refit_state().weights
        return (w.staging is not None and w.staging.device_fraction >= 1.0
                and type(self).refit_staging_destinations is not EngineEndpoint.refit_staging_destinations)

    def _refit_tensors(self) -> dict[str, LocalShard]:
        w = self._refit_state().weights
        live = dict(self.refit_destinations())
        if w.staging is None:
            return live
        if self._refit_swaps():
            return dict(self.refit_staging_destinations())
        shards = {n: as_local_shard(n, v) for n, v in live.items()}
        self._refit_stage_buffers(shards)
        return {n: LocalShard(w.staging_buffers[n][1], s.global_shape, s.mesh, s.placements)
                for n, s in shards.items()}

    def _refit_stage_buffers(self, shards: Mapping[str, LocalShard]) -> None:
        """Copy mode: one staging tensor per destination, made once per live tensor.

        The first ``device_fraction`` of the bytes (params in name order) is staged on the
        live tensors' device and the rest in host memory (pinned under CUDA), so that the
        device holds at most that fraction of a second model.
        """
        w = self._refit_state().weights
        if all(w.staging_buffers.get(n, (None,))[0] == id(s.tensor) for n, s in shards.items()) \
                and len(w.staging_buffers) == len(shards):
            return
        total = sum(s.tensor.numel() * s.tensor.element_size() for s in shards.values())
        if w.staging.device_fraction * total < total and any(s.tensor.device.type != "cpu" for s in shards.values()):
            # one rank's executor moves the tensors of one device: NCCL cannot land bytes in host
            # memory, so a part staged there would need a host transport of its own
            raise RefitError(f"{self._refit_label()}: device_fraction {w.staging.device_fraction:g} < 1 stages "
                             "part of the model in host memory, which a transfer into GPU tensors cannot land in "
                             "yet; stage on the device (device_fraction=1.0)")
        kept = {n: old[1] for n, old in w.staging_buffers.items() if n in shards and old[0] == id(shards[n].tensor)}
        buffers = allocate_staging({n: s.tensor for n, s in shards.items()}, w.staging.device_fraction, kept)
        w.staging_buffers = {n: (id(shards[n].tensor), buf) for n, buf in buffers.items()}

    def _refit_in_place(self) -> bool:
        """Whether a transfer writes into the live weights (True) or into buffers loaded at commit."""
        return self._refit_state().weights.staging is None

    def _refit_transfer_starts(self, epoch: int) -> None:
        w = self._refit_state().weights
        w.staged_epoch = w.prepared_epoch = -1  # the staging copies are about to be overwritten
        if self._refit_in_place():
            # the step in flight ends before the first byte lands; no later step reads torn weights
            with w.serving:
                self.mark_weights_inconsistent(f"a refit transfer (epoch {epoch}) is writing into the live weights")
                w.paused_at = time.perf_counter()

    def _refit_transfer_landed(self, epoch: int) -> None:
        w = self._refit_state().weights
        if w.staging is not None:
            w.staged_epoch = epoch

    def _refit_transfer_failed(self, epoch: int, msg: str) -> None:
        if self._refit_in_place():
            self.mark_weights_inconsistent(f"the refit transfer of epoch {epoch} failed part way: {msg}")

    def _refit_prepare(self, epoch: int) -> None:
        w = self._refit_state().weights
        if w.staging is not None:
            if w.staged_epoch != epoch:
                raise RefitError(f"{self._refit_label()}: no whole staged transfer of epoch {epoch} to switch to "
                                 f"(staged: {w.staged_epoch}); no worker switches")
            w.prepared_epoch = epoch

    def _refit_readiness(self) -> CommitReadiness:
        w = self._refit_state().weights
        return CommitReadiness(w.version, w.staging is not None)

    def _refit_committed(self, version: int | None) -> None:
        st = self._refit_state()
        w = st.weights
        if version is None:
            version = (w.version or 0) + 1
        if w.staging is not None:
            self._refit_switch(version, f"commit of epoch {st.loaded_epoch}")
            return
        try:
            self.on_weights_loaded()
        except BaseException as e:
            if self._refit_in_place():  # the verified bytes are in place, but the engine could not take them
                self.mark_weights_inconsistent(f"loading the verified weights of epoch {st.loaded_epoch} failed: "
                                               f"{error_summary(e)}")
            raise
        with w.serving:
            w.committed_epoch, w.commits, w.version = st.loaded_epoch, w.commits + 1, version
            if w.paused_at is not None:  # how long no step could run: from the first byte to now
                w.record_switch(version, "in place", time.perf_counter() - w.paused_at)
                w.paused_at = None
            self.mark_weights_consistent()
            w.serving.notify_all()

    def _refit_switch(self, version: int, why: str) -> None:
        """Serve the staged weights as ``version``, between two steps; a no-op if already switched.

        A worker of a shard may switch first, from its step loop, when a peer of the same
        shard already serves ``version`` (``refit_catch_up``): the controller commits only
        once every worker prepared, so a peer's switch is the decision.
        """
        w = self._refit_state().weights
        with w.serving:
            if w.version == version and w.prepared_epoch == -1:
                return
            if w.prepared_epoch == -1 or w.prepared_epoch != w.staged_epoch:
                raise InconsistentWeights(f"{self._refit_label()}: cannot switch to version {version} ({why}): "
                                          "no prepared staged transfer")
            t0 = time.perf_counter()
            if self._refit_swaps():
                self.on_weights_swap()
                mode = "swap"
            else:
                live = {n: as_local_shard(n, v).tensor for n, v in self.refit_destinations().items()}
                copy_staged_into_live(live, {n: buf for n, (_, buf) in w.staging_buffers.items()})
                mode = "copy"
            self.on_weights_loaded()
            seconds = time.perf_counter() - t0
            w.committed_epoch, w.commits, w.version = w.prepared_epoch, w.commits + 1, version
            w.staged_epoch = w.prepared_epoch = -1
            w.record_switch(version, mode, seconds)
            self.mark_weights_consistent()
            w.serving.notify_all()

    def refit_catch_up(self, version: int) -> bool:
        """Switch to ``version`` now if this worker prepared it; whether it could (called inside a step)."""
        w = self._refit_state().weights
        if w.staging is None or w.prepared_epoch == -1:
            return False
        self._refit_switch(version, "a peer of this shard already serves it")
        return True

    def serving_step(self) -> _ServingStep:
        """Hold the live weights for one engine step: a switch waits for it, and it for a switch.

        What an engine's step loop wraps every step in. Refuses (``InconsistentWeights``)
        while the weights are torn, or, staged, before any version was committed. Gives the
        version served.
        """
        return _ServingStep(self)

    def refit_wait_version(self, newer_than: int | None, timeout_s: float) -> int | None:
        """Wait until the live weights are whole and newer than ``newer_than``; the version then."""
        w = self._refit_state().weights
        deadline = time.monotonic() + timeout_s
        with w.serving:
            while not (w.consistent and w.version is not None
                       and (newer_than is None or w.version > newer_than)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                w.serving.wait(left)
            return w.version

    def mark_weights_inconsistent(self, reason: str) -> None:
        """Record that the live weights are torn, and tell the engine (``on_weights_inconsistent``)."""
        w = self._refit_state().weights
        w.reason, w.consistent = reason, False
        try:
            self.on_weights_inconsistent(reason)
        except Exception:  # the mark stands; raising here would strand the transfer's peers
            log.exception("%s: on_weights_inconsistent raised", self._refit_label())

    def mark_weights_consistent(self) -> None:
        """Record that the live weights are whole again (a verified refit was loaded completely)."""
        w = self._refit_state().weights
        w.consistent, w.reason = True, None

    def refit_weights_state(self) -> dict:
        """``consistent``, the ``epoch`` and count (``commits``) of the last refit committed, and the ``reason``.

        Also the ``version`` served (None before the first commit), whether transfers are
        ``staged``, the epoch waiting in staging (``staged_epoch``, -1 for none) and the last
        ``switch`` (its mode and seconds). Read without the endpoint's lock, so that it
        answers while a transfer runs.
        """
        w = self._refit_state().weights
        return {"consistent": w.consistent, "epoch": w.committed_epoch, "commits": w.commits,
                "reason": w.reason, "label": self._refit_label(), "version": w.version,
                "staged": w.staging is not None, "staged_epoch": w.staged_epoch,
                "switch": w.switches[-1] if w.switches else None}

    def refit_switches(self) -> list[dict]:
        """The last switches: ``version``, ``mode`` (swap or copy; in place: the refit wrote the live
        weights, and ``seconds`` runs from its first byte to the commit), ``seconds`` no step could run."""
        return list(self._refit_state().weights.switches)

    @property
    def weights_version(self) -> int | None:
        """The version of the live weights: None until a refit commits one."""
        return self._refit_state().weights.version

    def check_weights_consistent(self) -> None:
        """Raise ``InconsistentWeights`` while the live weights are torn: what a serving entry point calls first."""
        w = self._refit_state().weights
        if not w.consistent:
            raise InconsistentWeights(f"{self._refit_label()}: refusing to serve torn weights "
                                      f"({w.reason}); a refit must complete first")
        if w.staging is not None and w.staging.require_version and w.version is None:
            raise InconsistentWeights(f"{self._refit_label()}: refusing to serve before a refit brought this "
                                      "worker to the current weights version")



class _ServingStep:
    def __init__(self, endpoint: EngineEndpoint):
        self.endpoint = endpoint
        self.cond = endpoint._refit_state().weights.serving

    def __enter__(self) -> int | None:
        self.cond.acquire()
        try:
            self.endpoint.check_weights_consistent()
        except BaseException:
            self.cond.release()
            raise
        return self.endpoint._refit_state().weights.version

    def __exit__(self, *exc) -> None:
        self.cond.release()
