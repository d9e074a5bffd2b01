"""Where each checkpoint tensor lands in one vLLM worker: its shard, its layout, its target.

A vLLM worker of a TP group holds fused parameters (``qkv_proj``, ``gate_up_proj``), each
the worker's rows of several checkpoint tensors, plus row-parallel, vocab-parallel and
replicated ones. This module reads vLLM's own layer objects (their classes and the sizes
they were built with) and says, for every checkpoint name the model loads, what a refit
must deliver to this worker: the global shape, the layout over the engine's own workers
(``0 .. tp-1``) and, for direct writes, which rows of which live parameter it is.

Reading the layers instead of a table of model names is what keeps it exact: the same
arithmetic vLLM shards each layer with decides the slice, including key/value
heads replicated when tp exceeds them (a ``[kv_heads, tp / kv_heads]`` mesh, each head
sent once per replica) and a padded vocabulary whose shard ranges differ from an even
split (then the embedding is received whole, and said so). A layer this module does not
know is refused by name rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit.errors import LayoutError
from refit.layout import Placement, Replicate, Shard, chunk_bounds

__all__ = ["Destination", "plan_destinations"]


@dataclass(frozen=True)
class Destination:
    """One checkpoint tensor as one vLLM worker needs it.

    ``mesh`` and ``placements`` are over the engine's own workers. ``target`` is the live
    vLLM parameter it is loaded into and ``rows`` the rows of that parameter it occupies on
    this worker (a fused member's block); for a routed expert, the rows of ``target[expert]``
    (vLLM stacks every expert of a layer in one ``w13_weight`` / ``w2_weight``).
    """

    name: str
    global_shape: tuple[int, ...]
    mesh: Any
    placements: tuple[Placement, ...]
    local_shape: tuple[int, ...]
    target: str
    rows: tuple[int, int]
    dtype: torch.dtype
    expert: int | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.local_shape))


def _classes(module: torch.nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _tp_mesh(tp: int) -> list[int]:
    return list(range(tp))


def _kv_layout(total_kv: int, tp: int) -> tuple[Any, tuple[Placement, ...]]:
    """Key/value heads: split over tp, or replicated when tp exceeds them (vLLM's rank // replicas)."""
    if tp <= total_kv:
        return _tp_mesh(tp), (Shard(0),)
    replicas = tp // total_kv
    return np.arange(tp).reshape(total_kv, replicas).tolist(), (Shard(0), Replicate())


def _members(module_name: str, packed: Mapping[str, list[str]]) -> list[str]:
    leaf = module_name.rsplit(".", 1)[-1]
    members = packed.get(leaf)
    if not members:
        raise LayoutError(f"{module_name}: a fused vLLM layer with no entry in the model's packed_modules_mapping")
    prefix = module_name[: -len(leaf)]
    return [prefix + m for m in members]


def _vocab_layout(module: torch.nn.Module, tp: int) -> tuple[Any, tuple[Placement, ...], tuple[int, int]]:
    """An even split when vLLM's padded shard ranges equal it on every rank, else the whole vocabulary."""
    vocab = module.org_vocab_size
    if module.num_embeddings != vocab or tp == 1:
        return _tp_mesh(tp), (Replicate(),), (0, vocab)
    ranges = []
    for r in range(tp):
        idx = type(module)._get_indices(module.num_embeddings_padded, module.org_vocab_size_padded,
                                        module.num_embeddings, module.org_vocab_size, r, tp)
        ranges.append((idx.org_vocab_start_index, idx.org_vocab_end_index))
    if all(ranges[r] == chunk_bounds(vocab, tp, r) for r in range(tp)):
        return _tp_mesh(tp), (Shard(0),), ranges[module.tp_rank]
    return _tp_mesh(tp), (Replicate(),), (0, vocab)


def _expert_destinations(module: torch.nn.Module, mod_name: str, pname: str, attr: str, tp_rank: int, tp: int,
                         dtype: torch.dtype) -> list[Destination]:
    """Every routed expert's gate/up (in ``w13_weight``) or down (in ``w2_weight``) on this worker.

    vLLM stacks a layer's experts in two parameters, ``w13_weight [E_local, 2 * I', H]`` (each
    expert's gate rows, then its up rows) and ``w2_weight [E_local, H, I']``, and its loader
    takes the checkpoint's per-expert tensors. Split by tensor parallelism, every worker holds
    every expert and the loader narrows gate/up on dim 0 and down on dim 1 to ``I' = I // tp``
    rows at ``tp_rank * I'``. Under expert parallelism (``enable_expert_parallel``) a worker
    holds whole experts, those its ``expert_map`` gives a local slot, and the others are not
    its to receive. The destinations say the same, expert by expert, under the checkpoint
    names the layer was built with. Layouts that break that picture (redundant experts,
    expert groups wider than the engine's TP group, ungated or biased experts, sizes vLLM
    padded) are refused by name: a guess would load the wrong rows.
    """
    kind = type(module).__name__
    config = module.moe_config
    parallel = config.moe_parallel_config
    if attr not in ("w13_weight", "w2_weight"):
        raise LayoutError(f"{pname}: {attr!r} of vLLM's {kind} (a quantized engine, or experts with biases?) is "
                          "not mapped by refit's vLLM backend")
    if not config.is_act_and_mul:
        raise LayoutError(f"{pname}: ungated experts (no gate/up pair in w13) are not mapped by refit's vLLM backend")
    if config.num_experts != config.num_logical_experts:
        raise LayoutError(f"{pname}: {config.num_experts} physical experts for {config.num_logical_experts} logical "
                          "ones; refit's vLLM backend does not map redundant experts")
    expert_parallel = parallel.ep_size > 1
    split = parallel.ep_size if expert_parallel else parallel.tp_size
    if split != tp or (expert_parallel and parallel.ep_rank != tp_rank):
        raise LayoutError(f"{pname}: the experts are split over {split} ranks, the engine's tensor-parallel group "
                          f"has {tp}; refit's vLLM backend maps engines without data parallelism")
    rows, hidden = int(module.intermediate_size_per_partition), int(module.hidden_size)
    if config.intermediate_size_per_partition != rows or hidden != config.hidden_dim:
        raise LayoutError(f"{pname}: vLLM padded the experts' sizes; refit's vLLM backend does not map padded experts")
    gate, up, down = module.ckpt_gate_proj_name, module.ckpt_up_proj_name, module.ckpt_down_proj_name
    if not (gate and up and down):
        raise LayoutError(f"{pname}: {kind} names no checkpoint gate/up/down projections")
    if expert_parallel:
        slots = [int(x) for x in module.expert_map.tolist()]  # global expert -> local slot, -1 elsewhere
        mesh, gate_up, down_pl, inter = [tp_rank], (Replicate(),), (Replicate(),), rows
    else:
        if module.local_num_experts != module.global_num_experts:
            raise LayoutError(f"{pname}: this worker holds {module.local_num_experts} of "
                              f"{module.global_num_experts} experts without expert parallelism")
        slots = list(range(module.global_num_experts))
        mesh, gate_up, down_pl, inter = _tp_mesh(tp), (Shard(0),), (Shard(1),), rows * tp
    leaf = mod_name.rsplit(".", 1)[-1]
    prefix = mod_name.rsplit(".", 1)[0] if leaf == "routed_experts" else mod_name
    out = []
    for e, slot in enumerate(slots):
        if slot < 0:
            continue
        if attr == "w13_weight":
            for member, lo in ((gate, 0), (up, rows)):
                out.append(Destination(f"{prefix}.{e}.{member}.weight", (inter, hidden), mesh, gate_up,
                                       (rows, hidden), pname, (lo, lo + rows), dtype, expert=slot))
        else:
            out.append(Destination(f"{prefix}.{e}.{down}.weight", (hidden, inter), mesh, down_pl,
                                   (hidden, rows), pname, (0, hidden), dtype, expert=slot))
    return out


def plan_destinations(model: torch.nn.Module, *, tp_rank: int, tp_size: int) -> list[Destination]:
    """Every checkpoint tensor this worker loads, in the model's parameter order.

    Raises ``LayoutError`` naming the parameter for a layer kind it does not know (a
    quantized layer, redundant experts), before anything is allocated. Under expert
    parallelism workers list different experts: each only those it holds.
    """
    modules = dict(model.named_modules())
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    out: list[Destination] = []
    tp = tp_size
    for pname, param in model.named_parameters():
        mod_name, _, attr = pname.rpartition(".")
        module = modules.get(mod_name)
        if module is None:
            raise LayoutError(f"{pname}: no module {mod_name!r} in the model")
        kinds = _classes(module)
        dtype = param.dtype
        local = tuple(param.shape)
        if "LinearBase" in kinds:
            if attr not in ("weight", "bias"):
                raise LayoutError(f"{pname}: {attr!r} of a vLLM linear layer (a quantized engine?) is not mapped by "
                                  "refit's vLLM backend")
            # the checkpoint's shapes, from the sizes the layer was built with: vLLM's CPU build
            # repacks the live weights into another shape after start
            if "ReplicatedLinear" in kinds:  # a MoE router too
                rows, cols = module.output_size, module.input_size
            else:
                rows, cols = module.output_size_per_partition, module.input_size_per_partition
            local = (rows, cols) if attr == "weight" else (rows,)
        tp_list = _tp_mesh(tp)

        def add(name, shape, mesh_, placements, local_shape, rows, _pname=pname, _dtype=dtype):
            out.append(Destination(name, tuple(int(s) for s in shape), mesh_, tuple(placements),
                                   tuple(int(s) for s in local_shape), _pname, rows, _dtype))

        if "QKVParallelLinear" in kinds:
            q, k, v = _members(mod_name, packed)
            hs, vhs = module.head_size, module.v_head_size
            q_rows, kv_rows, v_rows = module.num_heads * hs, module.num_kv_heads * hs, module.num_kv_heads * vhs
            tail = local[1:] if attr == "weight" else ()
            kv_mesh, kv_pl = _kv_layout(module.total_num_kv_heads, tp)
            add(f"{q}.{attr}", (module.total_num_heads * hs, *tail), tp_list, (Shard(0),), (q_rows, *tail),
                (0, q_rows))
            add(f"{k}.{attr}", (module.total_num_kv_heads * hs, *tail), kv_mesh, kv_pl, (kv_rows, *tail),
                (q_rows, q_rows + kv_rows))
            add(f"{v}.{attr}", (module.total_num_kv_heads * vhs, *tail), kv_mesh, kv_pl, (v_rows, *tail),
                (q_rows + kv_rows, q_rows + kv_rows + v_rows))
        elif "MergedColumnParallelLinear" in kinds:
            names = _members(mod_name, packed)
            if len(names) != len(module.output_sizes):
                raise LayoutError(f"{pname}: {len(module.output_sizes)} fused outputs but packed_modules_mapping "
                                  f"names {len(names)}")
            tail = local[1:] if attr == "weight" else ()
            start = 0
            for name, size in zip(names, module.output_sizes):
                rows = size // tp
                add(f"{name}.{attr}", (size, *tail), tp_list, (Shard(0),), (rows, *tail), (start, start + rows))
                start += rows
        elif "ColumnParallelLinear" in kinds:
            shape = (module.output_size, *local[1:])
            add(pname, shape, tp_list, (Shard(0),), local, (0, local[0]))
        elif "RowParallelLinear" in kinds:
            if attr == "weight":
                add(pname, (local[0], module.input_size), tp_list, (Shard(1),), local, (0, local[0]))
            elif getattr(module, "input_is_parallel", True) is False:
                raise LayoutError(f"{pname}: a RowParallelLinear with unsplit input is not mapped")
            else:
                add(pname, local, tp_list, (Replicate(),), local, (0, local[0]))
        elif "VocabParallelEmbedding" in kinds:  # ParallelLMHead too
            mesh, placements, (lo, hi) = _vocab_layout(module, tp)
            shape = (module.org_vocab_size, *local[1:])
            if isinstance(placements[0], Shard):
                add(pname, shape, mesh, placements, (hi - lo, *local[1:]), (0, hi - lo))
            else:
                add(pname, shape, mesh, placements, shape, (0, hi - lo))
        elif "RoutedExperts" in kinds:
            out.extend(_expert_destinations(module, mod_name, pname, attr, tp_rank, tp, dtype))
        elif "FusedMoE" in kinds or "MoE" in type(module).__name__:
            raise LayoutError(f"{pname}: vLLM's MoE layer {type(module).__name__} is not mapped by refit's vLLM "
                              "backend")
        elif "LinearBase" in kinds and "ReplicatedLinear" not in kinds:
            raise LayoutError(f"{pname}: vLLM layer {type(module).__name__} is not mapped by refit's vLLM backend")
        elif "ReplicatedLinear" in kinds:
            add(pname, local, tp_list, (Replicate(),), local, (0, local[0]))
        else:  # norms, anything every worker holds whole
            add(pname, local, tp_list, (Replicate(),), local, (0, local[0] if local else 0))
    return out
