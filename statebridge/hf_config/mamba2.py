"""Mamba2 (``Mamba2Config``): every layer a Mamba2 mixer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from statebridge.errors import ConfigError
from statebridge.hf_config.base import ModelConfig, _require_positive
from statebridge.hf_config.fields import (_bool, _dtype, _int, _positive, _time_step_limit,
                                          _typed)

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
