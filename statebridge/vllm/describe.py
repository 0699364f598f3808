"""What vLLM hands a connector, turned into statebridge's spec and per-layer geometry.

Inputs (vLLM 0.32): the ``KVCacheConfig`` groups (``MambaSpec`` shapes, dtypes and
``mamba_type``; ``FullAttentionSpec`` heads and block size), the tensors ``register_kv_caches``
receives (one per layer, views of shared buffers: a recurrent layer's raw int8 pages, an
attention layer's ``[blocks, heads, block_size, 2 * head_dim]``), the conv layout vLLM uses
(``SD`` unless ``VLLM_SSM_CONV_STATE_LAYOUT=DS``) and the checkpoint's ``config.json``.

Everything is checked against what statebridge derives from the checkpoint for this TP size:
a layer kind or split statebridge does not move, a shape or dtype that differs, a state that
does not start its page, is a :class:`~statebridge.errors.ConfigError` at start, naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from statebridge.errors import ConfigError, UnsupportedModelError
from statebridge.state.paged import LayerSlot, PagedGeometry
from statebridge.state.sharding import kv_heads, local_channels
from statebridge.state.spec import StateSpec

__all__ = ["describe", "layer_index", "Layers", "MAMBA_TYPES"]

#: vLLM mamba_type (its enum's name) -> the model types whose state statebridge moves for it.
MAMBA_TYPES = {"SHORT_CONV": ("lfm2",), "MAMBA2": ("mamba2", "granitemoehybrid")}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Layers:
    """A rank's memory as the agent needs it: the geometry, which layers each of vLLM's
    transfer groups holds (recurrent groups: one state block per request; attention groups: a
    block table), and the buffer's ``(start, uint8 tensor)`` segments."""

    spec: StateSpec
    geometry: PagedGeometry
    groups: tuple[tuple[int, ...], ...]
    state_group: tuple[bool, ...]
    segments: tuple[tuple[int, torch.Tensor], ...]

    def describe(self) -> str:
        return json.dumps({"geometry": self.geometry.describe(),
                           "groups": [list(g) for g in self.groups],
                           "state_group": list(self.state_group)}, sort_keys=True)

    @staticmethod
    def parse(spec: StateSpec, text: str) -> tuple[PagedGeometry, list, list]:
        try:
            data = json.loads(text)
            return (PagedGeometry.from_description(spec, data["geometry"]),
                    [tuple(int(i) for i in g) for g in data["groups"]],
                    [bool(x) for x in data["state_group"]])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"malformed peer geometry: {type(e).__name__}: {e}") from None

    def tables(self, groups: Sequence[tuple[int, ...]], state_group: Sequence[bool],
               block_ids: Sequence[Sequence[int]], kv_blocks: int, first: int = 0):
        """Per-layer tables from per-group block ids (already clipped: a recurrent group's
        list is its one state block): ``({layer: block}, {layer: blocks[first:kv_blocks]})``."""
        if len(block_ids) != len(groups):
            raise ConfigError(f"{len(block_ids)} block lists for {len(groups)} cache groups")
        state, kv = {}, {}
        for layers, is_state, blocks in zip(groups, state_group, block_ids):
            for layer in layers:
                if is_state:
                    if len(blocks) != 1:
                        raise ConfigError(f"layer {layer}: {len(blocks)} state blocks, "
                                          f"expected 1")
                    state[layer] = int(blocks[0])
                else:
                    if len(blocks) < kv_blocks:
                        raise ConfigError(f"layer {layer}: {len(blocks)} KV blocks, "
                                          f"{kv_blocks} needed")
                    kv[layer] = [int(b) for b in blocks[first:kv_blocks]]
        return state, kv


def layer_index(name: str) -> int:
    """The decoder layer index in a vLLM layer name (``model.layers.3.mixer`` -> 3)."""
    m = _LAYER.search(name)
    if m is None:
        raise ConfigError(f"cannot tell the decoder layer of vLLM layer {name!r}")
    return int(m.group(1))


def _type_name(mamba_type: Any) -> str:
    return getattr(mamba_type, "name", str(mamba_type)).upper()


