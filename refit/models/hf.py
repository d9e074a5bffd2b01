"""Hugging Face ``transformers`` models on the trainer side, and refit checks that drive them.

Trainer. ``HFTrainer`` builds a ``transformers`` causal LM from a config (random init, nothing
fetched), shards it with PyTorch's own tensor parallelism (``parallelize_module``: q/k/v,
gate/up and the head column-parallel, o/down row-parallel, the embedding vocab-parallel) over
the ``tp`` dim of a ``(dp, tp)`` device mesh and with FSDP2 (``fully_shard``) over ``dp``, on
gloo, and takes real AdamW steps on synthetic batches. Its parameters are torch DTensors:
``[_StridedShard(0), Shard(0)]`` where FSDP2 meets a column-parallel weight,
``[Shard(0), Shard(1)]`` on row-parallel ones, ``[Shard(0), Replicate()]`` on Qwen3's q/k norms
(replicated over tp so their gradients are all-reduced, see ``HeadNormParallel``), and
FSDP-only ``[Shard(0)]`` on the ``dp`` sub-mesh for the other norms, routers and experts.
``HFTrainerWorker`` and ``EngineWorker`` are the same classes shaped for
``refit.runtime.ray.RayFleet`` (``trainer_cls(rank=, world_size=, ...)``,
``engine_cls(shard=, worker=, workers_per_shard=, ...)``), i.e. for the synchronizer: they
are ``TrainerEndpoint`` / ``EngineEndpoint`` s (``refit_sources`` / ``refit_destinations``,
``on_weights_loaded``).

What refit sees. ``dtensor_entries`` (and ``HFTrainer.sources``) maps those DTensors to
``{canonical_name: (DTensorRef, mesh, placements)}``:

* the mesh is the trainer's whole ``(dp, tp)`` mesh of ranks (``DeviceMesh.mesh``, which are
  ranks of the trainer's torch default group) plus ``offset``: the ranks of the refit
  communicator. A param that lives on a sub-mesh (FSDP-only params sit on the ``dp`` sub-mesh)
  is lifted to the whole mesh with ``Replicate()`` on the dims it does not use, so every rank
  reports the same layout for a param;
* the local tensor is the DTensor's own ``_local_tensor`` (FSDP2 keeps it in place across
  steps), so a refit reads the trainer's memory without a gather;
* transformers 5 holds a Qwen3-MoE layer's experts fused, ``mlp.experts.gate_up_proj``
  ``[E, 2*Ie, hidden]`` and ``mlp.experts.down_proj`` ``[E, hidden, Ie]``; they are exposed
  as the canonical per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` views. An expert
  lives on the FSDP rank whose chunk holds it, so its mesh is that rank's row of the mesh
  (replicated over tp), and ranks that do not hold it do not list it.

Rank mapping. A LocalFleet rank, the trainer's torch default-group rank and the trainer's
refit rank are the same number on the trainer side (``offset = 0``); engine shards sit after
the trainer ranks, shard ``k`` at ``offset = trainer_world + sum(tp of shards before k)``,
their meshes given in their own workers ``0..tp-1`` plus that offset.

Checks. ``refit_check_worker`` (an HF trainer) and ``megatron_check_worker`` (a Megatron-core
layout) are top-level functions to run on every rank of a ``refit.testing.launch.LocalFleet``: the
first ranks train (or hold Megatron shards), the rest are engine shards with their own TP
groups (any TP size per shard); after every step a ``Resharder`` moves the weights shard to shard,
and every engine computes logits and greedy tokens on a fixed prompt for the caller to compare
with the trainer's reference (an HF forward of the ``full_tensor()`` weights).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from refit.comm.group import free_port
from refit.errors import LayoutError
from refit.layout import (
    DTensorRef,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    chunk_bounds,
    mesh_coords_of,
    normalize_placements,
)
from refit.models.engine import EngineConfig, EngineShard, StatelessTPComm, TorchTPComm, random_canonical_state
from refit.models.megatron import Entry, MegatronLayout
from refit.models.parallel import TrainParallel
from refit.runtime.endpoint import TrainerEndpoint

__all__ = [
    "EngineWorker",
    "HFTrainer",
    "HFTrainerWorker",
    "Topology",
    "build_model",
    "canonical_from_hf",
    "dtensor_entries",
    "hf_from_canonical",
    "megatron_check_worker",
    "narrow_entry",
    "refit_check_worker",
    "select_entry",
    "shard_model",
    "tiny_llama_config",
    "tiny_qwen3_moe_config",
    "tp_plan",
]

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


# -- configs and models ------------------------------------------------------------------------

def tiny_llama_config(**overrides: Any):
    """A Llama-shaped config small enough for CPU tests (GQA 2:1, 2 layers, hidden 64)."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_qwen3_moe_config(**overrides: Any):
    """A Qwen3-MoE-shaped config for CPU tests (4 experts, top-2, q/k norms, hidden 64)."""
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
              num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def build_model(config: Any, *, seed: int = 0):
    """A randomly initialised fp32 causal LM for ``config`` (an HF config or its ``to_dict()``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(config), dtype=torch.float32)
    return model.to(torch.float32)


class HeadNormParallel:
    """A ``ParallelStyle`` for Qwen3's q/k RMSNorm, which runs on the TP-local heads only.

    Its weight becomes a DTensor replicated over tp and its input a DTensor sharded over the
    heads dim, so the weight's gradient (a sum over every head) is all-reduced over tp. Left
    plain, each TP rank would update the norm from its own heads and the replicas would drift.
    """

    def __new__(cls):
        from torch.distributed.tensor import DTensor, distribute_module
        from torch.distributed.tensor import Shard as TShard
        from torch.distributed.tensor.parallel.style import ParallelStyle

        class _Style(ParallelStyle):
            def _apply(self, module, device_mesh):
                def inputs(mod, args, mesh):
                    x = args[0]
                    return (DTensor.from_local(x, mesh, [TShard(x.ndim - 2)], run_check=False), *args[1:])

                def outputs(mod, out, mesh):
                    return out.to_local()

                return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)

            def __repr__(self) -> str:
                return "HeadNormParallel()"

        return _Style()


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The ``parallelize_module`` plan: q/k/v, gate/up, head colwise; o/down rowwise; embedding vocab-parallel.

    Qwen3's q/k norms (per head, on TP-local heads) get ``HeadNormParallel``. Routed experts
    and routers see replicated inputs and are left to FSDP2 (sharded over ``dp`` by expert).
    """
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"model.embed_tokens": RowwiseParallel(input_layouts=TReplicate())}
    if getattr(model, "lm_head", None) is not None and not model.config.tie_word_embeddings:
        plan["lm_head"] = ColwiseParallel(output_layouts=TReplicate())
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{n}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        for n in ("q_norm", "k_norm"):
            if getattr(layer.self_attn, n, None) is not None:
                plan[f"{p}.self_attn.{n}"] = HeadNormParallel()
        if hasattr(layer.mlp, "gate_proj"):
            plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def shard_model(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """TP over ``mesh['tp']`` then FSDP2 over ``mesh['dp']`` (each decoder layer, then the root)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = model.config
    tp = mesh["tp"].size()
    if tp > 1 and cfg.tie_word_embeddings:
        raise LayoutError("trainer tp > 1 with tied word embeddings is not supported (the head would share a "
                          "vocab-parallel DTensor with the embedding)")
    if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
        raise LayoutError(f"trainer tp={tp} must divide the {cfg.num_attention_heads} heads and "
                          f"{cfg.num_key_value_heads} key/value heads (transformers' attention infers local heads)")
    if tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


# -- canonical names ---------------------------------------------------------------------------

def canonical_from_hf(state: Mapping[str, torch.Tensor], *,
                      tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """A full HF state dict under canonical names: fused transformers-5 experts split into per-expert views.

    With tied embeddings the head is the embedding and has no canonical name of its own.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def hf_from_canonical(canonical: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict for ``model.load_state_dict`` from canonical tensors (experts re-fused as the model holds them)."""
    out: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        if name == "lm_head.weight" and name not in canonical and model.config.tie_word_embeddings:
            out[name] = canonical["model.embed_tokens.weight"]
            continue
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = canonical[name]
            continue
        prefix, kind = m.groups()
        n = 0
        while f"{prefix}.{n}.down_proj.weight" in canonical:
            n += 1
        if kind == "gate_up_proj":
            out[name] = torch.stack([torch.cat([canonical[f"{prefix}.{e}.gate_proj.weight"],
                                                canonical[f"{prefix}.{e}.up_proj.weight"]]) for e in range(n)])
        else:
            out[name] = torch.stack([canonical[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    return out


# -- DTensor layouts as refit entries ------------------------------------------------------------

def lift_placements(dtensor: Any, root_mesh: Any) -> tuple[Placement, ...]:
    """The placements of ``dtensor`` on the whole ``root_mesh`` (Replicate on dims its mesh lacks)."""
    sub = dtensor.device_mesh
    placements = normalize_placements(dtensor.placements)
    names, rnames = sub.mesh_dim_names, root_mesh.mesh_dim_names
    if tuple(sub.mesh.shape) == tuple(root_mesh.mesh.shape) and (names == rnames or names is None):
        if not torch.equal(sub.mesh, root_mesh.mesh):
            raise LayoutError(f"a DTensor's mesh {sub.mesh.tolist()} is not the trainer mesh {root_mesh.mesh.tolist()}")
        return placements
    if names is None or rnames is None or [n for n in rnames if n in names] != list(names):
        raise LayoutError(f"a DTensor on mesh dims {names} is not a sub-mesh of the trainer mesh dims {rnames}")
    return tuple(placements[names.index(n)] if n in names else Replicate() for n in rnames)


def _shift(p: Placement, dim: int) -> Placement:
    if isinstance(p, Shard) and p.dim > dim:
        return Shard(p.dim - 1)
    if isinstance(p, StridedShard) and p.dim > dim:
        return StridedShard(p.dim - 1, p.split_factor)
    return p


def select_entry(local: torch.Tensor | None, shape: Sequence[int], mesh: np.ndarray, placements: Sequence[Placement],
                 dim: int, index: int, rank: int) -> tuple[torch.Tensor | None, tuple[int, ...], np.ndarray,
                                                        tuple[Placement, ...]]:
    """Index ``index`` of tensor dim ``dim`` of a sharded tensor, as a layout of its own.

    ``dim`` may be sharded by at most one mesh dim, with plain ``Shard``: the index then lives
    on one slice of the mesh, which becomes the new mesh (that mesh dim dropped). Returns
    ``(local view or None when this rank does not hold it, shape, mesh, placements)``.
    """
    mesh = np.asarray(mesh)
    placements = normalize_placements(placements)
    on_dim = [i for i, p in enumerate(placements) if isinstance(p, (Shard, StridedShard)) and p.dim == dim]
    if len(on_dim) > 1 or any(isinstance(placements[i], StridedShard) for i in on_dim):
        raise LayoutError(f"select_entry: dim {dim} is split by {[placements[i] for i in on_dim]}; only one plain "
                          "Shard can be selected through")
    new_shape = tuple(int(s) for i, s in enumerate(shape) if i != dim)
    coords = mesh_coords_of(mesh, rank)
    if not on_dim:
        view = local.select(dim, index) if (local is not None and coords is not None) else None
        return view, new_shape, mesh, tuple(_shift(p, dim) for p in placements)
    md = on_dim[0]
    owner, start = None, 0
    for c in range(mesh.shape[md]):
        a, b = chunk_bounds(int(shape[dim]), mesh.shape[md], c)
        if a <= index < b:
            owner, start = c, a
            break
    if owner is None:
        raise LayoutError(f"select_entry: index {index} outside dim {dim} of size {shape[dim]}")
    sub = np.take(mesh, owner, axis=md)
    rest = tuple(_shift(p, dim) for i, p in enumerate(placements) if i != md)
    if sub.ndim == 0:
        sub, rest = sub.reshape(1), (Replicate(),)
    held = local is not None and coords is not None and coords[md] == owner
    return (local.select(dim, index - start) if held else None), new_shape, sub, rest


def narrow_entry(local: torch.Tensor | None, shape: Sequence[int], placements: Sequence[Placement], dim: int,
                 start: int, length: int) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """Rows ``start .. start+length`` of an UNSHARDED dim, as a view: ``(local view, new shape)``."""
    for p in normalize_placements(placements):
        if isinstance(p, (Shard, StridedShard)) and p.dim == dim:
            raise LayoutError(f"narrow_entry: dim {dim} is sharded ({p!r}); narrow only an unsharded dim")
    new_shape = tuple(length if i == dim else int(s) for i, s in enumerate(shape))
    return (local.narrow(dim, start, length) if local is not None else None), new_shape


def dtensor_entries(named: Mapping[str, Any], root_mesh: Any, *, rank: int | None = None,
                    offset: int = 0) -> dict[str, Entry]:
    """``{canonical_name: (DTensorRef, mesh, placements)}`` for a model's DTensor parameters.

    ``named`` maps HF parameter names to DTensors (``model.named_parameters()``); ``root_mesh``
    is the trainer's ``DeviceMesh``; ``rank`` this process's rank in it (default: the torch
    default group's rank). Only what this rank holds is listed.
    """
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank()
    ranks = root_mesh.mesh.cpu().numpy()
    out: dict[str, Entry] = {}
    for name, dt in named.items():
        if not hasattr(dt, "_local_tensor"):
            raise LayoutError(f"{name}: expected a DTensor, got {type(dt).__name__}")
        local, shape = dt._local_tensor, tuple(int(s) for s in dt.shape)
        placements = lift_placements(dt, root_mesh)
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = (DTensorRef(local, shape, dtype=dt.dtype), ranks + offset, placements)
            continue
        prefix, kind = m.groups()
        for e in range(shape[0]):
            view, eshape, emesh, eplace = select_entry(local, shape, ranks, placements, 0, e, rank)
            if kind == "down_proj":
                parts = {"down_proj": (view, eshape)}
            else:
                half = eshape[0] // 2
                parts = {"gate_proj": narrow_entry(view, eshape, eplace, 0, 0, half),
                         "up_proj": narrow_entry(view, eshape, eplace, 0, half, half)}
            if view is None:
                continue
            for part, (v, s) in parts.items():
                out[f"{prefix}.{e}.{part}.weight"] = (DTensorRef(v, s, dtype=dt.dtype), emesh + offset, eplace)
    return out


# -- the trainer ------------------------------------------------------------------------------------

class HFTrainer(TrainerEndpoint):
    """One rank of an HF model trained with TP (``parallelize_module``) x FSDP2 (``fully_shard``).

    Needs ``torch.distributed`` initialised over exactly the trainer's ranks (``dp * tp`` of
    them, e.g. ``init_process_group("gloo")``), unless a ``mesh`` is given. Every rank must
    construct it with the same arguments; collective methods say so.
    """

    def __init__(self, config: Any, *, dp: int = 1, tp: int = 1, mesh: Any = None, seed: int = 0, lr: float = 1e-3,
                 batch_size: int = 2, seq_len: int = 16, data_seed: int = 1234, device: str = "cpu"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise LayoutError("HFTrainer needs torch.distributed initialised over the trainer ranks")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mesh = mesh if mesh is not None else init_device_mesh(self.device.type, (dp, tp),
                                                                   mesh_dim_names=("dp", "tp"))
        self.dp, self.tp = self.mesh["dp"].size(), self.mesh["tp"].size()
        self.rank = dist.get_rank()
        self.config, self.seed = config, seed
        self.batch_size, self.seq_len, self.data_seed = batch_size, seq_len, data_seed
        self.model = shard_model(build_model(config, seed=seed).to(self.device), self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.steps = 0
        self._reference = None

    @property
    def dp_rank(self) -> int:
        return int(self.mesh.get_coordinate()[0])

    def synthetic_batch(self, step: int) -> torch.Tensor:
        """Token ids ``[batch, seq_len]`` for ``step``, different on every dp rank, the same across tp."""
        g = torch.Generator().manual_seed(self.data_seed + 1000 * step + self.dp_rank)
        ids = torch.randint(0, self.config.vocab_size, (self.batch_size, self.seq_len), generator=g)
        return ids.to(self.device)

    def train_step(self, input_ids: torch.Tensor | None = None) -> float:
        """One AdamW step on ``input_ids`` (default: the synthetic batch); returns the local loss (collective)."""
        ids = self.synthetic_batch(self.steps) if input_ids is None else input_ids.to(self.device)
        self.model.train()
        with warnings.catch_warnings():
            # transformers returns views from the FSDP2 root; nothing here modifies them in place
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(loss.detach())

    def dtensors(self) -> dict[str, Any]:
        return dict(self.model.named_parameters())

    def sources(self, offset: int = 0) -> dict[str, Entry]:
        """What this rank holds, as canonical refit entries (meshes in trainer ranks + ``offset``)."""
        return dtensor_entries(self.dtensors(), self.mesh, rank=self.rank, offset=offset)

    def refit_sources(self) -> dict[str, Entry]:
        """The ``TrainerEndpoint`` hook: meshes in trainer ranks ``0..dp*tp-1``."""
        return self.sources(0)

    def placements(self) -> dict[str, str]:
        """HF name -> the DTensor's placements and mesh dims (for reports)."""
        return {n: f"{list(p.device_mesh.mesh_dim_names or ())}: {list(p.placements)}"
                for n, p in self.model.named_parameters()}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors, gathered with ``full_tensor()`` (collective over the trainer ranks)."""
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}

    def reference_model(self) -> torch.nn.Module:
        """A plain (unsharded) copy of the model with the current weights (collective)."""
        full = self.full_state()
        if self._reference is None:
            self._reference = build_model(self.config, seed=self.seed).to(self.device).eval()
        missing, unexpected = self._reference.load_state_dict(full, strict=False)
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise LayoutError(f"reference model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
        return self._reference

    @torch.no_grad()
    def reference(self, input_ids: torch.Tensor, new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """HF logits ``[b, s, V]`` and greedy tokens ``[b, new_tokens]`` of the current weights (collective)."""
        model = self.reference_model()
        input_ids = input_ids.to(self.device)
        logits = model(input_ids=input_ids).logits
        return logits, greedy(model, input_ids, new_tokens)


class HFTrainerWorker(HFTrainer):
    """An ``HFTrainer`` shaped for ``refit.runtime.ray.RayFleet``: ``HFTrainerWorker(rank=, world_size=, ...)``.

    Joins the trainer's own torch default group (gloo, ``tcp://master_addr:master_port``) and
    builds the model from ``config`` (an HF config or its ``to_dict()``). ``world_size`` must be
    ``dp * tp``. Its refit ranks are its trainer ranks (``refit_sources`` meshes in ``0..world-1``).
    ``device="cuda"`` trains on this process's current GPU over NCCL (under Ray, the one GPU
    the actor was given), or, with ``share_gpus=G``, on GPU ``rank % G`` of the host (see
    ``shared_gpu``); results come back on the host.
    """

    def __init__(self, rank: int, world_size: int, *, config: Any, dp: int, tp: int, master_port: int,
                 master_addr: str = "127.0.0.1", threads: int = 1, device: str = "cpu",
                 share_gpus: int | None = None, visible_devices: str | None = None, **kwargs: Any):
        import torch.distributed as dist

        torch.set_num_threads(threads)
        _quiet_dtensor_logs()
        if dp * tp != world_size:
            raise LayoutError(f"HFTrainerWorker: dp*tp = {dp * tp} but world_size = {world_size}")
        if share_gpus:
            device = shared_gpu(rank % share_gpus, visible_devices)
        elif torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device).index or 0)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo",
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                    world_size=world_size)
        super().__init__(build_config(config), dp=dp, tp=tp, device=device, **kwargs)

    def train_and_reference(self, prompt: Sequence[int], new_tokens: int = 4) -> dict:
        """One optimizer step, then the reference logits/tokens of the new weights (collective)."""
        loss = self.train_step()
        logits, tokens = self.reference(torch.tensor([list(prompt)]), new_tokens)
        return {"loss": loss, "logits": logits.cpu(), "tokens": tokens.cpu(), "step": self.steps}


class EngineWorker(EngineShard):
    """An ``EngineShard`` shaped for ``refit.runtime.ray.RayFleet``: ``EngineWorker(shard=, worker=, workers_per_shard=)``.

    ``config`` is an HF config or its ``to_dict()`` (transformers is not imported). A shard of
    more than one worker needs its TP group: give ``tp_port`` (a ``StatelessProcessGroup``
    rendezvous hosted by worker 0 of the shard), or call ``connect_tp`` later, e.g. after a
    restart, with a fresh port. ``share_gpus=G`` puts worker ``w`` of shard ``s`` on GPU
    ``(s + w) % G`` of the host (``shared_gpu``), so a shard's workers never share one.
    """

    def __init__(self, shard: int, worker: int, workers_per_shard: int, *, config: Any, qkv: str = "plain",
                 tp_port: int | None = None, tp_addr: str = "127.0.0.1", threads: int = 1, device: str = "cpu",
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
            comm = self._connect(tp_addr, tp_port, worker, workers_per_shard)
        super().__init__(EngineConfig.from_hf(config), tp_size=workers_per_shard, tp_rank=worker,
                         comm=comm if comm is not None else _Unconnected(), qkv=qkv, **kwargs)
        if workers_per_shard == 1:
            self.comm = None

    def _connect(self, addr: str, port: int, worker: int, workers: int) -> StatelessTPComm:
        from refit.comm.group import StatelessProcessGroup

        if self._tp_group is not None:
            self._tp_group.abort()
        cuda = self.device.type == "cuda"
        self._tp_group = StatelessProcessGroup(addr, port, worker, workers, name=f"engine-tp/{self.shard}",
                                               backend="nccl" if cuda else "gloo", device=self.device if cuda else None)
        return StatelessTPComm(self._tp_group)

    def connect_tp(self, port: int, addr: str = "127.0.0.1") -> None:
        """(Re)build this shard's TP group; every worker of the shard calls it with the same port."""
        self.comm = self._connect(addr, port, self.rank, self.tp)

    def close(self) -> None:
        """Abort this worker's TP group (idempotent)."""
        if self._tp_group is not None:
            self._tp_group.abort()
            self._tp_group = None

    def logits(self, prompt: Sequence[int], new_tokens: int = 4) -> dict:
        """Logits and greedy tokens on ``prompt`` (collective over the shard's workers)."""
        ids = torch.tensor([list(prompt)])
        return {"logits": self.forward(ids).cpu(), "tokens": self.generate(ids, new_tokens).cpu(),
                "version": self.version}


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


def _quiet_dtensor_logs() -> None:
    """``full_tensor()`` of a ``_StridedShard`` DTensor logs a warning per call; keep demos readable."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@torch.no_grad()
def greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens of an HF model, full forward each step (the same loop ``EngineShard.generate`` runs)."""
    ids = input_ids
    for _ in range(new_tokens):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, input_ids.shape[1]:]


