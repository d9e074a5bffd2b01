"""Every tensor of a model, by its Hugging Face name, with a global shape and a sharding kind.

Built in: Llama-3-8B, Llama-3-70B, Qwen3-235B-A22B, DeepSeek-V3 and Kimi-K2 (routed
experts, shared experts, routers, multi-token-prediction layers and all). Anything else of
the same families is read from its ``config.json`` with ``load_hf_config``.

Each tensor carries a *kind* that says how tensor parallelism cuts it, the same on the
Megatron side and the vLLM side:

========== ======================================================================
kind        meaning
========== ======================================================================
``col``     column-parallel (output features, dim 0): q/k/v up-projections, gate/up
``kv``      column-parallel over key/value heads (``heads`` of them): k_proj, v_proj;
            when TP exceeds the heads, ranks share a head (see ``parallel``)
``row``     row-parallel (input features, dim 1): o_proj, down_proj
``vocab``   vocabulary-parallel (dim 0): embed_tokens, lm_head
``rep``     replicated on every TP rank: norms, routers, MLA down-projections
``ecol``    a routed expert's gate/up (dim 0 under expert TP)
``erow``    a routed expert's down (dim 1 under expert TP)
========== ======================================================================

Fused engine tensors (``qkv_proj``, ``gate_up_proj``, grouped ``w13``) are views over
these and move the same bytes; the adapters that map names live elsewhere.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from refit.errors import ConfigError


@dataclass(frozen=True)
class ParamShape:
    """One tensor: HF name, global shape, sharding kind, and where it sits in the model.

    ``layer`` is the decoder layer (``-1`` before the first, ``num_layers + mtp`` for the
    final norm and head); ``expert`` the routed expert index, else ``None``; ``heads`` the
    number of key/value heads along dim 0 of a ``kv`` tensor.
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int
    expert: int | None = None
    heads: int | None = None
    scales_of: str | None = None  # the block scales of this FP8 weight, laid out like it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def tp_dim(self) -> int | None:
        """The dim plain (one mesh dim) tensor parallelism cuts: 0 or 1, ``None`` when replicated."""
        return {"row": 1, "erow": 1, "rep": None}.get(self.kind, 0)


