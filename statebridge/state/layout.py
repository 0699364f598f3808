"""Where a rank's state bytes live inside a page: explicit axis orders, offsets, strides, views.

Letters (one table for the whole package):

    B  requests / pages        L  layers of a group       D  conv channels (local)
    K  conv width              S  conv state length K-1   H  SSM heads (local)
    P  SSM head dim            N  SSM d_state             G  B/C groups

A page holds every layer's state of one request on one rank. Each state tensor of a layer group
(see :mod:`statebridge.state.spec`) is one *region* of the page, whose axis order is data:

    conv region orders            SSM region orders
    LSD  layer, state, channel    LHPN  layer, head, head_dim, d_state
    LDS  layer, channel, state    HLPN  head, layer, head_dim, d_state
    DLS  channel, layer, state

A :class:`Layout` names one order per tensor kind. The command-line names are presets::

    "LSD" = conv LSD + SSM LHPN     (vLLM "SD")
    "LDS" = conv LDS + SSM LHPN     (vLLM "DS", dim-first per layer)
    "DLS" = conv DLS + SSM HLPN     (dim-first across layers: a channel range is ONE piece)

An explicit pair is written ``"LDS+HLPN"``. A page (one :class:`PageGeometry`) for a group list
``g0, g1, ...`` is::

    offset 0                                                   page_size
    | g0.conv | pad | g0.ssm | pad | g1.conv | pad | ... | pad |

Regions start at multiples of ``region_align`` bytes and the page size is a multiple of
``page_align``; the padding is never data. Kernels get strided torch views
(:meth:`PageGeometry.view`) in the canonical order ``[B, L, channel, *inner]`` or, per layer,
``[B, channel, *inner]`` -- whatever the physical order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from statebridge.errors import ConfigError, LayoutError, ShapeError
from statebridge.state.sharding import local_channels
from statebridge.state.spec import StateSpec, StateTensorSpec

__all__ = ["Layout", "RegionLayout", "PageGeometry", "LAYOUT_PRESETS", "DEFAULT_REGION_ALIGN",
           "DEFAULT_PAGE_ALIGN"]

#: Command-line layout names -> (conv order, SSM order).
LAYOUT_PRESETS: dict[str, tuple[str, str]] = {
    "LSD": ("LSD", "LHPN"),
    "LDS": ("LDS", "LHPN"),
    "DLS": ("DLS", "HLPN"),
}
DEFAULT_REGION_ALIGN = 16
DEFAULT_PAGE_ALIGN = 64


@dataclass(frozen=True, slots=True)
class Layout:
    """The axis order of every region kind in a page: ``conv`` (letters of L, D, S) and ``ssm``
    (letters of L, H, P, N)."""

    conv: str = "DLS"
    ssm: str = "HLPN"

    def __post_init__(self) -> None:
        for kind, order, letters in (("conv", self.conv, "LDS"), ("ssm", self.ssm, "LHPN")):
            if not isinstance(order, str) or sorted(order) != sorted(letters):
                raise LayoutError(f"{kind} axis order {order!r} is not a permutation of "
                                  f"{letters!r}")

    @classmethod
    def parse(cls, name: "str | Layout") -> "Layout":
        """``"DLS"`` (a preset) or ``"LDS+HLPN"`` (explicit conv+ssm orders)."""
        if isinstance(name, Layout):
            return name
        if not isinstance(name, str):
            raise LayoutError(f"layout must be a string, got {name!r}")
        key = name.strip().upper()
        if key in LAYOUT_PRESETS:
            return cls(*LAYOUT_PRESETS[key])
        if "+" in key:
            conv, _, ssm = key.partition("+")
            return cls(conv, ssm)
        raise LayoutError(f"unknown layout {name!r}; expected one of {sorted(LAYOUT_PRESETS)} "
                          f"or CONV+SSM orders like 'LDS+HLPN'")

    @property
    def name(self) -> str:
        for preset, orders in LAYOUT_PRESETS.items():
            if orders == (self.conv, self.ssm):
                return preset
        return f"{self.conv}+{self.ssm}"

    def order_for(self, tensor: StateTensorSpec) -> str:
        """Physical axis order (outermost first) of ``tensor``'s region."""
        order = self.conv if tensor.name == "conv" else self.ssm if tensor.name == "ssm" else None
        if order is None or sorted(order) != sorted("L" + tensor.axes):
            raise LayoutError(f"layout {self.name!r} has no order for tensor {tensor.name!r} "
                              f"with axes {'L' + tensor.axes!r}")
        return order

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """One tensor of one layer group inside a page.

    ``dims`` maps every axis letter to its local extent; ``order`` is the physical axis order,
    outermost first; ``strides`` are element strides per letter; ``offset`` is in bytes from the
    page start.
    """

    group: int
    tensor: StateTensorSpec
    order: str
    dims: tuple[tuple[str, int], ...]
    offset: int

    @property
    def canonical(self) -> str:
        """Logical axis order: ``"L"`` + channel + inner (``"LDS"``, ``"LHPN"``)."""
        return "L" + self.tensor.axes

    @property
    def dim(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def strides(self) -> dict[str, int]:
        dim = self.dim
        out, step = {}, 1
        for axis in reversed(self.order):
            out[axis] = step
            step *= dim[axis]
        return out

    @property
    def itemsize(self) -> int:
        return self.tensor.itemsize

    @property
    def numel(self) -> int:
        return math.prod(n for _, n in self.dims)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def canonical_shape_strides(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shape and element strides in canonical order ``(L, channel, *inner)``."""
        dim, strides = self.dim, self.strides
        return (tuple(dim[a] for a in self.canonical), tuple(strides[a] for a in self.canonical))


class PageGeometry:
    """Byte geometry of one page on every rank of a TP group: regions, padding, page size.

    It depends on (spec, tp_size, layout) only -- not on the rank -- since every rank holds the
    same local sizes.
    """

    def __init__(self, spec: StateSpec, tp_size: int, layout: "Layout | str", *,
                 region_align: int = DEFAULT_REGION_ALIGN, page_align: int = DEFAULT_PAGE_ALIGN,
                 page_size: int | None = None) -> None:
        self.spec = spec
        self.tp_size = tp_size
        self.layout = Layout.parse(layout)
        for name, value in (("region_align", region_align), ("page_align", page_align)):
            if value < 1 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two, got {value}")
        max_item = max(t.itemsize for g in spec.groups for t in g.tensors)
        region_align = max(region_align, max_item)
        regions = []
        offset = 0
        for gi, group in enumerate(spec.groups):
            for tensor in group.tensors:
                offset = _round_up(offset, region_align)
                dims = {"L": group.num_layers, tensor.channel_axis: local_channels(tensor, tp_size)}
                dims.update(zip(tensor.inner_axes, tensor.inner_shape))
                order = self.layout.order_for(tensor)
                region = RegionLayout(gi, tensor, order, tuple((a, dims[a]) for a in order), offset)
                regions.append(region)
                offset = region.end
        self.regions: tuple[RegionLayout, ...] = tuple(regions)
        self.used_bytes = offset
        natural = _round_up(offset, max(page_align, region_align))
        if page_size is None:
            page_size = natural
        elif page_size < offset or page_size % region_align:
            raise ConfigError(f"page_size {page_size} must be >= the state bytes {offset} and a "
                              f"multiple of {region_align}")
        self.page_size = page_size

    # -- lookup -----------------------------------------------------------------------------
    def region(self, group: int, tensor: str) -> RegionLayout:
        for r in self.regions:
            if r.group == group and r.tensor.name == tensor:
                return r
        raise ConfigError(f"no region for group {group} tensor {tensor!r}")

    def __iter__(self) -> Iterator[RegionLayout]:
        return iter(self.regions)

    @property
    def data_bytes(self) -> int:
        """Bytes of state (not padding) in one page."""
        return sum(r.nbytes for r in self.regions)

    def padding_intervals(self) -> list[tuple[int, int]]:
        """Byte intervals ``[start, end)`` of a page that hold no state."""
        out, pos = [], 0
        for r in self.regions:
            if r.offset > pos:
                out.append((pos, r.offset))
            pos = r.end
        if self.page_size > pos:
            out.append((pos, self.page_size))
        return out

    def describe(self) -> dict:
        """Plain-data description (travels in the handshake; compared by peers)."""
        return {
            "tp_size": self.tp_size,
            "layout": self.layout.name,
            "page_size": self.page_size,
            "regions": [[r.group, r.tensor.name, r.order, [list(d) for d in r.dims], r.offset]
                        for r in self.regions],
        }

    # -- views ------------------------------------------------------------------------------
    def view(self, buffer: torch.Tensor, group: int, tensor: str,
             layer: int | None = None) -> torch.Tensor:
        """A strided view of one region over every page of ``buffer``.

        ``buffer`` is a 1-D uint8 tensor of ``num_pages * page_size`` bytes. Returns
        ``[B, L, channel, *inner]`` (e.g. conv ``[B, L, D, S]``, SSM ``[B, L, H, P, N]``), or with
        ``layer`` (index within the group) ``[B, channel, *inner]`` -- in canonical order whatever
        the physical order; nothing is copied.
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ShapeError(f"page buffer must be 1-D uint8, got {tuple(buffer.shape)} "
                             f"{buffer.dtype}")
        if buffer.numel() % self.page_size:
            raise ShapeError(f"page buffer of {buffer.numel()} bytes is not a whole number of "
                             f"pages of {self.page_size} bytes")
        region = self.region(group, tensor)
        item = region.itemsize
        if buffer.storage_offset() % item:
            raise ShapeError(f"page buffer storage offset {buffer.storage_offset()} is not "
                             f"aligned to {item} bytes")
        typed = buffer.view(region.tensor.torch_dtype)
        num_pages = buffer.numel() // self.page_size
        shape, strides = region.canonical_shape_strides()
        shape = (num_pages, *shape)
        strides = (self.page_size // item, *strides)
        base = typed.storage_offset() + region.offset // item
        if layer is not None:
            if not 0 <= layer < shape[1]:
                raise ShapeError(f"layer index {layer} outside group {group} of {shape[1]} layers")
            base += layer * strides[1]
            shape, strides = shape[:1] + shape[2:], strides[:1] + strides[2:]
        return torch.as_strided(typed, shape, strides, base)


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align
