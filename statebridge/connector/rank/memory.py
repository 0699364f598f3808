"""A rank's memory: ONE buffer holding its pages, its KV block pool and its control words, of
one memory kind::

    0                          kv_base                       ctl_base                   nbytes
    | pages: num_pages x page_size | KV pool (spec with KV)   | notice slots              |
                       (kv_base: rounded up to 64)   (ctl_base: rounded up to a memory page)

The transport registers all of it, so every run is a plain absolute offset. The control words
(:class:`~statebridge.connector.data.shared.NoticeSlots`) start on a memory page: a same-host
reader maps them, and nothing before them, writable to answer.

A memory kind is one object, chosen at start; the rest of the rank sees views, what UCX
registers, what a same-host peer needs to map the buffer, and the copy out of a peer's map:

- :class:`HostMemfd`: a memfd (:class:`~statebridge.connector.data.shared.SharedBuffer`), for
  a prefill rank whose buffer some same-host decode rank may map (the shared-map rule,
  :func:`~statebridge.connector.data.shared.map_threshold`);
- :class:`HostAnonymous`: anonymous memory on transparent huge pages
  (:func:`~statebridge.connector.data.alloc_buffer`), for every other rank.

Every byte access to the buffer outside the transport goes through here: a new kind (device
memory) is a new class in this file.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from statebridge.connector.data import alloc_buffer, shared
from statebridge.state.kv import BlockGeometry
from statebridge.state.layout import PageGeometry

__all__ = ["RankMemory", "HostMemfd", "HostAnonymous"]


class HostAnonymous:
    """Anonymous host memory on transparent huge pages; no peer maps it."""

    name = "host"

    def __init__(self, nbytes: int, label: str) -> None:
        self.tensor = alloc_buffer(nbytes)

    @property
    def fd(self) -> int:
        return -1

    def close(self) -> None:
        pass


class HostMemfd:
    """Host memory in a memfd that a same-host peer opens (``/proc/<pid>/fd/<fd>``) and maps."""

    name = "host-memfd"

    def __init__(self, nbytes: int, label: str) -> None:
        self._shared = shared.SharedBuffer(nbytes, label)
        self.tensor = self._shared.tensor

    @property
    def fd(self) -> int:
        return self._shared.fd

    def close(self) -> None:
        self._shared.close()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class RankMemory:
    """The one buffer of a rank (see the module docstring): ``num_pages`` pages of
    ``geometry``, a KV pool of ``kv_geometry`` (None: none), the notice slots; in a
    :class:`HostMemfd` when ``mappable``, else :class:`HostAnonymous`."""

    def __init__(self, geometry: PageGeometry, num_pages: int,
                 kv_geometry: BlockGeometry | None = None, *, mappable: bool = False,
                 label: str = "statebridge-rank") -> None:
        pages_bytes = geometry.page_size * num_pages
        self.kv_base = _round_up(pages_bytes, 64) if kv_geometry is not None else pages_bytes
        kv_bytes = kv_geometry.nbytes if kv_geometry is not None else 0
        self.ctl_base = _round_up(self.kv_base + kv_bytes, mmap.PAGESIZE)
        self.nbytes = self.ctl_base + shared.NoticeSlots.nbytes(num_pages)
        self.kind: "HostMemfd | HostAnonymous" = \
            (HostMemfd if mappable else HostAnonymous)(self.nbytes, label)
        tensor = self.kind.tensor
        self._bytes = tensor.numpy()
        #: The pages (a :class:`~statebridge.state.cache.StateCache` buffer) and the KV pool.
        self.pages: torch.Tensor = tensor[:pages_bytes]
        self.kv_pool: torch.Tensor = tensor[self.kv_base:self.kv_base + kv_bytes]
        #: The control words: a notice slot per (page, peer rank).
        self.notices = shared.NoticeSlots(self._bytes[self.ctl_base:].view(np.int64),
                                          self.ctl_base, num_pages)

    @classmethod
    def for_rank(cls, role: str, tp_rank: int, geometry: PageGeometry, num_pages: int,
                 kv_geometry: BlockGeometry | None, side: shared.MapSide) -> "RankMemory":
        """A rank's memory: a memfd for a prefill rank whose group (``side``) the shared-map
        rule lets serve some decode group, else huge pages."""
        mappable = role == "prefill" and shared.map_threshold(side) is not None
        return cls(geometry, num_pages, kv_geometry, mappable=mappable,
                   label=f"statebridge-{role}-rank{tp_rank}")

    @property
    def registered(self) -> torch.Tensor:
        """What the UCX transport registers: the whole buffer."""
        return self.kind.tensor

    @property
    def peer_fd(self) -> int:
        """The descriptor a same-host peer opens (through this process's pid) to map the
        buffer; -1 when it cannot be mapped."""
        return self.kind.fd

    @property
    def pid(self) -> int:
        return os.getpid()

    def copy_from(self, src: shared.PeerMap, groups: list) -> int:
        """Copy ``(runs, src_add, dst_add)`` groups out of a peer's mapped buffer into this one
        (:func:`~statebridge.connector.data.shared.copy_groups`); returns the bytes."""
        return shared.copy_groups(self._bytes, src, groups)

    def close(self) -> None:
        """Release what the kind holds beyond the views (a memfd's descriptor)."""
        self.kind.close()

    def __repr__(self) -> str:
        return (f"RankMemory({self.kind.name}, {self.nbytes} B: pages, KV from {self.kv_base}, "
                f"control words from {self.ctl_base})")
