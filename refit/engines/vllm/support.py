"""Models a vLLM worker would serve wrong after a refit, refused by name when an engine connects.

A refit lands in loader mode through vLLM's own weight reload (``initialize_layerwise_reload``,
``model.load_weights``, ``finalize_layerwise_reload``), which re-runs each loaded layer's
``quant_method.process_weights_after_loading``. Whatever a layer computes with that the reload
does not rebuild keeps the weights the engine started with, while the bytes refit verified
sit unused in the parameters: the engine then serves outputs of neither. The worker rebuilds
what it knows the reload skips (``refit.engines.vllm.served``); a model that needs such a
rebuild on a worker told not to make it, or whose kernels would compute with other weights
than the ones a refit verified whatever the refit does (vLLM's CPU experts kernel under
expert parallelism), is refused before anything is joined, naming the architecture, the
layer and why, instead of being served wrong.

The rule is read from the model's own module graph, not from a list of model names.
"""

from __future__ import annotations

from typing import Any

import torch

from refit.engines.vllm.served import experts_kernel_copy
from refit.errors import RefitError

__all__ = ["check_model_support"]


def _kernel_ignores_expert_map(experts: object) -> bool:
    """Whether a fused-experts kernel indexes its stack of local experts by global expert ids.

    vLLM's CPU experts kernels hand ``topk_ids`` to their grouped GEMM as they come from the
    router, global ids, and drop the layer's expert map: under expert parallelism a worker
    holding global experts 2 and 3 in slots 0 and 1 computes expert 2 from a slot past its
    stack. refit's served check sees it (an expert routed alone is 0.016 off a tiny
    Qwen3-MoE's verified weights on the worker holding experts 2 and 3, exact on the one
    holding 0 and 1), and vLLM's own forward crashes that worker.
    """
    return type(experts).__module__.endswith("fused_moe.experts.cpu_moe")


def _uses_expert_parallelism(module: torch.nn.Module) -> bool:
    expert_map = getattr(module, "expert_map", None)
    if expert_map is None:
        return False
    return expert_map.tolist() != list(range(len(expert_map)))


def check_model_support(model: torch.nn.Module, model_config: Any = None, *,
                        rebuilds_kernel_copies: bool = True) -> None:
    """Raise ``RefitError`` naming the architecture when the worker would serve ``model`` wrong after a refit.

    ``rebuilds_kernel_copies``: whether the worker re-runs, after every load, the post-load
    steps vLLM's reload skips (an experts kernel's own layout of the weights).
    """
    architectures = list(getattr(model_config, "architectures", None) or []) or [type(model).__name__]
    arch = "/".join(architectures)
    for name, module in model.named_modules():
        kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if kernel is not None and _uses_expert_parallelism(module) and _kernel_ignores_expert_map(kernel):
            raise RefitError(
                f"{arch}: refit cannot serve this model with expert parallelism on this vLLM build: its routed "
                f"experts ({name}) compute through {type(kernel).__name__}, which indexes the worker's own stack "
                "of experts by global expert ids (it drops the expert map), so a worker holding experts past its "
                "first slots computes them from other weights; split the experts by tensor parallelism instead "
                "(enable_expert_parallel=False)")
    if rebuilds_kernel_copies:
        return
    for name, module in model.named_modules():
        kernel = experts_kernel_copy(module)
        if kernel is not None:
            raise RefitError(
                f"{arch}: refit cannot serve this model on this vLLM build: its routed experts ({name}) compute "
                f"through {type(kernel).__name__}, which keeps a copy of the experts' weights in its own layout "
                "that vLLM builds once at start-up and its weight reload never rebuilds, and this worker was "
                "told not to rebuild it (reprocess_shared=False): after a refit the experts would compute with "
                "bytes in the wrong layout")
