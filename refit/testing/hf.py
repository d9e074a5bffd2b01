"""A reference Hugging Face trainer: a ``transformers`` causal LM trained with TP x FSDP2 on gloo or NCCL.

``HFTrainer`` builds a ``transformers`` causal LM from a config (random init, nothing
fetched), shards it with PyTorch's own tensor parallelism (``parallelize_module``: q/k/v,
gate/up and the head column-parallel, o/down row-parallel, the embedding vocab-parallel) over
the ``tp`` dim of a ``(dp, tp)`` device mesh and with FSDP2 (``fully_shard``) over ``dp``, and
takes real AdamW steps on synthetic batches. Its parameters are torch DTensors:
``[_StridedShard(0), Shard(0)]`` where FSDP2 meets a column-parallel weight,
``[Shard(0), Shard(1)]`` on row-parallel ones, ``[Shard(0), Replicate()]`` on Qwen3's q/k norms
(replicated over tp so their gradients are all-reduced, see ``HeadNormParallel``), and
FSDP-only ``[Shard(0)]`` on the ``dp`` sub-mesh for the other norms, routers and experts: the
real layouts a refit has to read, which is why the checks train one instead of faking them.
``refit.models.hf.dtensor_entries`` (``HFTrainer.sources``) maps them to canonical entries.

``HFTrainerWorker`` is the same class shaped for ``refit.runtime.ray.RayFleet``
(``trainer_cls(rank=, world_size=, ...)``), i.e. a ``TrainerEndpoint`` for the synchronizer.
A trainer rank's refit rank is its torch default-group rank (``offset = 0``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from refit.errors import LayoutError
from refit.models.fp8 import dequantize, quantize_reference
from refit.models.hf import dtensor_entries
from refit.models.megatron import Entry
from refit.plan.quant import BlockFp8
from refit.runtime.endpoint import TrainerEndpoint
from refit.testing.engine import shared_gpu

__all__ = ["HFTrainer", "HFTrainerWorker", "build_config", "build_model", "check_trainer_tp", "greedy", "shard_model",
           "tiny_gemma_config", "tiny_llama_config", "tiny_qwen2_config", "tiny_qwen3_config", "tiny_qwen3_moe_config",
           "tp_plan"]

# -- configs and models ------------------------------------------------------------------------

def _tiny(config: str, overrides: dict[str, Any], **shape: Any):
    """transformers' ``config`` class at the tests' size (vocab 128, hidden 64, 2 layers, 4 heads, GQA 2:1,
    untied), with the model's own ``shape`` and then the caller's ``overrides`` on top."""
    import transformers

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return getattr(transformers, config)(**{**kw, **shape, **overrides})


def tiny_llama_config(**overrides: Any):
    """A Llama-shaped config small enough for CPU tests (GQA 2:1, 2 layers, hidden 64)."""
    return _tiny("LlamaConfig", overrides, head_dim=16)


def tiny_qwen2_config(**overrides: Any):
    """A Qwen2-shaped config for CPU tests: biases on q/k/v (and none on o), GQA 2:1, hidden 64."""
    return _tiny("Qwen2Config", overrides, use_sliding_window=False)


def tiny_qwen3_config(**overrides: Any):
    """A dense Qwen3-shaped config for CPU tests: per-head q/k RMSNorms, one key/value head, tied embeddings."""
    return _tiny("Qwen3Config", overrides, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)


def tiny_gemma_config(**overrides: Any):
    """A Gemma-shaped config for CPU tests: RMSNorm scaled by ``1 + weight``, embeddings scaled by sqrt(hidden),
    a tanh-GELU MLP. Untied, so a trainer can split the head and the embedding over tp."""
    return _tiny("GemmaConfig", overrides, head_dim=16, hidden_act="gelu_pytorch_tanh",
                 hidden_activation="gelu_pytorch_tanh")


def tiny_qwen3_moe_config(**overrides: Any):
    """A Qwen3-MoE-shaped config for CPU tests (4 experts, top-2, q/k norms, hidden 64)."""
    return _tiny("Qwen3MoeConfig", overrides, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=True, head_dim=16)


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


def check_trainer_tp(config: Any, tp: int) -> None:
    """Raise ``LayoutError`` unless ``shard_model`` can cut a model of ``config`` over ``tp`` ranks.

    Callable before any rank starts (``config``: an HF config or its ``to_dict()``), so that a
    launcher refuses a TP size at once rather than after its fleet's start-up.
    """
    cfg = build_config(config)
    if tp > 1 and cfg.tie_word_embeddings:
        raise LayoutError("trainer tp > 1 with tied word embeddings is not supported (the head would share a "
                          "vocab-parallel DTensor with the embedding)")
    if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
        raise LayoutError(f"trainer tp={tp} must divide the {cfg.num_attention_heads} heads and "
                          f"{cfg.num_key_value_heads} key/value heads (transformers' attention infers local heads)")


def shard_model(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """TP over ``mesh['tp']`` then FSDP2 over ``mesh['dp']`` (each decoder layer, then the root)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh["tp"].size()
    check_trainer_tp(model.config, tp)
    if tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def build_config(config: Mapping[str, Any] | Any):
    """An HF config object from ``to_dict()`` output (or the object itself)."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    cfg = dict(config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)



# -- the trainer ------------------------------------------------------------------------------------

class HFTrainer(TrainerEndpoint):
    """One rank of an HF model trained with TP (``parallelize_module``) x FSDP2 (``fully_shard``).

    Needs ``torch.distributed`` initialised over exactly the trainer's ranks (``dp * tp`` of
    them, e.g. ``init_process_group("gloo")``), unless a ``mesh`` is given. Every rank must
    construct it with the same arguments; collective methods say so.
    """

    def __init__(self, config: Any, *, dp: int = 1, tp: int = 1, mesh: Any = None, seed: int = 0, lr: float = 1e-3,
                 batch_size: int = 2, seq_len: int = 16, data_seed: int = 1234, device: str = "cpu",
                 fp8_block: tuple[int, int] | None = None):
        import torch.distributed as dist

        if fp8_block is not None:  # the block of the FP8 engines it feeds (quantized on its ranks)
            self.refit_fp8_block = (int(fp8_block[0]), int(fp8_block[1]))
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

    def synthetic_batch(self) -> torch.Tensor:
        """Token ids ``[batch, seq_len]``: the same every step, different on every dp rank, the same across tp.

        Each row counts up from a random start (``t, t+1, ...`` modulo the vocabulary), and
        the batch is fixed, so a small model's loss falls from the first step on and a run
        shows training doing what it should (a fresh batch of uniformly random tokens each
        step leaves nothing to learn: the loss only wanders around log(vocab)). The weights
        change every step all the same, which is what a refit needs.
        """
        g = torch.Generator().manual_seed(self.data_seed + self.dp_rank)
        starts = torch.randint(0, self.config.vocab_size, (self.batch_size, 1), generator=g)
        ids = (starts + torch.arange(self.seq_len)) % self.config.vocab_size
        return ids.to(self.device)

    def train_step(self, input_ids: torch.Tensor | None = None) -> float:
        """One AdamW step on ``input_ids`` (default: the synthetic batch); returns the local loss (collective)."""
        ids = self.synthetic_batch() if input_ids is None else input_ids.to(self.device)
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

    def reference_model(self, fp8_params: Sequence[str] = ()) -> torch.nn.Module:
        """A plain (unsharded) copy of the model with the current weights (collective); the params
        named in ``fp8_params`` quantized to this rank's FP8 block and back, as an FP8 engine holds them."""
        full = self.full_state()
        if fp8_params:
            fmt = BlockFp8(self.refit_fp8_block)
            for n in fp8_params:
                full[n] = dequantize(*quantize_reference(full[n], fmt), fmt).to(full[n].dtype)
        if self._reference is None:
            self._reference = build_model(self.config, seed=self.seed).to(self.device).eval()
        missing, unexpected = self._reference.load_state_dict(full, strict=False)
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise LayoutError(f"reference model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
        return self._reference

    @torch.no_grad()
    def reference(self, input_ids: torch.Tensor, new_tokens: int = 0,
                  fp8_params: Sequence[str] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """HF logits ``[b, s, V]`` and greedy tokens ``[b, new_tokens]`` of the current weights
        (collective); ``fp8_params`` as ``reference_model``."""
        model = self.reference_model(fp8_params)
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

    def train_and_reference(self, prompt: Sequence[int], new_tokens: int = 4, fp8_params: Sequence[str] = ()) -> dict:
        """One optimizer step, then the reference logits/tokens of the new weights (collective);
        ``fp8_params``: those an FP8 engine holds, quantized and back in the reference."""
        loss = self.train_step()
        logits, tokens = self.reference(torch.tensor([list(prompt)]), new_tokens, fp8_params)
        return {"loss": loss, "logits": logits.cpu(), "tokens": tokens.cpu(), "step": self.steps}



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

