"""Per-layer paged memory (the way vLLM holds Mamba state and attention KV) and its transfer plan.

vLLM gives every layer its own tensor over a shared buffer: block ``b`` of layer ``l`` is the
``block_stride`` bytes at ``base[l] + b * block_stride``. A request owns one block per recurrent
layer (the state slot of the layer's cache group) and a block table per attention layer::

    recurrent layer, one block (conv at byte 0, SSM right after it, padding to the stride):
        | conv  [S, D] ("SD", vLLM's default) or [D, S] ("DS")  | ssm [H, P, N] | pad |
    attention layer, one block (vLLM's CPU layout, heads outermost):
        | head 0: K [T, E], V [T, E] | head 1: ... | pad |

(letters as in :mod:`statebridge.state.layout`; ``T`` tokens in a block, ``E`` head_dim).

A :class:`PagedGeometry` says where each layer lives in one rank's buffer; it reuses the page
and block geometry of the rest of statebridge: a recurrent block is a :class:`PageGeometry` of a
one-layer spec in ``LSD`` / ``LDS`` order (SSM ``LHPN``), unaligned, padded to the stride; an
attention block is a :class:`BlockGeometry` of one layer in ``BHLCTE`` order, padded. A
:class:`PagedPlan` is built once per (source group, destination group) from the ordinary
:class:`TransferPlan` and :class:`KVPlan` of those one-layer geometries; per request only the
layers' bases and block ids are added (:meth:`PagedPlan.runs`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from statebridge.errors import ConfigError, LayoutError
from statebridge.state.kv import BlockGeometry, KVPlan
from statebridge.state.layout import Layout, PageGeometry
from statebridge.state.plan import TransferPlan, coalesce
from statebridge.state.spec import LayerGroup, StateSpec

__all__ = ["CONV_LAYOUTS", "LayerSlot", "PagedGeometry", "PagedPlan"]

#: vLLM's conv-state layout names -> statebridge's page layout of one layer.
CONV_LAYOUTS: dict[str, Layout] = {"SD": Layout("LSD", "LHPN"), "DS": Layout("LDS", "LHPN")}
#: The attention block order: heads outermost inside a block (vLLM's CPU attention cache).
KV_BLOCK_ORDER = "BHLCTE"
_EMPTY = np.zeros((0, 3), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class LayerSlot:
    """Where one layer's blocks live in a rank's buffer: block ``b`` at ``base + b *
    block_stride`` (bytes), ``num_blocks`` of them."""

    base: int
    block_stride: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("base", "block_stride", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 \
                    or (name != "base" and value == 0):
                raise ConfigError(f"layer slot {name} must be a non-negative integer (positive "
                                  f"for strides and counts), got {value!r}")

    def offset(self, block: int) -> int:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) \
                or not 0 <= block < self.num_blocks:
            raise ConfigError(f"block id {block!r} outside the layer's {self.num_blocks} blocks")
        return self.base + int(block) * self.block_stride


def _one_layer(group: LayerGroup) -> StateSpec:
    return StateSpec("layer", (LayerGroup((0,), group.tensors),))


class PagedGeometry:
    """One TP group's per-layer paged memory: the spec, the TP size, the conv layout (``"SD"`` or
    ``"DS"``), the attention block size, and every layer's :class:`LayerSlot` on one rank (all
    ranks of a group have the same geometry, at their own bases).

    ``slots`` maps each decoder layer index the spec names (recurrent layers and attention
    layers) to its slot.
    """

    def __init__(self, spec: StateSpec, tp_size: int, conv_layout: str, block_size: int | None,
                 slots: Mapping[int, LayerSlot]) -> None:
        if conv_layout not in CONV_LAYOUTS:
            raise LayoutError(f"conv state layout {conv_layout!r} is not one of "
                              f"{sorted(CONV_LAYOUTS)}")
        self.spec, self.tp_size, self.conv_layout = spec, tp_size, conv_layout
        self.block_size = block_size
        self.slots = dict(slots)
        need = [i for g in spec.groups for i in g.layer_ids]
        need += list(spec.kv.layer_ids) if spec.kv is not None else []
        missing = sorted(set(need) - set(self.slots))
        if missing:
            raise ConfigError(f"no memory for layers {missing}; have {sorted(self.slots)}")
        #: per spec group: the one-layer page of its recurrent layers (padded to the stride)
        self.pages: list[PageGeometry] = []
        for group in spec.groups:
            strides = {self.slots[i].block_stride for i in group.layer_ids}
            if len(strides) != 1:
                raise ConfigError(f"layers {list(group.layer_ids)} of one shape have different "
                                  f"block strides {sorted(strides)}")
            self.pages.append(PageGeometry(_one_layer(group), tp_size, CONV_LAYOUTS[conv_layout],
                                           region_align=1, page_align=1,
                                           page_size=strides.pop()))
        self.kv_block: BlockGeometry | None = None
        if spec.kv is not None:
            if not isinstance(block_size, int) or block_size < 1:
                raise ConfigError(f"attention block size must be a positive integer, got "
                                  f"{block_size!r}")
            strides = {self.slots[i].block_stride for i in spec.kv.layer_ids}
            if len(strides) != 1:
                raise ConfigError(f"attention layers {list(spec.kv.layer_ids)} have different "
                                  f"block strides {sorted(strides)}")
            one = replace(spec.kv, layer_ids=(0,))
            self.kv_block = BlockGeometry(one, tp_size, KV_BLOCK_ORDER, block_size, 1,
                                          block_bytes=strides.pop())

    def state_offsets(self, group: int) -> dict[str, tuple[int, int]]:
        """``tensor name -> (byte offset, bytes)`` inside one block of spec group ``group``."""
        return {r.tensor.name: (r.offset, r.nbytes) for r in self.pages[group].regions}

    def describe(self) -> dict:
        """Plain data for a handshake: what a peer needs to rebuild this geometry."""
        return {"tp_size": self.tp_size, "conv_layout": self.conv_layout,
                "block_size": self.block_size,
                "slots": {str(i): [s.base, s.block_stride, s.num_blocks]
                          for i, s in sorted(self.slots.items())}}

    @classmethod
    def from_description(cls, spec: StateSpec, data: Mapping) -> "PagedGeometry":
        try:
            slots = {int(i): LayerSlot(int(a), int(b), int(c))
                     for i, (a, b, c) in dict(data["slots"]).items()}
            block = data["block_size"]
            return cls(spec, int(data["tp_size"]), str(data["conv_layout"]),
                       None if block is None else int(block), slots)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed paged geometry description: {type(e).__name__}: "
                              f"{e}") from None


class PagedPlan:
    """The runs one source rank sends one destination rank, per request, between two paged
    geometries of the same spec (built once; :meth:`runs` adds a request's blocks)."""

    def __init__(self, src: PagedGeometry, dst: PagedGeometry) -> None:
        if src.spec.to_dict() != dst.spec.to_dict():
            raise ConfigError(f"source and destination state specs differ: "
                              f"{src.spec.fingerprint()} != {dst.spec.fingerprint()}")
        if src.conv_layout != dst.conv_layout:
            raise LayoutError(f"conv state layouts differ: source {src.conv_layout}, destination "
                              f"{dst.conv_layout} (set VLLM_SSM_CONV_STATE_LAYOUT alike on both)")
        if src.spec.kv is not None and src.block_size != dst.block_size:
            raise ConfigError(f"attention block sizes differ: source {src.block_size}, "
                              f"destination {dst.block_size} tokens")
        self.src, self.dst, self.spec = src, dst, src.spec
        self.state = [TransferPlan(a, b) for a, b in zip(src.pages, dst.pages)]
        self.kv = KVPlan(src.kv_block, dst.kv_block) if src.spec.kv is not None else None
        pairs = {key for p in self.state for key in p.pairs}
        if self.kv is not None:
            pairs |= set(self.kv.pairs)
        self.pairs: tuple[tuple[int, int], ...] = tuple(sorted(pairs))

    def sources_of(self, dst_rank: int) -> list[int]:
        """Source ranks that send anything to ``dst_rank``."""
        return [s for s, d in self.pairs if d == dst_rank]

    def runs(self, src_rank: int, dst_rank: int, src_state: Mapping[int, int],
             dst_state: Mapping[int, int], src_kv: Mapping[int, Sequence[int]] | None = None,
             dst_kv: Mapping[int, Sequence[int]] | None = None) -> np.ndarray:
        """Absolute runs ``[R, 3]`` (src offset, dst offset, length) of one request.

        ``src_state`` / ``dst_state``: recurrent layer -> its block id on each side;
        ``src_kv`` / ``dst_kv``: attention layer -> block table (the same length on both
        sides: the blocks of the tokens that move).
        """
        out = []
        for gi, group in enumerate(self.spec.groups):
            pair = self.state[gi].pair(src_rank, dst_rank)
            if pair is None:
                continue
            for layer in group.layer_ids:
                base = (self.src.slots[layer].offset(_get(src_state, layer, "source")),
                        self.dst.slots[layer].offset(_get(dst_state, layer, "destination")), 0)
                out.append(pair.runs + np.array(base, dtype=np.int64))
        if self.kv is not None:
            pair = self.kv.pair(src_rank, dst_rank)
            if pair is not None:
                for layer in self.spec.kv.layer_ids:
                    src_blocks = _get(src_kv or {}, layer, "source")
                    dst_blocks = _get(dst_kv or {}, layer, "destination")
                    if len(src_blocks) != len(dst_blocks):
                        raise ConfigError(f"attention layer {layer}: {len(src_blocks)} source "
                                          f"blocks, {len(dst_blocks)} destination blocks")
                    if not len(src_blocks):
                        continue
                    src_slot, dst_slot = self.src.slots[layer], self.dst.slots[layer]
                    for slot, blocks in ((src_slot, src_blocks), (dst_slot, dst_blocks)):
                        slot.offset(max(blocks))
                        slot.offset(min(blocks))
                    runs = pair.runs(src_blocks, dst_blocks)
                    out.append(runs + np.array([src_slot.base, dst_slot.base, 0],
                                               dtype=np.int64))
        if not out:
            return _EMPTY
        runs = np.concatenate(out)
        return coalesce(runs[np.argsort(runs[:, 1], kind="stable")])


def _get(table: Mapping, layer: int, side: str):
    try:
        return table[layer]
    except KeyError:
        raise ConfigError(f"no {side} block for layer {layer}; have {sorted(table)}") from None
