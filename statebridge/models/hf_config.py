"""The Hugging Face ``config.json`` of an LFM2 or Mamba2 checkpoint, read the way transformers
reads it.

:class:`ModelConfig` is the one place that turns a raw ``config.json`` dict into the numbers the
runtime uses: defaults and field aliases are those of ``Lfm2Config`` / ``Mamba2Config`` in
transformers, special floats written as ``{"__float__": "Infinity"}`` (transformers 5) or bare
``Infinity`` (older writers) are decoded, and the LFM2 MLP width is computed exactly as
``Lfm2MLP`` computes it. Nothing here imports transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.state.spec import dtype_from_name

__all__ = ["ModelConfig", "lfm2_ff_dim", "decode_special_floats", "encode_special_floats",
           "LFM2_DEFAULTS", "MAMBA2_DEFAULTS", "ARCHITECTURES", "WEIGHT_ALIASES"]

#: model_type -> the HF class whose weight names the runtime reads.
ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM", "mamba2": "Mamba2ForCausalLM"}

#: ``Lfm2Config`` defaults (transformers 5) of the fields the runtime reads.
LFM2_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 12288,
    "norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True,
}

#: ``Mamba2Config`` defaults (transformers 5) of the fields the runtime reads. ``n_groups``,
#: ``head_dim``, ``state_size`` and ``expand`` are required instead: the state spec
#: (:mod:`statebridge.state.spec`) has other defaults for some of them, and a silent
#: disagreement would size pages for another model.
MAMBA2_DEFAULTS: dict[str, Any] = {
    "layer_norm_epsilon": 1e-5,
    "conv_kernel": 4,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "residual_in_fp32": True,
    "time_step_limit": (0.0, math.inf),
    "chunk_size": 256,
    "tie_word_embeddings": False,
}

#: Other names a checkpoint may use for a weight (mamba_ssm-style Mamba2 checkpoints name the
#: embedding ``backbone.embedding``; transformers renames it on load).
WEIGHT_ALIASES: dict[str, tuple[str, ...]] = {
    "backbone.embeddings.weight": ("backbone.embedding.weight",),
}

_FLOAT_TAG = "__float__"
_FLOAT_VALUES = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_special_floats(obj: Any) -> Any:
    """Replace ``{"__float__": "Infinity"}`` objects (transformers 5's JSON form) by floats."""
    if isinstance(obj, dict):
        if set(obj) == {_FLOAT_TAG} and obj[_FLOAT_TAG] in _FLOAT_VALUES:
            return _FLOAT_VALUES[obj[_FLOAT_TAG]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [decode_special_floats(v) for v in obj]
    return obj


def encode_special_floats(obj: Any) -> Any:
    """Inverse of :func:`decode_special_floats` (what transformers 5 writes to config.json)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        tag = "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"
        return {_FLOAT_TAG: tag}
    if isinstance(obj, dict):
        return {k: encode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_special_floats(v) for v in obj]
    return obj


def lfm2_ff_dim(config: Mapping[str, Any]) -> int:
    """Width of the LFM2 SwiGLU MLP, computed exactly as transformers' ``Lfm2MLP``::

        ff = intermediate_size
        if block_auto_adjust_ff_dim:
            ff = int(2 * ff / 3)
            if block_ffn_dim_multiplier is not None:
                ff = int(block_ffn_dim_multiplier * ff)
                ff = block_multiple_of * ceil(ff / block_multiple_of)
    """
    ff = config["intermediate_size"]
    if config["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        multiplier = config["block_ffn_dim_multiplier"]
        if multiplier is not None:
            ff = int(multiplier * ff)
            multiple = config["block_multiple_of"]
            ff = multiple * ((ff + multiple - 1) // multiple)
    if ff <= 0:
        raise ConfigError(f"lfm2: MLP width computed from intermediate_size="
                          f"{config['intermediate_size']!r} is {ff}; must be > 0")
    return int(ff)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    if key not in config or config[key] is None:
        raise ConfigError(f"config.json lacks {key!r}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return int(value)


def _lfm2_layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types`` as transformers derives it: from ``layer_types``, else from
    ``full_attn_idxs``, else EVERY layer is attention (``Lfm2Config.__post_init__``)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        attn = config.get("full_attn_idxs")
        attn = set(range(num_layers)) if attn is None else set(attn)
        layer_types = ["full_attention" if i in attn else "conv" for i in range(num_layers)]
    layer_types = tuple(str(t) for t in layer_types)
    if len(layer_types) != num_layers:
        raise ConfigError(f"lfm2: layer_types has {len(layer_types)} entries but "
                          f"num_hidden_layers is {num_layers}")
    return layer_types


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs from ``config.json``.

    ``hf`` is the normalized dict (aliases resolved, defaults filled, special floats decoded)
    handed to the kernel mixers' ``from_hf_state_dict``. ``layer_types`` uses the state spec's
    names (``"conv"``, ``"full_attention"``, ``"mamba2"``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    dtype: str
    norm_eps: float
    hf: Mapping[str, Any]
    ff_dim: int = 0                 # lfm2: SwiGLU width
    residual_in_fp32: bool = False  # mamba2

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Normalize a ``config.json`` dict; raises ConfigError / UnsupportedModelError."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"model config must be a JSON object, got {type(raw).__name__}")
        config = decode_special_floats(dict(raw))
        model_type = config.get("model_type")
        if model_type == "lfm2":
            return cls._lfm2(config)
        if model_type == "mamba2":
            return cls._mamba2(config)
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: "
                                    f"{sorted(ARCHITECTURES)}")

    @staticmethod
    def _common(config: dict[str, Any]) -> dict[str, Any]:
        return {
            "vocab_size": _positive_int(config, "vocab_size"),
            "hidden_size": _positive_int(config, "hidden_size"),
            "num_layers": _positive_int(config, "num_hidden_layers"),
            "dtype": dtype_from_name(config.get("dtype") or config.get("torch_dtype") or "float32"),
        }

    @classmethod
    def _lfm2(cls, config: dict[str, Any]) -> "ModelConfig":
        # Aliases Lfm2Config.__post_init__ accepts.
        if "block_ff_dim" in config and config.get("intermediate_size") is None:
            config["intermediate_size"] = config["block_ff_dim"]
        if "tie_embedding" in config and "tie_word_embeddings" not in config:
            config["tie_word_embeddings"] = config["tie_embedding"]
        for key, value in LFM2_DEFAULTS.items():
            # block_ffn_dim_multiplier: an explicit null means "no multiplier, no rounding"
            keep_null = key == "block_ffn_dim_multiplier" and key in config
            if config.get(key) is None and not keep_null:
                config[key] = value
        common = cls._common(config)
        layer_types = _lfm2_layer_types(config, common["num_layers"])
        for i, kind in enumerate(layer_types):
            if kind != "conv":
                raise UnsupportedModelError(
                    f"lfm2: layer {i} has type {kind!r}; only 'conv' (ShortConv) layers are "
                    f"served until attention KV transfer exists (layer_types={list(layer_types)})")
        config["layer_types"] = list(layer_types)
        conv_dim = config.get("conv_dim", common["hidden_size"])
        if conv_dim != common["hidden_size"]:
            raise ConfigError(f"lfm2: conv_dim={conv_dim!r} differs from hidden_size="
                              f"{common['hidden_size']}; the ShortConv runs over hidden_size")
        _positive_int(config, "conv_L_cache")
        _positive_int(config, "intermediate_size")
        return cls(model_type="lfm2", layer_types=layer_types,
                   tie_word_embeddings=bool(config["tie_word_embeddings"]),
                   norm_eps=float(config["norm_eps"]), hf=config, ff_dim=lfm2_ff_dim(config),
                   **common)

    @classmethod
    def _mamba2(cls, config: dict[str, Any]) -> "ModelConfig":
        for key, value in MAMBA2_DEFAULTS.items():
            if config.get(key) is None:
                config[key] = value
        common = cls._common(config)
        hidden = common["hidden_size"]
        for key in ("n_groups", "head_dim", "state_size", "conv_kernel", "chunk_size"):
            _positive_int(config, key)
        expand = config.get("expand")
        if expand is None:
            raise ConfigError("config.json lacks 'expand'")
        inner = expand * hidden
        if inner != int(inner) or inner <= 0:
            raise ConfigError(f"mamba2: expand * hidden_size = {expand} * {hidden} is not a "
                              f"positive integer")
        heads = int(inner) // config["head_dim"]
        if config.get("num_heads") is None:
            config["num_heads"] = heads
        if config["num_heads"] * config["head_dim"] != inner:
            raise ConfigError(f"mamba2: num_heads * head_dim = {config['num_heads']} * "
                              f"{config['head_dim']} != expand * hidden_size = {inner}")
        config["time_step_limit"] = tuple(float(v) for v in config["time_step_limit"])
        return cls(model_type="mamba2", layer_types=("mamba2",) * common["num_layers"],
                   tie_word_embeddings=bool(config["tie_word_embeddings"]),
                   norm_eps=float(config["layer_norm_epsilon"]), hf=config,
                   residual_in_fp32=bool(config["residual_in_fp32"]), **common)

    # -- weights ----------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def embedding_name(self) -> str:
        return "model.embed_tokens.weight" if self.model_type == "lfm2" else \
            "backbone.embeddings.weight"

    def layer_prefix(self, layer: int) -> str:
        """Weight-name prefix of decoder layer ``layer``'s mixer (what ``from_hf_state_dict``
        reads below)."""
        if self.model_type == "lfm2":
            return f"model.layers.{layer}.conv."
        return f"backbone.layers.{layer}.mixer."

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight of the ``*ForCausalLM`` checkpoint and its shape, in module order.

        The one description of the HF format: the runner checks a checkpoint against it and
        :func:`~statebridge.models.checkpoint.make_checkpoint` writes exactly it. A tied
        ``lm_head`` is absent (transformers does not save it).
        """
        V, Hd = self.vocab_size, self.hidden_size
        out: dict[str, tuple[int, ...]] = {self.embedding_name: (V, Hd)}
        hf = self.hf
        if self.model_type == "lfm2":
            K, F, bias = hf["conv_L_cache"], self.ff_dim, bool(hf["conv_bias"])
            for i in range(self.num_layers):
                p = f"model.layers.{i}."
                out[p + "operator_norm.weight"] = (Hd,)
                out[p + "conv.in_proj.weight"] = (3 * Hd, Hd)
                if bias:
                    out[p + "conv.in_proj.bias"] = (3 * Hd,)
                out[p + "conv.conv.weight"] = (Hd, 1, K)
                if bias:
                    out[p + "conv.conv.bias"] = (Hd,)
                out[p + "conv.out_proj.weight"] = (Hd, Hd)
                if bias:
                    out[p + "conv.out_proj.bias"] = (Hd,)
                out[p + "ffn_norm.weight"] = (Hd,)
                out[p + "feed_forward.w1.weight"] = (F, Hd)
                out[p + "feed_forward.w3.weight"] = (F, Hd)
                out[p + "feed_forward.w2.weight"] = (Hd, F)
            out["model.embedding_norm.weight"] = (Hd,)
        else:
            inner = hf["num_heads"] * hf["head_dim"]
            heads = hf["num_heads"]
            conv_dim = inner + 2 * hf["n_groups"] * hf["state_size"]
            K = hf["conv_kernel"]
            for i in range(self.num_layers):
                p = f"backbone.layers.{i}."
                m = p + "mixer."
                out[p + "norm.weight"] = (Hd,)
                out[m + "in_proj.weight"] = (inner + conv_dim + heads, Hd)
                if hf["use_bias"]:
                    out[m + "in_proj.bias"] = (inner + conv_dim + heads,)
                out[m + "conv1d.weight"] = (conv_dim, 1, K)
                if hf["use_conv_bias"]:
                    out[m + "conv1d.bias"] = (conv_dim,)
                out[m + "dt_bias"] = (heads,)
                out[m + "A_log"] = (heads,)
                out[m + "D"] = (heads,)
                out[m + "norm.weight"] = (inner,)
                out[m + "out_proj.weight"] = (Hd, inner)
                if hf["use_bias"]:
                    out[m + "out_proj.bias"] = (Hd,)
            out["backbone.norm_f.weight"] = (Hd,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (V, Hd)
        return out
