"""The one config.json reader against transformers' own config classes (the oracle), and the
state spec and the model runtime reading one config alike."""

from __future__ import annotations

import json
import math

import pytest
import torch

from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.hf_config import (
    GRANITE_DEFAULTS,
    GRANITE_LAYER_TYPES,
    LFM2_DEFAULTS,
    MAMBA2_DEFAULTS,
    GraniteHybridModelConfig,
    Lfm2ModelConfig,
    Mamba2Geometry,
    Mamba2ModelConfig,
    ModelConfig,
)
from statebridge.models import ModelRunner, make_checkpoint
from statebridge.state import PageGeometry, StateCache, StateSpec

tf = pytest.importorskip("transformers")

# (model_type, our attribute, transformers' attribute): every default the reader applies.
DEFAULT_CASES = [
    ("lfm2", "vocab_size", "vocab_size"),
    ("lfm2", "hidden_size", "hidden_size"),
    ("lfm2", "num_layers", "num_hidden_layers"),
    ("lfm2", "layer_types", "layer_types"),           # all attention without layer_types
    ("lfm2", "intermediate_size", "intermediate_size"),
    ("lfm2", "norm_eps", "norm_eps"),
    ("lfm2", "tie_word_embeddings", "tie_word_embeddings"),
    ("lfm2", "conv_bias", "conv_bias"),
    ("lfm2", "conv_L_cache", "conv_L_cache"),
    ("lfm2", "block_multiple_of", "block_multiple_of"),
    ("lfm2", "block_ffn_dim_multiplier", "block_ffn_dim_multiplier"),
    ("lfm2", "block_auto_adjust_ff_dim", "block_auto_adjust_ff_dim"),
    ("lfm2", "num_attention_heads", "num_attention_heads"),
    ("lfm2", "num_key_value_heads", "num_key_value_heads"),
    ("mamba2", "vocab_size", "vocab_size"),
    ("mamba2", "hidden_size", "hidden_size"),
    ("mamba2", "num_layers", "num_hidden_layers"),
    ("mamba2", "expand", "expand"),
    ("mamba2", "num_heads", "num_heads"),              # derived; equal at the defaults
    ("mamba2", "head_dim", "head_dim"),
    ("mamba2", "state_size", "state_size"),
    ("mamba2", "n_groups", "n_groups"),
    ("mamba2", "conv_kernel", "conv_kernel"),
    ("mamba2", "chunk_size", "chunk_size"),
    ("mamba2", "norm_eps", "layer_norm_epsilon"),      # block norms, norm_f AND the gated norm
    ("mamba2", "use_bias", "use_bias"),
    ("mamba2", "use_conv_bias", "use_conv_bias"),
    ("mamba2", "hidden_act", "hidden_act"),
    ("mamba2", "residual_in_fp32", "residual_in_fp32"),
    ("mamba2", "time_step_limit", "time_step_limit"),
    ("mamba2", "tie_word_embeddings", "tie_word_embeddings"),
    ("granitemoehybrid", "vocab_size", "vocab_size"),
    ("granitemoehybrid", "hidden_size", "hidden_size"),
    ("granitemoehybrid", "num_layers", "num_hidden_layers"),
    ("granitemoehybrid", "layer_types", "layer_types"),   # all mamba without layer_types
    ("granitemoehybrid", "intermediate_size", "intermediate_size"),
    ("granitemoehybrid", "shared_intermediate_size", "shared_intermediate_size"),
    ("granitemoehybrid", "hidden_act", "hidden_act"),
    ("granitemoehybrid", "norm_eps", "rms_norm_eps"),
    ("granitemoehybrid", "tie_word_embeddings", "tie_word_embeddings"),
    ("granitemoehybrid", "num_attention_heads", "num_attention_heads"),
    ("granitemoehybrid", "num_key_value_heads", "num_key_value_heads"),  # derived: = heads
    ("granitemoehybrid", "attention_bias", "attention_bias"),
    ("granitemoehybrid", "position_embedding_type", "position_embedding_type"),
    ("granitemoehybrid", "attention_multiplier", "attention_multiplier"),
    ("granitemoehybrid", "embedding_multiplier", "embedding_multiplier"),
    ("granitemoehybrid", "residual_multiplier", "residual_multiplier"),
    ("granitemoehybrid", "logits_scaling", "logits_scaling"),
    ("granitemoehybrid", "mamba_n_heads", "mamba_n_heads"),
    ("granitemoehybrid", "mamba_d_head", "mamba_d_head"),  # derived from "auto"
    ("granitemoehybrid", "mamba_d_state", "mamba_d_state"),
    ("granitemoehybrid", "mamba_n_groups", "mamba_n_groups"),
    ("granitemoehybrid", "mamba_d_conv", "mamba_d_conv"),
    ("granitemoehybrid", "mamba_expand", "mamba_expand"),
    ("granitemoehybrid", "mamba_chunk_size", "mamba_chunk_size"),
    ("granitemoehybrid", "mamba_conv_bias", "mamba_conv_bias"),
    ("granitemoehybrid", "mamba_proj_bias", "mamba_proj_bias"),
    ("granitemoehybrid", "time_step_limit", "time_step_limit"),
    ("lfm2", "rope_theta", "rope_theta"),               # in rope_parameters (transformers 5)
    ("granitemoehybrid", "rope_theta", "rope_theta"),
]
HF_CLASSES = {"lfm2": "Lfm2Config", "mamba2": "Mamba2Config",
              "granitemoehybrid": "GraniteMoeHybridConfig"}
