"""The recurrent state of a model, declared once as data.

A :class:`StateSpec` is built from a Hugging Face ``config.json`` (LFM2 or Mamba2). It says, for
every layer that carries recurrent state, which state tensors it owns, how their channel axis is
made of segments, and how each segment is sharded across tensor-parallel ranks::

    ShortConv (LFM2) conv state, one layer, global:
        channel axis D = [ Bx (hidden, split) ]             inner axes: S = L_cache - 1

    Mamba2 conv state, one layer, global:
        channel axis D = [ x (I, split) | B (G*N, grouped) | C (G*N, grouped) ]   inner: S = K - 1
    Mamba2 SSM state, one layer, global:
        channel axis H = [ heads (H, split) ]               inner axes: P, N

A *grouped* segment is split on group boundaries when ``G % tp == 0`` and replicated (every rank
holds the one group) when ``G == 1``; anything else is a :class:`~statebridge.errors.ConfigError`.
Layers whose state tensors have identical shapes and dtypes form one :class:`LayerGroup`; a page
stores each tensor of a group as one region (see :mod:`statebridge.state.layout`).

The spec carries no TP size: sharding is computed by :mod:`statebridge.state.sharding`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from statebridge.errors import ConfigError, UnsupportedModelError

__all__ = [
    "Sharding",
    "Segment",
    "StateTensorSpec",
    "LayerGroup",
    "StateSpec",
    "DTYPES",
    "dtype_from_name",
    "load_config",
]

#: dtype names accepted in configs and on the wire -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


def dtype_from_name(name: str | torch.dtype) -> str:
    """Canonical dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``) of ``name``."""
    if isinstance(name, torch.dtype):
        for key, value in DTYPES.items():
            if value == name:
                return key
        raise ConfigError(f"unsupported state dtype {name!r}; expected one of {sorted(DTYPES)}")
    key = str(name).removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ConfigError(f"unsupported state dtype {name!r}; expected one of {sorted(DTYPES)}")
    return key


class Sharding(enum.Enum):
    """How a segment of a channel axis is distributed over TP ranks."""

    SPLIT = "split"            # rank r of t holds [r*n/t, (r+1)*n/t)
    REPLICATED = "replicated"  # every rank holds all n
    GROUPED = "grouped"        # split by groups when groups % t == 0, replicated when groups == 1


@dataclass(frozen=True, slots=True)
class Segment:
    """A named, contiguous piece of a state tensor's channel axis (global sizes).

    ``groups`` is set for :attr:`Sharding.GROUPED` segments: ``size`` is ``groups * group_size``.
    """

    name: str
    size: int
    sharding: Sharding
    groups: int = 1

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ConfigError(f"segment {self.name!r}: size must be > 0, got {self.size}")
        if self.groups <= 0 or self.size % self.groups:
            raise ConfigError(
                f"segment {self.name!r}: size {self.size} is not a multiple of groups {self.groups}")


@dataclass(frozen=True, slots=True)
class StateTensorSpec:
    """One state tensor of a layer: a channel axis of segments and fixed inner axes.

    Canonical (logical) axis order of one layer's tensor is ``(channel, *inner)``; the letters
    name the axes (conv: ``"D"`` + ``("S",)``; SSM: ``"H"`` + ``("P", "N")``).
    """

    name: str                       # "conv" or "ssm"
    channel_axis: str               # "D" or "H"
    segments: tuple[Segment, ...]
    inner_axes: tuple[str, ...]
    inner_shape: tuple[int, ...]
    dtype: str                      # canonical dtype name, see DTYPES

    def __post_init__(self) -> None:
        if len(self.inner_axes) != len(self.inner_shape):
            raise ConfigError(f"tensor {self.name!r}: inner axes {self.inner_axes} do not match "
                              f"inner shape {self.inner_shape}")
        if any(n <= 0 for n in self.inner_shape):
            raise ConfigError(f"tensor {self.name!r}: inner shape {self.inner_shape} must be > 0")
        if not self.segments:
            raise ConfigError(f"tensor {self.name!r}: no segments")
        dtype_from_name(self.dtype)

    @property
    def channels(self) -> int:
        """Global size of the channel axis."""
        return sum(s.size for s in self.segments)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def inner_numel(self) -> int:
        return math.prod(self.inner_shape)

    @property
    def axes(self) -> str:
        """Canonical axis letters of one layer: channel then inner (``"DS"``, ``"HPN"``)."""
        return self.channel_axis + "".join(self.inner_axes)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers whose state tensors have identical specs; a page stores each tensor as one region."""

    layer_ids: tuple[int, ...]
    tensors: tuple[StateTensorSpec, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def tensor(self, name: str) -> StateTensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ConfigError(f"no state tensor {name!r} in group; have {[t.name for t in self.tensors]}")


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Every recurrent state tensor of a model, grouped by identical layer shapes.

    ``layer_types`` lists every decoder layer's type (``"conv"``, ``"mamba2"``,
    ``"full_attention"``); only stateful layers appear in ``groups``.
    """

    model_type: str
    groups: tuple[LayerGroup, ...]
    layer_types: tuple[str, ...] = field(default=())
    conv_kernel: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise UnsupportedModelError(f"{self.model_type}: model has no recurrent-state layers")

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, dtype: str | torch.dtype | None = None,
                    ssm_dtype: str | torch.dtype | None = None) -> "StateSpec":
        """Build the spec from a Hugging Face config dict.

        ``dtype`` overrides the model dtype for every state tensor (default: the config's
        ``torch_dtype``/``dtype``, else float32). ``ssm_dtype`` sets the SSM state dtype alone
        (e.g. ``"float32"`` for an fp32 SSM state beside a bf16 conv state).
        """
        model_type = config.get("model_type")
        builder = _BUILDERS.get(model_type)
        if builder is None:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported: {sorted(_BUILDERS)}")
        conv_dtype = dtype_from_name(dtype) if dtype is not None else _config_dtype(config)
        ssm = dtype_from_name(ssm_dtype) if ssm_dtype is not None else conv_dtype
        return builder(config, conv_dtype, ssm)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> "StateSpec":
        """Build the spec from a checkpoint directory or a ``config.json`` path."""
        return cls.from_config(load_config(path), **kwargs)

    # -- derived ----------------------------------------------------------------------------
    @property
    def num_state_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    def bytes_per_request(self) -> int:
        """Global (TP=1, unpadded) state bytes of one request."""
        return sum(g.num_layers * t.channels * t.inner_numel * t.itemsize
                   for g in self.groups for t in g.tensors)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data description (stable; used for the compatibility hash and ``--json``)."""
        return {
            "model_type": self.model_type,
            "conv_kernel": self.conv_kernel,
            "layer_types": list(self.layer_types),
            "groups": [
                {
                    "layer_ids": list(g.layer_ids),
                    "tensors": [
                        {
                            "name": t.name,
                            "channel_axis": t.channel_axis,
                            "segments": [[s.name, s.size, s.sharding.value, s.groups]
                                         for s in t.segments],
                            "inner_axes": list(t.inner_axes),
                            "inner_shape": list(t.inner_shape),
                            "dtype": t.dtype,
                        }
                        for t in g.tensors
                    ],
                }
                for g in self.groups
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StateSpec":
        """Inverse of :meth:`to_dict` (a peer's spec from the handshake)."""
        try:
            groups = tuple(
                LayerGroup(
                    tuple(int(i) for i in g["layer_ids"]),
                    tuple(
                        StateTensorSpec(
                            name=t["name"], channel_axis=t["channel_axis"],
                            segments=tuple(Segment(n, int(size), Sharding(sh), int(groups))
                                           for n, size, sh, groups in t["segments"]),
                            inner_axes=tuple(t["inner_axes"]),
                            inner_shape=tuple(int(x) for x in t["inner_shape"]),
                            dtype=t["dtype"])
                        for t in g["tensors"]))
                for g in data["groups"])
            return cls(data["model_type"], groups, tuple(data["layer_types"]),
                       int(data["conv_kernel"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed state spec description: {type(e).__name__}: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "StateSpec":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ConfigError(f"malformed state spec JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"malformed state spec JSON: not an object: {text[:64]!r}")
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """A short stable hash of :meth:`to_dict` (peers compare it in the handshake)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


# -- config readers ---------------------------------------------------------------------------

def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` from a checkpoint directory, or a JSON file given directly."""
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


def _config_dtype(config: Mapping[str, Any]) -> str:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    return dtype_from_name(name)


def _int(config: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    """The first of ``keys`` present in ``config`` as a positive int."""
    for key in keys:
        if key in config and config[key] is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise ConfigError(f"config field {key!r} must be an integer, got {value!r}")
            if int(value) <= 0:
                raise ConfigError(f"config field {key!r} must be > 0, got {value!r}")
            return int(value)
    if default is not None:
        return default
    raise ConfigError(f"config lacks {' / '.join(repr(k) for k in keys)}")


def _group_layers(layers: list[tuple[int, tuple[StateTensorSpec, ...]]]) -> tuple[LayerGroup, ...]:
    """Group layers with identical tensor specs, in order of first appearance."""
    order: list[tuple[StateTensorSpec, ...]] = []
    members: dict[tuple[StateTensorSpec, ...], list[int]] = {}
    for layer_id, tensors in layers:
        if tensors not in members:
            order.append(tensors)
            members[tensors] = []
        members[tensors].append(layer_id)
    return tuple(LayerGroup(tuple(members[t]), t) for t in order)


def _lfm2(config: Mapping[str, Any], conv_dtype: str, ssm_dtype: str) -> StateSpec:
    hidden = _int(config, "hidden_size")
    channels = _int(config, "conv_dim", default=hidden)
    kernel = _int(config, "conv_L_cache", default=3)
    if kernel < 2:
        raise ConfigError(f"conv_L_cache must be >= 2 to carry state, got {kernel}")
    layer_types = config.get("layer_types")
    if layer_types is None:
        # As transformers' Lfm2Config: without layer_types, full_attn_idxs (default: every
        # layer) names the attention layers.
        num_layers = _int(config, "num_hidden_layers")
        idxs = config.get("full_attn_idxs")
        attn = set(range(num_layers) if idxs is None else idxs)
        layer_types = ["full_attention" if i in attn else "conv" for i in range(num_layers)]
    layer_types = [str(t) for t in layer_types]
    unknown = sorted({t for t in layer_types} - {"conv", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"lfm2: unknown layer type(s) {unknown} in layer_types")
    conv = StateTensorSpec(
        name="conv", channel_axis="D",
        segments=(Segment("Bx", channels, Sharding.SPLIT),),
        inner_axes=("S",), inner_shape=(kernel - 1,), dtype=conv_dtype)
    layers = [(i, (conv,)) for i, t in enumerate(layer_types) if t == "conv"]
    if not layers:
        raise UnsupportedModelError("lfm2: config has no conv layers (layer_types are all attention)")
    return StateSpec("lfm2", _group_layers(layers), tuple(layer_types), kernel)


def _mamba2(config: Mapping[str, Any], conv_dtype: str, ssm_dtype: str) -> StateSpec:
    hidden = _int(config, "hidden_size", "d_model")
    expand = config.get("expand", 2)
    intermediate = int(expand * hidden)
    if intermediate != expand * hidden:
        raise ConfigError(f"mamba2: expand * hidden_size = {expand} * {hidden} is not an integer")
    head_dim = _int(config, "head_dim", "headdim", default=64)
    d_state = _int(config, "state_size", "d_state", default=128)
    n_groups = _int(config, "n_groups", "ngroups", default=8)      # transformers' default
    kernel = _int(config, "conv_kernel", "d_conv", default=4)
    num_layers = _int(config, "num_hidden_layers", "n_layer")
    if intermediate % head_dim:
        raise ConfigError(f"mamba2: intermediate size {intermediate} is not a multiple of "
                          f"head_dim {head_dim}")
    heads = intermediate // head_dim
    if "num_heads" in config and config["num_heads"] is not None and config["num_heads"] != heads:
        raise ConfigError(f"mamba2: num_heads {config['num_heads']!r} != expand * hidden_size / "
                          f"head_dim = {heads}")
    if heads % n_groups:
        raise ConfigError(f"mamba2: num_heads {heads} is not a multiple of n_groups {n_groups}")
    if kernel < 2:
        raise ConfigError(f"mamba2: conv_kernel must be >= 2 to carry state, got {kernel}")
    bc = n_groups * d_state
    conv = StateTensorSpec(
        name="conv", channel_axis="D",
        segments=(Segment("x", intermediate, Sharding.SPLIT),
                  Segment("B", bc, Sharding.GROUPED, n_groups),
                  Segment("C", bc, Sharding.GROUPED, n_groups)),
        inner_axes=("S",), inner_shape=(kernel - 1,), dtype=conv_dtype)
    ssm = StateTensorSpec(
        name="ssm", channel_axis="H",
        segments=(Segment("heads", heads, Sharding.SPLIT),),
        inner_axes=("P", "N"), inner_shape=(head_dim, d_state), dtype=ssm_dtype)
    layers = [(i, (conv, ssm)) for i in range(num_layers)]
    return StateSpec("mamba2", _group_layers(layers), ("mamba2",) * num_layers, kernel)


_BUILDERS = {"lfm2": _lfm2, "mamba2": _mamba2}
