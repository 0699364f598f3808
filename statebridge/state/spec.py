"""The recurrent state of a model, declared once as data.

A :class:`StateSpec` is built from a Hugging Face ``config.json`` (LFM2, Mamba2 or
GraniteMoeHybrid) as read by :class:`~statebridge.hf_config.ModelConfig`, the one reader the
model runtime uses too. It says, for every layer that carries recurrent state, which state
tensors it owns, how their channel axis is made of segments, and how each segment is sharded
across tensor-parallel ranks::

    ShortConv (LFM2) conv state, one layer, global:
        channel axis D = [ Bx (hidden, split) ]             inner axes: S = L_cache - 1

    Mamba2 conv state (Mamba2, and Granite-4.0-H mamba layers), one layer, global:
        channel axis D = [ x (I, split) | B (G*N, grouped) | C (G*N, grouped) ]   inner: S = K - 1
    Mamba2 SSM state, one layer, global:
        channel axis H = [ heads (H, split) ]               inner axes: P, N

A *grouped* segment is split on group boundaries when ``G % tp == 0`` and replicated (every rank
holds the one group) when ``G == 1``; anything else is a :class:`~statebridge.errors.ConfigError`.
Layers whose state tensors have identical shapes and dtypes form one :class:`LayerGroup`; a page
stores each tensor of a group as one region (see :mod:`statebridge.state.layout`).

Attention layers carry KV instead (:class:`KVSpec`): per token and layer, K and V of
``num_kv_heads x head_dim``, growing with the request's tokens, kept in a per-rank block pool
beside the pages (:mod:`statebridge.state.kv`). KV heads are split across TP when
``num_kv_heads % tp == 0`` and replicated (consecutive ranks share a head) when ``tp`` is a
multiple of ``num_kv_heads``.

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

from statebridge.dtypes import DTYPES, dtype_from_name
from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.hf_config import (
    GraniteHybridModelConfig,
    Lfm2ModelConfig,
    Mamba2Geometry,
    Mamba2ModelConfig,
    ModelConfig,
)

__all__ = [
    "Sharding",
    "Segment",
    "StateTensorSpec",
    "LayerGroup",
    "KVSpec",
    "StateSpec",
]


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


class _OfDtype:
    """A spec whose elements are of the dtype named by its ``dtype`` field."""

    __slots__ = ()
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize


@dataclass(frozen=True, slots=True)
class StateTensorSpec(_OfDtype):
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
class KVSpec(_OfDtype):
    """The attention KV of a model: for every layer of ``layer_ids`` and every token, K and V of
    ``num_kv_heads x head_dim`` elements of ``dtype`` (global sizes)."""

    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ConfigError("KV spec without attention layers")
        if len(set(self.layer_ids)) != len(self.layer_ids) or min(self.layer_ids) < 0:
            raise ConfigError(f"KV spec: layer ids {list(self.layer_ids)} must be distinct and "
                              f">= 0")
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KV spec: {name} must be a positive integer, got {value!r}")
        dtype_from_name(self.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def bytes_per_token(self) -> int:
        """Global (TP=1) K and V bytes of one token over every attention layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"layer_ids": list(self.layer_ids), "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVSpec":
        return cls(tuple(int(i) for i in data["layer_ids"]), int(data["num_kv_heads"]),
                   int(data["head_dim"]), data["dtype"])


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Every recurrent state tensor of a model, grouped by identical layer shapes.

    ``layer_types`` lists every decoder layer's type (``"conv"``, ``"mamba2"``,
    ``"full_attention"``); only recurrent-state layers appear in ``groups``, attention layers
    in ``kv`` (None for a model without attention).
    """

    model_type: str
    groups: tuple[LayerGroup, ...]
    layer_types: tuple[str, ...] = field(default=())
    conv_kernel: int = 0
    kv: KVSpec | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise UnsupportedModelError(f"{self.model_type}: model has no recurrent-state layers")

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig | Mapping[str, Any], *,
                    dtype: str | torch.dtype | None = None,
                    ssm_dtype: str | torch.dtype | None = None,
                    kv_dtype: str | torch.dtype | None = None) -> "StateSpec":
        """Build the spec from a :class:`~statebridge.hf_config.ModelConfig` or a Hugging Face
        ``config.json`` dict (read by :meth:`ModelConfig.from_dict
        <statebridge.hf_config.ModelConfig.from_dict>`, the one reader).

        ``dtype`` overrides the model dtype for every state tensor (default: the config's
        ``dtype``, else ``torch_dtype``, else float32). ``ssm_dtype`` sets the SSM state dtype
        alone (e.g. ``"float32"`` for an fp32 SSM state beside a bf16 conv state); ``kv_dtype``
        the attention KV's (default: the model dtype, or ``dtype``).
        """
        model = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
        conv_dtype = dtype_from_name(dtype) if dtype is not None else model.dtype
        ssm = dtype_from_name(ssm_dtype) if ssm_dtype is not None else conv_dtype
        kv = dtype_from_name(kv_dtype) if kv_dtype is not None else conv_dtype
        if isinstance(model, Lfm2ModelConfig):
            return _lfm2(model, conv_dtype, kv)
        if isinstance(model, Mamba2ModelConfig):
            return _mamba2(model, conv_dtype, ssm)
        if isinstance(model, GraniteHybridModelConfig):
            return _granite(model, conv_dtype, ssm, kv)
        raise UnsupportedModelError(f"no state spec for model_type {model.model_type!r}")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> "StateSpec":
        """Build the spec from a checkpoint directory or a ``config.json`` path."""
        return cls.from_config(ModelConfig.load(path), **kwargs)

    # -- derived ----------------------------------------------------------------------------
    @property
    def num_state_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    def bytes_per_request(self) -> int:
        """Global (TP=1, unpadded) recurrent-state bytes of one request (KV comes on top:
        :meth:`kv_bytes`)."""
        return sum(g.num_layers * t.channels * t.inner_numel * t.itemsize
                   for g in self.groups for t in g.tensors)

    def kv_bytes(self, tokens: int) -> int:
        """Global (TP=1) KV bytes of ``tokens`` tokens (0 without attention layers)."""
        return 0 if self.kv is None else tokens * self.kv.bytes_per_token()

    def to_dict(self) -> dict[str, Any]:
        """Plain-data description (stable; used for the compatibility hash and ``--json``)."""
        out = {
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
        if self.kv is not None:                   # absent without attention: old hashes hold
            out["kv"] = self.kv.to_dict()
        return out

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
            kv = KVSpec.from_dict(data["kv"]) if data.get("kv") is not None else None
            return cls(data["model_type"], groups, tuple(data["layer_types"]),
                       int(data["conv_kernel"]), kv)
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


# -- builders ----------------------------------------------------------------------------------

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


def _lfm2(config: Lfm2ModelConfig, conv_dtype: str, kv_dtype: str) -> StateSpec:
    kernel = config.conv_L_cache
    if kernel < 2:
        raise ConfigError(f"lfm2: conv_L_cache must be >= 2 to carry state, got {kernel}")
    conv = StateTensorSpec(
        name="conv", channel_axis="D",
        segments=(Segment("Bx", config.hidden_size, Sharding.SPLIT),),
        inner_axes=("S",), inner_shape=(kernel - 1,), dtype=conv_dtype)
    layers = [(i, (conv,)) for i in config.conv_layers]
    if not layers:
        raise UnsupportedModelError("lfm2: config has no conv layers (layer_types are all attention)")
    attention = config.attention_layers
    kv = KVSpec(attention, config.num_key_value_heads, config.head_dim, kv_dtype) \
        if attention else None
    return StateSpec("lfm2", _group_layers(layers), config.layer_types, kernel, kv)


def _mamba2_tensors(mixer: Mamba2Geometry, *, what: str, conv_dtype: str,
                    ssm_dtype: str) -> tuple[StateTensorSpec, StateTensorSpec]:
    """The conv and SSM state tensors of one Mamba2 mixer (Mamba2, GraniteMoeHybrid); ``what``
    names the kernel-width field in errors."""
    kernel, groups = mixer.conv_kernel, mixer.n_groups
    if kernel < 2:
        raise ConfigError(f"{what} must be >= 2 to carry state, got {kernel}")
    bc = groups * mixer.state_size
    conv = StateTensorSpec(
        name="conv", channel_axis="D",
        segments=(Segment("x", mixer.intermediate_size, Sharding.SPLIT),
                  Segment("B", bc, Sharding.GROUPED, groups),
                  Segment("C", bc, Sharding.GROUPED, groups)),
        inner_axes=("S",), inner_shape=(kernel - 1,), dtype=conv_dtype)
    ssm = StateTensorSpec(
        name="ssm", channel_axis="H",
        segments=(Segment("heads", mixer.num_heads, Sharding.SPLIT),),
        inner_axes=("P", "N"), inner_shape=(mixer.head_dim, mixer.state_size), dtype=ssm_dtype)
    return conv, ssm


def _mamba2(config: Mamba2ModelConfig, conv_dtype: str, ssm_dtype: str) -> StateSpec:
    tensors = _mamba2_tensors(config.mamba, what="mamba2: conv_kernel", conv_dtype=conv_dtype,
                              ssm_dtype=ssm_dtype)
    layers = [(i, tensors) for i in range(config.num_layers)]
    return StateSpec("mamba2", _group_layers(layers), config.layer_types, config.conv_kernel)


def _granite(config: GraniteHybridModelConfig, conv_dtype: str, ssm_dtype: str,
             kv_dtype: str) -> StateSpec:
    tensors = _mamba2_tensors(config.mamba, what="granitemoehybrid: mamba_d_conv",
                              conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)
    layers = [(i, tensors) for i in config.mamba_layers]
    if not layers:
        raise UnsupportedModelError("granitemoehybrid: config has no mamba layers (layer_types "
                                    "are all attention, e.g. Granite-4.0-Micro): no recurrent "
                                    "state to describe")
    attention = config.attention_layers
    kv = KVSpec(attention, config.num_key_value_heads, config.head_dim, kv_dtype) \
        if attention else None
    return StateSpec("granitemoehybrid", _group_layers(layers), config.layer_types,
                     config.mamba_d_conv, kv)
