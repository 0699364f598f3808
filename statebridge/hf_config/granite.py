"""GraniteMoeHybrid, dense (Granite-4.0-H, ``GraniteMoeHybridConfig``): Mamba2 layers and
attention layers, each followed by the shared MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.hf_config.base import (ModelConfig, _base_fields, _require_min_max,
                                        _require_positive)
from statebridge.hf_config.fields import (_bool, _count, _int, _layer_type_list, _positive,
                                          _rope_theta, _time_step_limit, _typed)
from statebridge.hf_config.mixer import Mamba2Geometry, MixerKeys

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

#: Where ``GraniteMoeHybridConfig`` keeps the Mamba2 layers' mixer geometry.
GRANITE_KEYS = MixerKeys(
    family="granitemoehybrid", derived="head_dim", expand=("mamba_expand",),
    num_heads=("mamba_n_heads",), head_dim=("mamba_d_head",), n_groups=("mamba_n_groups",),
    state_size=("mamba_d_state",), conv_kernel=("mamba_d_conv",),
    chunk_size=("mamba_chunk_size",), proj_bias=("mamba_proj_bias",),
    conv_bias=("mamba_conv_bias",))


@dataclass(frozen=True, slots=True, kw_only=True)
class GraniteHybridModelConfig(ModelConfig):
    """A dense GraniteMoeHybrid (Granite-4.0-H) config: Mamba2 layers (``"mamba2"``) and
    attention layers (``"full_attention"``), each followed by the shared SwiGLU MLP
    (``shared_intermediate_size``). Field names are ``GraniteMoeHybridConfig``'s
    (``norm_eps`` is ``rms_norm_eps``: the block norms, the final norm and the mamba gated norm).

    ``head_dim`` is the attention heads' width (``hidden_size // num_attention_heads`` unless the
    config carries ``head_dim``); ``mamba_*`` describe the mamba layers exactly as
    ``GraniteMoeHybridMambaLayer`` reads them; :attr:`mamba` is the same geometry in the names
    both families share. MoE (``num_local_experts > 0``) is refused; ``intermediate_size``
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
                          "num_attention_heads", "num_key_value_heads", "logits_scaling")
        if self.position_embedding_type not in GRANITE_POSITION_EMBEDDINGS:
            raise ConfigError(f"granitemoehybrid: position_embedding_type="
                              f"{self.position_embedding_type!r}; expected one of "
                              f"{list(GRANITE_POSITION_EMBEDDINGS)}")
        # GraniteMoeHybridConfig.validate_architecture checks the sizes whatever the layers;
        # heads per group matter only where there are mamba layers.
        GRANITE_KEYS.check(self.mamba, grouped=bool(self.mamba_layers))
        if self.attention_layers:       # (without them the attention geometry is never used)
            _require_positive(self, "head_dim")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(f"granitemoehybrid: num_attention_heads="
                                  f"{self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads}")
        _require_min_max(self, "time_step_limit")

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

        if config.get("mamba_d_head") == "auto":   # GraniteMoeHybridConfig.__post_init__
            config = {**config, "mamba_d_head": None}   # derived, as when absent
        mixer = GRANITE_KEYS.read(config, d, hidden_size=hidden)

        def number(key: str) -> float:
            return float(_positive(config, key, default=d[key]))

        position = config.get("position_embedding_type")
        if position is not None and not isinstance(position, str):
            raise ConfigError(f"config field 'position_embedding_type' must be a string or "
                              f"null, got {position!r}")
        return cls(
            **_base_fields(config, d, hidden_size=hidden, num_layers=num_layers,
                           layer_types=layer_types, norm_key="rms_norm_eps"),
            intermediate_size=_int(config, "intermediate_size", default=d["intermediate_size"]),
            shared_intermediate_size=_int(config, "shared_intermediate_size",
                                          default=d["shared_intermediate_size"]),
            num_local_experts=_count(config, "num_local_experts",
                                     default=d["num_local_experts"]),
            hidden_act=_typed(config, str, "a string", "hidden_act", default=d["hidden_act"]),
            num_attention_heads=heads,
            num_key_value_heads=_int(config, "num_key_value_heads", default=heads),
            head_dim=head_dim,
            attention_bias=_bool(config, "attention_bias", default=d["attention_bias"]),
            position_embedding_type=position,
            attention_multiplier=number("attention_multiplier"),
            embedding_multiplier=number("embedding_multiplier"),
            residual_multiplier=number("residual_multiplier"),
            logits_scaling=number("logits_scaling"),
            **GRANITE_KEYS.attributes(mixer),
            time_step_limit=_time_step_limit(config, default=d["time_step_limit"]),
            rope_theta=(_rope_theta(config, default=d["rope_theta"]) if position == "rope"
                        else d["rope_theta"]),
        )

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Indices of the Mamba2 layers (the ones with recurrent state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mamba2")

    @property
    def mamba(self) -> Mamba2Geometry:
        """The Mamba2 layers' mixer geometry, in the names both families share."""
        return GRANITE_KEYS.geometry(self)

    @property
    def rotary(self) -> bool:
        """Whether the attention layers apply RoPE (``position_embedding_type == "rope"``;
        ``None`` and ``"nope"`` mean none, as in ``GraniteMoeHybridModel``)."""
        return self.position_embedding_type == "rope"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        V, Hd, mixer = self.vocab_size, self.hidden_size, self.mamba
        D, S = self.head_dim, self.shared_intermediate_size
        q, kv = self.num_attention_heads * D, self.num_key_value_heads * D
        out: dict[str, tuple[int, ...]] = {self.embedding_name: (V, Hd)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (Hd,)
            if self.layer_types[i] == "mamba2":
                out.update(mixer.weight_shapes(p + "mamba."))
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
