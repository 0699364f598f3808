"""Staging buffers: memory a staged pair is gathered into (send) or received into (recv), on
the device of the rank's pool.

:meth:`Transport.post_send_staged` gathers a pair's source pieces into a pooled staging buffer
and sends it as one message; :meth:`Transport.post_recv_staged` receives into a pooled buffer
and scatters it into the page before the handle reports done. On the host the gather/scatter
is :func:`statebridge.kernels.pack.copy_runs_host`; a staged pair costs two host copies plus
one message (docs/measurements.md, "Transport choices"). With the pool in device memory the
buffers are device memory too, and the copies are :func:`statebridge.kernels.pack.pack` /
:func:`~statebridge.kernels.pack.unpack` launches the transport waits for before UCX reads
(or after UCX wrote).
"""

from __future__ import annotations

import collections

import torch

from statebridge.connector.data.env import alloc_buffer

__all__ = ["StagingPool"]


class StagingPool:
    """Reusable staging buffers in power-of-two size classes (>= 64 KiB) on ``device`` (host
    buffers THP-backed).

    At most ``max_cached_bytes`` of free buffers are kept; a buffer whose transfer failed while
    UCX might still write into it is quarantined (kept alive, never reused) until
    :meth:`clear`. Used by its transport's owner thread only.
    """

    MIN_CLASS = 64 * 1024

    def __init__(self, max_cached_bytes: int, *, device: "torch.device | str" = "cpu") -> None:
        self.max_cached_bytes = max_cached_bytes
        self.device = torch.device(device)
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._cached = 0
        self.allocations = 0
        self.quarantined: list[torch.Tensor] = []

    def _size_class(self, nbytes: int) -> int:
        return max(self.MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (its full size class)."""
        size = self._size_class(nbytes)
        free = self._free.get(size)
        if free:
            self._cached -= size
            return free.pop()
        self.allocations += 1
        if self.device.type != "cpu":
            return torch.zeros(size, dtype=torch.uint8, device=self.device)
        return alloc_buffer(size)

    def release(self, buf: torch.Tensor, *, quiescent: bool = True) -> None:
        """Give ``buf`` back; ``quiescent`` False: UCX may still write into it (quarantine)."""
        if not quiescent:
            self.quarantined.append(buf)
        elif self._cached + buf.numel() <= self.max_cached_bytes:
            self._free[buf.numel()].append(buf)
            self._cached += buf.numel()

    @property
    def cached_bytes(self) -> int:
        return self._cached

    @property
    def quarantined_bytes(self) -> int:
        return sum(b.numel() for b in self.quarantined)

    def clear(self) -> None:
        self._free.clear()
        self._cached = 0
        self.quarantined.clear()