#: What a config must add to transformers' defaults to be read at all, on both sides of a
#: default check: transformers' default Granite is MoE (8 experts), which is refused
#: (test_granite_moe_is_refused checks that default).
READABLE = {"granitemoehybrid": {"num_local_experts": 0}}


def _attr(hf_config, name):
    """A transformers config field; rope_theta lives in ``rope_parameters`` in transformers 5."""
    if name == "rope_theta":
        return hf_config.rope_parameters["rope_theta"]
    return getattr(hf_config, name)


def _plain(value):
    return tuple(value) if isinstance(value, list) else value


def _in_our_names(arch, theirs, value):
    """transformers' value in the reader's names (Granite layer types: the state spec's)."""
    if arch == "granitemoehybrid" and theirs == "layer_types":
        return tuple(GRANITE_LAYER_TYPES[t] for t in value)
    return _plain(value)


@pytest.mark.parametrize("arch,ours,theirs", DEFAULT_CASES,
                         ids=[f"{a}-{t}" for a, _, t in DEFAULT_CASES])
def test_defaults_are_transformers_defaults(arch, ours, theirs):
    """A config.json holding only its model_type reads as transformers' default config."""
    extra = READABLE.get(arch, {})
    got = getattr(ModelConfig.from_dict({"model_type": arch, **extra}), ours)
    want = _attr(getattr(tf, HF_CLASSES[arch])(**extra), theirs)
    assert _plain(got) == _in_our_names(arch, theirs, want)


def test_every_default_is_checked_against_transformers():
    for arch, table in (("lfm2", LFM2_DEFAULTS), ("mamba2", MAMBA2_DEFAULTS),
                        ("granitemoehybrid", GRANITE_DEFAULTS)):
        checked = {theirs for a, _, theirs in DEFAULT_CASES if a == arch} | set(
            READABLE.get(arch, {}))
        assert set(table) <= checked, set(table) - checked
        hf = getattr(tf, HF_CLASSES[arch])()
        for key, value in table.items():
            assert _plain(_attr(hf, key)) == _plain(value), key


def test_granite_moe_is_refused():
    """transformers' default Granite (num_local_experts=8) and the MoE Granite-4.0-H models
    (Tiny: 64 experts) are refused naming the count; only dense (0) is read."""
    for raw, count in (({}, 8), ({"num_local_experts": 64}, 64), ({"num_local_experts": None}, 8)):
        with pytest.raises(UnsupportedModelError) as info:
            ModelConfig.from_dict({"model_type": "granitemoehybrid", **raw})
        assert f"num_local_experts={count}" in str(info.value)
        assert "dense Granite-4.0-H only, num_local_experts=0" in str(info.value)


