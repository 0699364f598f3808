"""The Hugging Face ``config.json`` of an LFM2, Mamba2 or GraniteMoeHybrid (Granite-4.0-H)
checkpoint, read once, the way transformers reads it.

:meth:`ModelConfig.from_dict` and :meth:`ModelConfig.load` are the only readers of
``config.json``. The state spec (:mod:`statebridge.state.spec`), the checkpoint loader and runner
(:mod:`statebridge.models`) and the weight sharding (:mod:`statebridge.models.tp`) all take the
:class:`ModelConfig` they return, so no two of them can read a value differently::

    config.json --ModelConfig.from_dict--> Lfm2ModelConfig | Mamba2ModelConfig
                                           | GraniteHybridModelConfig
                                             |-> StateSpec.from_config   (page sizes)
                                             |-> ModelRunner, Checkpoint (weight names, norms)
                                             '-> models.tp               (weight shards)

Rules, in the order they apply:

- **Defaults** are those of transformers' ``Lfm2Config`` / ``Mamba2Config`` /
  ``GraniteMoeHybridConfig`` (transformers 5; see :data:`LFM2_DEFAULTS`, :data:`MAMBA2_DEFAULTS`,
  :data:`GRANITE_DEFAULTS`). ``tests/test_hf_config.py`` checks every one against transformers
  itself. A ``null`` value counts as absent (except
  ``block_ffn_dim_multiplier``, where ``null`` means "no multiplier", as in ``Lfm2MLP``).
- **Derived, not defaulted**, only where transformers would refuse the config instead, so no
  config that transformers accepts is read differently: an LFM2 or Granite
  ``num_hidden_layers`` absent beside ``layer_types`` is ``len(layer_types)`` (transformers' 32
  must equal it); an absent Mamba2 ``num_heads`` is ``expand * hidden_size / head_dim``
  (transformers' 128 must equal it). Derived as transformers derives them: Granite
  ``num_key_value_heads`` (``num_attention_heads``), ``mamba_d_head`` (absent or ``"auto"``:
  ``mamba_expand * hidden_size // mamba_n_heads``) and ``head_dim`` (``hidden_size //
  num_attention_heads`` unless the config carries one, which ``GraniteMoeHybridAttention``
  then uses).
- **Aliases**: LFM2 ``block_ff_dim`` and ``tie_embedding`` win over ``intermediate_size`` and
  ``tie_word_embeddings``, as ``Lfm2Config.__post_init__`` lets them; the original mamba_ssm
  names ``d_model``, ``n_layer``, ``d_state``, ``headdim``, ``ngroups``, ``d_conv`` are read when
  the transformers name is absent; Granite ``layers_block_type`` wins over ``layer_types``
  (``attribute_map``: transformers sets it last).
- **Layer types** are stored in the state spec's names. Granite's ``"linear_attention"`` and
  legacy ``"mamba"`` are ``"mamba2"``; ``"full_attention"`` and legacy ``"attention"`` are
  ``"full_attention"`` (transformers' ``remap_legacy_layer_types``).
- **dtype**: ``dtype`` first, then ``torch_dtype``, then ``float32``. transformers >= 4.56 writes
  ``dtype`` and reads ``torch_dtype`` only as the legacy fallback
  (``PreTrainedConfig.__init__``: ``self.dtype = self.dtype if self.dtype is not None else
  torch_dtype``); most published configs still carry ``torch_dtype`` alone. With neither, the
  weights are float32 (torch's default dtype).
- **Special floats** written as ``{"__float__": "Infinity"}`` (transformers 5) or a bare
  ``Infinity`` (older writers) are decoded.
- **Errors**: a value of the wrong type or out of range raises
  :class:`~statebridge.errors.ConfigError` naming the key and the value; a ``model_type``, layer
  type or feature that statebridge cannot describe (Granite MoE: ``num_local_experts > 0``)
  raises :class:`~statebridge.errors.UnsupportedModelError`. Keys the runtime does not read are
  ignored.

Nothing here imports transformers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from statebridge.dtypes import DTYPES, dtype_from_name
from statebridge.errors import ConfigError, UnsupportedModelError

__all__ = ["ModelConfig", "Lfm2ModelConfig", "Mamba2ModelConfig", "GraniteHybridModelConfig",
           "LFM2_DEFAULTS", "MAMBA2_DEFAULTS", "GRANITE_DEFAULTS", "ARCHITECTURES",
           "LFM2_LAYER_TYPES", "GRANITE_LAYER_TYPES", "DEFAULT_DTYPE",
           "read_config_json", "decode_special_floats", "encode_special_floats"]

#: model_type -> the HF class whose weight names the runtime reads.
ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM", "mamba2": "Mamba2ForCausalLM",
                 "granitemoehybrid": "GraniteMoeHybridForCausalLM"}

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

#: ``Mamba2Config`` defaults (transformers 5) of every field the runtime reads. ``num_heads`` is
#: derived when absent (see the module docstring); at these defaults it is transformers' 128.
MAMBA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32768,
    "hidden_size": 4096,
    "num_hidden_layers": 64,
    "expand": 2,
    "head_dim": 64,
    "state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 256,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "residual_in_fp32": True,
    "time_step_limit": (0.0, math.inf),
    "tie_word_embeddings": False,
}

#: GraniteMoeHybrid layer types as written in config.json (transformers' names and the legacy
#: ones ``remap_legacy_layer_types`` renames) -> the state spec's names.
GRANITE_LAYER_TYPES = {"linear_attention": "mamba2", "mamba": "mamba2",
                       "full_attention": "full_attention", "attention": "full_attention"}

#: Granite position embeddings: ``None`` or ``"nope"`` (no rotary; published Granite-4.0-H
#: configs say ``"nope"``) and ``"rope"``, the only value ``GraniteMoeHybridModel`` acts on.
GRANITE_POSITION_EMBEDDINGS = (None, "nope", "rope")

#: ``GraniteMoeHybridConfig`` defaults (transformers 5) of every field the runtime reads.
#: Derived, not defaulted (see the module docstring): ``num_key_value_heads``,
#: ``mamba_d_head``, ``head_dim``, and ``layer_types`` (every layer mamba without it). The
#: default ``num_local_experts`` is 8, an MoE model: a config must say 0 to be read.
GRANITE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "shared_intermediate_size": 1024,
    "num_local_experts": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_attention_heads": 32,
    "attention_bias": False,
    "position_embedding_type": None,
    "attention_multiplier": 1.0,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": (0.0, math.inf),
    "rope_theta": 10_000.0,             # RotaryEmbeddingConfigMixin.default_theta
}

#: The weights' dtype when the config names none.
DEFAULT_DTYPE = "float32"

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


# -- field readers: each names the key and the value it refuses --------------------------------

_ABSENT = object()


def _lookup(config: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    """The first of ``keys`` whose value is not null, and that value (``_ABSENT`` if none)."""
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return keys[0], _ABSENT


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(config: Mapping[str, Any], *keys: str, default: int) -> int:
    key, value = _lookup(config, keys)
    if value is _ABSENT:
        return default
    if not _is_number(value) or not math.isfinite(value) or value != int(value) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return int(value)


def _positive(config: Mapping[str, Any], key: str, *, default: float) -> float:
    """A positive finite number, kept as given (``expand`` may be an int or a float)."""
    _, value = _lookup(config, (key,))
    if value is _ABSENT:
        return default
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive number, got {value!r}")
    return value


def _count(config: Mapping[str, Any], key: str, *, default: int) -> int:
    """A non-negative integer (a count that may be 0)."""
    _, value = _lookup(config, (key,))
    if value is _ABSENT:
        return default
    if not _is_number(value) or not math.isfinite(value) or value != int(value) or value < 0:
        raise ConfigError(f"config field {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _typed(config: Mapping[str, Any], key: str, kind: type, what: str, *, default: Any) -> Any:
    """A value of exactly ``kind`` (``bool`` or ``str``); ``what`` says which in errors."""
    _, value = _lookup(config, (key,))
    if value is _ABSENT:
        return default
    if not isinstance(value, kind):
        raise ConfigError(f"config field {key!r} must be {what}, got {value!r}")
    return value


def _bool(config: Mapping[str, Any], key: str, *, default: bool) -> bool:
    return _typed(config, key, bool, "true or false", default=default)


def _time_step_limit(config: Mapping[str, Any], *,
                     default: tuple[float, float]) -> tuple[float, float]:
    limit = config.get("time_step_limit")
    if limit is None:
        limit = default
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or not all(
            _is_number(v) for v in limit):
        raise ConfigError(f"config field 'time_step_limit' must be [min, max], got {limit!r}")
    return float(limit[0]), float(limit[1])


def _layer_type_list(config: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ConfigError(f"config field {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _dtype(config: Mapping[str, Any]) -> str:
    """``dtype``, else the legacy ``torch_dtype``, else float32 (see the module docstring)."""
    key, value = _lookup(config, ("dtype", "torch_dtype"))
    if value is _ABSENT:
        return DEFAULT_DTYPE
    if not isinstance(value, str):
        raise ConfigError(f"config field {key!r} must be a dtype name, got {value!r}")
    try:
        return dtype_from_name(value)
    except ConfigError:
        raise ConfigError(f"config field {key!r} is {value!r}; expected one of "
                          f"{sorted(DTYPES)}") from None


def _int_list(config: Mapping[str, Any], key: str) -> list[int] | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"config field {key!r} must be a list of integers, got {value!r}")
    return list(value)


def _rope_theta(config: Mapping[str, Any], *, default: float) -> float:
    """``rope_parameters.rope_theta`` (transformers 5), else the legacy top-level ``rope_theta``,
    else the model's default; only the ``"default"`` rope type is served."""
    params = config.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"config field 'rope_parameters.rope_type' is {rope_type!r}; "
                                    f"only 'default' rotary embeddings are served")
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise UnsupportedModelError(f"config field 'partial_rotary_factor' is {factor!r}; only "
                                    f"1.0 (rotary over the whole head) is served")
    theta = params.get("rope_theta", config.get("rope_theta", default))
    if not _is_number(theta) or not theta > 0:
        raise ConfigError(f"config field 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint directory, or a JSON file given directly."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {path!r}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {path!r} is not a JSON object")
    return config


# -- the typed config ---------------------------------------------------------------------------

def _mamba_mixer_shapes(m: str, hidden: int, inner: int, conv_dim: int, heads: int, width: int,
                        *, proj_bias: bool, conv_bias: bool) -> dict[str, tuple[int, ...]]:
    """The weights of one Mamba2 mixer named ``m + name`` (``Mamba2Mixer`` and
    ``GraniteMoeHybridMambaLayer`` save the same ones)."""
    out: dict[str, tuple[int, ...]] = {m + "in_proj.weight": (inner + conv_dim + heads, hidden)}
    if proj_bias:
        out[m + "in_proj.bias"] = (inner + conv_dim + heads,)
    out[m + "conv1d.weight"] = (conv_dim, 1, width)
    if conv_bias:
        out[m + "conv1d.bias"] = (conv_dim,)
    out.update({m + "dt_bias": (heads,), m + "A_log": (heads,), m + "D": (heads,),
                m + "norm.weight": (inner,), m + "out_proj.weight": (hidden, inner)})
    if proj_bias:
        out[m + "out_proj.bias"] = (hidden,)
    return out


def _require_positive(config: "ModelConfig", *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not _is_number(value) or value <= 0:
            raise ConfigError(f"{config.model_type}: {name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What the runtime reads from ``config.json``; :meth:`from_dict` returns the subclass of the
    config's ``model_type`` (:class:`Lfm2ModelConfig`, :class:`Mamba2ModelConfig` or
    :class:`GraniteHybridModelConfig`).

    ``num_layers`` is ``num_hidden_layers``; ``norm_eps`` is the RMSNorm epsilon
    (LFM2 ``norm_eps``, Mamba2 ``layer_norm_epsilon``, Granite ``rms_norm_eps``); ``dtype`` a
    name of :data:`~statebridge.dtypes.DTYPES`. ``layer_types`` uses the state spec's names
    (``"conv"``, ``"full_attention"``, ``"mamba2"``).
    """

    model_type: ClassVar[str] = ""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    dtype: str
    norm_eps: float

    def __post_init__(self) -> None:
        if type(self) is ModelConfig:
            raise ConfigError("ModelConfig is abstract: use ModelConfig.from_dict or a subclass")
        _require_positive(self, "vocab_size", "hidden_size", "num_layers", "norm_eps")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{self.model_type}: layer_types has {len(self.layer_types)} "
                              f"entries but num_hidden_layers is {self.num_layers}")
        dtype_from_name(self.dtype)

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> \
            "Lfm2ModelConfig | Mamba2ModelConfig | GraniteHybridModelConfig":
        """Read a ``config.json`` dict; raises ConfigError / UnsupportedModelError."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"model config must be a JSON object, got {type(raw).__name__}")
        config = decode_special_floats(dict(raw))
        model_type = config.get("model_type")
        reader = _READERS.get(model_type) if isinstance(model_type, str) else None
        if reader is None:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: "
                                        f"{sorted(_READERS)}")
        return reader(config)

    @classmethod
    def load(cls, path: str | os.PathLike) -> \
            "Lfm2ModelConfig | Mamba2ModelConfig | GraniteHybridModelConfig":
        """Read ``config.json`` from a checkpoint directory, or a JSON file given directly."""
        return cls.from_dict(read_config_json(path))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the ones with KV; none for Mamba2)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    # -- weights ------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def embedding_name(self) -> str:
        raise NotImplementedError

    def layer_prefix(self, layer: int) -> str:
        """Weight-name prefix of decoder layer ``layer``'s mixer."""
        raise NotImplementedError

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight of the ``*ForCausalLM`` checkpoint and its shape, in module order.

        The one description of the HF format: the runner checks a checkpoint against it and
        :func:`~statebridge.models.checkpoint.make_checkpoint` writes exactly it. A tied
        ``lm_head`` is absent (transformers does not save it). Raises UnsupportedModelError for a
        model the runtime cannot load (LFM2 attention layers, GraniteMoeHybrid as yet).
        """
        raise NotImplementedError


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
            vocab_size=_int(config, "vocab_size", default=d["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=layer_types,
            tie_word_embeddings=_bool(config, "tie_word_embeddings",
                                      default=d["tie_word_embeddings"]),
            dtype=_dtype(config),
            norm_eps=float(_positive(config, "norm_eps", default=d["norm_eps"])),
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

    @property
    def embedding_name(self) -> str:
        return "model.embed_tokens.weight"

    def layer_prefix(self, layer: int) -> str:
        mixer = "conv" if self.layer_types[layer] == "conv" else "self_attn"
        return f"model.layers.{layer}.{mixer}."

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba2ModelConfig(ModelConfig):
    """A Mamba2 config. Field names are ``Mamba2Config``'s (``norm_eps`` is
    ``layer_norm_epsilon``: the eps of the block norms, the final norm and the gated norm)."""

    model_type: ClassVar[str] = "mamba2"

    expand: int | float
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    hidden_act: str
    residual_in_fp32: bool
    time_step_limit: tuple[float, float]

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        _require_positive(self, "expand", "num_heads", "head_dim", "state_size", "n_groups",
                          "conv_kernel", "chunk_size")
        inner = self.expand * self.hidden_size
        if inner != int(inner):
            raise ConfigError(f"mamba2: expand * hidden_size = {self.expand} * "
                              f"{self.hidden_size} is not an integer")
        if self.num_heads * self.head_dim != inner:
            raise ConfigError(f"mamba2: num_heads * head_dim = {self.num_heads} * "
                              f"{self.head_dim} != expand * hidden_size = {int(inner)}")
        if self.num_heads % self.n_groups:
            raise ConfigError(f"mamba2: num_heads {self.num_heads} is not a multiple of "
                              f"n_groups {self.n_groups}")
        if len(self.time_step_limit) != 2:
            raise ConfigError(f"mamba2: time_step_limit must be (min, max), got "
                              f"{self.time_step_limit!r}")

    @classmethod
    def _read(cls, config: Mapping[str, Any]) -> "Mamba2ModelConfig":
        d = MAMBA2_DEFAULTS
        hidden = _int(config, "hidden_size", "d_model", default=d["hidden_size"])
        expand = _positive(config, "expand", default=d["expand"])
        head_dim = _int(config, "head_dim", "headdim", default=d["head_dim"])
        inner = expand * hidden
        if inner != int(inner):
            raise ConfigError(f"mamba2: expand * hidden_size = {expand} * {hidden} is not an "
                              f"integer")
        if config.get("num_heads") is None and int(inner) % head_dim:
            raise ConfigError(f"mamba2: intermediate size {int(inner)} (expand * hidden_size) "
                              f"is not a multiple of head_dim {head_dim}")
        num_layers = _int(config, "num_hidden_layers", "n_layer", default=d["num_hidden_layers"])
        return cls(
            vocab_size=_int(config, "vocab_size", default=d["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=("mamba2",) * num_layers,
            tie_word_embeddings=_bool(config, "tie_word_embeddings",
                                      default=d["tie_word_embeddings"]),
            dtype=_dtype(config),
            norm_eps=float(_positive(config, "layer_norm_epsilon",
                                     default=d["layer_norm_epsilon"])),
            expand=expand,
            num_heads=_int(config, "num_heads", default=int(inner) // head_dim),
            head_dim=head_dim,
            state_size=_int(config, "state_size", "d_state", default=d["state_size"]),
            n_groups=_int(config, "n_groups", "ngroups", default=d["n_groups"]),
            conv_kernel=_int(config, "conv_kernel", "d_conv", default=d["conv_kernel"]),
            chunk_size=_int(config, "chunk_size", default=d["chunk_size"]),
            use_bias=_bool(config, "use_bias", default=d["use_bias"]),
            use_conv_bias=_bool(config, "use_conv_bias", default=d["use_conv_bias"]),
            hidden_act=_typed(config, "hidden_act", str, "a string", default=d["hidden_act"]),
            residual_in_fp32=_bool(config, "residual_in_fp32", default=d["residual_in_fp32"]),
            time_step_limit=_time_step_limit(config, default=d["time_step_limit"]),
        )

    @property
    def intermediate_size(self) -> int:
        """I = expand * hidden_size = num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[x (I) | B (G*N) | C (G*N)]``."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def embedding_name(self) -> str:
        return "backbone.embeddings.weight"

    def layer_prefix(self, layer: int) -> str:
        return f"backbone.layers.{layer}.mixer."

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        V, Hd, H, K = self.vocab_size, self.hidden_size, self.num_heads, self.conv_kernel
        inner, conv_dim = self.intermediate_size, self.conv_dim
        out: dict[str, tuple[int, ...]] = {self.embedding_name: (V, Hd)}
        for i in range(self.num_layers):
            p = f"backbone.layers.{i}."
            out[p + "norm.weight"] = (Hd,)
            out.update(_mamba_mixer_shapes(p + "mixer.", Hd, inner, conv_dim, H, K,
                                           proj_bias=self.use_bias,
                                           conv_bias=self.use_conv_bias))
        out["backbone.norm_f.weight"] = (Hd,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (V, Hd)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GraniteHybridModelConfig(ModelConfig):
    """A dense GraniteMoeHybrid (Granite-4.0-H) config: Mamba2 layers (``"mamba2"``) and
    attention layers (``"full_attention"``), each followed by the shared SwiGLU MLP
    (``shared_intermediate_size``). Field names are ``GraniteMoeHybridConfig``'s
    (``norm_eps`` is ``rms_norm_eps``: the block norms, the final norm and the mamba gated norm).

    ``head_dim`` is the attention heads' width (``hidden_size // num_attention_heads`` unless the
    config carries ``head_dim``); ``mamba_*`` describe the mamba layers exactly as
    ``GraniteMoeHybridMambaLayer`` reads them (see :attr:`mamba_intermediate_size`,
    :attr:`mamba_conv_dim`). MoE (``num_local_experts > 0``) is refused; ``intermediate_size``
    is the experts' width, kept because transformers reads it, unused by a dense model.
    """

    model_type: ClassVar[str] = "granitemoehybrid"

    intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    hidden_act: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    position_embedding_type: str | None
    attention_multiplier: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_expand: int | float
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    rope_theta: float

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_types) - set(GRANITE_LAYER_TYPES.values()))
        if unknown:
            raise UnsupportedModelError(f"granitemoehybrid: unknown layer type(s) {unknown} in "
                                        f"layer_types; known: {sorted(GRANITE_LAYER_TYPES)}")
        if self.num_local_experts != 0:
            raise UnsupportedModelError(
                f"granitemoehybrid: num_local_experts={self.num_local_experts!r}: MoE is not "
                f"served (dense Granite-4.0-H only, num_local_experts=0)")
        ModelConfig.__post_init__(self)
        _require_positive(self, "intermediate_size", "shared_intermediate_size",
                          "num_attention_heads", "num_key_value_heads", "logits_scaling",
                          "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                          "mamba_d_conv", "mamba_expand", "mamba_chunk_size")
        if self.position_embedding_type not in GRANITE_POSITION_EMBEDDINGS:
            raise ConfigError(f"granitemoehybrid: position_embedding_type="
                              f"{self.position_embedding_type!r}; expected one of "
                              f"{list(GRANITE_POSITION_EMBEDDINGS)}")
        # GraniteMoeHybridConfig.validate_architecture checks these two whatever the layers.
        inner = self.mamba_expand * self.hidden_size
        if inner != int(inner):
            raise ConfigError(f"granitemoehybrid: mamba_expand * hidden_size = "
                              f"{self.mamba_expand} * {self.hidden_size} is not an integer")
        if self.mamba_n_heads * self.mamba_d_head != inner:
            raise ConfigError(f"granitemoehybrid: mamba_n_heads * mamba_d_head = "
                              f"{self.mamba_n_heads} * {self.mamba_d_head} != mamba_expand * "
                              f"hidden_size = {int(inner)}")
        if self.mamba_layers and self.mamba_n_heads % self.mamba_n_groups:
            raise ConfigError(f"granitemoehybrid: mamba_n_heads={self.mamba_n_heads} is not a "
                              f"multiple of mamba_n_groups={self.mamba_n_groups}")
        if self.attention_layers:       # (without them the attention geometry is never used)
            _require_positive(self, "head_dim")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(f"granitemoehybrid: num_attention_heads="
                                  f"{self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads}")
        if len(self.time_step_limit) != 2:
            raise ConfigError(f"granitemoehybrid: time_step_limit must be (min, max), got "
                              f"{self.time_step_limit!r}")

    @classmethod
    def _read(cls, config: Mapping[str, Any]) -> "GraniteHybridModelConfig":
        d = GRANITE_DEFAULTS
        hidden = _int(config, "hidden_size", default=d["hidden_size"])
        # attribute_map: transformers sets ``layers_block_type`` after ``layer_types``, so it wins.
        key = "layers_block_type" if config.get("layers_block_type") is not None else \
            "layer_types"
        written = _layer_type_list(config, key)
        if written is None:
            num_layers = _int(config, "num_hidden_layers", default=d["num_hidden_layers"])
            layer_types = ("mamba2",) * num_layers
        else:
            layer_types = tuple(GRANITE_LAYER_TYPES.get(t, t) for t in written)
            num_layers = _int(config, "num_hidden_layers", default=len(layer_types))

        heads = _int(config, "num_attention_heads", default=d["num_attention_heads"])
        if config.get("head_dim") is not None:
            head_dim = _int(config, "head_dim", default=0)
        elif hidden % heads and "full_attention" in layer_types:
            raise ConfigError(f"granitemoehybrid: hidden_size={hidden} is not a multiple of "
                              f"num_attention_heads={heads}")
        else:
            head_dim = hidden // heads          # as GraniteMoeHybridAttention computes it

        expand = _positive(config, "mamba_expand", default=d["mamba_expand"])
        mamba_heads = _int(config, "mamba_n_heads", default=d["mamba_n_heads"])
        d_head: Any = config.get("mamba_d_head")
        if d_head is None or d_head == "auto":  # GraniteMoeHybridConfig.__post_init__
            inner = expand * hidden
            if inner != int(inner) or int(inner) % mamba_heads:
                raise ConfigError(f"granitemoehybrid: mamba_n_heads={mamba_heads} does not "
                                  f"divide mamba_expand * hidden_size = {expand} * {hidden}")
            d_head = int(inner) // mamba_heads
        else:
            d_head = _int(config, "mamba_d_head", default=0)

        def number(key: str) -> float:
            return float(_positive(config, key, default=d[key]))

        position = config.get("position_embedding_type")
        if position is not None and not isinstance(position, str):
            raise ConfigError(f"config field 'position_embedding_type' must be a string or "
                              f"null, got {position!r}")
        return cls(
            vocab_size=_int(config, "vocab_size", default=d["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=layer_types,
            tie_word_embeddings=_bool(config, "tie_word_embeddings",
                                      default=d["tie_word_embeddings"]),
            dtype=_dtype(config),
            norm_eps=number("rms_norm_eps"),
            intermediate_size=_int(config, "intermediate_size", default=d["intermediate_size"]),
            shared_intermediate_size=_int(config, "shared_intermediate_size",
                                          default=d["shared_intermediate_size"]),
            num_local_experts=_count(config, "num_local_experts",
                                     default=d["num_local_experts"]),
            hidden_act=_typed(config, "hidden_act", str, "a string", default=d["hidden_act"]),
            num_attention_heads=heads,
            num_key_value_heads=_int(config, "num_key_value_heads", default=heads),
            head_dim=head_dim,
            attention_bias=_bool(config, "attention_bias", default=d["attention_bias"]),
            position_embedding_type=position,
            attention_multiplier=number("attention_multiplier"),
            embedding_multiplier=number("embedding_multiplier"),
            residual_multiplier=number("residual_multiplier"),
            logits_scaling=number("logits_scaling"),
            mamba_n_heads=mamba_heads,
            mamba_d_head=d_head,
            mamba_d_state=_int(config, "mamba_d_state", default=d["mamba_d_state"]),
            mamba_n_groups=_int(config, "mamba_n_groups", default=d["mamba_n_groups"]),
            mamba_d_conv=_int(config, "mamba_d_conv", default=d["mamba_d_conv"]),
            mamba_expand=expand,
            mamba_chunk_size=_int(config, "mamba_chunk_size", default=d["mamba_chunk_size"]),
            mamba_conv_bias=_bool(config, "mamba_conv_bias", default=d["mamba_conv_bias"]),
            mamba_proj_bias=_bool(config, "mamba_proj_bias", default=d["mamba_proj_bias"]),
            time_step_limit=_time_step_limit(config, default=d["time_step_limit"]),
            rope_theta=(_rope_theta(config, default=d["rope_theta"]) if position == "rope"
                        else d["rope_theta"]),
        )

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Indices of the Mamba2 layers (the ones with recurrent state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mamba2")

    @property
    def mamba_intermediate_size(self) -> int:
        """I = int(mamba_expand * hidden_size) = mamba_n_heads * mamba_d_head, as
        ``GraniteMoeHybridMambaLayer.intermediate_size``."""
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[x (I) | B (G*N) | C (G*N)]``."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def embedding_name(self) -> str:
        return "model.embed_tokens.weight"

    def layer_prefix(self, layer: int) -> str:
        mixer = "mamba" if self.layer_types[layer] == "mamba2" else "self_attn"
        return f"model.layers.{layer}.{mixer}."

    @property
    def rotary(self) -> bool:
        """Whether the attention layers apply RoPE (``position_embedding_type == "rope"``;
        ``None`` and ``"nope"`` mean none, as in ``GraniteMoeHybridModel``)."""
        return self.position_embedding_type == "rope"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        V, Hd, K = self.vocab_size, self.hidden_size, self.mamba_d_conv
        inner, conv_dim, H = self.mamba_intermediate_size, self.mamba_conv_dim, self.mamba_n_heads
        D, S = self.head_dim, self.shared_intermediate_size
        q, kv = self.num_attention_heads * D, self.num_key_value_heads * D
        out: dict[str, tuple[int, ...]] = {self.embedding_name: (V, Hd)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (Hd,)
            if self.layer_types[i] == "mamba2":
                out.update(_mamba_mixer_shapes(p + "mamba.", Hd, inner, conv_dim, H, K,
                                               proj_bias=self.mamba_proj_bias,
                                               conv_bias=self.mamba_conv_bias))
            else:
                a = p + "self_attn."
                for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                    out[a + name + ".weight"] = (rows, Hd)
                    if self.attention_bias:
                        out[a + name + ".bias"] = (rows,)
                out[a + "o_proj.weight"] = (Hd, q)
                if self.attention_bias:
                    out[a + "o_proj.bias"] = (Hd,)
            out[p + "post_attention_layernorm.weight"] = (Hd,)
            out[p + "shared_mlp.input_linear.weight"] = (2 * S, Hd)
            out[p + "shared_mlp.output_linear.weight"] = (Hd, S)
        out["model.norm.weight"] = (Hd,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (V, Hd)
        return out


_READERS = {"lfm2": Lfm2ModelConfig._read, "mamba2": Mamba2ModelConfig._read,
            "granitemoehybrid": GraniteHybridModelConfig._read}
