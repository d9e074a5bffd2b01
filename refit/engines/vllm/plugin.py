"""vLLM's plugin hook: registers refit's weight-transfer backend as ``"refit"`` in every vLLM process.

vLLM calls the ``vllm.general_plugins`` entry points in the engine and in each worker
process (``load_general_plugins``), which is where the engine-side factory is consulted;
registering from the trainer's process alone would leave the workers without it.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the engine and trainer sides under ``"refit"`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    module = "refit.engines.vllm.transfer_engine"
    if "refit" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("refit", module, "RefitWeightTransferEngine")
    if "refit" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("refit", module, "RefitTrainerWeightTransferEngine")