# (id, layer type key, its value): every spelling transformers reads, one meaning.
GRANITE_SPELLINGS = [
    ("transformers", "layer_types", ["linear_attention", "full_attention", "linear_attention"]),
    ("legacy", "layer_types", ["mamba", "attention", "mamba"]),
    ("mixed", "layer_types", ["mamba", "full_attention", "linear_attention"]),
    ("layers_block_type", "layers_block_type", ["mamba", "attention", "linear_attention"]),
]


@pytest.mark.parametrize("key,types", [c[1:] for c in GRANITE_SPELLINGS],
                         ids=[c[0] for c in GRANITE_SPELLINGS])
def test_granite_layer_type_spellings(key, types):
    raw = {"model_type": "granitemoehybrid", "num_local_experts": 0, "num_hidden_layers": 3,
           key: types}
    ours = ModelConfig.from_dict(raw)
    assert ours.layer_types == ("mamba2", "full_attention", "mamba2")
    assert (ours.mamba_layers, ours.attention_layers) == ((0, 2), (1,))
    hf = tf.GraniteMoeHybridConfig.from_dict(raw)
    assert _in_our_names("granitemoehybrid", "layer_types", hf.layer_types) == ours.layer_types


def test_granite_layers_block_type_wins_as_in_transformers():
    raw = {"model_type": "granitemoehybrid", "num_local_experts": 0, "num_hidden_layers": 2,
           "layer_types": ["mamba", "mamba"], "layers_block_type": ["mamba", "attention"]}
    assert ModelConfig.from_dict(raw).layer_types == ("mamba2", "full_attention")
    assert tf.GraniteMoeHybridConfig.from_dict(raw).layer_types == ["linear_attention",
                                                                     "full_attention"]


def test_granite_head_dim_as_transformers_attention_reads_it():
    """``hidden_size // num_attention_heads`` unless config.json carries ``head_dim``:
    GraniteMoeHybridAttention takes ``getattr(config, "head_dim", hidden // heads)``."""
    raw = {"model_type": "granitemoehybrid", "num_local_experts": 0, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8,
           "num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "vocab_size": 32,
           "shared_intermediate_size": 16}
    for extra, head_dim in (({}, 16), ({"head_dim": 8}, 8)):
        ours = ModelConfig.from_dict({**raw, **extra})
        assert ours.head_dim == head_dim
        attn = tf.GraniteMoeHybridForCausalLM(
            tf.GraniteMoeHybridConfig.from_dict({**raw, **extra})).model.layers[1].self_attn
        assert attn.k_proj.weight.shape == (2 * head_dim, 64)


#: the smallest configs both transformers and the state spec accept
SMALLEST = {"lfm2": {"model_type": "lfm2", "layer_types": ["conv"] * 32},
            "mamba2": {"model_type": "mamba2"},
            "granitemoehybrid": {"model_type": "granitemoehybrid", "num_local_experts": 0}}

# (id, dtype fields of config.json, what both read)
DTYPE_CASES = [
    ("dtype-only", {"dtype": "bfloat16"}, "bfloat16"),
    ("torch_dtype-only", {"torch_dtype": "float16"}, "float16"),
    ("dtype-wins", {"dtype": "float16", "torch_dtype": "bfloat16"}, "float16"),
    ("null-dtype-falls-back", {"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),
    ("neither", {}, "float32"),
]


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "granitemoehybrid"])
@pytest.mark.parametrize("fields,want", [c[1:] for c in DTYPE_CASES],
                         ids=[c[0] for c in DTYPE_CASES])
def test_dtype_precedence_is_transformers(arch, fields, want):
    """``dtype`` first, then ``torch_dtype``, as PreTrainedConfig; float32 without either. The
    state spec's dtype is the reader's."""
    raw = {**SMALLEST[arch], **fields}
    assert ModelConfig.from_dict(raw).dtype == want
    spec = StateSpec.from_config(raw)
    assert {t.dtype for g in spec.groups for t in g.tensors} == {want}
    hf = getattr(tf, HF_CLASSES[arch]).from_dict(raw).dtype
    assert hf == (None if want == "float32" else getattr(torch, want))


