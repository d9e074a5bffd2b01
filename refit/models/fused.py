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
        fused: dict[str, torch.Tensor] = {}
        fp8 = self.fp8
        if fp8 is not None:
            dtype = getattr(torch, fp8.dtype_name)
            fp8_new = fp8_new or (lambda shape: new(shape).to(dtype))
            scale_new = scale_new or (lambda shape: new(shape).to(torch.float32))
        scales: dict[str, torch.Tensor] = {}

        def hold(name: str, *shape: int) -> torch.Tensor:
            fused[name] = new(shape)
            return fused[name]

        def hold_linear(name: str, *shape: int) -> torch.Tensor:
            """A linear layer's fused weight: in FP8 with its scale grid beside it, when the engine is FP8."""
            if fp8 is None:
                return hold(name, *shape)
            fused[name] = fp8_new(shape)
            fused[name + "_scale_inv"] = scales[name] = scale_new(fp8.scale_shape(shape))
            return fused[name]

        def scale_rows(name: str, lo: int, hi: int, *lead: int) -> torch.Tensor:
            """The scale rows of the fused weight's rows ``lo:hi`` (block-aligned, checked at construction)."""
            return scales[name][(*lead, slice(lo // fp8.block[0], -(-hi // fp8.block[0])))]

        s, tp = self.spec, self.tp_size
        h, hd = s.hidden_size, s.head_dim
        mesh = np.arange(tp)
        col, row, rep = (Shard(0),), (Shard(1),), (Replicate(),)
        out: dict[str, Entry] = {}

        def put(name: str, local: torch.Tensor, shape, m: np.ndarray, placements: tuple[Placement, ...],
                scale: torch.Tensor | None = None) -> None:
            out[name] = (DTensorRef(local, shape), m, placements)
            if fp8 is not None and scale is not None:
                out[name + "_scale_inv"] = (DTensorRef(scale, fp8.scale_shape(shape)), m, placements)

        def own(name: str, local_shape: tuple[int, ...], shape: tuple[int, ...], placements) -> None:
            put(name, hold(name, *local_shape), shape, mesh, placements)  # unfused: the canonical name is its own

        def own_linear(name: str, local_shape: tuple[int, ...], shape: tuple[int, ...], placements) -> None:
            local = hold_linear(name, *local_shape)
            put(name, local, shape, mesh, placements, scales.get(name))

        own("model.embed_tokens.weight", (self.vocab, h), (s.vocab_size, h), col)
        q_rows, kv_rows = self.heads * hd, self.kv_heads * hd
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}"
            a = f"{p}.self_attn"
            own(f"{p}.input_layernorm.weight", (h,), (h,), rep)
            qkv = hold_linear(f"{a}.qkv_proj.weight", q_rows + 2 * kv_rows, h)
            spans = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
            for which, (lo, hi) in spans.items():
                local = qkv[lo:hi]
                heads = s.num_heads if which == "q" else s.num_kv_heads
                m, pl = qkv_layout(which, mesh, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                                   grouped=self.qkv == "grouped")
                if self.qkv == "grouped":
                    local = grouped_local(local, num_kv_heads=s.num_kv_heads, tp=tp)
                    shape = grouped_shape(which, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=hd,
                                          trailing=(h,))
                else:
                    shape = (heads * hd, h)
                scale = scale_rows(f"{a}.qkv_proj.weight", lo, hi) if fp8 is not None else None
                put(f"{a}.{which}_proj.weight", local, shape, m, pl, scale)
            own_linear(f"{a}.o_proj.weight", (h, q_rows), (h, s.num_heads * hd), row)
            if s.qk_norm:
                own(f"{a}.q_norm.weight", (hd,), (hd,), rep)
                own(f"{a}.k_norm.weight", (hd,), (hd,), rep)
            own(f"{p}.post_attention_layernorm.weight", (h,), (h,), rep)
            if s.is_moe_layer(layer):
                own(f"{p}.mlp.gate.weight", (s.num_experts, h), (s.num_experts, h), rep)
                ie, il, n = s.moe_intermediate_size, self.expert_inter, len(self.experts)
                w13n, w2n = f"{p}.mlp.experts.w13_weight", f"{p}.mlp.experts.w2_weight"
                w13 = hold_linear(w13n, n, 2 * il, h)
                w2 = hold_linear(w2n, n, h, il)
                # under EP an expert lives whole on its owner: a one-rank mesh, nothing to cut
                m, c, r = (np.array([self.tp_rank]), rep, rep) if self.expert_parallel else (mesh, col, row)
                for i, e in enumerate(self.experts):
                    x = f"{p}.mlp.experts.{e}"
                    sg = su = sd = None
                    if fp8 is not None:
                        sg, su, sd = scale_rows(w13n, 0, il, i), scale_rows(w13n, il, 2 * il, i), scales[w2n][i]
                    put(f"{x}.gate_proj.weight", w13[i, :il], (ie, h), m, c, sg)
                    put(f"{x}.up_proj.weight", w13[i, il:], (ie, h), m, c, su)
                    put(f"{x}.down_proj.weight", w2[i], (h, ie), m, r, sd)
            else:
                gun = f"{p}.mlp.gate_up_proj.weight"
                gu = hold_linear(gun, 2 * self.inter, h)
                sg = su = None
                if fp8 is not None:
                    sg, su = scale_rows(gun, 0, self.inter), scale_rows(gun, self.inter, 2 * self.inter)
                put(f"{p}.mlp.gate_proj.weight", gu[:self.inter], (s.intermediate_size, h), mesh, col, sg)
                put(f"{p}.mlp.up_proj.weight", gu[self.inter:], (s.intermediate_size, h), mesh, col, su)
                own_linear(f"{p}.mlp.down_proj.weight", (h, self.inter), (h, s.intermediate_size), row)
        own("model.norm.weight", (h,), (h,), rep)
        if not s.tie_word_embeddings:
            own("lm_head.weight", (self.vocab, h), (s.vocab_size, h), col)
        return fused, out
