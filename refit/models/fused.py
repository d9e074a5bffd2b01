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
from refit.plan.quant import BlockFp8

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
    fp8: BlockFp8 | None = None  # linear weights in block-scaled FP8, each with its fused ``_scale_inv``

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
        if self.fp8 is not None:
            self._check_fp8()

    def _check_fp8(self) -> None:
        """Every fused FP8 tensor must split into its canonical parts, and over TP, on block boundaries:
        the engine keeps one scale grid per fused tensor, so a part cut inside a block has no scales."""
        s, (br, bc) = self.spec, self.fp8.block
        if self.qkv != "plain":
            raise LayoutError("FP8 engine weights take the plain q/k/v layout (qkv='plain')")
        rows = [("q rows of a rank", self.heads * s.head_dim, br),
                ("k/v rows of a rank", self.kv_heads * s.head_dim, br),
                ("o_proj columns of a rank", self.heads * s.head_dim, bc),
                ("gate/up rows of a rank", self.inter, br), ("down_proj columns of a rank", self.inter, bc)]
        if s.num_experts:
            rows += [("expert gate/up rows of a rank", self.expert_inter, br),
                     ("expert down_proj columns of a rank", self.expert_inter, bc)]
        for what, n, block in rows:
            if n % block:
                raise LayoutError(f"{s.name} at engine tp={self.tp_size}: the {what}, {n}, are not a whole number "
                                  f"of {block}-element FP8 blocks; this engine cannot pad them, so keep it in "
                                  "bf16 or pick a TP size that cuts on block boundaries")

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
    def build(self, new: Callable[[tuple[int, ...]], torch.Tensor], *,
              fp8_new: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
              scale_new: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
              ) -> tuple[dict[str, torch.Tensor], dict[str, Entry]]:
        """This rank's fused tensors, each made by ``new(local_shape)``, and the canonical views into them.

        With ``fp8``, the linear layers' fused weights are made by ``fp8_new`` in FP8 and each
        gets a fused ``<name>_scale_inv`` grid (``scale_new``, float32) beside it, viewed under
        the canonical ``<canonical>_scale_inv`` names like the weights.

        Returns ``(fused, views)``: ``{vLLM name: tensor}`` in checkpoint order and
        ``{canonical_name: (DTensorRef view, mesh, placements)}``, meshes in the shard's own
        workers ``0 .. tp-1`` (``offset_entries`` moves them).
        """
        builder = _FusedBuilder(self, new, fp8_new, scale_new)
        h = self.spec.hidden_size
        builder.own("model.embed_tokens.weight", (self.vocab, h), (self.spec.vocab_size, h), builder.col)
        for layer in range(self.spec.num_layers):
            builder.layer(layer)
        builder.own("model.norm.weight", (h,), (h,), builder.rep)
        if not self.spec.tie_word_embeddings:
            builder.own("lm_head.weight", (self.vocab, h), (self.spec.vocab_size, h), builder.col)
        return builder.fused, builder.out