def test_lfm2_aliases_win_as_in_transformers():
    raw = {"model_type": "lfm2", "intermediate_size": 1000, "block_ff_dim": 2000,
           "tie_word_embeddings": True, "tie_embedding": False, "layer_types": ["conv"] * 32}
    ours, hf = ModelConfig.from_dict(raw), tf.Lfm2Config.from_dict(raw)
    assert (ours.intermediate_size, ours.tie_word_embeddings) == (2000, False)
    assert (hf.intermediate_size, hf.tie_word_embeddings) == (2000, False)


def test_values_derived_only_where_transformers_refuses():
    """layer_types without num_hidden_layers and Mamba2 without num_heads: transformers' fixed
    defaults (32 layers, 128 heads) would make it refuse these configs; the reader derives."""
    lfm2 = {"model_type": "lfm2", "layer_types": ["conv", "conv", "full_attention"]}  # 2560/32
    mamba2 = {"model_type": "mamba2", "hidden_size": 64, "head_dim": 16, "n_groups": 2}
    granite = {"model_type": "granitemoehybrid", "num_local_experts": 0,
               "layer_types": ["mamba", "attention", "mamba"]}
    assert ModelConfig.from_dict(lfm2).num_layers == 3
    assert ModelConfig.from_dict(mamba2).num_heads == 8
    assert ModelConfig.from_dict(granite).num_layers == 3
    for cls, raw in (("Lfm2Config", lfm2), ("Mamba2Config", mamba2),
                     ("GraniteMoeHybridConfig", granite)):
        with pytest.raises(Exception, match="must (be )?equal"):
            getattr(tf, cls).from_dict(raw)


