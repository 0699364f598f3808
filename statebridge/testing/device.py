"""Device memory emulated in host memory, so the CPU test suite runs every path of a rank's
device pool (:mod:`statebridge.connector.data.device`): export, open, the one-launch gather
and its event polled from the rank loop.

:class:`EmulatedBackend` stands in for :class:`~statebridge.connector.data.device.CudaBackend`:

- a pool is a memfd (:class:`~statebridge.connector.data.shared.SharedBuffer`); its "IPC
  handle" is the pid and descriptor a same-host peer opens through ``/proc/<pid>/fd/<fd>``
  (a peer in the same process gets the allocation itself, as with CUDA);
- launches run synchronously; the gather is the kernel's torch reference
  (:func:`~statebridge.kernels.pack.gather_ref`, its oracle in the kernel tests: the
  interpreted kernel takes seconds for the thousands of runs of a staged pair), or the
  interpreted kernel itself with ``kernel=True``; an event reports done only on its ``polls``-th query, so a rank loop that answers before its
  event fired, or sleeps while a gather runs, is caught;
- every device is device memory (:meth:`device_memory`): a rank on the CPU holds its pool
  through the emulation, and its group says ``memory="cuda"`` at the handshake.

Install it in a process with :func:`install` (a :class:`~statebridge.testing.hosts.RankHostPool`
initializer, or a test fixture together with :func:`restore`).
"""

from __future__ import annotations

import contextlib
import os
import struct
import warnings
from typing import Any

import torch

from statebridge.connector.data import device as dev
from statebridge.connector.data import shared
from statebridge.errors import TransferError

__all__ = ["EmulatedBackend", "install", "restore"]

_HANDLE = struct.Struct("<8sqq")
_MAGIC = b"EMULATED"


class _Event:
    __slots__ = ("left",)

    def __init__(self, polls: int) -> None:
        self.left = polls


class EmulatedBackend(dev.Backend):
    """See the module docstring. ``polls``: queries before an event reports done (>= 1).
    :attr:`counts` counts allocations, opens, events and launches."""

    name = "emulated"

    def __init__(self, polls: int = 2, *, kernel: bool = False) -> None:
        if isinstance(polls, bool) or not isinstance(polls, int) or polls < 1:
            raise ValueError(f"polls must be a positive integer, got {polls!r}")
        self.polls = polls
        self.kernel = kernel
        self.counts = {"allocate": 0, "open": 0, "event": 0, "launch": 0}
        self._pools: dict[int, shared.SharedBuffer] = {}      # pointer -> this process's pools
        self._opened: dict[tuple[int, int], shared.PeerMap] = {}

    def device_memory(self, device: torch.device) -> bool:
        return True

    def allocate(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, dev.ExportRecord]:
        buf = shared.SharedBuffer(int(nbytes), "statebridge-emulated-pool")
        tensor = buf.tensor[:nbytes]
        pointer = tensor.data_ptr()
        self._pools[pointer] = buf
        self.counts["allocate"] += 1
        handle = _HANDLE.pack(_MAGIC, os.getpid(), buf.fd).ljust(64, b"\0")
        return tensor, dev.ExportRecord(device=0, pid=os.getpid(), pointer=pointer,
                                        nbytes=int(nbytes), uuid=b"emulated-device!",
                                        handle=handle)

    def open(self, record: dev.ExportRecord, device: torch.device) -> torch.Tensor:
        magic, pid, fd = _HANDLE.unpack_from(record.handle)
        if magic != _MAGIC or pid != record.pid:
            raise TransferError(f"not an emulated pool's handle (pid {record.pid})")
        self.counts["open"] += 1
        if pid == os.getpid():
            buf = self._pools.get(record.pointer)
            if buf is None:
                raise TransferError(f"emulated pool at {record.pointer:#x} of this process "
                                    f"is gone")
            return buf.tensor[:record.nbytes]
        peer = self._opened.get((pid, fd))
        if peer is None:
            peer = self._opened[pid, fd] = shared.PeerMap(pid, fd)
        with warnings.catch_warnings():             # a read-only map: this side never writes
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(peer._array)[:record.nbytes]

    def stream(self, device: torch.device) -> Any:
        return object()

    def event(self, stream: Any) -> Any:
        self.counts["event"] += 1
        return _Event(self.polls)

    def done(self, event: Any) -> bool:
        event.left -= 1
        return event.left <= 0

    def gather(self, src: torch.Tensor, dst: torch.Tensor, template: Any, bases: list) -> None:
        from statebridge.kernels.pack import gather, gather_ref

        (gather if self.kernel else gather_ref)(src, dst, template, bases)

    def launch(self, stream: Any):
        self.counts["launch"] += 1
        return contextlib.nullcontext()


def install(polls: int = 2, *, kernel: bool = False) -> dev.Backend:
    """Install an :class:`EmulatedBackend` in this process; returns the backend it replaced."""
    return dev.set_backend(EmulatedBackend(polls, kernel=kernel))


def restore(old: dev.Backend) -> None:
    """Put back the backend :func:`install` returned."""
    dev.set_backend(old)
