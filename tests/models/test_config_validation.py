"""A config.json that cannot describe a model is refused by name, before any shape is built."""

from __future__ import annotations

import json

import pytest

from refit import ConfigError, RefitError
from refit.models import dtype_name, get_model, load_hf_config

LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "torch_dtype": "bfloat16",
}
MOE = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 64}
MLA = {
    "model_type": "deepseek_v3", "hidden_size": 250, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
}


def changed(base: dict, **changes) -> dict:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not ...}


@pytest.mark.parametrize("cfg, key", [
    (changed(LLAMA, vocab_size=...), "vocab_size"),
    (changed(LLAMA, hidden_size=...), "hidden_size"),
    (changed(LLAMA, num_hidden_layers=...), "num_hidden_layers"),
    (changed(LLAMA, num_attention_heads=0), "num_attention_heads"),
    (changed(LLAMA, num_attention_heads=-8), "num_attention_heads"),
    (changed(LLAMA, num_key_value_heads=0), "num_key_value_heads"),
    (changed(LLAMA, num_key_value_heads=3), "num_key_value_heads"),
    (changed(LLAMA, hidden_size=250), "hidden_size 250 is not divisible by num_attention_heads 8"),
    (changed(LLAMA, hidden_size=256.5), "hidden_size"),
    (changed(LLAMA, hidden_size="256"), "hidden_size"),
    (changed(LLAMA, hidden_size=True), "hidden_size"),
    (changed(LLAMA, num_hidden_layers=0), "num_hidden_layers"),
    (changed(LLAMA, vocab_size=-1), "vocab_size"),
    (changed(LLAMA, intermediate_size=...), "intermediate_size"),
    (changed(LLAMA, intermediate_size=-4), "intermediate_size"),
    (changed(LLAMA, head_dim=0), "head_dim"),
    (changed(LLAMA, torch_dtype="bfloat17"), "torch_dtype"),
    (changed(LLAMA, torch_dtype=..., dtype="int4"), "dtype"),
    (changed(MOE, num_experts=-2), "num_experts"),
    (changed(MOE, moe_intermediate_size=0), "moe_intermediate_size"),
    (changed(MOE, decoder_sparse_step=0), "decoder_sparse_step"),
    (changed(MLA, v_head_dim=0), "v_head_dim"),
])
def test_bad_config_is_refused_naming_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key) as e:
        load_hf_config(cfg, name="tiny")
    assert isinstance(e.value, RefitError) and isinstance(e.value, ValueError)
    assert "tiny" in str(e.value)


def test_good_configs_still_load():
    assert load_hf_config(LLAMA).head_dim == 32
    assert load_hf_config(changed(LLAMA, hidden_size=250, head_dim=32)).head_dim == 32  # sized on their own
    assert load_hf_config(MLA).mla  # MLA sizes its heads with qk_*_head_dim: hidden need not divide
    assert load_hf_config(changed(LLAMA, num_key_value_heads=None)).num_kv_heads == 8
    assert load_hf_config(changed(MOE, intermediate_size=...)).num_experts == 4  # every layer is MoE
    assert load_hf_config(changed(LLAMA, hidden_size=256.0)).hidden_size == 256


@pytest.mark.parametrize("text, name", [("torch.float16", "float16"), ("bf16", "bfloat16"), ("FP32", "float32"),
                                        ("float64", "float64")])
def test_dtype_spellings(text, name):
    assert dtype_name(text) == name
    assert load_hf_config(changed(LLAMA, torch_dtype=text)).dtype == name


def test_unknown_dtype_is_refused_not_replaced():
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        dtype_name("fp8")
    with pytest.raises(ConfigError, match="dtype"):
        get_model("llama3-8b", dtype="bfloat17")


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("  \n", "is empty"),
    ('{"hidden_size": 256,', "not valid JSON"),
    ("[1, 2]", "must be a JSON object, not list"),
    ("42", "must be a JSON object, not int"),
    ("null", "must be a JSON object, not NoneType"),
])
def test_unreadable_file_is_refused_naming_it(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    for load in (load_hf_config, get_model):
        with pytest.raises(ConfigError, match=message) as e:
            load(str(path))
        assert str(path) in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_hf_config(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="a folder without a config.json"):
        get_model(str(tmp_path / "empty"))
    path.write_text(json.dumps(changed(LLAMA, num_attention_heads=0)))
    with pytest.raises(ConfigError, match=f"{path}: num_attention_heads must be a positive integer, got 0"):
        get_model(str(tmp_path))