def test_mamba_ssm_names_and_special_floats():
    ours = ModelConfig.from_dict({"model_type": "mamba2", "d_model": 256, "n_layer": 2,
                                  "d_state": 16, "headdim": 32, "ngroups": 1, "d_conv": 3,
                                  "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert isinstance(ours, Mamba2ModelConfig)
    assert (ours.hidden_size, ours.num_layers, ours.state_size, ours.head_dim, ours.n_groups,
            ours.conv_kernel, ours.num_heads) == (256, 2, 16, 32, 1, 3, 16)
    assert ours.time_step_limit == (0.0, math.inf)


#: One Mamba2 mixer written by each family: hidden 48, expand 2 (I = 96), 8 heads of 12,
#: 2 groups of state 16, conv width 3, chunk 32, projection biases, no conv bias. Each family
#: derives the size its transformers config derives (Mamba2 the heads, Granite the head width)
#: or reads both, under its own spellings.
MIXER_MAMBA2 = {"model_type": "mamba2", "num_hidden_layers": 2, "expand": 2, "chunk_size": 32,
                "use_bias": True, "use_conv_bias": False}
MIXER_MAMBA2_SPELLINGS = [
    ("derived-heads", {"hidden_size": 48, "head_dim": 12, "state_size": 16, "n_groups": 2,
                       "conv_kernel": 3}),
    ("mamba_ssm-names", {"d_model": 48, "headdim": 12, "num_heads": 8, "d_state": 16,
                         "ngroups": 2, "d_conv": 3}),
]
MIXER_GRANITE = {"model_type": "granitemoehybrid", "num_local_experts": 0, "hidden_size": 48,
                 "layer_types": ["mamba", "attention"], "num_attention_heads": 4,
                 "num_key_value_heads": 2, "mamba_expand": 2, "mamba_n_heads": 8,
                 "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 3,
                 "mamba_chunk_size": 32, "mamba_proj_bias": True, "mamba_conv_bias": False}
MIXER_GRANITE_SPELLINGS = [("auto-d-head", {"mamba_d_head": "auto"}),
                           ("absent-d-head", {}),
                           ("explicit-d-head", {"mamba_d_head": 12})]
#: The one mixer's weights, sizes worked out by hand: in_proj rows z 96 + xBC 160 + dt 8.
MIXER_WEIGHTS = {"in_proj.weight": (264, 48), "in_proj.bias": (264,),
                 "conv1d.weight": (160, 1, 3), "dt_bias": (8,), "A_log": (8,), "D": (8,),
                 "norm.weight": (96,), "out_proj.weight": (48, 96), "out_proj.bias": (48,)}


@pytest.mark.parametrize("granite_extra", [c[1] for c in MIXER_GRANITE_SPELLINGS],
                         ids=[c[0] for c in MIXER_GRANITE_SPELLINGS])
@pytest.mark.parametrize("mamba2_extra", [c[1] for c in MIXER_MAMBA2_SPELLINGS],
                         ids=[c[0] for c in MIXER_MAMBA2_SPELLINGS])
def test_mamba2_and_granite_read_one_mixer_geometry(mamba2_extra, granite_extra):
    """The same mixer written in Mamba2's keys and in Granite's ``mamba_*`` keys reads as one
    geometry, with the same sizes, weights and state tensors."""
    mamba2 = ModelConfig.from_dict({**MIXER_MAMBA2, **mamba2_extra})
    granite = ModelConfig.from_dict({**MIXER_GRANITE, **granite_extra})
    want = Mamba2Geometry(hidden_size=48, expand=2, num_heads=8, head_dim=12, n_groups=2,
                          state_size=16, conv_kernel=3, chunk_size=32, proj_bias=True,
                          conv_bias=False)
    assert mamba2.mamba == granite.mamba == want
    assert (want.intermediate_size, want.conv_dim) == (96, 160)
    assert (mamba2.intermediate_size, mamba2.conv_dim) == (96, 160)
    assert (granite.mamba_n_heads, granite.mamba_d_head, granite.mamba_d_state) == (8, 12, 16)
    assert (mamba2.num_heads, mamba2.head_dim, mamba2.state_size) == (8, 12, 16)

    def mixer_weights(config, prefix):
        shapes = config.weight_shapes()
        return {name[len(prefix):]: shape for name, shape in shapes.items()
                if name.startswith(prefix)}
    assert mixer_weights(mamba2, "backbone.layers.0.mixer.") == MIXER_WEIGHTS
    assert mixer_weights(granite, "model.layers.0.mamba.") == MIXER_WEIGHTS

    conv, ssm = StateSpec.from_config(mamba2).groups[0].tensors
    assert (conv, ssm) == StateSpec.from_config(granite).groups[0].tensors
    assert [(s.name, s.size, s.groups) for s in conv.segments] == [("x", 96, 1), ("B", 32, 2),
                                                                  ("C", 32, 2)]
    assert conv.inner_shape == (2,) and (ssm.channels, *ssm.inner_shape) == (8, 12, 16)


LFM2 = {"model_type": "lfm2", "hidden_size": 64, "layer_types": ["conv"] * 2}
MAMBA2 = {"model_type": "mamba2", "hidden_size": 64, "head_dim": 16, "n_groups": 2,
          "num_hidden_layers": 2}
GRANITE = {"model_type": "granitemoehybrid", "num_local_experts": 0, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8,
           "mamba_n_groups": 2, "layer_types": ["mamba", "attention"]}


@pytest.mark.parametrize("raw,error,words", [
    ({"model_type": "gpt2"}, UnsupportedModelError, ["model_type", "'gpt2'"]),
    ({**LFM2, "hidden_size": "big"}, ConfigError, ["'hidden_size'", "'big'"]),
    ({**LFM2, "conv_L_cache": 2.5}, ConfigError, ["'conv_L_cache'", "2.5"]),
    ({**LFM2, "conv_bias": "no"}, ConfigError, ["'conv_bias'", "'no'"]),
    ({**LFM2, "norm_eps": -1}, ConfigError, ["'norm_eps'", "-1"]),
    ({**LFM2, "dtype": "int8"}, ConfigError, ["'dtype'", "'int8'"]),
    ({**LFM2, "dtype": None, "torch_dtype": "float64"}, ConfigError, ["'torch_dtype'",
                                                                     "'float64'"]),
    ({**LFM2, "conv_dim": 48}, ConfigError, ["conv_dim=48", "hidden_size=64"]),
    ({**LFM2, "layer_types": ["conv", "mamba"]}, UnsupportedModelError, ["'mamba'"]),
    ({**LFM2, "num_hidden_layers": 3}, ConfigError, ["layer_types", "3"]),
    ({**LFM2, "full_attn_idxs": ["0"], "layer_types": None}, ConfigError, ["'full_attn_idxs'"]),
    ({**LFM2, "block_ffn_dim_multiplier": "x"}, ConfigError, ["'block_ffn_dim_multiplier'"]),
    ({**MAMBA2, "num_heads": 5}, ConfigError, ["num_heads", "5"]),
    ({**MAMBA2, "n_groups": 3}, ConfigError, ["num_heads=8", "n_groups=3"]),
    ({**MAMBA2, "head_dim": 48}, ConfigError, ["head_dim=48", "2 * 64"]),
    ({**MAMBA2, "expand": 1.01}, ConfigError, ["expand", "1.01"]),
    ({**MAMBA2, "time_step_limit": [0.0]}, ConfigError, ["'time_step_limit'", "[0.0]"]),
    ({**MAMBA2, "hidden_act": 7}, ConfigError, ["'hidden_act'", "7"]),
    ({**GRANITE, "layer_types": ["mamba", "sliding_attention"]}, UnsupportedModelError,
     ["'sliding_attention'"]),
    ({**GRANITE, "layers_block_type": "mamba"}, ConfigError, ["'layers_block_type'", "'mamba'"]),
    ({**GRANITE, "num_local_experts": -1}, ConfigError, ["'num_local_experts'", "-1"]),
    ({**GRANITE, "num_key_value_heads": 3}, ConfigError, ["num_attention_heads=4",
                                                          "num_key_value_heads=3"]),
    ({**GRANITE, "num_attention_heads": 6, "num_key_value_heads": 6}, ConfigError,
     ["hidden_size=64", "num_attention_heads=6"]),
    ({**GRANITE, "mamba_n_groups": 3}, ConfigError, ["mamba_n_heads=8", "mamba_n_groups=3"]),
    ({**GRANITE, "mamba_d_head": 32}, ConfigError, ["8 * 32", "= 128"]),
    ({**GRANITE, "mamba_n_heads": 6}, ConfigError, ["mamba_n_heads=6", "2 * 64"]),
    ({**GRANITE, "mamba_d_head": "big"}, ConfigError, ["'mamba_d_head'", "'big'"]),
    ({**GRANITE, "mamba_expand": 1.01}, ConfigError, ["mamba_expand", "1.01"]),
    ({**GRANITE, "rms_norm_eps": 0}, ConfigError, ["'rms_norm_eps'", "0"]),
    ({**GRANITE, "position_embedding_type": "alibi"}, ConfigError,
     ["position_embedding_type='alibi'"]),
    ({**GRANITE, "num_hidden_layers": 3}, ConfigError, ["layer_types", "3"]),
], ids=["model-type", "not-int", "fraction", "not-bool", "negative-eps", "dtype",
        "torch_dtype", "conv_dim", "layer-type", "layer-count", "attn-idxs", "multiplier",
        "num-heads", "groups", "head-dim", "expand", "time-step-limit", "hidden-act",
        "granite-layer-type", "granite-block-type", "granite-experts", "granite-kv-heads",
        "granite-heads", "granite-groups", "granite-d-head", "granite-auto-d-head",
        "granite-d-head-type", "granite-expand", "granite-eps", "granite-position",
        "granite-layer-count"])
def test_bad_values_raise_naming_key_and_value(raw, error, words):
    with pytest.raises(error) as info:
        ModelConfig.from_dict(raw)
    for word in words:
        assert word in str(info.value)


def test_load_reads_a_directory_or_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LFM2))
    assert ModelConfig.load(tmp_path) == ModelConfig.load(tmp_path / "config.json")
    assert isinstance(ModelConfig.load(tmp_path), Lfm2ModelConfig)
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.load(tmp_path / "nope")


