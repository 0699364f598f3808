"""StateCache: one rank's contiguous buffer of equal pages, an allocator, and kernel views.

::

    buffer (uint8, one allocation, registrable with UCX/NIXL as a single region)
    | page 0 | page 1 | ... | page num_pages-1 |       page p starts at p * page_size

A page holds one request's state on this rank, laid out by the cache's
:class:`~statebridge.state.layout.PageGeometry`. Pages are handed out FIFO (a freed page goes to
the back of the queue, so a page a late transfer might still address is reused last).
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np
import torch

from statebridge.errors import CacheFullError, ConfigError, DoubleFreeError, UnknownPageError
from statebridge.state.layout import PageGeometry

__all__ = ["PagePool", "StateCache", "page_checksum"]


class PagePool:
    """Allocator of page ids ``0..num_pages-1`` (FIFO reuse), thread-safe.

    A TP group's coordinator uses one pool for the whole group: page ``p`` is page ``p`` on every
    rank's :class:`StateCache`.
    """

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._used: set[int] = set()

    def allocate(self) -> int:
        """A free page id; :class:`CacheFullError` when none is left."""
        with self._lock:
            if not self._free:
                raise CacheFullError(f"all {self.num_pages} pages are in use")
            page = self._free.popleft()
            self._used.add(page)
            return page

    def allocate_many(self, count: int) -> list[int]:
        """``count`` pages at once, or none (CacheFullError) -- never a partial allocation."""
        with self._lock:
            if count < 0 or count > len(self._free):
                raise CacheFullError(f"asked for {count} pages, {len(self._free)} of "
                                     f"{self.num_pages} free")
            pages = [self._free.popleft() for _ in range(count)]
            self._used.update(pages)
            return pages

    def free(self, page: int) -> None:
        """Return ``page`` to the pool; errors on an unknown or already free page."""
        self.check(page)
        with self._lock:
            if page not in self._used:
                raise DoubleFreeError(f"page {page} is not allocated (double free?)")
            self._used.remove(page)
            self._free.append(page)

    def is_allocated(self, page: int) -> bool:
        self.check(page)
        with self._lock:
            return page in self._used

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used(self) -> int:
        with self._lock:
            return len(self._used)

    def used_pages(self) -> list[int]:
        with self._lock:
            return sorted(self._used)

    def check(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise UnknownPageError(f"page {page!r} is not in [0, {self.num_pages})")


class StateCache:
    """``num_pages`` equal pages of ``geometry.page_size`` bytes in one buffer.

    Thread-safe: the connector allocates and frees from its own threads.
    """

    def __init__(self, geometry: PageGeometry, num_pages: int, *,
                 device: str | torch.device = "cpu", buffer: torch.Tensor | None = None) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = geometry.page_size
        nbytes = num_pages * self.page_size
        if buffer is None:
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != nbytes:
            raise ConfigError(f"buffer must be 1-D uint8 of {nbytes} bytes, got "
                              f"{tuple(buffer.shape)} {buffer.dtype}")
        self.buffer = buffer
        self.pool = PagePool(num_pages)

    # -- allocator (see PagePool) ------------------------------------------------------------
    def allocate(self) -> int:
        """A free page id; :class:`CacheFullError` when none is left."""
        try:
            return self.pool.allocate()
        except CacheFullError:
            raise CacheFullError(f"all {self.num_pages} pages of {self.page_size} bytes are in "
                                 f"use") from None

    def allocate_many(self, count: int) -> list[int]:
        return self.pool.allocate_many(count)

    def free(self, page: int) -> None:
        self.pool.free(page)

    def is_allocated(self, page: int) -> bool:
        return self.pool.is_allocated(page)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def used_pages(self) -> list[int]:
        return self.pool.used_pages()

    # -- addressing ----------------------------------------------------------------------------
    def page_offset(self, page: int) -> int:
        """Byte offset of ``page`` in :attr:`buffer`."""
        self._check(page)
        return page * self.page_size

    def page_bytes(self, page: int) -> torch.Tensor:
        """The raw bytes of one page (a view)."""
        start = self.page_offset(page)
        return self.buffer[start:start + self.page_size]

    def view(self, group: int, tensor: str, layer: int | None = None) -> torch.Tensor:
        """Kernel view over every page: ``[B, L, channel, *inner]`` or, with ``layer``,
        ``[B, channel, *inner]`` (index by page id); see :meth:`PageGeometry.view`."""
        return self.geometry.view(self.buffer, group, tensor, layer)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def _check(self, page: int) -> None:
        self.pool.check(page)

    def __repr__(self) -> str:
        return (f"StateCache(pages={self.num_pages}, page_size={self.page_size}, "
                f"layout={self.geometry.layout.name}, tp={self.geometry.tp_size}, "
                f"used={self.num_used})")


def page_checksum(geometry: PageGeometry, page_bytes: torch.Tensor | np.ndarray) -> str:
    """blake2b of the state bytes of one page (regions in page order; padding excluded).

    A decode rank reports it per request when its group computes checksums, so tests and
    benchmarks can compare what arrived with what was sent. ``page_bytes`` may live on any
    device: a tensor outside host memory is copied to the host first (one copy of the page)."""
    if isinstance(page_bytes, torch.Tensor):
        raw = page_bytes.detach().to("cpu").numpy()
    else:
        raw = page_bytes
    h = hashlib.blake2b(digest_size=16)
    for region in sorted(geometry.regions, key=lambda r: r.offset):
        h.update(raw[region.offset:region.end].tobytes())
    return h.hexdigest()
