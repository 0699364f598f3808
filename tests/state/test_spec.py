"""State specs from Hugging Face configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.state.sharding import local_channels
from statebridge.state.spec import Sharding, StateSpec

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

# Published shapes, written out here by hand (see ../shared/reference/vllm-mamba-state.md).
LFM2_1_2B = {
    "model_type": "lfm2", "hidden_size": 2048, "num_hidden_layers": 16, "conv_L_cache": 3,
    "torch_dtype": "bfloat16",
    "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
}
MAMBA2_2_7B = {
    "model_type": "mamba2", "hidden_size": 2560, "expand": 2, "head_dim": 64, "state_size": 128,
    "n_groups": 1, "num_hidden_layers": 64, "conv_kernel": 4, "torch_dtype": "bfloat16",
}

#: Granite-4.0-H-1B's state and attention fields (reference: hybrid-models.md section 1): dense,
#: attention at 5, 15, 25, 35, 12 heads / 4 KV heads, mamba 48 heads x 64, d_state 128, 1 group.
GRANITE_4_0_H_1B = {
    "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40,
    "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 4096,
    "num_local_experts": 0, "vocab_size": 100352, "mamba_n_heads": 48, "mamba_d_head": 64,
    "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 256, "position_embedding_type": "nope", "torch_dtype": "bfloat16",
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
}
GRANITE_ATTENTION = (5, 15, 25, 35)


def test_lfm2_1_2b_has_ten_conv_layers_of_2048_by_2():
    spec = StateSpec.from_config(LFM2_1_2B)
    assert spec.num_state_layers == 10
    assert len(spec.groups) == 1
    group = spec.groups[0]
    assert group.layer_ids == (0, 1, 3, 4, 6, 7, 9, 11, 13, 15)
    (conv,) = group.tensors
    assert (conv.channels, conv.inner_shape) == (2048, (2,))
    assert conv.torch_dtype == torch.bfloat16
    assert [(s.name, s.size, s.sharding) for s in conv.segments] == [("Bx", 2048, Sharding.SPLIT)]
    assert spec.bytes_per_request() == 10 * 2048 * 2 * 2  # 81,920 B, as vLLM's worked example


def test_lfm2_legacy_full_attn_idxs():
    config = {k: v for k, v in LFM2_1_2B.items() if k != "layer_types"}
    config["full_attn_idxs"] = [2, 5, 8, 10, 12, 14]
    assert StateSpec.from_config(config).groups == StateSpec.from_config(LFM2_1_2B).groups


def test_mamba2_2_7b_conv_5376_and_ssm_80_64_128():
    spec = StateSpec.from_config(MAMBA2_2_7B)
    assert spec.num_state_layers == 64 and len(spec.groups) == 1
    conv, ssm = spec.groups[0].tensors
    assert conv.channels == 5376
    assert [(s.name, s.size) for s in conv.segments] == [("x", 5120), ("B", 128), ("C", 128)]
    assert conv.inner_shape == (3,)
    assert (ssm.channels, *ssm.inner_shape) == (80, 64, 128)
    # n_groups = 1: B and C are replicated on every rank, x is split.
    assert local_channels(conv, 4) == 5120 // 4 + 2 * 128
    assert local_channels(ssm, 4) == 20


def test_granite_4_0_h_1b_is_36_mamba2_layers_and_kv_4_by_128():
    spec = StateSpec.from_config(GRANITE_4_0_H_1B)
    assert spec.model_type == "granitemoehybrid" and spec.conv_kernel == 4
    assert spec.layer_types == tuple("full_attention" if i in GRANITE_ATTENTION else "mamba2"
                                     for i in range(40))
    (group,) = spec.groups
    assert group.layer_ids == tuple(i for i in range(40) if i not in GRANITE_ATTENTION)
    conv, ssm = group.tensors
    assert [(s.name, s.size, s.sharding, s.groups) for s in conv.segments] == [
        ("x", 3072, Sharding.SPLIT, 1), ("B", 128, Sharding.GROUPED, 1),
        ("C", 128, Sharding.GROUPED, 1)]
    assert (conv.channels, conv.inner_shape, conv.dtype) == (3328, (3,), "bfloat16")
    assert (ssm.channels, *ssm.inner_shape) == (48, 64, 128)
    assert [(s.name, s.sharding) for s in ssm.segments] == [("heads", Sharding.SPLIT)]
    assert (spec.kv.layer_ids, spec.kv.num_kv_heads, spec.kv.head_dim, spec.kv.dtype) == (
        GRANITE_ATTENTION, 4, 128, "bfloat16")
    assert spec.bytes_per_request() == 36 * (3328 * 3 + 48 * 64 * 128) * 2
    assert spec.kv_bytes(1) == 4 * 2 * 4 * 128 * 2            # 8 KiB per token
    # n_groups = 1: B and C replicated on every rank at TP > 1, x and the heads split.
    assert local_channels(conv, 4) == 3072 // 4 + 2 * 128
    assert local_channels(ssm, 4) == 12


def test_granite_mamba_state_is_mamba2_state():
    """The mamba layers of a Granite config describe the same tensors as the Mamba2 config of
    the same mixer (one builder for both)."""
    granite = StateSpec.from_config(GRANITE_4_0_H_1B, ssm_dtype="float32")
    mamba2 = StateSpec.from_config({"model_type": "mamba2", "hidden_size": 1536, "expand": 2,
                                    "head_dim": 64, "state_size": 128, "n_groups": 1,
                                    "num_hidden_layers": 1, "conv_kernel": 4,
                                    "torch_dtype": "bfloat16"}, ssm_dtype="float32")
    assert granite.groups[0].tensors == mamba2.groups[0].tensors


def test_granite_kv_dtype_and_fingerprint():
    spec = StateSpec.from_config(GRANITE_4_0_H_1B, kv_dtype="float16")
    assert spec.kv.dtype == "float16"
    assert {t.dtype for t in spec.groups[0].tensors} == {"bfloat16"}
    assert StateSpec.from_json(spec.to_json()) == spec
    assert spec.fingerprint() != StateSpec.from_config(GRANITE_4_0_H_1B).fingerprint()


def test_shipped_example_configs_match_the_published_shapes():
    assert StateSpec.from_pretrained(CONFIGS / "lfm2-1.2b.json").to_dict() == \
        StateSpec.from_config(LFM2_1_2B).to_dict()
    assert StateSpec.from_pretrained(CONFIGS / "mamba2-2.7b.json").to_dict() == \
        StateSpec.from_config(MAMBA2_2_7B).to_dict()


def test_original_mamba_key_names():
    config = {"model_type": "mamba2", "d_model": 2560, "n_layer": 64, "d_state": 128,
              "headdim": 64, "ngroups": 1, "d_conv": 4, "expand": 2}
    assert StateSpec.from_config(config, dtype="bfloat16").to_dict() == \
        StateSpec.from_config(MAMBA2_2_7B).to_dict()


def test_dtypes_per_tensor():
    spec = StateSpec.from_config(MAMBA2_2_7B, ssm_dtype="float32")
    conv, ssm = spec.groups[0].tensors
    assert (conv.dtype, ssm.dtype) == ("bfloat16", "float32")
    assert spec.fingerprint() != StateSpec.from_config(MAMBA2_2_7B).fingerprint()
    spec16 = StateSpec.from_config(MAMBA2_2_7B, dtype=torch.float16)
    assert {t.dtype for t in spec16.groups[0].tensors} == {"float16"}
    assert StateSpec.from_config({**MAMBA2_2_7B, "torch_dtype": None}).groups[0].tensors[0].dtype \
        == "float32"


def test_from_pretrained_reads_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LFM2_1_2B))
    assert StateSpec.from_pretrained(tmp_path).num_state_layers == 10


@pytest.mark.parametrize("config,kwargs,error,value", [
    ({"model_type": "llama"}, {}, UnsupportedModelError, "'llama'"),
    ({"hidden_size": 8}, {}, UnsupportedModelError, "None"),
    ({**LFM2_1_2B, "layer_types": ["conv", "sliding_attention"]}, {}, UnsupportedModelError,
     "sliding_attention"),
    ({**LFM2_1_2B, "layer_types": ["full_attention"] * 16}, {}, UnsupportedModelError, "no conv"),
    ({**LFM2_1_2B, "conv_L_cache": 1}, {}, ConfigError, "1"),
    ({**LFM2_1_2B, "hidden_size": "big"}, {}, ConfigError, "'big'"),
    ({**MAMBA2_2_7B, "num_heads": 81}, {}, ConfigError, "81"),
    ({**MAMBA2_2_7B, "head_dim": 48}, {}, ConfigError, "48"),
    ({**MAMBA2_2_7B, "n_groups": 3}, {}, ConfigError, "n_groups=3"),
    (MAMBA2_2_7B, {"ssm_dtype": "int8"}, ConfigError, "'int8'"),
    ({**GRANITE_4_0_H_1B, "layer_types": ["attention"] * 40}, {}, UnsupportedModelError,
     "no mamba layers"),
    ({**GRANITE_4_0_H_1B, "mamba_d_conv": 1}, {}, ConfigError, "mamba_d_conv must be >= 2"),
    ({**GRANITE_4_0_H_1B, "num_local_experts": 64}, {}, UnsupportedModelError,
     "num_local_experts=64"),
], ids=["unknown-model-type", "no-model-type", "unknown-layer", "no-conv-layer", "L_cache-1",
        "non-int", "num-heads", "head-dim", "groups-vs-heads", "dtype", "granite-no-mamba",
        "granite-d-conv-1", "granite-moe"])
def test_bad_configs_raise_typed_errors_naming_the_value(config, kwargs, error, value):
    with pytest.raises(error) as info:
        StateSpec.from_config(config, **kwargs)
    assert value in str(info.value)


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        StateSpec.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        StateSpec.from_pretrained(tmp_path)


def test_defaults_agree_with_transformers():
    """Without layer_types or full_attn_idxs transformers' Lfm2Config makes every layer
    attention; Mamba2Config's n_groups defaults to 8."""
    with pytest.raises(UnsupportedModelError, match="no conv"):
        StateSpec.from_config({"model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 2})
    spec = StateSpec.from_config({k: v for k, v in MAMBA2_2_7B.items() if k != "n_groups"})
    assert spec.groups[0].tensors[0].segments[1].groups == 8