def test_spec_and_model_read_one_config_alike(tmp_path):
    """One config.json with both dtype keys and no layer_norm_epsilon: the state spec, the
    runner and its mixers (and transformers) all read the same values from it."""
    path = make_checkpoint("mamba2", tmp_path / "m", "tiny", dtype="bfloat16",
                           overrides={"n_groups": 2, "torch_dtype": "float16"})
    raw = json.loads((path / "config.json").read_text())
    del raw["layer_norm_epsilon"]
    (path / "config.json").write_text(json.dumps(raw))

    spec = StateSpec.from_pretrained(path)
    runner = ModelRunner(path, 1, 0, StateCache(PageGeometry(spec, 1, "DLS"), 2))
    config = runner.config
    conv, ssm = spec.groups[0].tensors
    assert conv.dtype == ssm.dtype == config.dtype == "bfloat16"
    assert runner.dtype == torch.bfloat16
    assert conv.channels == config.conv_dim and conv.inner_shape == (config.conv_kernel - 1,)
    assert [s.groups for s in conv.segments] == [1, config.n_groups, config.n_groups] == [1, 2, 2]
    assert (ssm.channels, *ssm.inner_shape) == (config.num_heads, config.head_dim,
                                                config.state_size)
    mixer = runner.layers[0].mixer
    assert (mixer.heads_local, mixer.head_dim, mixer.d_state) == (ssm.channels, *ssm.inner_shape)
    assert mixer.conv_dim_local == conv.channels
    assert mixer.norm_eps == config.norm_eps == 1e-5

    hf = tf.AutoConfig.from_pretrained(path)
    assert hf.dtype == torch.bfloat16 and hf.layer_norm_epsilon == mixer.norm_eps
    assert (hf.num_heads, hf.head_dim, hf.state_size, hf.n_groups) == (
        config.num_heads, config.head_dim, config.state_size, config.n_groups)