@dataclass(frozen=True)
class ModelSpec:
    """The shape-determining fields of a decoder-only model's config."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    # mixture of experts
    num_experts: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # DeepSeek style: one fused shared MLP of n x moe size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE style shared expert (+ its gate)
    first_dense_layers: int = 0  # leading dense-MLP layers (DeepSeek first_k_dense_replace)
    moe_layer_freq: int = 1
    moe_layer_offset: int = 0  # a layer is MoE when (layer + offset) % freq == 0 (Qwen: 1, DeepSeek: 0)
    router_bias: bool = False  # DeepSeek-V3 noaux_tc e_score_correction_bias
    expert_naming: str = "mlp"  # "mlp" (mlp.experts.E.gate_proj) or "mixtral" (block_sparse_moe.experts.E.w1)
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_mtp_layers: int = 0  # DeepSeek-V3 multi-token prediction layers, stored after the last layer
    dtype: str = "bfloat16"
    _extra: tuple = field(default=(), compare=False, repr=False)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        if self.num_experts == 0 or layer < self.first_dense_layers:
            return False
        return (layer + self.moe_layer_offset) % self.moe_layer_freq == 0

    # -- tensors -------------------------------------------------------------------------
    def params(self) -> Iterator[ParamShape]:
        """Every tensor, in checkpoint order: embedding, layers (then MTP layers), norm, head."""
        h, v = self.hidden_size, self.vocab_size
        yield ParamShape("model.embed_tokens.weight", (v, h), "vocab", -1)
        for layer in range(self.num_layers):
            yield from self._layer(layer, f"model.layers.{layer}")
        for i in range(self.num_mtp_layers):
            layer = self.num_layers + i
            p = f"model.layers.{layer}"
            yield ParamShape(f"{p}.embed_tokens.weight", (v, h), "vocab", layer)
            yield ParamShape(f"{p}.enorm.weight", (h,), "rep", layer)
            yield ParamShape(f"{p}.hnorm.weight", (h,), "rep", layer)
            yield ParamShape(f"{p}.eh_proj.weight", (h, 2 * h), "rep", layer)
            yield from self._layer(layer, p, moe=self.num_experts > 0)
            yield ParamShape(f"{p}.shared_head.norm.weight", (h,), "rep", layer)
            yield ParamShape(f"{p}.shared_head.head.weight", (v, h), "vocab", layer)
        last = self.num_layers + self.num_mtp_layers
        yield ParamShape("model.norm.weight", (h,), "rep", last)
        if not self.tie_word_embeddings:
            yield ParamShape("lm_head.weight", (v, h), "vocab", last)

    def _layer(self, layer: int, p: str, moe: bool | None = None) -> Iterator[ParamShape]:
        h = self.hidden_size
        yield ParamShape(f"{p}.input_layernorm.weight", (h,), "rep", layer)
        a = f"{p}.self_attn"
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                yield ParamShape(f"{a}.q_a_proj.weight", (self.q_lora_rank, h), "rep", layer)
                yield ParamShape(f"{a}.q_a_layernorm.weight", (self.q_lora_rank,), "rep", layer)
                yield ParamShape(f"{a}.q_b_proj.weight", (self.num_heads * qk, self.q_lora_rank), "col", layer)
            else:
                yield ParamShape(f"{a}.q_proj.weight", (self.num_heads * qk, h), "col", layer)
            yield ParamShape(f"{a}.kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope_head_dim, h),
                             "rep", layer)
            yield ParamShape(f"{a}.kv_a_layernorm.weight", (self.kv_lora_rank,), "rep", layer)
            yield ParamShape(f"{a}.kv_b_proj.weight",
                             (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                             "col", layer)
            yield ParamShape(f"{a}.o_proj.weight", (h, self.num_heads * self.v_head_dim), "row", layer)
        else:
            d, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
            yield ParamShape(f"{a}.q_proj.weight", (nq * d, h), "col", layer)
            yield ParamShape(f"{a}.k_proj.weight", (nkv * d, h), "kv", layer, heads=nkv)
            yield ParamShape(f"{a}.v_proj.weight", (nkv * d, h), "kv", layer, heads=nkv)
            if self.attention_bias:
                yield ParamShape(f"{a}.q_proj.bias", (nq * d,), "col", layer)
                yield ParamShape(f"{a}.k_proj.bias", (nkv * d,), "kv", layer, heads=nkv)
                yield ParamShape(f"{a}.v_proj.bias", (nkv * d,), "kv", layer, heads=nkv)
            yield ParamShape(f"{a}.o_proj.weight", (h, nq * d), "row", layer)
            if self.qk_norm:
                yield ParamShape(f"{a}.q_norm.weight", (d,), "rep", layer)
                yield ParamShape(f"{a}.k_norm.weight", (d,), "rep", layer)
        yield ParamShape(f"{p}.post_attention_layernorm.weight", (h,), "rep", layer)
        moe = self.is_moe_layer(layer) if moe is None else moe
        if not moe:
            yield from _mlp(f"{p}.mlp", h, self.intermediate_size, layer)
            return
        e_inter = self.moe_intermediate_size
        if self.expert_naming == "mixtral":
            m = f"{p}.block_sparse_moe"
            yield ParamShape(f"{m}.gate.weight", (self.num_experts, h), "rep", layer)
            for e in range(self.num_experts):
                x = f"{m}.experts.{e}"
                yield ParamShape(f"{x}.w1.weight", (e_inter, h), "ecol", layer, e)
                yield ParamShape(f"{x}.w2.weight", (h, e_inter), "erow", layer, e)
                yield ParamShape(f"{x}.w3.weight", (e_inter, h), "ecol", layer, e)
            return
        m = f"{p}.mlp"
        yield ParamShape(f"{m}.gate.weight", (self.num_experts, h), "rep", layer)
        if self.router_bias:
            yield ParamShape(f"{m}.gate.e_score_correction_bias", (self.num_experts,), "rep", layer)
        for e in range(self.num_experts):
            x = f"{m}.experts.{e}"
            yield ParamShape(f"{x}.gate_proj.weight", (e_inter, h), "ecol", layer, e)
            yield ParamShape(f"{x}.up_proj.weight", (e_inter, h), "ecol", layer, e)
            yield ParamShape(f"{x}.down_proj.weight", (h, e_inter), "erow", layer, e)
        if self.num_shared_experts:
            yield from _mlp(f"{m}.shared_experts", h, e_inter * self.num_shared_experts, layer)
        if self.shared_expert_intermediate_size:
            yield from _mlp(f"{m}.shared_expert", h, self.shared_expert_intermediate_size, layer)
            yield ParamShape(f"{m}.shared_expert_gate.weight", (1, h), "rep", layer)

    @cached_property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params())

    @cached_property
    def num_tensors(self) -> int:
        """How many tensors ``params`` yields, counted per kind of layer (one of each is built, not all):
        a config's size is checked against ``MAX_TENSORS`` before anything iterates its tensors."""
        per_dense = sum(1 for _ in self._layer(0, "x", moe=False))
        per_moe = sum(1 for _ in self._layer(0, "x", moe=True)) if self.num_experts else per_dense
        moe_layers = sum(1 for layer in range(self.num_layers) if self.is_moe_layer(layer))
        mtp = self.num_mtp_layers * (6 + (per_moe if self.num_experts else per_dense))
        head = 0 if self.tie_word_embeddings else 1
        return 2 + head + (self.num_layers - moe_layers) * per_dense + moe_layers * per_moe + mtp

    @property
    def num_stored_layers(self) -> int:
        """Decoder layers plus MTP layers: what pipeline stages divide."""
        return self.num_layers + self.num_mtp_layers

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.num_params, "tensors": self.num_tensors,
                "layers": self.num_layers, "mtp_layers": self.num_mtp_layers, "experts": self.num_experts,
                "dtype": self.dtype}


