"""LFM2: ShortConv layers and full-attention layers (``Lfm2Config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.hf_config.base import ModelConfig, _base_fields, _require_positive
from statebridge.hf_config.fields import (_bool, _int, _int_list, _is_number, _layer_type_list,
                                          _rope_theta)

#: LFM2 decoder layer types statebridge can describe (transformers' names).
LFM2_LAYER_TYPES = ("conv", "full_attention")
#: Other spellings of attention layers in published configs, read as ``"full_attention"``.
ATTENTION_ALIASES = ("attention",)

#: ``Lfm2Config`` defaults (transformers 5) of every field the runtime reads. Without
#: ``layer_types`` and ``full_attn_idxs`` EVERY layer is attention, as in transformers.
LFM2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536,
    "hidden_size": 2560,
    "num_hidden_layers": 32,
    "intermediate_size": 12288,
    "norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 1_000_000.0,          # Lfm2Config.default_theta
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Lfm2ModelConfig(ModelConfig):
    """An LFM2 config: ShortConv layers (``"conv"``) and attention layers
    (``"full_attention"``). Field names are ``Lfm2Config``'s."""

    model_type: ClassVar[str] = "lfm2"

    intermediate_size: int
    conv_L_cache: int
    conv_bias: bool
    block_multiple_of: int
    block_ffn_dim_multiplier: float | None
    block_auto_adjust_ff_dim: bool
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_types) - set(LFM2_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"lfm2: unknown layer type(s) {unknown} in layer_types; "
                                        f"known: {list(LFM2_LAYER_TYPES)}")
        ModelConfig.__post_init__(self)
        _require_positive(self, "intermediate_size", "conv_L_cache", "block_multiple_of",
                          "num_attention_heads", "num_key_value_heads")
        if self.attention_layers:       # (without them the attention geometry is never used)
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"lfm2: hidden_size={self.hidden_size} is not a multiple of "
                                  f"num_attention_heads={self.num_attention_heads}")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(f"lfm2: num_attention_heads={self.num_attention_heads} is not "
                                  f"a multiple of num_key_value_heads="
                                  f"{self.num_key_value_heads}")
        if self.ff_dim <= 0:
            raise ConfigError(f"lfm2: MLP width computed from intermediate_size="
                              f"{self.intermediate_size!r} is {self.ff_dim}; must be > 0")

    @classmethod
    def _read(cls, config: Mapping[str, Any]) -> "Lfm2ModelConfig":
        config = dict(config)
        # Lfm2Config.__post_init__ pops these aliases and lets them win over the field.
        for alias, key in (("block_ff_dim", "intermediate_size"),
                           ("tie_embedding", "tie_word_embeddings")):
            if config.get(alias) is not None:
                config[key] = config[alias]
        d = LFM2_DEFAULTS
        hidden = _int(config, "hidden_size", default=d["hidden_size"])
        layer_types = _layer_type_list(config, "layer_types")
        if layer_types is None:
            num_layers = _int(config, "num_hidden_layers", default=d["num_hidden_layers"])
            attn = _int_list(config, "full_attn_idxs")
            attn = set(range(num_layers)) if attn is None else set(attn)
            layer_types = tuple("full_attention" if i in attn else "conv"
                                for i in range(num_layers))
        else:
            layer_types = tuple("full_attention" if t in ATTENTION_ALIASES else t
                                for t in layer_types)
            num_layers = _int(config, "num_hidden_layers", default=len(layer_types))
        # conv_dim is no Lfm2Config field: transformers' ShortConv runs over hidden_size.
        conv_dim = _int(config, "conv_dim", default=hidden)
        if conv_dim != hidden:
            raise ConfigError(f"lfm2: conv_dim={conv_dim!r} differs from hidden_size={hidden}; "
                              f"the ShortConv runs over hidden_size")
        multiplier = d["block_ffn_dim_multiplier"]
        if "block_ffn_dim_multiplier" in config:  # an explicit null: no multiplier, no rounding
            multiplier = config["block_ffn_dim_multiplier"]
            if multiplier is not None and (not _is_number(multiplier) or multiplier <= 0):
                raise ConfigError(f"config field 'block_ffn_dim_multiplier' must be a positive "
                                  f"number or null, got {multiplier!r}")
        return cls(
            **_base_fields(config, d, hidden_size=hidden, num_layers=num_layers,
                           layer_types=layer_types, norm_key="norm_eps"),
            intermediate_size=_int(config, "intermediate_size", default=d["intermediate_size"]),
            conv_L_cache=_int(config, "conv_L_cache", default=d["conv_L_cache"]),
            conv_bias=_bool(config, "conv_bias", default=d["conv_bias"]),
            block_multiple_of=_int(config, "block_multiple_of", default=d["block_multiple_of"]),
            block_ffn_dim_multiplier=multiplier,
            block_auto_adjust_ff_dim=_bool(config, "block_auto_adjust_ff_dim",
                                           default=d["block_auto_adjust_ff_dim"]),
            num_attention_heads=_int(config, "num_attention_heads",
                                     default=d["num_attention_heads"]),
            num_key_value_heads=_int(config, "num_key_value_heads",
                                     default=d["num_key_value_heads"]),
            rope_theta=_rope_theta(config, default=d["rope_theta"]),
        )

    @property
    def conv_layers(self) -> tuple[int, ...]:
        """Indices of the ShortConv layers (the ones with recurrent state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "conv")

    @property
    def head_dim(self) -> int:
        """Per-head width of the attention layers (``hidden_size // num_attention_heads``)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def ff_dim(self) -> int:
        """Width of the SwiGLU MLP, computed exactly as transformers' ``Lfm2MLP``::

            ff = intermediate_size
            if block_auto_adjust_ff_dim:
                ff = int(2 * ff / 3)
                if block_ffn_dim_multiplier is not None:
                    ff = int(block_ffn_dim_multiplier * ff)
                    ff = block_multiple_of * ceil(ff / block_multiple_of)
        """
        ff = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            ff = int(2 * ff / 3)
            if self.block_ffn_dim_multiplier is not None:
                ff = int(self.block_ffn_dim_multiplier * ff)
                multiple = self.block_multiple_of
                ff = multiple * ((ff + multiple - 1) // multiple)
        return int(ff)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        V, Hd, K, F = self.vocab_size, self.hidden_size, self.conv_L_cache, self.ff_dim
        D = self.head_dim
        q, kv = self.num_attention_heads * D, self.num_key_value_heads * D
        bias = self.conv_bias
        out: dict[str, tuple[int, ...]] = {self.embedding_name: (V, Hd)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "operator_norm.weight"] = (Hd,)
            if self.layer_types[i] == "conv":
                out[p + "conv.in_proj.weight"] = (3 * Hd, Hd)
                if bias:
                    out[p + "conv.in_proj.bias"] = (3 * Hd,)
                out[p + "conv.conv.weight"] = (Hd, 1, K)
                if bias:
                    out[p + "conv.conv.bias"] = (Hd,)
                out[p + "conv.out_proj.weight"] = (Hd, Hd)
                if bias:
                    out[p + "conv.out_proj.bias"] = (Hd,)
            else:                       # Lfm2Attention: no biases
                a = p + "self_attn."
                out[a + "q_proj.weight"] = (q, Hd)
                out[a + "k_proj.weight"] = (kv, Hd)
                out[a + "v_proj.weight"] = (kv, Hd)
                out[a + "out_proj.weight"] = (Hd, q)
                out[a + "q_layernorm.weight"] = (D,)
                out[a + "k_layernorm.weight"] = (D,)
            out[p + "ffn_norm.weight"] = (Hd,)
            out[p + "feed_forward.w1.weight"] = (F, Hd)
            out[p + "feed_forward.w3.weight"] = (F, Hd)
            out[p + "feed_forward.w2.weight"] = (Hd, F)
        out["model.embedding_norm.weight"] = (Hd,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (V, Hd)
        return out
