"""Backends for real inference engines: vLLM first (``refit.engines.vllm``)."""
