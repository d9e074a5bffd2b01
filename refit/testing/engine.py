"""A small inference engine in plain torch, on the fused vLLM-style layout, for checks and demos.

``EngineShard`` is one tensor-parallel rank of one generation shard. Its weights are the fused
tensors of ``refit.models.fused.FusedLayout`` (``qkv_proj``, ``gate_up_proj``, ``w13``/``w2``,
vocab-parallel embedding and head) and ``destinations()`` are that layout's canonical views, so
a refit writes straight into the tensors the forward reads.

``forward`` is a real tensor-parallel forward over the shard's own TP group (a ``TPComm``):
masked vocab-parallel embedding + all-reduce, column-parallel fused qkv, GQA attention with
RoPE (and Qwen3's q/k norms), row-parallel o_proj + all-reduce, fused SwiGLU MLP or top-k
routed experts + all-reduce, vocab-parallel head + all-gather. It gives full logits on every
rank, and ``generate`` greedy tokens: comparing them with a Hugging Face forward of the
trainer's weights is what shows that every byte landed in the right place. TP groups:
``TorchTPComm`` (a ``torch.distributed`` group), ``StatelessTPComm`` (a
``refit.StatelessProcessGroup``), ``ThreadTPComm`` (threads of one process). ``EngineWorker``
is the same engine shaped for ``refit.runtime.ray.RayFleet``; ``CanonicalTrainer`` a trainer to
refit it from.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from refit.errors import InconsistentWeights, LayoutError
from refit.layout import Shard, mesh_coords_of, shard_slices
from refit.models.fp8 import dequantize
from refit.models.fused import FusedLayout, offset_entries
from refit.models.megatron import Entry
from refit.models.specs import ModelSpec, hf_config_dict, load_hf_config
from refit.plan.quant import BlockFp8
from refit.runtime.endpoint import TrainerEndpoint
from refit.runtime.engine_endpoint import EngineEndpoint

__all__ = ["CanonicalTrainer", "EngineConfig", "EngineShard", "EngineWorker", "TPComm", "StatelessTPComm",
           "ThreadTPComm", "TorchTPComm", "on_tp_threads", "random_canonical_state", "shared_gpu"]


@dataclass(frozen=True)
class EngineConfig:
    """The model's shapes (``ModelSpec``) plus the few numbers a forward needs."""

    spec: ModelSpec
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, config: Any, *, dtype: str = "float32") -> EngineConfig:
        """From a ``transformers`` config object or its ``to_dict()`` (Llama, Qwen3, Qwen3-MoE shapes)."""
        cfg = hf_config_dict(config)
        spec = replace(load_hf_config(cfg, name=cfg.get("model_type") or "model"), dtype=dtype)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise LayoutError(f"{spec.name}: rope type {rope_type!r} is not implemented by the reference engine")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(spec=spec, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def random_canonical_state(spec: ModelSpec, *, seed: int = 0, std: float = 0.02,
                           dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every canonical tensor of ``spec``, random (norm weights near 1), the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in spec.params():
        t = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        else:
            t = std * t
        out[p.name] = t.to(dtype)
    return out


class CanonicalTrainer(TrainerEndpoint):
    """A trainer holding the canonical (HF) weights of a step (``random_canonical_state`` seeded with
    it), cut along dim 0 over the trainer ranks: the source the reference engines are refit from."""

    def __init__(self, rank: int, world_size: int, *, config: dict, threads: int = 1):
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.spec = rank, world_size, EngineConfig.from_hf(config).spec
        self.shapes = {p.name: tuple(p.shape) for p in self.spec.params()}
        self.params: dict[str, torch.Tensor] = {}
        self.set_step(0)

    def set_step(self, step: int) -> int:
        for name, full in random_canonical_state(self.spec, seed=step).items():
            local = full[shard_slices(full.shape, [self.world_size], [self.rank], [Shard(0)])].contiguous()
            if name in self.params:
                self.params[name].copy_(local)
            else:
                self.params[name] = local
        return step

    def refit_sources(self) -> dict[str, Any]:
        mesh = list(range(self.world_size))
        return {n: (t, self.shapes[n], mesh, [Shard(0)]) for n, t in self.params.items()}


class TPComm(Protocol):
    """The two collectives a tensor-parallel forward needs, over the shard's own TP group."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...  # sum, in place, returns t
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...  # by TP rank


class TorchTPComm:
    """``TPComm`` over a ``torch.distributed`` group (``None``: the default group)."""

    def __init__(self, group: Any = None):
        self.group = group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out`` := the sum of ``parts`` added in rank order, so every rank gets the same bits."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return out.copy_(total)


class StatelessTPComm:
    """``TPComm`` over a ``refit.StatelessProcessGroup`` of the shard's workers (no torch world needed).

    Built from broadcasts, one per rank, summed in rank order: every rank gets bit-identical
    results. Fine for the tiny models here; a real engine uses its NCCL group.
    """

    def __init__(self, group: Any):
        self.group = group

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for src in range(self.group.world_size):
            buf = t.contiguous().clone() if src == self.group.rank else torch.empty_like(t)
            self.group.broadcast(buf, src)
            out.append(buf)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return _sum_in_rank_order(self.all_gather(t), t)


class ThreadTPComm:
    """``TPComm`` for the TP ranks of one shard running as threads of one process (tests, in-process demos).

    ``ThreadTPComm.group(tp)`` gives one comm per rank; every rank must call each collective,
    from its own thread. Sums run in rank order, so every rank gets the same bits.
    """

    def __init__(self, shared: dict, rank: int):
        self._shared, self.rank = shared, rank

    @classmethod
    def group(cls, tp: int, *, timeout_s: float = 60.0) -> list[ThreadTPComm]:
        shared = {"buf": [None] * tp, "barrier": threading.Barrier(tp, timeout=timeout_s)}
        return [cls(shared, r) for r in range(tp)]

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        s = self._shared
        s["buf"][self.rank] = t.clone()
        s["barrier"].wait()
        out = list(s["buf"])
        s["barrier"].wait()
        return out

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(t)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return _sum_in_rank_order(self._exchange(t), t)

    def abort(self) -> None:
        """Release ranks waiting in a collective (after one rank failed)."""
        self._shared["barrier"].abort()


def on_tp_threads(shard: Sequence[EngineShard], fn: Callable[[EngineShard], Any]) -> list[Any]:
    """``fn(engine)`` for every TP rank of one shard, each on a thread of its own (every rank must join
    each collective); the results by rank. A rank that raises aborts its comm where the comm can
    abort (``ThreadTPComm``), which releases the others, and the first error is raised."""
    out: list[Any] = [None] * len(shard)
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            out[r] = fn(shard[r])
        except BaseException as e:
            errors.append(e)
            abort = getattr(shard[r].comm, "abort", None)
            if abort is not None:
                abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(shard))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


class EngineShard(EngineEndpoint):
    """One TP rank of a generation shard: fused weights, canonical views, a TP forward.

    ``comm`` is the shard's TP group (``TPComm``); it may be ``None`` when ``tp_size == 1``.
    Weights start as ``fill`` (NaN by default), so a forward on a param that no refit wrote
    shows at once.
    """

    def __init__(self, config: EngineConfig, *, tp_size: int = 1, tp_rank: int = 0, comm: TPComm | None = None,
                 qkv: str = "plain", dtype: torch.dtype = torch.float32, device: Any = "cpu",
                 fill: float = float("nan"), expert_parallel: bool = False, fp8: BlockFp8 | None = None):
        layout = FusedLayout(config.spec, tp_size=tp_size, tp_rank=tp_rank, qkv=qkv, expert_parallel=expert_parallel,
                             fp8=fp8)
        self.fp8 = fp8
        if fp8 is not None:
            self.refit_fp8_block = fp8.block
        if tp_size > 1 and comm is None:
            raise LayoutError("an engine shard with tp_size > 1 needs its TP group (comm)")
        self.config, self.spec, self.layout = config, config.spec, layout
        self.tp, self.rank, self.comm, self.qkv = tp_size, tp_rank, comm, qkv
        self.dtype, self.device = dtype, torch.device(device)
        self.version = 0
        self.heads, self.kv_heads, self.inter = layout.heads, layout.kv_heads, layout.inter
        self.expert_parallel, self.e_inter = expert_parallel, layout.expert_inter
        self.experts = layout.experts  # the routed experts this worker computes
        self.vocab = layout.vocab
        self._alloc = lambda shape: torch.full(shape, fill, dtype=dtype, device=self.device)
        self.weights, self._views = layout.build(self._alloc)
        self._standby: tuple[dict, dict] | None = None  # the second set of weights a staged refit lands in
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.step_version: int | None = None  # the weights version the last forward ran under
        self.step_times: list[float] | None = None  # when recording: the end of every forward

    # -- what refit sees -----------------------------------------------------------------------
    def destinations(self, offset: int = 0) -> dict[str, Entry]:
        """``{canonical_name: (DTensorRef view, mesh, placements)}``, meshes in workers ``offset + 0..tp-1``."""
        return offset_entries(self._views, offset)

    def refit_destinations(self) -> dict[str, Entry]:
        """The ``EngineEndpoint`` hook: the views, meshes in the shard's own workers ``0..tp-1``."""
        return self.destinations(0)

    def fp8_params(self) -> list[str]:
        """The canonical params this engine holds in FP8 (their ``_scale_inv`` grids beside them)."""
        return sorted(n for n, (ref, _, _) in self._views.items() if ref._local_tensor.dtype.itemsize == 1
                      and ref._local_tensor.dtype.is_floating_point)

    def refit_staging_destinations(self) -> dict[str, Entry]:
        """Staged refit: the views of a second set of fused weights, which ``on_weights_swap`` serves from.

        A swap of two dict references is the whole switch, so generation stalls for no copy.
        """
        if self._standby is None:
            self._standby = self.layout.build(self._alloc)
        return offset_entries(self._standby[1], 0)

    def on_weights_swap(self) -> None:
        """Serve the staged set; the old live set becomes the next refit's staging."""
        if self._standby is None:
            raise LayoutError("on_weights_swap: no staged weights (refit_staging_destinations was never asked)")
        (self.weights, self._views), self._standby = self._standby, (self.weights, self._views)

    def on_weights_loaded(self) -> None:
        """After a verified refit: the views already wrote the fused tensors; count the version."""
        self.version += 1

    def load_canonical(self, full: Mapping[str, torch.Tensor]) -> None:
        """Fill the fused tensors from full canonical (plain HF) tensors, through the same views."""
        for name, (ref, mesh, placements) in self._views.items():
            if name not in full:
                raise LayoutError(f"load_canonical: {name} is missing")
            t = full[name].reshape(ref.shape)
            coords = mesh_coords_of(np.asarray(mesh), self.rank)
            ref._local_tensor.copy_(t[shard_slices(ref.shape, np.asarray(mesh).shape, coords, placements)])

    # -- forward ---------------------------------------------------------------------------------
    def _linear(self, name: str) -> torch.Tensor:
        """A linear layer's fused weight for the matmul: an FP8 engine dequantizes it (weight x scale
        of its block), which is what a GPU kernel computes inside its matmul."""
        w = self.weights[name]
        if self.fp8 is None:
            return w
        return dequantize(w, self.weights[name + "_scale_inv"], self.fp8).to(self.dtype)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t) if self.tp > 1 else t

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * x32.to(x.dtype)

    def _rope(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq not in self._rope_cache:
            hd = self.spec.head_dim
            inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache[seq] = (emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype))
        return self._rope_cache[seq]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _attention(self, p: str, x: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.weights
        b, n, _ = x.shape
        hd = s.head_dim
        qkv = F.linear(x, self._linear(f"{p}.qkv_proj.weight"))
        q, k, v = qkv.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q = q.view(b, n, self.heads, hd)
        k = k.view(b, n, self.kv_heads, hd)
        v = v.view(b, n, self.kv_heads, hd)
        if s.qk_norm:
            q = self._rms(q, w[f"{p}.q_norm.weight"])
            k = self._rms(k, w[f"{p}.k_norm.weight"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = self._rope(n)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (hd ** -0.5)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, self.heads * hd)
        return self._all_reduce(F.linear(o, self._linear(f"{p}.o_proj.weight")))

    def _mlp(self, p: str, x: torch.Tensor, moe: bool) -> torch.Tensor:
        w = self.weights
        if not moe:
            gate, up = F.linear(x, self._linear(f"{p}.gate_up_proj.weight")).split(self.inter, dim=-1)
            return self._all_reduce(F.linear(F.silu(gate) * up, self._linear(f"{p}.down_proj.weight")))
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(flat, w[f"{p}.gate.weight"]), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.config.num_experts_per_tok, dim=-1)
        if self.config.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(flat)
        w13, w2 = self._linear(f"{p}.experts.w13_weight"), self._linear(f"{p}.experts.w2_weight")
        for i, e in enumerate(self.experts):
            tok, pos = torch.where(top_i == e)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(flat[tok], w13[i]).split(self.e_inter, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[i]) * top_w[tok, pos, None]
            out.index_add_(0, tok, y)
        return self._all_reduce(out).view(shape)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits ``[batch, seq, vocab]`` on every TP rank (every rank of the shard must call it).

        Refuses (``InconsistentWeights``) while a refit that wrote into the weights has not
        completed: torn weights give plausible logits of no model at all.
        """
        with self.serving_step():
            self._check_shard_consistent()
            self.step_version = self.weights_version
            logits = self._forward(input_ids)
        if self.step_times is not None:
            self.step_times.append(time.perf_counter())
        return logits

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.weights
        ids = input_ids.to(self.device)
        lo = self.rank * self.vocab
        inside = (ids >= lo) & (ids < lo + self.vocab)
        x = F.embedding((ids - lo).clamp(0, self.vocab - 1), w["model.embed_tokens.weight"])
        x = self._all_reduce(x * inside.unsqueeze(-1).to(x.dtype))
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}"
            x = x + self._attention(f"{p}.self_attn", self._rms(x, w[f"{p}.input_layernorm.weight"]))
            h = self._rms(x, w[f"{p}.post_attention_layernorm.weight"])
            x = x + self._mlp(f"{p}.mlp", h, s.is_moe_layer(layer))
        x = self._rms(x, w["model.norm.weight"])
        head = w["model.embed_tokens.weight"] if s.tie_word_embeddings else w["lm_head.weight"]
        logits = F.linear(x, head)
        if self.tp > 1:
            logits = torch.cat(self.comm.all_gather(logits), dim=-1)
        return logits

    def _check_shard_consistent(self) -> None:
        """Every TP rank refuses when any rank of the shard is torn; one refusing alone would leave
        the others waiting in the forward's first collective.

        Staged, the ranks also agree on the version: the controller's commit reaches the
        workers of a shard one by one, so a step may start with some of them switched. A rank
        behind that prepared the staged weights switches now (the controller commits only
        after every worker prepared, so a peer's switch is the decision); if one cannot, every
        rank refuses the step rather than compute it from two versions.
        """
        state = self.refit_weights_state()
        mine = state["consistent"]
        if self.tp > 1:
            staged = state["staged"]
            me = [0.0 if mine else 1.0, -1.0 if state["version"] is None else float(state["version"]),
                  1.0 if self._refit_state().weights.prepared_epoch != -1 else 0.0]
            rows = torch.stack(self.comm.all_gather(torch.tensor(me, dtype=torch.float64, device=self.device))).cpu()
            torn, versions, prepared = rows[:, 0], rows[:, 1], rows[:, 2]
            top = versions.max().item()
            if staged and versions.min().item() < top:
                behind = versions < top
                if not bool((prepared[behind] > 0).all()):
                    raise InconsistentWeights(f"{self._refit_label()}: refusing to serve: the workers of this shard "
                                              f"hold versions {versions.tolist()} and one behind cannot switch")
                if me[1] < top:
                    self.refit_catch_up(int(top))
            if mine and torn.sum().item() > 0:
                raise InconsistentWeights(f"{self._refit_label()}: refusing to serve: another worker of this shard "
                                          "holds torn weights; a refit must complete first")
        self.check_weights_consistent()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens ``[batch, max_new_tokens]`` (no KV cache: the model is tiny).

        ``last_versions`` then holds the weights version each token was produced under: a
        staged refit may switch between two tokens of one sequence.
        """
        return self.generate_versioned(input_ids, max_new_tokens)[0]

    @torch.no_grad()
    def generate_versioned(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, list]:
        """``generate``, and the weights version of every token."""
        ids, versions = input_ids, []
        for _ in range(max_new_tokens):
            nxt = self.forward(ids)[:, -1].argmax(-1, keepdim=True)
            versions.append(self.step_version)
            ids = torch.cat([ids, nxt.to(ids.device)], dim=1)
        self.last_versions = versions
        return ids[:, input_ids.shape[1]:], versions

    def __repr__(self) -> str:
        ep = ", expert_parallel" if self.expert_parallel else ""
        return (f"EngineShard({self.spec.name}, tp={self.tp}, rank={self.rank}, qkv={self.qkv}{ep}, "
                f"version={self.version})")


class EngineWorker(EngineShard):
    """An engine shard shaped for ``refit.runtime.ray.RayFleet``: ``EngineWorker(shard=, worker=, workers_per_shard=)``.

    ``config`` is an HF config or its ``to_dict()`` (transformers is not imported). A shard of
    more than one worker needs its TP group: give ``tp_port`` (a ``StatelessProcessGroup``
    rendezvous hosted by worker 0 of the shard, with ``tp_secret``, the same fresh secret on
    every worker of the shard), or call ``connect_tp`` later, e.g. after a restart, with a
    fresh port and secret. ``share_gpus=G`` puts worker ``w`` of shard ``s`` on GPU
    ``(s + w) % G`` of the host (``shared_gpu``), so a shard's workers never share one.
    """

    def __init__(self, shard: int, worker: int, workers_per_shard: int, *, config: Any, qkv: str = "plain",
                 tp_port: int | None = None, tp_addr: str = "127.0.0.1", tp_secret: bytes | str | None = None,
                 threads: int = 1, device: str = "cpu",
                 share_gpus: int | None = None, visible_devices: str | None = None, **kwargs: Any):
        torch.set_num_threads(threads)
        if share_gpus:  # a shard's workers on distinct GPUs (its TP group is NCCL), shards staggered
            device = shared_gpu((shard + worker) % share_gpus, visible_devices)
        elif torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device).index or 0)
        kwargs["device"] = device
        self.device = torch.device(device)  # _connect, below, runs before EngineShard.__init__ sets it
        self.shard = shard
        self._tp_group = None
        comm = None
        if workers_per_shard > 1 and tp_port is not None:
            comm = self._connect(tp_addr, tp_port, worker, workers_per_shard, tp_secret)
        super().__init__(EngineConfig.from_hf(config), tp_size=workers_per_shard, tp_rank=worker,
                         comm=comm if comm is not None else _Unconnected(), qkv=qkv, **kwargs)
        if workers_per_shard == 1:
            self.comm = None

    def _connect(self, addr: str, port: int, worker: int, workers: int, secret: bytes | str | None) -> StatelessTPComm:
        from refit.comm.group import StatelessProcessGroup

        if self._tp_group is not None:
            self._tp_group.abort()
        cuda = self.device.type == "cuda"
        self._tp_group = StatelessProcessGroup(addr, port, worker, workers, name=f"engine-tp/{self.shard}",
                                               backend="nccl" if cuda else "gloo", device=self.device if cuda else None,
                                               secret=secret)
        return StatelessTPComm(self._tp_group)

    def connect_tp(self, port: int, addr: str = "127.0.0.1", secret: bytes | str | None = None) -> None:
        """(Re)build this shard's TP group; every worker of the shard calls it with the same port and secret."""
        self.comm = self._connect(addr, port, self.rank, self.tp, secret)

    def close(self) -> None:
        """Abort this worker's TP group (idempotent)."""
        if self._tp_group is not None:
            self._tp_group.abort()
            self._tp_group = None

    def logits(self, prompt: Sequence[int], new_tokens: int = 4) -> dict:
        """Logits and greedy tokens on ``prompt`` (collective over the shard's workers)."""
        ids = torch.tensor([list(prompt)])
        logits = self.forward(ids).cpu()
        tokens, versions = self.generate_versioned(ids, new_tokens)
        return {"logits": logits, "tokens": tokens.cpu(), "version": self.version, "weights_version": versions[-1]}

    # -- a serving loop: generation that goes on while refits land -----------------------------
    def start_serving(self, prompt: Sequence[int], new_tokens: int = 8, *, batch: int = 1) -> None:
        """Generate ``batch`` requests of ``new_tokens`` on ``prompt`` at a time, back to back, on a thread,
        until ``stop_serving``.

        Every worker of the shard runs it (its forward is collective). A refused step (torn
        weights, or none committed yet) waits for the weights to change, not for a fixed time.
        """
        if getattr(self, "_serve_thread", None) is not None:
            raise LayoutError("start_serving: already serving")
        self._serve_stop = threading.Event()
        self._serve_log = {"requests": [], "refused": 0, "error": None, "started": time.perf_counter()}
        self.step_times = []
        self._serve_thread = threading.Thread(target=self._serve_loop, args=(list(prompt), new_tokens, batch),
                                              name="engine-serving", daemon=True)
        self._serve_thread.start()

    def _serve_loop(self, prompt: list[int], new_tokens: int, batch: int) -> None:
        ids, log = torch.tensor([prompt] * batch), self._serve_log
        try:
            while True:
                stop = self._serve_stop.is_set()
                if self.tp > 1:  # the shard's workers stop at the same request, or one waits in a collective
                    flags = self.comm.all_gather(torch.tensor([1.0 if stop else 0.0], device=self.device))
                    stop = any(f.item() > 0 for f in flags)
                if stop:
                    return
                try:
                    tokens, versions = self.generate_versioned(ids, new_tokens)
                except InconsistentWeights:
                    log["refused"] += 1
                    self.refit_wait_version(None, timeout_s=0.5)
                    continue
                log["requests"].append({"versions": versions, "tokens": tokens[0].tolist(),
                                        "end": time.perf_counter()})
        except Exception as e:  # reported by stop_serving
            log["error"] = f"{type(e).__name__}: {e}"

    def serving_requests(self) -> int:
        """Requests completed by the serving loop so far."""
        return len(self._serve_log["requests"]) if getattr(self, "_serve_log", None) else 0

    def stop_serving(self, timeout_s: float = 60.0) -> dict:
        """Stop the serving loop; its ``requests`` (tokens, versions), ``step_times``, ``refused`` steps."""
        thread = getattr(self, "_serve_thread", None)
        if thread is None:
            raise LayoutError("stop_serving: not serving")
        self._serve_stop.set()
        thread.join(timeout_s)
        if thread.is_alive():
            raise LayoutError(f"stop_serving: the serving loop did not stop within {timeout_s}s")
        self._serve_thread = None
        out = dict(self._serve_log, step_times=list(self.step_times or ()), stopped=time.perf_counter())
        self.step_times = None
        return out


class _Unconnected:
    def all_reduce(self, t):
        raise LayoutError("this engine shard's TP group is not connected: call connect_tp(port) on every worker")

    all_gather = all_reduce


def shared_gpu(index: int, visible_devices: str | None) -> str:
    """Select GPU ``index`` in a process that Ray gave no GPU of its own; returns the device.

    Ray hides every GPU from an actor that asked for none, but ranks that share GPUs (the
    NIXL transport, whose CUDA IPC needs the peers' GPUs visible) must see them all:
    ``visible_devices`` is the driver's ``CUDA_VISIBLE_DEVICES`` (None: every GPU). Must run
    before this process touches CUDA.
    """
    if torch.cuda.is_initialized():
        raise LayoutError("shared_gpu: CUDA is already initialised in this process; choose the GPU first")
    if visible_devices is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    if not 0 <= index < torch.cuda.device_count():
        raise LayoutError(f"shared_gpu: GPU {index} requested, this process sees {torch.cuda.device_count()}")
    torch.cuda.set_device(index)
    return f"cuda:{index}"