def _mlp(p: str, h: int, inter: int, layer: int) -> Iterator[ParamShape]:
    yield ParamShape(f"{p}.gate_proj.weight", (inter, h), "col", layer)
    yield ParamShape(f"{p}.up_proj.weight", (inter, h), "col", layer)
    yield ParamShape(f"{p}.down_proj.weight", (h, inter), "row", layer)


# -- built-in models (values from each model's published config.json) ---------------------

def _llama3(name: str, hidden: int, layers: int, heads: int, inter: int) -> ModelSpec:
    return ModelSpec(name=name, vocab_size=128256, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=8, head_dim=128, intermediate_size=inter)


def _deepseek(name: str, *, heads: int, experts: int, vocab: int, dense: int, mtp: int) -> ModelSpec:
    return ModelSpec(name=name, vocab_size=vocab, hidden_size=7168, num_layers=61, num_heads=heads,
                     num_kv_heads=heads, head_dim=128, intermediate_size=18432, num_experts=experts,
                     moe_intermediate_size=2048, num_shared_experts=1, first_dense_layers=dense, router_bias=True,
                     q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, num_mtp_layers=mtp)


MODELS: dict[str, ModelSpec] = {
    "llama3-8b": _llama3("llama3-8b", 4096, 32, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 8192, 80, 64, 28672),
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b", vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, intermediate_size=12288, qk_norm=True, num_experts=128, moe_intermediate_size=1536),
    "deepseek-v3": _deepseek("deepseek-v3", heads=128, experts=256, vocab=129280, dense=3, mtp=1),
    "kimi-k2": _deepseek("kimi-k2", heads=64, experts=384, vocab=163840, dense=1, mtp=0),
}
_ALIASES = {
    "llama-3-8b": "llama3-8b", "meta-llama-3-8b": "llama3-8b", "llama3.1-8b": "llama3-8b",
    "llama-3-70b": "llama3-70b", "meta-llama-3-70b": "llama3-70b", "llama3.1-70b": "llama3-70b",
    "qwen3-235b": "qwen3-235b-a22b", "deepseek-v3-base": "deepseek-v3", "deepseekv3": "deepseek-v3",
    "kimi-k2-instruct": "kimi-k2", "kimik2": "kimi-k2",
}


def get_model(name_or_path: str, *, dtype: str | None = None) -> ModelSpec:
    """A built-in model by name (case-insensitive), or a ``config.json`` (or a folder holding one)."""
    key = name_or_path.lower().replace("_", "-").split("/")[-1]
    key = _ALIASES.get(key, key)
    spec = MODELS.get(key)
    if spec is None:
        path = name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise ConfigError(f"{name_or_path}: a folder without a config.json")
        if not os.path.exists(path):
            raise ConfigError(f"unknown model {name_or_path!r}: give one of {sorted(MODELS)} or a config.json path")
        spec = load_hf_config(path)
    if dtype is not None:
        spec = _replace(spec, dtype=dtype_name(dtype))
    return spec


def _replace(spec: ModelSpec, **changes) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


