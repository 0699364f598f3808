"""A rank's memory: ONE buffer holding its pages, its KV block pool and its control words, of
one memory kind::

    0                          kv_base                       ctl_base                   nbytes
    | pages: num_pages x page_size | KV pool (spec with KV)   | notice slots              |
    |<------------------------ the pool ---------------------->|<-- control words -------->|
                       (kv_base: rounded up to 64)   (ctl_base: rounded up to a memory page)

Every run is a plain absolute offset in this one address space, whatever the kind. The control
words (:class:`~statebridge.connector.data.shared.NoticeSlots`) start on a memory page: a
same-host reader maps them, and nothing before them, writable to answer.

A memory kind is one object, chosen at start; the rest of the rank sees views, what UCX
registers, what a same-host peer needs to reach the pool, and the read out of a peer's pool:

- :class:`HostMemfd`: a memfd (:class:`~statebridge.connector.data.shared.SharedBuffer`), for
  a prefill rank whose buffer some same-host decode rank may map (the shared-map rule,
  :func:`~statebridge.connector.data.shared.map_threshold`);
- :class:`HostAnonymous`: anonymous memory on transparent huge pages
  (:func:`~statebridge.connector.data.alloc_buffer`), for every other host rank;
- :class:`CudaDevice`: the pool in device memory, ONE allocation of its own
  (:class:`~statebridge.connector.data.device.DevicePool`), the control words in host memory --
  for a prefill rank a memfd a same-host decode rank maps as above, with the pool's export
  record (its CUDA IPC handle) after the control words. The decode rank opens the pool once
  (:meth:`RankMemory.open_peer`) and gathers a request's runs out of it in ONE kernel launch
  on its own stream (:meth:`RankMemory.gather_from`), then polls the event.

Every byte access to the buffer outside the transport goes through here: a new kind is a new
class in this file.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import numpy as np
import torch

from statebridge.connector.data import alloc_buffer, shared
from statebridge.connector.data import device as dev
from statebridge.errors import TransferError
from statebridge.state.kv import BlockGeometry
from statebridge.state.layout import PageGeometry

log = logging.getLogger(__name__)

__all__ = ["RankMemory", "HostMemfd", "HostAnonymous", "CudaDevice", "MEMORY_KINDS"]

#: What a node tells its peers its ranks' pools are in (GroupInfo ``memory``).
MEMORY_KINDS = ("host", "cuda")


class HostAnonymous:
    """Anonymous host memory on transparent huge pages; no peer maps it."""

    name = "host"
    memory = "host"

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
    memory = "host"

    def __init__(self, nbytes: int, label: str) -> None:
        self._shared = shared.SharedBuffer(nbytes, label)
        self.tensor = self._shared.tensor

    @property
    def fd(self) -> int:
        return self._shared.fd

    def close(self) -> None:
        self._shared.close()


class CudaDevice:
    """The pool (``[0, pool_bytes)``: pages and KV blocks) in device memory, ONE allocation of
    its own on ``device``; the control words (``[pool_bytes, nbytes)``) in host memory.

    ``mappable`` (a prefill rank some same-host decode rank reads): the host part is a memfd
    of the whole address space plus :data:`~statebridge.connector.data.device.EXPORT_BYTES`,
    so offsets keep their meaning in a peer's map of it; only the control words and the export
    record after them are ever touched (the rest of the file is never written, so it holds no
    memory). Otherwise the host part is the control words alone.
    """

    name = "cuda"
    memory = "cuda"

    def __init__(self, nbytes: int, label: str, *, device: torch.device, pool_bytes: int,
                 mappable: bool) -> None:
        self.device = torch.device(device)
        self.pool = dev.DevicePool(pool_bytes, self.device)
        self.tensor = self.pool.tensor           # the pool, as a uint8 tensor on the device
        self.control_base = pool_bytes
        self._shared: shared.SharedBuffer | None = None
        if mappable:
            self._shared = shared.SharedBuffer(nbytes + dev.EXPORT_BYTES, label)
            host = self._shared.tensor
            host[nbytes:nbytes + dev.EXPORT_BYTES].numpy()[:len(self.pool.record.encode())] = \
                np.frombuffer(self.pool.record.encode(), dtype=np.uint8)
            self.host = host[pool_bytes:nbytes]
        else:
            self.host = alloc_buffer(nbytes - pool_bytes)

    @property
    def fd(self) -> int:
        return self._shared.fd if self._shared is not None else -1

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class RankMemory:
    """The one buffer of a rank (see the module docstring): ``num_pages`` pages of
    ``geometry``, a KV pool of ``kv_geometry`` (None: none), the notice slots. On ``device``
    (default the CPU): a CUDA device gives :class:`CudaDevice`; on the CPU a
    :class:`HostMemfd` when ``mappable``, else :class:`HostAnonymous`."""

    def __init__(self, geometry: PageGeometry, num_pages: int,
                 kv_geometry: BlockGeometry | None = None, *, mappable: bool = False,
                 label: str = "statebridge-rank", device: "torch.device | str | None" = None) -> None:
        pages_bytes = geometry.page_size * num_pages
        self.kv_base = _round_up(pages_bytes, 64) if kv_geometry is not None else pages_bytes
        kv_bytes = kv_geometry.nbytes if kv_geometry is not None else 0
        self.ctl_base = _round_up(self.kv_base + kv_bytes, mmap.PAGESIZE)
        self.nbytes = self.ctl_base + shared.NoticeSlots.nbytes(num_pages)
        self.device = torch.device(device if device is not None else "cpu")
        self.kind: "HostMemfd | HostAnonymous | CudaDevice"
        if dev.memory_of(self.device) == "cuda":
            self.kind = CudaDevice(self.nbytes, label, device=self.device,
                                   pool_bytes=self.ctl_base, mappable=mappable)
            pool = self.kind.tensor
            self._bytes = None                 # no host view of the pool
            control = self.kind.host.numpy()
        elif self.device.type == "cpu":
            self.kind = (HostMemfd if mappable else HostAnonymous)(self.nbytes, label)
            pool = self.kind.tensor
            self._bytes = pool.numpy()
            control = self._bytes[self.ctl_base:]
        else:
            raise TransferError(f"rank memory on {self.device} is not supported (cpu or cuda)")
        #: The pages (a :class:`~statebridge.state.cache.StateCache` buffer) and the KV pool.
        self.pages: torch.Tensor = pool[:pages_bytes]
        self.kv_pool: torch.Tensor = pool[self.kv_base:self.kv_base + kv_bytes]
        #: The control words: a notice slot per (page, peer rank).
        self.notices = shared.NoticeSlots(control.view(np.int64), self.ctl_base, num_pages)

    @classmethod
    def for_rank(cls, role: str, tp_rank: int, geometry: PageGeometry, num_pages: int,
                 kv_geometry: BlockGeometry | None, side: shared.MapSide,
                 device: "torch.device | str | None" = None) -> "RankMemory":
        """A rank's memory on ``device``: shared with same-host readers (a memfd) for a prefill
        rank whose group (``side``) the shared-map rule lets serve some decode group, else
        private. A decode rank on CUDA compiles its gather before it serves (a first compile
        in the loop would stall its heartbeats)."""
        mappable = role == "prefill" and shared.map_threshold(side) is not None
        memory = cls(geometry, num_pages, kv_geometry, mappable=mappable,
                     label=f"statebridge-{role}-rank{tp_rank}", device=device)
        if role == "decode" and memory.memory == "cuda":
            memory.warm_up()
        return memory

    @property
    def memory(self) -> str:
        """``"host"`` or ``"cuda"``: what the pool is in (:data:`MEMORY_KINDS`)."""
        return self.kind.memory

    @property
    def registered(self) -> "torch.Tensor | list[tuple[int, torch.Tensor]]":
        """What the UCX transport registers: the whole buffer (host kinds), or the pool and the
        control words as two segments at their offsets (device memory)."""
        if isinstance(self.kind, CudaDevice):
            return [(0, self.kind.tensor), (self.ctl_base, self.kind.host)]
        return self.kind.tensor

    @property
    def peer_fd(self) -> int:
        """The descriptor a same-host peer opens (through this process's pid) to map the
        buffer -- with device memory, the control words and the export record; -1 when it
        cannot be mapped."""
        return self.kind.fd

    @property
    def pid(self) -> int:
        return os.getpid()

    def copy_from(self, src: shared.PeerMap, groups: list) -> int:
        """Copy ``(runs, src_add, dst_add)`` groups out of a peer's mapped buffer into this one
        (:func:`~statebridge.connector.data.shared.copy_groups`); returns the bytes."""
        if self._bytes is None:
            raise TransferError(f"{self!r}: a host copy into device memory; gather instead")
        return shared.copy_groups(self._bytes, src, groups)

    # -- device memory: reads out of a same-host peer's pool -----------------------------------
    def open_peer(self, src: shared.PeerMap) -> "dev.PeerPool":
        """Open the device pool of the peer whose shared map is ``src`` (its export record is
        after its control words, at the end of the map). :class:`TransferError` naming the
        peer when it exported none or it cannot be opened."""
        if not isinstance(self.kind, CudaDevice):
            raise TransferError(f"{self!r} cannot read a peer's device pool: this rank's pool "
                                f"is in host memory")
        where = f" of pid {src.pid}"
        return dev.open_peer(src.read(src.nbytes - dev.EXPORT_BYTES, dev.EXPORT_BYTES),
                             self.device, where)

    def prepare_gather(self, groups: list) -> Any:
        """One or two groups of ``[R, 3]`` runs checked once and copied to this rank's device
        (:func:`~statebridge.kernels.pack.prepare_gather`)."""
        from statebridge.kernels.pack import prepare_gather

        return prepare_gather(groups, self.kind.tensor.device)

    def gather_from(self, src: "dev.PeerPool", template: Any,
                    bases: "list[tuple[int, int]]") -> Any:
        """Launch the gather of ``template`` (at ``bases``, one ``(src, dst)`` per group) out
        of the peer's pool into this rank's pool on this rank's own stream, and return the
        event recorded after it (:meth:`gather_done` polls it). Raises ShapeError before
        anything is launched when a run would leave a pool."""
        pool = self.kind.pool
        stream = pool.stream
        with pool.backend.launch(stream):
            pool.backend.gather(src.tensor, self.kind.tensor, template, bases)
        return pool.backend.event(stream)

    def gather_done(self, event: Any) -> bool:
        """Whether the gather that recorded ``event`` has finished (no waiting)."""
        return self.kind.pool.backend.done(event)

    def warm_up(self) -> None:
        """Compile the gather for every word size now (one tiny gather each, then wait)."""
        from statebridge.kernels.pack import prepare_gather

        scratch = torch.zeros(64, dtype=torch.uint8, device=self.kind.tensor.device)
        pool = self.kind.pool
        events = []
        for word in (8, 4, 2, 1):
            template = prepare_gather([np.array([[0, 0, word]], dtype=np.int64)], scratch.device)
            with pool.backend.launch(pool.stream):
                pool.backend.gather(scratch, scratch[32:], template, [(0, 0)])
            events.append(pool.backend.event(pool.stream))
        for event in events:
            while not pool.backend.done(event):
                pass

    def close(self) -> None:
        """Release what the kind holds beyond the views (a memfd's descriptor; device memory
        goes with its last view)."""
        self.kind.close()

    def __repr__(self) -> str:
        return (f"RankMemory({self.kind.name}, {self.nbytes} B: pages, KV from {self.kv_base}, "
                f"control words from {self.ctl_base})")