def test_granite_spec_matches_the_cache_transformers_allocates():
    """The state spec of a config that transformers' own GraniteMoeHybridConfig wrote (to_dict)
    describes the cache GraniteMoeHybridForCausalLM fills: conv ``[B, conv_dim, K]`` (the spec
    keeps the last K-1 columns), SSM ``[B, H, P, N]``, KV ``[B, KV heads, T, head_dim]``."""
    hf_config = tf.GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=48, num_hidden_layers=4, num_local_experts=0,
        layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_conv=3, shared_intermediate_size=32, intermediate_size=16)
    spec = StateSpec.from_config(hf_config.to_dict())
    assert spec.model_type == "granitemoehybrid" and spec.conv_kernel == 3
    (group,) = spec.groups
    conv, ssm = group.tensors
    assert group.layer_ids == (0, 2, 3)
    assert [(s.name, s.size, s.groups) for s in conv.segments] == [("x", 96, 1), ("B", 16, 2),
                                                                  ("C", 16, 2)]
    assert (spec.kv.layer_ids, spec.kv.num_kv_heads, spec.kv.head_dim) == ((1,), 2, 12)

    torch.manual_seed(0)
    model = tf.GraniteMoeHybridForCausalLM(hf_config).eval()
    cache = tf.DynamicCache(config=hf_config)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, use_cache=True)
    for i in group.layer_ids:
        layer = cache.layers[i]
        assert tuple(layer.conv_states[0].shape) == (1, conv.channels, conv.inner_shape[0] + 1)
        assert tuple(layer.recurrent_states[0].shape) == (1, ssm.channels, *ssm.inner_shape)
    keys = cache.layers[1].keys
    assert tuple(keys.shape) == (1, spec.kv.num_kv_heads, 5, spec.kv.head_dim)
    assert keys.dtype == spec.kv.torch_dtype == torch.float32