# Weights dtypes a model or a layout may name; the aliases are the spellings configs and users write.
DTYPES = ("bfloat16", "float16", "float32", "float64")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                  "fp64": "float64", "double": "float64"}


def dtype_name(text: Any, *, what: str = "dtype") -> str:
    """The canonical name of a weights dtype (``torch.bfloat16``, ``bf16`` -> ``bfloat16``).

    An unknown name is refused rather than replaced by a default: a wrong dtype silently
    doubles or halves every byte count that a plan or a benchmark reports.
    """
    key = str(text).strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(key, key)
    if name not in DTYPES:
        raise ConfigError(f"{what}: unknown dtype {text!r}; use one of {', '.join(DTYPES)}")
    return name


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A ``config.json`` parsed into a dict; ConfigError, naming the file, when it cannot be."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"{os.fspath(path)}: cannot read the model config ({reason})") from None
    if not text.strip():
        raise ConfigError(f"{os.fspath(path)}: the model config is empty")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{os.fspath(path)}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{os.fspath(path)}: the model config must be a JSON object, not {type(cfg).__name__}")
    return cfg


# The largest value a config may give each size it sets, and the most tensors a model may have.
# Each is several times the largest published model's (Llama-3-405B: 126 layers, hidden 16384,
# MLP 53248; Kimi-K2: 384 routed experts, 70k tensors; Gemma: a 262k vocabulary). A config
# beyond them is a typo or an attack, not a model: planning it would run without bound (a
# 10^8-layer config yields 10^9 tensors, one at a time) before anything could say so.
CONFIG_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 1 << 20, "vocab_size": 1 << 22,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096,
    "n_routed_experts": 16384, "num_experts": 16384, "num_local_experts": 16384, "moe_intermediate_size": 1 << 20,
    "n_shared_experts": 64, "shared_expert_intermediate_size": 1 << 20, "first_k_dense_replace": 1024,
    "moe_layer_freq": 1024, "decoder_sparse_step": 1024, "num_nextn_predict_layers": 64,
    "q_lora_rank": 65536, "kv_lora_rank": 65536, "qk_nope_head_dim": 4096, "qk_rope_head_dim": 4096,
    "v_head_dim": 4096,
}
MAX_TENSORS = 1 << 20


