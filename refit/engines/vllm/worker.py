"""The refit endpoint that lives inside one vLLM worker process: what it receives, and how it loads it.

Two receive modes, chosen per engine and reported by ``refit_receive_mode``:

- **loader**: every checkpoint tensor's shard lands in a buffer of its own, in checkpoint
  format, and vLLM's own loaders then run under layerwise reload
  (``initialize_layerwise_reload`` / ``model.load_weights`` / ``finalize_layerwise_reload``),
  which re-runs each layer's post-load processing. It is the only way in on vLLM's CPU
  build, which repacks linear weights after start so that a write into ``qkv_proj`` is
  never seen, and on quantized engines, whose stored weights are not the checkpoint's.
  vLLM's loaders narrow full checkpoint tensors to the worker's slice; they are handed a
  ``CheckpointShard`` (full shape, no storage) whose narrow to that slice is the shard.
- **direct**: on a GPU with unquantized weights the shard is written straight into the live
  fused parameter (the q rows of ``qkv_proj`` ...); nothing is copied or loaded afterwards.

Loading starts only after the controller verified the transfer, so a failed or corrupted
refit never reaches the live weights in loader mode. A failure inside the load itself puts
every layer that was not finished back on its previous tensors before the error is raised:
vLLM's layerwise reload leaves unfinished layers on the ``meta`` device otherwise, and the
next generation kills the engine. The finished layers keep their new weights, so the
endpoint marks itself inconsistent while a load runs and consistent when it completes; in
direct mode, from the start of a transfer until its commit (``EngineEndpoint``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from refit.engines.vllm.destinations import plan_destinations
from refit.engines.vllm.served import (
    ServedCheck,
    ServedReport,
    rebuild_experts_kernels,
    reprocess_sharing_layers,
)
from refit.engines.vllm.shard_tensor import as_checkpoint_tensor
from refit.engines.vllm.support import check_model_support
from refit.errors import LayoutError, RefitError
from refit.layout import mesh_coords_of, shard_slices
from refit.runtime.engine_endpoint import EngineEndpoint
from refit.runtime.shards import LocalShard

__all__ = ["RECEIVE_MODES", "VllmWorkerEndpoint", "check_parallel_layout", "choose_receive_mode"]

log = logging.getLogger(__name__)

RECEIVE_MODES = ("auto", "loader", "direct")


def choose_receive_mode(requested: str, *, device: torch.device, quantized: bool) -> str:
    """``auto`` is direct on a GPU with unquantized weights and loader everywhere else."""
    if requested not in RECEIVE_MODES:
        raise RefitError(f"receive_mode must be one of {RECEIVE_MODES}, got {requested!r}")
    if requested == "direct":
        if device.type == "cpu":
            raise RefitError("receive_mode='direct' needs a GPU engine: vLLM's CPU build repacks linear weights "
                             "after start, so bytes written into them are never used; use 'loader' or 'auto'")
        if quantized:
            raise RefitError("receive_mode='direct' needs unquantized weights; a quantized engine stores "
                             "processed weights, so use 'loader' or 'auto'")
    if requested != "auto":
        return requested
    return "direct" if device.type != "cpu" and not quantized else "loader"


def check_parallel_layout(parallel_config: Any) -> None:
    """Refuse the engine layouts the destinations do not describe yet, before anything is joined."""
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        raise RefitError(f"refit's vLLM backend maps tensor-parallel engines; this one has pipeline_parallel_size={pp}")
    dp = getattr(parallel_config, "data_parallel_size", 1)
    if getattr(parallel_config, "enable_expert_parallel", False) and dp > 1:
        raise RefitError(f"refit's vLLM backend maps expert parallelism within one tensor-parallel group; this "
                         f"engine spreads its experts over data_parallel_size={dp} as well")


class VllmWorkerEndpoint(EngineEndpoint):
    """``EngineEndpoint`` of one vLLM worker: its destinations, and the load after a verified refit.

    Args:
        model: the worker's model (``worker.model_runner.get_model()``).
        model_config: vLLM's ``ModelConfig`` (layerwise reload needs it).
        tp_rank, tp_size: this worker's place in the engine's tensor-parallel group.
        device: where the model lives.
        receive_mode: ``"auto"``, ``"loader"`` or ``"direct"``.
        quantized: whether the engine runs a quantization method (forces loader mode).
        check_served: after every load, run each layer that holds a received weight through its
            own kernel and compare with the verified shard (``refit.engines.vllm.served``); a
            layer that disagrees fails the commit, named, and the worker stays inconsistent.
        reprocess_shared: after every load, re-run the post-load processing that vLLM's reload
            skips: of layers that share a loaded parameter without loading it themselves (a tied
            output head), and of experts kernels that keep their own layout of the weights. False
            leaves them as vLLM's own reload does, which is how the served check is shown to catch them.
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, *, tp_rank: int, tp_size: int,
                 device: torch.device, receive_mode: str = "auto", quantized: bool = False,
                 check_served: bool = True, reprocess_shared: bool = True):
        check_model_support(model, model_config, rebuilds_kernel_copies=reprocess_shared)
        self.model = model
        self.model_config = model_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.receive_mode = choose_receive_mode(receive_mode, device=self.device, quantized=quantized)
        self.destinations = plan_destinations(model, tp_rank=tp_rank, tp_size=tp_size)
        self.loads = 0
        self.last_load_s = 0.0
        self.check_served = bool(check_served)
        self.reprocess_shared = bool(reprocess_shared)
        self.last_served: ServedReport | None = None
        self.reprocessed: list[str] = []  # layers re-processed because they share a loaded parameter
        if self.receive_mode == "direct":
            self._views, self._loadable = self._direct_views(), {}
        else:
            self._views, self._loadable = self._loader_buffers()
        self._served_check = ServedCheck(model, self.destinations, tp_rank=tp_rank)
        if self.check_served:
            self._served_check.warm_up(self._views)

    # -- destinations -----------------------------------------------------------------
    def _loader_buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One shard-sized buffer per checkpoint tensor, made once and reused by every refit,
        and the full-shape ``CheckpointShard`` over it that vLLM's loader narrows."""
        buffers, loadable = {}, {}
        for d in self.destinations:
            mesh = np.asarray(d.mesh)
            slices = shard_slices(d.global_shape, mesh.shape, mesh_coords_of(mesh, self.tp_rank), d.placements)
            buf = torch.zeros(d.local_shape, dtype=d.dtype, device=self.device)
            buffers[d.name] = buf
            loadable[d.name] = as_checkpoint_tensor(buf, d.global_shape, slices, d.name)
        return buffers, loadable

    def _direct_views(self) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        views = {}
        for d in self.destinations:
            p = params[d.target].data
            if d.expert is not None:
                p = p[d.expert]
            lo, hi = d.rows
            view = p[lo:hi] if p.dim() else p
            if tuple(view.shape) != d.local_shape:
                raise LayoutError(f"{d.name}: the live {d.target} rows {lo}:{hi} have shape {list(view.shape)}, "
                                  f"the layout says {list(d.local_shape)}; receive_mode='loader' handles it")
            views[d.name] = view
        return views

    def refit_destinations(self) -> dict[str, LocalShard]:
        return {d.name: LocalShard(self._views[d.name], d.global_shape, d.mesh, d.placements)
                for d in self.destinations}

    def refit_receive_mode(self) -> dict:
        """The mode, and how many bytes of destinations this worker holds (its exact share)."""
        return {"mode": self.receive_mode, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "params": len(self.destinations),
                "bytes": sum(v.numel() * v.element_size() for v in self._views.values()),
                "loads": self.loads, "last_load_s": self.last_load_s, "check_served": self.check_served,
                "served": None if self.last_served is None else self.last_served.as_dict(),
                "served_warmup_s": self._served_check.warmup_s,
                "reprocessed": list(self.reprocessed)}

    # -- after a verified refit -------------------------------------------------------
    def _refit_in_place(self) -> bool:
        """Direct mode writes into the live parameters (unless staged: into copies of them); loader
        mode into buffers vLLM loads at commit."""
        return self.receive_mode == "direct" and super()._refit_in_place()

    def on_weights_loaded(self) -> None:
        if self.receive_mode == "loader":
            self.load_received()
        if self.check_served:
            self.check_served_weights()

    def check_served_weights(self) -> ServedReport:
        """Run every layer holding a received weight through its own kernel; raise naming those that disagree.

        The received shards passed the controller's checksums, so a layer that computes
        something else serves weights nobody verified (a private copy that was not rebuilt,
        a layout read wrongly). The worker is marked inconsistent before the error leaves,
        so it is never reported serving the new version.
        """
        report = self._served_check.run(self._views, salt=self.loads)
        self.last_served = report
        if report.mismatches:
            self.mark_weights_inconsistent(f"{len(report.mismatches)} layer(s) do not compute with the verified "
                                           f"weights: {', '.join(sorted({m.layer for m in report.mismatches}))}")
            report.raise_if_mismatched(self._refit_label())
        return report

    def load_received(self) -> None:
        """Run vLLM's loaders over the received shards under layerwise reload.

        The live weights are torn from the moment the load starts until it completes: one
        that fails part way leaves the finished layers new and the others old.
        """
        t0 = time.perf_counter()
        self.mark_weights_inconsistent("vLLM's load of the received weights is running")
        try:
            self._run_loaders()
        except Exception as e:
            self.mark_weights_inconsistent(f"vLLM's load of the received weights failed part way: "
                                           f"{type(e).__name__}: {e}")
            raise
        self.loads += 1
        self.last_load_s = time.perf_counter() - t0
        self.mark_weights_consistent()

    def load_checkpoint(self, state: Mapping[str, torch.Tensor]) -> None:
        """Whole checkpoint tensors through vLLM's own loaders, as vLLM loads a checkpoint from disk.

        The reference an exact refit reproduces bit for bit: the tests compare an engine's
        outputs after a refit with its outputs after this load of the same weights. It runs
        the same post-load steps as a refit's load, the ones vLLM's reload skips included (a
        tied head, an experts kernel's own layout). Every worker receives every tensor whole,
        so this is for tests and small models.
        """
        absent = [d.name for d in self.destinations if d.name not in state]
        if absent:
            raise LayoutError(f"load_checkpoint: {len(absent)} checkpoint tensor(s) of this engine are not in "
                              f"the state given: {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''}")
        self.mark_weights_inconsistent("vLLM's load of a whole checkpoint is running")
        self._run_loaders((d.name, state[d.name]) for d in self.destinations)
        self.mark_weights_consistent()

    def live_weights_digest(self) -> dict[str, str]:
        """A BLAKE2b digest of every live parameter's bytes, by vLLM's parameter name.

        Two loads of the same weights leave the same bytes, whatever vLLM repacked them into
        (its CPU build prepacks linear and expert weights), so an engine can be compared with
        itself after ``load_checkpoint`` without generating a token.
        """
        out = {}
        for name, p in self.model.named_parameters():
            data = p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            out[name] = hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
        return out

    def _run_loaders(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if weights is None:
            weights = ((d.name, self._loadable[d.name]) for d in self.destinations)
        initialize_layerwise_reload(self.model)
        finished = False
        try:
            with torch.no_grad():
                loaded = self.model.load_weights(weights)
            # a checkpoint name the model's loader does not match is skipped without a word, and
            # layerwise reload then puts that parameter back on its old tensor: refuse instead
            missing = sorted({d.target for d in self.destinations} - set(loaded)) if loaded is not None else []
            if missing:
                raise LayoutError(f"vLLM's loader did not load {len(missing)} parameter(s) from the tensors it "
                                  f"was given: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
            finished = True
        finally:
            # also on failure: layers that were not finished go back to their previous
            # tensors instead of staying on the meta device
            finalize_layerwise_reload(self.model, self.model_config)
            if not finished:
                log.error("refit: loading the received weights failed; unfinished layers keep their old weights")
        # layerwise reload re-processes the layers it loaded; a layer tied to one of them (an
        # output head sharing the embedding) keeps the private copy it made at start-up
        # and an experts kernel that prepacked its own layout at start-up (vLLM's CPU build) is
        # skipped by the reload's update path: the new weights would be read in the old layout
        if self.reprocess_shared:
            targets = {d.target for d in self.destinations}
            self.reprocessed = [*reprocess_sharing_layers(self.model, targets),
                                *rebuild_experts_kernels(self.model, targets)]

    def received_state(self) -> Mapping[str, torch.Tensor]:
        """The shards as received (loader mode) or as written in place (direct mode), by checkpoint name."""
        return dict(self._views)
