"""What every family's config holds: :class:`ModelConfig`, the one entry point
(:meth:`ModelConfig.from_dict`, :meth:`ModelConfig.load`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from statebridge.dtypes import dtype_from_name
from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.hf_config.fields import (_bool, _dtype, _int, _is_number, _positive,
                                         decode_special_floats, read_config_json)

#: model_type -> the HF class whose weight names the runtime reads.
ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM", "mamba2": "Mamba2ForCausalLM",
                 "granitemoehybrid": "GraniteMoeHybridForCausalLM"}

#: layer type -> the HF module name of its mixer in ``model.layers.{i}.{mixer}.`` (LFM2, Granite;
#: Mamba2 names its weights ``backbone.layers.{i}.mixer.``).
_MIXER_MODULES = {"conv": "conv", "mamba2": "mamba", "full_attention": "self_attn"}

#: model_type -> the reader of that family's config (``cls._read``); the package's ``__init__``
#: fills it with every family.
_READERS: dict[str, Callable[[Mapping[str, Any]], "ModelConfig"]] = {}


def _require_positive(config: "ModelConfig", *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not _is_number(value) or value <= 0:
            raise ConfigError(f"{config.model_type}: {name} must be > 0, got {value!r}")


def _require_min_max(config: "ModelConfig", name: str) -> None:
    value = getattr(config, name)
    if len(value) != 2:
        raise ConfigError(f"{config.model_type}: {name} must be (min, max), got {value!r}")


def _base_fields(config: Mapping[str, Any], defaults: Mapping[str, Any], *, hidden_size: int,
                 num_layers: int, layer_types: tuple[str, ...], norm_key: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields read from a ``config.json`` dict the same way in every
    family (``norm_key``: the family's key of the RMSNorm epsilon); ``defaults`` are the
    family's, by key."""
    return dict(
        vocab_size=_int(config, "vocab_size", default=defaults["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=num_layers,
        layer_types=layer_types,
        tie_word_embeddings=_bool(config, "tie_word_embeddings",
                                  default=defaults["tie_word_embeddings"]),
        dtype=_dtype(config),
        norm_eps=float(_positive(config, norm_key, default=defaults[norm_key])),
    )


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
    #: the checkpoint's name of the token embedding
    embedding_name: ClassVar[str] = "model.embed_tokens.weight"

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

    def layer_prefix(self, layer: int) -> str:
        """Weight-name prefix of decoder layer ``layer``'s mixer."""
        return f"model.layers.{layer}.{_MIXER_MODULES[self.layer_types[layer]]}."

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight of the ``*ForCausalLM`` checkpoint and its shape, in module order.

        The one description of the HF format: the runner checks a checkpoint against it and
        :func:`~statebridge.models.checkpoint.make_checkpoint` writes exactly it. A tied
        ``lm_head`` is absent (transformers does not save it). Raises UnsupportedModelError for a
        model the runtime cannot load (LFM2 attention layers, GraniteMoeHybrid as yet).
        """
        raise NotImplementedError