# -- fleet drivers ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Topology:
    """Trainer ranks first, then engine shards, on one refit communicator (e.g. a LocalFleet).

    Trainer rank ``r`` is refit rank ``r``; engine shard ``k`` (``engine_tps[k]`` workers, any
    size each) starts at ``engine_offset(k)``. ``trainer_dp`` x ``trainer_tp`` is an HF
    trainer's mesh (a Megatron check sizes ``trainer_world`` from its ``TrainParallel``). The
    ports are the torch rendezvous of the trainer's default group and of every engine shard
    with ``tp > 1``; ``make`` picks free ones.
    """

    trainer_world: int
    engine_tps: tuple[int, ...]
    trainer_port: int = 0
    engine_ports: tuple[int, ...] = ()
    trainer_dp: int = 1
    trainer_tp: int = 1

    @classmethod
    def make(cls, *, engine_tps: Sequence[int], dp: int = 1, tp: int = 1,
             trainer_world: int | None = None) -> "Topology":
        world = dp * tp if trainer_world is None else trainer_world
        return cls(trainer_world=world, engine_tps=tuple(engine_tps), trainer_port=free_port(),
                   engine_ports=tuple(free_port() if t > 1 else 0 for t in engine_tps), trainer_dp=dp, trainer_tp=tp)

    @property
    def world(self) -> int:
        return self.trainer_world + sum(self.engine_tps)

    def engine_offset(self, shard: int) -> int:
        return self.trainer_world + sum(self.engine_tps[:shard])

    def role(self, rank: int) -> tuple[str, int, int]:
        """``("trainer", rank, 0)`` or ``("engine", shard, tp_rank)``."""
        if rank < self.trainer_world:
            return ("trainer", rank, 0)
        for k, tp in enumerate(self.engine_tps):
            off = self.engine_offset(k)
            if off <= rank < off + tp:
                return ("engine", k, rank - off)
        raise LayoutError(f"rank {rank} outside the {self.world} ranks of {self}")