def describe(model_dir: str, groups: list[tuple[str, Any]], kv_caches: Mapping[str, Any],
             tp_size: int, conv_layout: str) -> Layers:
    """:class:`~statebridge.vllm.agent.Layers` of one worker rank.

    ``groups``: vLLM's transfer groups as ``(kind, spec)`` pairs with ``kind`` ``"mamba"`` or
    ``"attention"`` and the group's ``layer_names`` on ``spec.layer_names``; ``kv_caches``: the
    tensors of ``register_kv_caches``.
    """
    mamba = [g for kind, g in groups if kind == "mamba"]
    attention = [g for kind, g in groups if kind == "attention"]
    dtype = ssm_dtype = kv_dtype = None
    if mamba:
        dtypes = mamba[0].kv_cache_spec.dtypes
        dtype = dtypes[0]
        ssm_dtype = dtypes[1] if len(dtypes) > 1 else None
    if attention:
        kv_dtype = attention[0].kv_cache_spec.dtype
    spec = StateSpec.from_pretrained(model_dir, dtype=dtype, ssm_dtype=ssm_dtype,
                                     kv_dtype=kv_dtype)
    for g in mamba:
        name = _type_name(g.kv_cache_spec.mamba_type)
        if spec.model_type not in MAMBA_TYPES.get(name, ()):
            raise UnsupportedModelError(
                f"statebridge connector: vLLM layers {list(g.layer_names)} are of mamba_type "
                f"{name}, which statebridge does not move for model_type {spec.model_type!r} "
                f"(it moves {', '.join(f'{k} ({v[0]})' for k, v in MAMBA_TYPES.items())})")
        if g.kv_cache_spec.num_speculative_blocks:
            raise ConfigError(f"statebridge connector: speculative decoding "
                              f"(num_speculative_blocks="
                              f"{g.kv_cache_spec.num_speculative_blocks}) is not supported")
    state_layers = {i for g in spec.groups for i in g.layer_ids}
    kv_layers = set(spec.kv.layer_ids) if spec.kv is not None else set()

    slots: dict[int, LayerSlot] = {}
    storages: dict[int, torch.Tensor] = {}
    tensors = {}
    for name, t in kv_caches.items():
        if isinstance(t, (list, tuple)):
            raise ConfigError(f"statebridge connector: layer {name!r} registered "
                              f"{len(t)} tensors; expected one raw cache tensor per layer")
        if t.device.type != "cpu":
            raise ConfigError(f"statebridge connector: layer {name!r} lives on {t.device}; "
                              f"this build moves host (CPU) memory only")
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage
        tensors[layer_index(name)] = (name, t)
    base = min(storages)
    segments = []
    for ptr in sorted(storages):
        storage = storages[ptr]
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        segments.append((ptr - base, whole))

    block_size = None
    for g in groups:
        kind, group = g
        for name in group.layer_names:
            layer = layer_index(name)
            expect = state_layers if kind == "mamba" else kv_layers
            if layer not in expect:
                raise UnsupportedModelError(
                    f"statebridge connector: vLLM layer {name!r} is {kind} but the checkpoint's "
                    f"layer {layer} is {spec.layer_types[layer] if layer < len(spec.layer_types) else 'missing'}")
            if layer not in tensors:
                raise ConfigError(f"statebridge connector: no registered tensor for {name!r}")
            _, t = tensors[layer]
            stride = t.stride(0) * t.element_size()
            slots[layer] = LayerSlot(t.data_ptr() - base, stride, t.shape[0])
        if kind == "attention":
            block_size = group.kv_cache_spec.block_size
    missing = sorted((state_layers | kv_layers) - set(slots))
    if missing:
        raise UnsupportedModelError(f"statebridge connector: vLLM transfers no cache for the "
                                    f"checkpoint's layers {missing}")
    geometry = PagedGeometry(spec, tp_size, conv_layout, block_size, slots)
    _check_shapes(spec, geometry, groups, tensors, tp_size, conv_layout)
    layer_groups = tuple(tuple(layer_index(n) for n in g.layer_names) for _, g in groups)
    return Layers(spec, geometry, layer_groups, tuple(kind == "mamba" for kind, _ in groups),
                  tuple(segments))


def _check_shapes(spec: StateSpec, geometry: PagedGeometry, groups, tensors, tp_size: int,
                  conv_layout: str) -> None:
    """vLLM's per-rank shapes must be the ones statebridge derives (else the plan would read the
    wrong bytes): the conv state at byte 0, the SSM right after it, heads as split."""
    for kind, group in groups:
        spec_v = group.kv_cache_spec
        if kind == "mamba":
            gi = next(i for i, g in enumerate(spec.groups)
                      if layer_index(group.layer_names[0]) in g.layer_ids)
            want = []
            for t in spec.groups[gi].tensors:
                shape = (local_channels(t, tp_size), *t.inner_shape)
                if t.name == "conv" and conv_layout == "SD":
                    shape = shape[::-1]
                want.append(shape)
            got = [tuple(s) for s in spec_v.shapes]
            if got != want:
                raise ConfigError(f"statebridge connector: vLLM's state shapes {got} for layers "
                                  f"{list(group.layer_names)} at TP {tp_size} ({conv_layout}) "
                                  f"differ from the checkpoint's {want}")
            offsets = geometry.state_offsets(gi)
            pos = 0
            for t in spec.groups[gi].tensors:
                if offsets[t.name][0] != pos:
                    raise ConfigError(f"statebridge connector: {t.name} state at byte "
                                      f"{offsets[t.name][0]} of the page, vLLM puts it at {pos}")
                pos += offsets[t.name][1]
        else:
            _, heads = kv_heads(spec.kv, tp_size, 0)
            if getattr(spec_v, "sliding_window", None):
                raise UnsupportedModelError("statebridge connector: sliding-window attention "
                                            "is not supported")
            for name in group.layer_names:
                _, t = tensors[layer_index(name)]
                want = (heads, spec_v.block_size, 2 * spec.kv.head_dim)
                if tuple(t.shape[1:]) != want or not t[0].is_contiguous() \
                        or t.dtype != spec.kv.torch_dtype:
                    raise ConfigError(
                        f"statebridge connector: attention cache of {name!r} is "
                        f"{tuple(t.shape)} {t.dtype} with strides {t.stride()}; expected "
                        f"[blocks, {want[0]}, {want[1]}, {want[2]}] {spec.kv.torch_dtype}, "
                        f"contiguous per block (vLLM's CPU layout)")
                if spec_v.num_kv_heads != heads or spec_v.head_size != spec.kv.head_dim:
                    raise ConfigError(f"statebridge connector: vLLM holds {spec_v.num_kv_heads} "
                                      f"KV heads of {spec_v.head_size} per rank, the checkpoint "
                                      f"{heads} of {spec.kv.head_dim} at TP {tp_size}")