class _FusedBuilder:
    """Makes one rank's fused tensors (``fused``) and the canonical views into them (``out``), layer by layer."""

    col, row, rep = (Shard(0),), (Shard(1),), (Replicate(),)

    def __init__(self, layout: FusedLayout, new: Callable[[tuple[int, ...]], torch.Tensor],
                 fp8_new: Callable[[tuple[int, ...]], torch.Tensor] | None,
                 scale_new: Callable[[tuple[int, ...]], torch.Tensor] | None):
        self.layout, self.spec, self.new, self.fp8 = layout, layout.spec, new, layout.fp8
        if self.fp8 is not None:
            dtype = getattr(torch, self.fp8.dtype_name)
            fp8_new = fp8_new or (lambda shape: new(shape).to(dtype))
            scale_new = scale_new or (lambda shape: new(shape).to(torch.float32))
        self.fp8_new, self.scale_new = fp8_new, scale_new
        self.mesh = np.arange(layout.tp_size)
        self.fused: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        self.out: dict[str, Entry] = {}

    def hold(self, name: str, *shape: int) -> torch.Tensor:
        self.fused[name] = self.new(shape)
        return self.fused[name]

    def hold_linear(self, name: str, *shape: int) -> torch.Tensor:
        """A linear layer's fused weight: in FP8 with its scale grid beside it, when the engine is FP8."""
        if self.fp8 is None:
            return self.hold(name, *shape)
        self.fused[name] = self.fp8_new(shape)
        self.fused[name + "_scale_inv"] = self.scales[name] = self.scale_new(self.fp8.scale_shape(shape))
        return self.fused[name]

    def scale_rows(self, name: str, lo: int, hi: int, *lead: int) -> torch.Tensor | None:
        """The scale rows of the fused weight's rows ``lo:hi`` (block-aligned, checked at construction)."""
        if self.fp8 is None:
            return None
        return self.scales[name][(*lead, slice(lo // self.fp8.block[0], -(-hi // self.fp8.block[0])))]

    def put(self, name: str, local: torch.Tensor, shape, m: np.ndarray, placements: tuple[Placement, ...],
            scale: torch.Tensor | None = None) -> None:
        self.out[name] = (DTensorRef(local, shape), m, placements)
        if self.fp8 is not None and scale is not None:
            self.out[name + "_scale_inv"] = (DTensorRef(scale, self.fp8.scale_shape(shape)), m, placements)

    def own(self, name: str, local_shape: tuple[int, ...], shape: tuple[int, ...], placements) -> None:
        """An unfused param: the canonical name is its own."""
        self.put(name, self.hold(name, *local_shape), shape, self.mesh, placements)

    def own_linear(self, name: str, local_shape: tuple[int, ...], shape: tuple[int, ...], placements) -> None:
        self.put(name, self.hold_linear(name, *local_shape), shape, self.mesh, placements, self.scales.get(name))

    def layer(self, layer: int) -> None:
        h, p = self.spec.hidden_size, f"model.layers.{layer}"
        self.own(f"{p}.input_layernorm.weight", (h,), (h,), self.rep)
        self.attention(f"{p}.self_attn")
        self.own(f"{p}.post_attention_layernorm.weight", (h,), (h,), self.rep)
        if self.spec.is_moe_layer(layer):
            self.experts(p)
        else:
            self.mlp(p)

    def attention(self, a: str) -> None:
        s, lay, h, hd = self.spec, self.layout, self.spec.hidden_size, self.spec.head_dim
        q_rows, kv_rows = lay.heads * hd, lay.kv_heads * hd
        qkv = self.hold_linear(f"{a}.qkv_proj.weight", q_rows + 2 * kv_rows, h)
        spans = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        for which, (lo, hi) in spans.items():
            local = qkv[lo:hi]
            heads = s.num_heads if which == "q" else s.num_kv_heads
            m, pl = qkv_layout(which, self.mesh, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                               grouped=lay.qkv == "grouped")
            if lay.qkv == "grouped":
                local = grouped_local(local, num_kv_heads=s.num_kv_heads, tp=lay.tp_size)
                shape = grouped_shape(which, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=hd,
                                      trailing=(h,))
            else:
                shape = (heads * hd, h)
            self.put(f"{a}.{which}_proj.weight", local, shape, m, pl, self.scale_rows(f"{a}.qkv_proj.weight", lo, hi))
        self.own_linear(f"{a}.o_proj.weight", (h, q_rows), (h, s.num_heads * hd), self.row)
        if s.qk_norm:
            self.own(f"{a}.q_norm.weight", (hd,), (hd,), self.rep)
            self.own(f"{a}.k_norm.weight", (hd,), (hd,), self.rep)

    def experts(self, p: str) -> None:
        s, lay, h = self.spec, self.layout, self.spec.hidden_size
        self.own(f"{p}.mlp.gate.weight", (s.num_experts, h), (s.num_experts, h), self.rep)
        ie, il, n = s.moe_intermediate_size, lay.expert_inter, len(lay.experts)
        w13n, w2n = f"{p}.mlp.experts.w13_weight", f"{p}.mlp.experts.w2_weight"
        w13 = self.hold_linear(w13n, n, 2 * il, h)
        w2 = self.hold_linear(w2n, n, h, il)
        # under EP an expert lives whole on its owner: a one-rank mesh, nothing to cut
        m, c, r = ((np.array([lay.tp_rank]), self.rep, self.rep) if lay.expert_parallel
                   else (self.mesh, self.col, self.row))
        for i, e in enumerate(lay.experts):
            x = f"{p}.mlp.experts.{e}"
            down_scale = self.scales[w2n][i] if self.fp8 is not None else None
            self.put(f"{x}.gate_proj.weight", w13[i, :il], (ie, h), m, c, self.scale_rows(w13n, 0, il, i))
            self.put(f"{x}.up_proj.weight", w13[i, il:], (ie, h), m, c, self.scale_rows(w13n, il, 2 * il, i))
            self.put(f"{x}.down_proj.weight", w2[i], (h, ie), m, r, down_scale)

    def mlp(self, p: str) -> None:
        s, inter, h = self.spec, self.layout.inter, self.spec.hidden_size
        gun = f"{p}.mlp.gate_up_proj.weight"
        gu = self.hold_linear(gun, 2 * inter, h)
        self.put(f"{p}.mlp.gate_proj.weight", gu[:inter], (s.intermediate_size, h), self.mesh, self.col,
                 self.scale_rows(gun, 0, inter))
        self.put(f"{p}.mlp.up_proj.weight", gu[inter:], (s.intermediate_size, h), self.mesh, self.col,
                 self.scale_rows(gun, inter, 2 * inter))
        self.own_linear(f"{p}.mlp.down_proj.weight", (h, inter), (h, s.intermediate_size), self.row)