def _init_torch_group(port: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _destroy_torch_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _engine(topo: Topology, rank: int, config: Mapping[str, Any], qkv: str,
            tp_comm: str, expert_parallel: bool = False) -> tuple[EngineShard, int, int]:
    """This rank's engine shard: an ``EngineWorker`` (stateless TP group) or an ``EngineShard`` on a torch group."""
    _, shard, tp_rank = topo.role(rank)
    tp = topo.engine_tps[shard]
    if tp_comm == "stateless":
        port = topo.engine_ports[shard] if tp > 1 else None
        return EngineWorker(shard, tp_rank, tp, config=config, qkv=qkv, tp_port=port,
                            expert_parallel=expert_parallel), shard, tp_rank
    if tp_comm != "torch":
        raise LayoutError(f"tp_comm must be 'torch' or 'stateless', got {tp_comm!r}")
    comm = None
    if tp > 1:
        _init_torch_group(topo.engine_ports[shard], tp_rank, tp)
        comm = TorchTPComm()
    return EngineShard(EngineConfig.from_hf(config), tp_size=tp, tp_rank=tp_rank, comm=comm, qkv=qkv,
                       expert_parallel=expert_parallel), shard, tp_rank


def _refit(group, src: Mapping[str, Entry], dst: Mapping[str, Entry]) -> dict:
    from refit.transport.xfer import Resharder

    t0 = time.perf_counter()
    r = Resharder(group, src=src, dst=dst)
    stats = r.run()
    return {"plan_s": r.plan_seconds, "refit_s": time.perf_counter() - t0,
            "bytes_received": stats.bytes_received, "bytes_sent": stats.bytes_sent}


def _serve(group, topo: Topology, engine: EngineShard, shard: int, tp_rank: int, steps: int, ids: torch.Tensor,
           new_tokens: int) -> list[dict]:
    """The engine side of a check: receive every refit into the views, then logits and greedy tokens."""
    reports = []
    dst = engine.destinations(topo.engine_offset(shard))
    for step in range(steps + 1):
        refit = _refit(group, {}, dst)
        engine.on_weights_loaded()
        logits, tokens = engine.forward(ids), engine.generate(ids, new_tokens)
        rep = {"step": step, "role": "engine", "rank": group.rank, "shard": shard, "refit": refit,
               "version": engine.version}
        if tp_rank == 0:
            rep.update(logits=logits, tokens=tokens)
        reports.append(rep)
    return reports


def refit_check_worker(group, topo: Topology, config: Mapping[str, Any], *, steps: int = 2, prompt: Sequence[int],
                       new_tokens: int = 4, seed: int = 0, lr: float = 1e-2, tp_comm: str = "stateless",
                       engine_ep: bool = False) -> list[dict]:
    """Run on every rank of a LocalFleet: HF trainer (TP x FSDP2) -> engine shards, refit after every step.

    ``group`` is the fleet's refit communicator (``StatelessProcessGroup``); ``config`` an HF
    config's ``to_dict()`` (engine ranks never import transformers). Trainer ranks are
    ``HFTrainerWorker`` s on their own torch default group; engine ranks ``EngineWorker`` s
    (``tp_comm="stateless"``) or ``EngineShard`` s on a torch group per shard (``"torch"``).
    Step 0 refits the initial weights, then each step is one AdamW step and a refit.
    ``engine_ep`` splits the routed experts whole across each shard's workers (engine EP).

    Returns per-step dicts: trainer rank 0 adds the reference ``logits`` / ``tokens`` (an HF
    forward of the ``full_tensor()`` weights), ``loss`` and, at step 0, ``placements``; TP rank
    0 of every engine shard adds its own ``logits`` / ``tokens``. Every dict has ``refit``
    (plan and transfer seconds, bytes).
    """
    role = topo.role(group.rank)[0]
    ids = torch.tensor([list(prompt)])
    engine = None
    try:
        if role != "trainer":
            engine, shard, tp_rank = _engine(topo, group.rank, config, "plain", tp_comm, engine_ep)
            return _serve(group, topo, engine, shard, tp_rank, steps, ids, new_tokens)
        trainer = HFTrainerWorker(group.rank, topo.trainer_world, config=config, dp=topo.trainer_dp,
                                  tp=topo.trainer_tp, master_port=topo.trainer_port, seed=seed, lr=lr)
        reports = []
        for step in range(steps + 1):
            loss = trainer.train_step() if step else None
            refit = _refit(group, trainer.sources(0), {})
            logits, tokens = trainer.reference(ids, new_tokens)
            rep = {"step": step, "role": role, "rank": group.rank, "refit": refit, "loss": loss}
            if group.rank == 0:
                rep.update(logits=logits, tokens=tokens)
                if step == 0:
                    rep["placements"] = trainer.placements()
            reports.append(rep)
        return reports
    finally:
        if isinstance(engine, EngineWorker):
            engine.close()
        _destroy_torch_group()


def build_config(config: Mapping[str, Any] | Any):
    """An HF config object from ``to_dict()`` output (or the object itself)."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    cfg = dict(config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def megatron_check_worker(group, topo: Topology, config: Mapping[str, Any], parallel: TrainParallel, *,
                          steps: int = 2, prompt: Sequence[int], new_tokens: int = 4, seed: int = 0,
                          expert_layout: str = "te", tp_comm: str = "torch") -> list[dict]:
    """Run on every rank of a LocalFleet: Megatron-core-shaped trainer ranks -> engine shards (grouped q/k/v).

    The trainer ranks hold the Megatron local state of ``random_canonical_state(spec, seed +
    step)`` (cut by the plain reference conversion, updated in place every step) and expose it
    through ``MegatronLayout.to_canonical`` views. Engine TP rank 0 of every shard returns its
    logits and tokens per step; the caller compares them with an HF forward of the same state.
    """
    role = topo.role(group.rank)[0]
    ids = torch.tensor([list(prompt)])
    engine = None
    try:
        if role != "trainer":
            engine, shard, tp_rank = _engine(topo, group.rank, config, "grouped", tp_comm)
            return _serve(group, topo, engine, shard, tp_rank, steps, ids, new_tokens)
        spec = EngineConfig.from_hf(config).spec
        layout = MegatronLayout(spec, parallel, expert_layout=expert_layout)
        local = layout.from_canonical(random_canonical_state(spec, seed=seed), group.rank)
        src = layout.to_canonical(local, group.rank)
        reports = []
        for step in range(steps + 1):
            if step:
                new = layout.from_canonical(random_canonical_state(spec, seed=seed + step), group.rank)
                for k, t in new.items():
                    local[k].copy_(t)
            reports.append({"step": step, "role": role, "rank": group.rank, "refit": _refit(group, src, {})})
        return reports
    finally:
        if isinstance(engine, EngineWorker):
            engine.close()
        _destroy_torch_group()
