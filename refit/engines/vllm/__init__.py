"""refit as a backend of vLLM: shard-to-shard refits into real vLLM engines.

- ``refit.engines.vllm.transfer_engine``: vLLM's weight-transfer API, engine side and
  trainer side, registered as ``"refit"`` (``WeightTransferConfig(backend="refit")``).
- ``refit.engines.vllm.engine``: vLLM engines under ``ReshardWeightSynchronizer``, with its
  recovery: ``VllmEngineHost`` runs an ``LLM`` (in a process or a Ray actor of its own) and
  ``VllmEngine`` turns it into one shard of worker handles.
- ``refit.engines.vllm.worker``: the endpoint inside each vLLM worker (loader and direct
  receive modes); ``destinations``: where every checkpoint tensor lands in a worker.

Nothing here imports vLLM until it is used, so the rest of refit runs without it.
"""
