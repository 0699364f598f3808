"""Mamba2 (``Mamba2Config``): every layer a Mamba2 mixer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from statebridge.hf_config.base import ModelConfig, _base_fields, _require_min_max
from statebridge.hf_config.fields import _bool, _int, _time_step_limit, _typed
from statebridge.hf_config.mixer import Mamba2Geometry, MixerKeys

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


#: Where ``Mamba2Config`` keeps the mixer geometry (then the original mamba_ssm names).
MAMBA2_KEYS = MixerKeys(
    family="mamba2", derived="num_heads", expand=("expand",), num_heads=("num_heads",),
    head_dim=("head_dim", "headdim"), n_groups=("n_groups", "ngroups"),
    state_size=("state_size", "d_state"), conv_kernel=("conv_kernel", "d_conv"),
    chunk_size=("chunk_size",), proj_bias=("use_bias",), conv_bias=("use_conv_bias",))


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba2ModelConfig(ModelConfig):
    """A Mamba2 config. Field names are ``Mamba2Config``'s (``norm_eps`` is
    ``layer_norm_epsilon``: the eps of the block norms, the final norm and the gated norm);
    :attr:`mamba` is the mixer geometry in the names both Mamba2 families share."""

    model_type: ClassVar[str] = "mamba2"
    embedding_name: ClassVar[str] = "backbone.embeddings.weight"

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
        MAMBA2_KEYS.check(self.mamba)
        _require_min_max(self, "time_step_limit")

    @classmethod
    def _read(cls, config: Mapping[str, Any]) -> "Mamba2ModelConfig":
        d = MAMBA2_DEFAULTS
        hidden = _int(config, "hidden_size", "d_model", default=d["hidden_size"])
        mixer = MAMBA2_KEYS.read(config, d, hidden_size=hidden)
        num_layers = _int(config, "num_hidden_layers", "n_layer", default=d["num_hidden_layers"])
        return cls(
            **_base_fields(config, d, hidden_size=hidden, num_layers=num_layers,
                           layer_types=("mamba2",) * num_layers, norm_key="layer_norm_epsilon"),
            **MAMBA2_KEYS.attributes(mixer),
            hidden_act=_typed(config, str, "a string", "hidden_act", default=d["hidden_act"]),
            residual_in_fp32=_bool(config, "residual_in_fp32", default=d["residual_in_fp32"]),
            time_step_limit=_time_step_limit(config, default=d["time_step_limit"]),
        )

    @property
    def mamba(self) -> Mamba2Geometry:
        """Every layer's mixer geometry, in the names both families share."""
        return MAMBA2_KEYS.geometry(self)

    @property
    def intermediate_size(self) -> int:
        """I = expand * hidden_size = num_heads * head_dim."""
        return self.mamba.intermediate_size

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[x (I) | B (G*N) | C (G*N)]``."""
        return self.mamba.conv_dim

    def layer_prefix(self, layer: int) -> str:
        return f"backbone.layers.{layer}.mixer."

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        V, Hd, mixer = self.vocab_size, self.hidden_size, self.mamba
        out: dict[str, tuple[int, ...]] = {self.embedding_name: (V, Hd)}
        for i in range(self.num_layers):
            p = f"backbone.layers.{i}."
            out[p + "norm.weight"] = (Hd,)
            out.update(mixer.weight_shapes(p + "mixer."))
        out["backbone.norm_f.weight"] = (Hd,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (V, Hd)
        return out
