"""A small inference engine in plain torch: fused vLLM-style layout, refit written straight into it.

``EngineShard`` is one tensor-parallel rank of one generation shard. It holds a Llama- or
Qwen3-MoE-shaped decoder the way vLLM holds it: ``qkv_proj`` (``[q; k; v]`` rows of the rank),
``gate_up_proj`` (``[gate; up]`` rows of the rank), vocab-parallel embedding and head, and
routed experts as ``w13`` (``[E, 2*Ie/tp, hidden]``, per expert ``[gate; up]``) and ``w2``
(``[E, hidden, Ie/tp]``). Key/value heads are replicated when tp exceeds them: rank ``t``
holds kv head ``t // (tp / kv_heads)``.

``destinations()`` exposes those fused tensors to refit under canonical Hugging Face names
(``refit.models.specs``), one ``(DTensorRef, mesh, placements)`` per canonical param, whose
local tensor is a VIEW of the fused tensor: the q/k/v row blocks of ``qkv_proj``, the gate/up
row blocks of ``gate_up_proj``, ``w13[e, :Ie/tp]`` ... A refit writes through those views, so
after it the fused tensors are right without a copy or a load step. Meshes are the shard's
own workers ``0 .. tp-1`` (plus ``offset``): k/v are ``[Shard(0), Replicate()]`` over a
``[kv_heads, tp/kv_heads]`` mesh when tp exceeds the kv heads, so each kv head is sent once per
replica. With ``qkv="grouped"`` q/k/v use the grouped shapes of ``refit.models.megatron``
(needed to receive from a Megatron-core trainer); the default ``"plain"`` uses the HF shapes
(to receive from an HF/DTensor trainer).

``forward`` is a real tensor-parallel forward over the shard's own TP group (a ``TPComm``):
masked vocab-parallel embedding + all-reduce, column-parallel fused qkv, GQA attention with
RoPE (and Qwen3's q/k norms), row-parallel o_proj + all-reduce, fused SwiGLU MLP or top-k
routed experts + all-reduce, vocab-parallel head + all-gather. It gives full logits on every
rank, and ``generate`` greedy tokens. TP groups: ``TorchTPComm`` (a ``torch.distributed``
group), ``StatelessTPComm`` (a ``refit.StatelessProcessGroup``), ``ThreadTPComm`` (threads of
one process). Routed experts are cut by TP inside the shard, or, with ``expert_parallel=True``
(vLLM's ``enable_expert_parallel``), split whole across the shard's workers: worker ``t`` holds
experts ``t*E/tp .. (t+1)*E/tp - 1`` at full width (``w13`` ``[E/tp, 2*Ie, hidden]``), each
exposed on a one-rank mesh, so a refit sends every expert to its one owner only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Mapping, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from refit.errors import LayoutError
from refit.layout import DTensorRef, Placement, Replicate, Shard, mesh_coords_of, shard_slices
from refit.models.megatron import Entry, check_qkv_tp, grouped_local, grouped_shape, qkv_layout
from refit.models.specs import ModelSpec, load_hf_config
from refit.runtime.endpoint import EngineEndpoint

__all__ = [
    "EngineConfig",
    "EngineShard",
    "TPComm",
    "StatelessTPComm",
    "ThreadTPComm",
    "TorchTPComm",
    "hf_config_dict",
    "offset_entries",
    "random_canonical_state",
]


@dataclass(frozen=True)
class EngineConfig:
    """The model's shapes (``ModelSpec``) plus the few numbers a forward needs."""

    spec: ModelSpec
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, config: Any, *, dtype: str = "float32") -> "EngineConfig":
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


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config (object or ``to_dict()``) as a dict ``load_hf_config`` reads right.

    transformers 5 writes a Qwen-MoE config's ``num_experts`` under its alias
    ``num_local_experts`` (the Mixtral name), which would read as Mixtral expert naming.
    """
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if cfg.get("model_type") != "mixtral" and "num_local_experts" in cfg and "num_experts" not in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    return cfg


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


def offset_entries(entries: Mapping[str, Entry], offset: int) -> dict[str, Entry]:
    """The same entries with ``offset`` added to every mesh rank."""
    return {n: (t, np.asarray(m) + offset, pl) for n, (t, m, pl) in entries.items()}


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
        parts = self.all_gather(t)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        t.copy_(total)
        return t


class ThreadTPComm:
    """``TPComm`` for the TP ranks of one shard running as threads of one process (tests, in-process demos).

    ``ThreadTPComm.group(tp)`` gives one comm per rank; every rank must call each collective,
    from its own thread. Sums run in rank order, so every rank gets the same bits.
    """

    def __init__(self, shared: dict, rank: int):
        self._shared, self.rank = shared, rank

    @classmethod
    def group(cls, tp: int, *, timeout_s: float = 60.0) -> list["ThreadTPComm"]:
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
        parts = self._exchange(t)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return t.copy_(total)

    def abort(self) -> None:
        """Release ranks waiting in a collective (after one rank failed)."""
        self._shared["barrier"].abort()


class EngineShard(EngineEndpoint):
    """One TP rank of a generation shard: fused weights, canonical views, a TP forward.

    ``comm`` is the shard's TP group (``TPComm``); it may be ``None`` when ``tp_size == 1``.
    Weights start as ``fill`` (NaN by default), so a forward on a param that no refit wrote
    shows at once.
    """

    def __init__(self, config: EngineConfig, *, tp_size: int = 1, tp_rank: int = 0, comm: TPComm | None = None,
                 qkv: str = "plain", dtype: torch.dtype = torch.float32, device: Any = "cpu",
                 fill: float = float("nan"), expert_parallel: bool = False):
        s = config.spec
        if s.mla or s.attention_bias or s.num_shared_experts or s.shared_expert_intermediate_size:
            raise LayoutError(f"{s.name}: the reference engine runs Llama/Qwen3(-MoE) shapes only")
        if s.num_experts and s.expert_naming != "mlp":
            raise LayoutError(f"{s.name}: the reference engine expects Qwen-style expert names")
        if qkv not in ("plain", "grouped"):
            raise LayoutError(f"qkv must be 'plain' or 'grouped', got {qkv!r}")
        if not 0 <= tp_rank < tp_size:
            raise LayoutError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
        if tp_size > 1 and comm is None:
            raise LayoutError("an engine shard with tp_size > 1 needs its TP group (comm)")
        if expert_parallel and not s.num_experts:
            raise LayoutError(f"{s.name}: expert_parallel needs routed experts; the model has none")
        if expert_parallel and s.num_experts % tp_size:
            raise LayoutError(f"engine expert parallelism over {tp_size} workers does not divide the "
                              f"{s.num_experts} experts of {s.name}")
        check_qkv_tp(s.num_heads, s.num_kv_heads, tp_size, who=f"engine tp={tp_size}")
        checks = [("vocabulary", s.vocab_size), ("intermediate size", s.intermediate_size)]
        if not expert_parallel:
            checks.append(("expert intermediate size", s.moe_intermediate_size))
        for what, n in checks:
            if n % tp_size:
                raise LayoutError(f"engine tp={tp_size} does not divide the {what} {n} of {s.name}")
        self.config, self.spec = config, s
        self.tp, self.rank, self.comm, self.qkv = tp_size, tp_rank, comm, qkv
        self.dtype, self.device = dtype, torch.device(device)
        self.version = 0
        h, hd = s.hidden_size, s.head_dim
        self.heads = s.num_heads // tp_size
        self.kv_heads = max(s.num_kv_heads // tp_size, 1)
        self.inter = s.intermediate_size // tp_size
        self.expert_parallel = expert_parallel
        self.e_inter = s.moe_intermediate_size if expert_parallel else s.moe_intermediate_size // tp_size
        per_rank = s.num_experts // tp_size if expert_parallel else s.num_experts
        first = tp_rank * per_rank if expert_parallel else 0
        self.experts = range(first, first + per_rank)  # the routed experts this worker computes
        self.vocab = s.vocab_size // tp_size
        w: dict[str, torch.Tensor] = {}

        def new(*shape: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        w["model.embed_tokens.weight"] = new(self.vocab, h)
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}"
            w[f"{p}.input_layernorm.weight"] = new(h)
            w[f"{p}.self_attn.qkv_proj.weight"] = new((self.heads + 2 * self.kv_heads) * hd, h)
            w[f"{p}.self_attn.o_proj.weight"] = new(h, self.heads * hd)
            if s.qk_norm:
                w[f"{p}.self_attn.q_norm.weight"] = new(hd)
                w[f"{p}.self_attn.k_norm.weight"] = new(hd)
            w[f"{p}.post_attention_layernorm.weight"] = new(h)
            if s.is_moe_layer(layer):
                w[f"{p}.mlp.gate.weight"] = new(s.num_experts, h)
                w[f"{p}.mlp.experts.w13_weight"] = new(len(self.experts), 2 * self.e_inter, h)
                w[f"{p}.mlp.experts.w2_weight"] = new(len(self.experts), h, self.e_inter)
            else:
                w[f"{p}.mlp.gate_up_proj.weight"] = new(2 * self.inter, h)
                w[f"{p}.mlp.down_proj.weight"] = new(h, self.inter)
        w["model.norm.weight"] = new(h)
        if not s.tie_word_embeddings:
            w["lm_head.weight"] = new(self.vocab, h)
        self.weights = w
        self._views = self._build_views()
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- what refit sees -----------------------------------------------------------------------
    def _build_views(self) -> dict[str, Entry]:
        s, w, tp = self.spec, self.weights, self.tp
        h, hd = s.hidden_size, s.head_dim
        mesh = np.arange(tp)
        col, row, rep = (Shard(0),), (Shard(1),), (Replicate(),)
        out: dict[str, Entry] = {}

        def put(name: str, local: torch.Tensor, shape, m: np.ndarray, placements: tuple[Placement, ...]) -> None:
            out[name] = (DTensorRef(local, shape), m, placements)

        put("model.embed_tokens.weight", w["model.embed_tokens.weight"], (s.vocab_size, h), mesh, col)
        q_rows, kv_rows = self.heads * hd, self.kv_heads * hd
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}"
            a = f"{p}.self_attn"
            put(f"{p}.input_layernorm.weight", w[f"{p}.input_layernorm.weight"], (h,), mesh, rep)
            qkv = w[f"{a}.qkv_proj.weight"]
            blocks = {"q": qkv[:q_rows], "k": qkv[q_rows:q_rows + kv_rows], "v": qkv[q_rows + kv_rows:]}
            for which, local in blocks.items():
                heads = s.num_heads if which == "q" else s.num_kv_heads
                m, pl = qkv_layout(which, mesh, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                                   grouped=self.qkv == "grouped")
                if self.qkv == "grouped":
                    local = grouped_local(local, num_kv_heads=s.num_kv_heads, tp=tp)
                    shape = grouped_shape(which, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=hd,
                                          trailing=(h,))
                else:
                    shape = (heads * hd, h)
                put(f"{a}.{which}_proj.weight", local, shape, m, pl)
            put(f"{a}.o_proj.weight", w[f"{a}.o_proj.weight"], (h, s.num_heads * hd), mesh, row)
            if s.qk_norm:
                put(f"{a}.q_norm.weight", w[f"{a}.q_norm.weight"], (hd,), mesh, rep)
                put(f"{a}.k_norm.weight", w[f"{a}.k_norm.weight"], (hd,), mesh, rep)
            put(f"{p}.post_attention_layernorm.weight", w[f"{p}.post_attention_layernorm.weight"], (h,), mesh, rep)
            if s.is_moe_layer(layer):
                put(f"{p}.mlp.gate.weight", w[f"{p}.mlp.gate.weight"], (s.num_experts, h), mesh, rep)
                w13, w2 = w[f"{p}.mlp.experts.w13_weight"], w[f"{p}.mlp.experts.w2_weight"]
                ie, il = s.moe_intermediate_size, self.e_inter
                # under EP an expert lives whole on its owner: a one-rank mesh, nothing to cut
                m, c, r = (np.array([self.rank]), rep, rep) if self.expert_parallel else (mesh, col, row)
                for i, e in enumerate(self.experts):
                    x = f"{p}.mlp.experts.{e}"
                    put(f"{x}.gate_proj.weight", w13[i, :il], (ie, h), m, c)
                    put(f"{x}.up_proj.weight", w13[i, il:], (ie, h), m, c)
                    put(f"{x}.down_proj.weight", w2[i], (h, ie), m, r)
            else:
                gu = w[f"{p}.mlp.gate_up_proj.weight"]
                put(f"{p}.mlp.gate_proj.weight", gu[:self.inter], (s.intermediate_size, h), mesh, col)
                put(f"{p}.mlp.up_proj.weight", gu[self.inter:], (s.intermediate_size, h), mesh, col)
                put(f"{p}.mlp.down_proj.weight", w[f"{p}.mlp.down_proj.weight"], (h, s.intermediate_size), mesh, row)
        put("model.norm.weight", w["model.norm.weight"], (h,), mesh, rep)
        if not s.tie_word_embeddings:
            put("lm_head.weight", w["lm_head.weight"], (s.vocab_size, h), mesh, col)
        return out

    def destinations(self, offset: int = 0) -> dict[str, Entry]:
        """``{canonical_name: (DTensorRef view, mesh, placements)}``, meshes in workers ``offset + 0..tp-1``."""
        return offset_entries(self._views, offset)

    def refit_destinations(self) -> dict[str, Entry]:
        """The ``EngineEndpoint`` hook: the views, meshes in the shard's own workers ``0..tp-1``."""
        return self.destinations(0)

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
        qkv = F.linear(x, w[f"{p}.qkv_proj.weight"])
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
        return self._all_reduce(F.linear(o, w[f"{p}.o_proj.weight"]))

    def _mlp(self, p: str, x: torch.Tensor, moe: bool) -> torch.Tensor:
        w = self.weights
        if not moe:
            gate, up = F.linear(x, w[f"{p}.gate_up_proj.weight"]).split(self.inter, dim=-1)
            return self._all_reduce(F.linear(F.silu(gate) * up, w[f"{p}.down_proj.weight"]))
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(flat, w[f"{p}.gate.weight"]), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.config.num_experts_per_tok, dim=-1)
        if self.config.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(flat)
        w13, w2 = w[f"{p}.experts.w13_weight"], w[f"{p}.experts.w2_weight"]
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
        """Full logits ``[batch, seq, vocab]`` on every TP rank (every rank of the shard must call it)."""
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

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens ``[batch, max_new_tokens]`` (no KV cache: the model is tiny)."""
        ids = input_ids
        for _ in range(max_new_tokens):
            nxt = self.forward(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt.to(ids.device)], dim=1)
        return ids[:, input_ids.shape[1]:]

    def fused_numel(self) -> int:
        return sum(t.numel() for t in self.weights.values())

    def __repr__(self) -> str:
        ep = ", expert_parallel" if self.expert_parallel else ""
        return (f"EngineShard({self.spec.name}, tp={self.tp}, rank={self.rank}, qkv={self.qkv}{ep}, "
                f"version={self.version})")
