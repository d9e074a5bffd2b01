"""The vLLM-style fused engine layout, with canonical Hugging Face names as views into it.

An engine rank holds a Llama- or Qwen3-MoE-shaped decoder the way vLLM holds it:
``qkv_proj`` (``[q; k; v]`` rows of the rank), ``gate_up_proj`` (``[gate; up]`` rows of the
rank), vocab-parallel embedding and head, and routed experts as ``w13``
(``[E, 2*Ie/tp, hidden]``, per expert ``[gate; up]``) and ``w2`` (``[E, hidden, Ie/tp]``).
Key/value heads are replicated when tp exceeds them: rank ``t`` holds kv head
``t // (tp / kv_heads)``.

``FusedLayout.build`` makes those fused tensors and exposes them to refit under canonical names
(``refit.models.specs``), one ``(DTensorRef, mesh, placements)`` per canonical param, whose
local tensor is a VIEW of the fused tensor: the q/k/v row blocks of ``qkv_proj``, the gate/up
row blocks of ``gate_up_proj``, ``w13[e, :Ie/tp]`` ... A refit writes through those views, so
after it the fused tensors are right without a copy or a load step: a temporary per-param
buffer would double the engine's peak memory on a large model. Meshes are the shard's own
workers ``0 .. tp-1``: k/v are ``[Shard(0), Replicate()]`` over a ``[kv_heads, tp/kv_heads]``
mesh when tp exceeds the kv heads, so each kv head is sent once per replica. With
``qkv="grouped"`` q/k/v use the grouped shapes of ``refit.models.megatron`` (needed to receive
from a Megatron-core trainer); the default ``"plain"`` uses the HF shapes (to receive from an
HF/DTensor trainer). With ``expert_parallel=True`` (vLLM's ``enable_expert_parallel``) the
routed experts are split whole across the shard's workers: worker ``t`` holds experts
``t*E/tp .. (t+1)*E/tp - 1`` at full width, each exposed on a one-rank mesh, so a refit sends
every expert to its one owner only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from refit.errors import LayoutError
from refit.layout import DTensorRef, Placement, Replicate, Shard
from refit.models.megatron import Entry, check_qkv_tp, grouped_local, grouped_shape, qkv_layout
from refit.models.specs import ModelSpec

__all__ = ["FusedLayout", "offset_entries"]


def offset_entries(entries: Mapping[str, Entry], offset: int) -> dict[str, Entry]:
    """The same entries with ``offset`` added to every mesh rank."""
    return {n: (t, np.asarray(m) + offset, pl) for n, (t, m, pl) in entries.items()}


@dataclass(frozen=True)
class FusedLayout:
    """One TP rank of a vLLM-style engine shard: its fused tensors' shapes and the canonical views into them.

    The checks run at construction, so a layout the engine could not hold fails before any
    memory is allocated.
    """

    spec: ModelSpec
    tp_size: int = 1
    tp_rank: int = 0
    qkv: str = "plain"
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        s, tp = self.spec, self.tp_size
        if s.mla or s.attention_bias or s.num_shared_experts or s.shared_expert_intermediate_size:
            raise LayoutError(f"{s.name}: the fused engine layout holds Llama/Qwen3(-MoE) shapes only")
        if s.num_experts and s.expert_naming != "mlp":
            raise LayoutError(f"{s.name}: the fused engine layout expects Qwen-style expert names")
        if self.qkv not in ("plain", "grouped"):
            raise LayoutError(f"qkv must be 'plain' or 'grouped', got {self.qkv!r}")
        if not 0 <= self.tp_rank < tp:
            raise LayoutError(f"tp_rank {self.tp_rank} outside tp_size {tp}")
        if self.expert_parallel and not s.num_experts:
            raise LayoutError(f"{s.name}: expert_parallel needs routed experts; the model has none")
        if self.expert_parallel and s.num_experts % tp:
            raise LayoutError(f"engine expert parallelism over {tp} workers does not divide the "
                              f"{s.num_experts} experts of {s.name}")
        check_qkv_tp(s.num_heads, s.num_kv_heads, tp, who=f"engine tp={tp}")
        checks = [("vocabulary", s.vocab_size), ("intermediate size", s.intermediate_size)]
        if not self.expert_parallel:
            checks.append(("expert intermediate size", s.moe_intermediate_size))
        for what, n in checks:
            if n % tp:
                raise LayoutError(f"engine tp={tp} does not divide the {what} {n} of {s.name}")

    # -- what one rank holds -------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.spec.num_heads // self.tp_size

    @property
    def kv_heads(self) -> int:
        return max(self.spec.num_kv_heads // self.tp_size, 1)

    @property
    def inter(self) -> int:
        return self.spec.intermediate_size // self.tp_size

    @property
    def expert_inter(self) -> int:
        ie = self.spec.moe_intermediate_size
        return ie if self.expert_parallel else ie // self.tp_size

    @property
    def experts(self) -> range:
        """The routed experts this rank holds (all of them unless ``expert_parallel``)."""
        e = self.spec.num_experts
        if not self.expert_parallel:
            return range(e)
        per_rank = e // self.tp_size
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    @property
    def vocab(self) -> int:
        return self.spec.vocab_size // self.tp_size

    # -- the tensors and what refit sees --------------------------------------------------------
    def build(self, new: Callable[[tuple[int, ...]], torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Entry]]:
        """This rank's fused tensors, each made by ``new(local_shape)``, and the canonical views into them.

        Returns ``(fused, views)``: ``{vLLM name: tensor}`` in checkpoint order and
        ``{canonical_name: (DTensorRef view, mesh, placements)}``, meshes in the shard's own
        workers ``0 .. tp-1`` (``offset_entries`` moves them).
        """
        fused: dict[str, torch.Tensor] = {}

        def hold(name: str, *shape: int) -> torch.Tensor:
            fused[name] = new(shape)
            return fused[name]

        s, tp = self.spec, self.tp_size
        h, hd = s.hidden_size, s.head_dim
        mesh = np.arange(tp)
        col, row, rep = (Shard(0),), (Shard(1),), (Replicate(),)
        out: dict[str, Entry] = {}

        def put(name: str, local: torch.Tensor, shape, m: np.ndarray, placements: tuple[Placement, ...]) -> None:
            out[name] = (DTensorRef(local, shape), m, placements)

        def own(name: str, local_shape: tuple[int, ...], shape: tuple[int, ...], placements) -> None:
            put(name, hold(name, *local_shape), shape, mesh, placements)  # unfused: the canonical name is its own

        own("model.embed_tokens.weight", (self.vocab, h), (s.vocab_size, h), col)
        q_rows, kv_rows = self.heads * hd, self.kv_heads * hd
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}"
            a = f"{p}.self_attn"
            own(f"{p}.input_layernorm.weight", (h,), (h,), rep)
            qkv = hold(f"{a}.qkv_proj.weight", q_rows + 2 * kv_rows, h)
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
            own(f"{a}.o_proj.weight", (h, q_rows), (h, s.num_heads * hd), row)
            if s.qk_norm:
                own(f"{a}.q_norm.weight", (hd,), (hd,), rep)
                own(f"{a}.k_norm.weight", (hd,), (hd,), rep)
            own(f"{p}.post_attention_layernorm.weight", (h,), (h,), rep)
            if s.is_moe_layer(layer):
                own(f"{p}.mlp.gate.weight", (s.num_experts, h), (s.num_experts, h), rep)
                ie, il, n = s.moe_intermediate_size, self.expert_inter, len(self.experts)
                w13 = hold(f"{p}.mlp.experts.w13_weight", n, 2 * il, h)
                w2 = hold(f"{p}.mlp.experts.w2_weight", n, h, il)
                # under EP an expert lives whole on its owner: a one-rank mesh, nothing to cut
                m, c, r = (np.array([self.tp_rank]), rep, rep) if self.expert_parallel else (mesh, col, row)
                for i, e in enumerate(self.experts):
                    x = f"{p}.mlp.experts.{e}"
                    put(f"{x}.gate_proj.weight", w13[i, :il], (ie, h), m, c)
                    put(f"{x}.up_proj.weight", w13[i, il:], (ie, h), m, c)
                    put(f"{x}.down_proj.weight", w2[i], (h, ie), m, r)
            else:
                gu = hold(f"{p}.mlp.gate_up_proj.weight", 2 * self.inter, h)
                put(f"{p}.mlp.gate_proj.weight", gu[:self.inter], (s.intermediate_size, h), mesh, col)
                put(f"{p}.mlp.up_proj.weight", gu[self.inter:], (s.intermediate_size, h), mesh, col)
                own(f"{p}.mlp.down_proj.weight", (h, self.inter), (h, s.intermediate_size), row)
        own("model.norm.weight", (h,), (h,), rep)
        if not s.tie_word_embeddings:
            own("lm_head.weight", (self.vocab, h), (s.vocab_size, h), col)
        return fused, out