class _ConfigReader:
    """Typed reads of a config dict; every refusal names the key and where the config came from.

    Sizes must be whole and positive (and counts whole and non-negative): a zero or a
    fraction would otherwise surface much later as a division by zero or as a model with
    no weights that every step "syncs" in no time. Each is at most its ``CONFIG_LIMITS``.
    """

    def __init__(self, cfg: Mapping[str, Any], where: str):
        self.cfg, self.where = cfg, where

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def given(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def _whole(self, key: str, least: int, what: str) -> int:
        value = self.cfg[key]
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole or value < least:
            raise self.fail(f"{key} must be a {what} integer, got {value!r}")
        limit = CONFIG_LIMITS.get(key)
        if limit is not None and value > limit:
            raise self.fail(f"{key} {int(value)} is more than {limit}, the most refit plans (refit.models.specs."
                            "CONFIG_LIMITS); nothing was planned")
        return int(value)

    def size(self, key: str) -> int:
        """A required positive integer."""
        if not self.given(key):
            raise self.fail(f"config.json has no {key!r}")
        return self._whole(key, 1, "positive")

    def optional_size(self, key: str, default: int = 0) -> int:
        """A positive integer when given (null or absent: ``default``)."""
        return self._whole(key, 1, "positive") if self.given(key) else default

    def count(self, key: str, default: int = 0) -> int:
        """A non-negative integer (null or absent: ``default``)."""
        return self._whole(key, 0, "non-negative") if self.given(key) else default


def load_hf_config(config: str | os.PathLike | Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` (a path or the parsed dict).

    Reads the Llama / Mistral / Qwen2 / Qwen3 (dense and MoE) / Mixtral / DeepSeek-V2/V3 /
    Kimi-K2 families; a multimodal wrapper's ``text_config`` is read in its place. A config
    that cannot describe a model (missing or non-positive sizes, heads that do not divide,
    an unknown dtype, a file that is no JSON object) raises ``ConfigError`` naming the key, and
    so does one beyond ``CONFIG_LIMITS`` or ``MAX_TENSORS``, before any tensor is listed.
    """
    if not isinstance(config, Mapping):
        cfg = read_config_file(config)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(config))) or "model"
        where = os.fspath(config)
    else:
        cfg = dict(config)
        where = ""
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    model_type = str(cfg.get("model_type", ""))
    name = name or cfg.get("_name_or_path") or model_type or "model"
    read = _ConfigReader(cfg, where or str(name))
    fields: dict[str, Any] = dict(
        name=str(name), vocab_size=read.size("vocab_size"), num_layers=read.size("num_hidden_layers"),
        **_attention_fields(read), intermediate_size=read.count("intermediate_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"), attention_bias=bool(cfg.get("attention_bias", False))
        or model_type in ("qwen2", "qwen2_moe"), dtype=_config_dtype(read),
    )
    fields.update(_expert_fields(read))
    if cfg.get("kv_lora_rank"):
        fields.update(q_lora_rank=read.count("q_lora_rank") or None, kv_lora_rank=read.size("kv_lora_rank"),
                      qk_nope_head_dim=read.size("qk_nope_head_dim"), qk_rope_head_dim=read.size("qk_rope_head_dim"),
                      v_head_dim=read.size("v_head_dim"), num_mtp_layers=read.count("num_nextn_predict_layers"))
    spec = ModelSpec(**fields)
    if spec.num_tensors > MAX_TENSORS:
        raise read.fail(f"{spec.num_tensors} tensors ({spec.num_layers} layers of up to {spec.num_experts} experts "
                        f"each) is more than {MAX_TENSORS}, the most refit plans (refit.models.specs.MAX_TENSORS); "
                        "nothing was planned")
    dense = [layer for layer in range(spec.num_layers) if not spec.is_moe_layer(layer)]
    if dense and not spec.intermediate_size:
        raise read.fail(f"intermediate_size must be a positive integer: layer {dense[0]} has a dense MLP")
    return spec


def _attention_fields(read: _ConfigReader) -> dict[str, int]:
    """Hidden size and heads; the head size is hidden / heads unless ``head_dim`` says otherwise."""
    hidden, heads = read.size("hidden_size"), read.size("num_attention_heads")
    kv_heads = read.optional_size("num_key_value_heads", heads)
    if heads % kv_heads:
        raise read.fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if read.given("head_dim"):
        head_dim = read.optional_size("head_dim")
    elif hidden % heads and not read.cfg.get("kv_lora_rank"):  # MLA sizes its heads with qk_*_head_dim
        raise read.fail(f"hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                        "(give head_dim when the heads are sized on their own)")
    else:
        head_dim = hidden // heads
    return dict(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _config_dtype(read: _ConfigReader) -> str:
    for key in ("torch_dtype", "dtype"):
        if read.given(key):
            return dtype_name(read.cfg[key], what=f"{read.where}: {key}")
    return "bfloat16"


def _expert_fields(read: _ConfigReader) -> dict[str, Any]:
    """Routed and shared experts and which layers hold them; none for a dense model."""
    cfg = read.cfg
    key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if read.given(k)), None)
    experts = read.count(key) if key else 0
    if not experts:
        return {}
    moe_key = "moe_intermediate_size" if read.given("moe_intermediate_size") else "intermediate_size"
    fields: dict[str, Any] = dict(num_experts=experts, moe_intermediate_size=read.size(moe_key))
    if key == "num_local_experts":
        fields["expert_naming"] = "mixtral"
    if "first_k_dense_replace" in cfg:
        fields["first_dense_layers"] = read.count("first_k_dense_replace")
        fields["moe_layer_freq"] = read.optional_size("moe_layer_freq", 1)
    elif cfg.get("mlp_only_layers"):
        raise read.fail("mlp_only_layers is not supported; list the layers as a dense prefix")
    else:
        fields["moe_layer_freq"] = read.optional_size("decoder_sparse_step", 1)
        fields["moe_layer_offset"] = 1
    fields["num_shared_experts"] = read.count("n_shared_experts")
    fields["shared_expert_intermediate_size"] = read.count("shared_expert_intermediate_size")
    fields["router_bias"] = cfg.get("topk_method") == "noaux_tc"
    return fields


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config (object or ``to_dict()``) as a dict ``load_hf_config`` reads right.

    transformers 5 writes a Qwen-MoE config's ``num_experts`` under its alias
    ``num_local_experts`` (the Mixtral name), which would read as Mixtral expert naming.
    """
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if cfg.get("model_type") != "mixtral" and "num_local_experts" in cfg and "num_experts" not in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    return cfg
