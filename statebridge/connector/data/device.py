"""Device memory of a rank: ONE allocation for its pool (pages | KV blocks), exported to
same-host peers by a CUDA IPC memory handle, and the peers' pools opened from theirs.

Why not a tensor from PyTorch's caching allocator: a CUDA IPC handle names a whole allocation
(``cudaMalloc`` segment), and the caching allocator puts other tensors into the segments it
cut a tensor from -- a handle of the pool would then open those as well. The pool is one
``cudaMalloc`` of its own, made through ``cuda-bindings`` (the CUDA Python runtime bindings,
installed with ``ucxx-cu12``: no new dependency), and seen by torch as a uint8 tensor over it
(``__cuda_array_interface__``). The memory is freed when the last view of it is gone.

Export: a prefill rank writes an :class:`ExportRecord` (magic, device, pid, pointer, size,
device UUID, the 64-byte ``cudaIpcMemHandle_t``) at the end of the host shared map that holds
its control words (the memfd a same-host decode rank maps already): one record serves every
peer, and a peer opens it once (:func:`open_peer`, ``cudaIpcOpenMemHandle`` with lazy peer
access, so a peer on another GPU of the host reads over NVLink or PCIe). A peer in the same
process (test rank hosts) gets the allocation itself: CUDA cannot open a handle in the process
that made it.

Everything CUDA goes through one :class:`Backend` object (:func:`backend`); the CPU test suite
installs an emulation (:func:`set_backend`) and so runs every path around it.
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from statebridge.errors import ConfigError, TransferError

__all__ = ["ExportRecord", "EXPORT_BYTES", "Backend", "CudaBackend", "backend", "set_backend",
           "DevicePool", "PeerPool", "open_peer", "cuda_array", "memory_of"]

#: Bytes reserved for the export record at the end of an exporting rank's shared map.
EXPORT_BYTES = 4096
_MAGIC = b"SBCUDA\x00\x01"
_FORMAT = struct.Struct("<8sIIQQQ16s64s")


@dataclass(frozen=True)
class ExportRecord:
    """What a same-host peer needs to open a rank's device pool::

        magic(8) | record version u32 | device ordinal u32 | pid u64 | pointer u64 |
        nbytes u64 | device uuid(16) | cudaIpcMemHandle_t(64)        (little-endian)
    """

    device: int
    pid: int
    pointer: int
    nbytes: int
    uuid: bytes
    handle: bytes
    version: int = 1

    def encode(self) -> bytes:
        if len(self.uuid) != 16 or len(self.handle) != 64:
            raise ConfigError(f"export record: uuid of {len(self.uuid)} bytes and handle of "
                              f"{len(self.handle)} bytes (want 16 and 64)")
        return _FORMAT.pack(_MAGIC, self.version, self.device, self.pid, self.pointer,
                            self.nbytes, self.uuid, self.handle)

    @classmethod
    def decode(cls, data: bytes, where: str = "") -> "ExportRecord":
        """The record in ``data``; :class:`TransferError` naming ``where`` and the bad field
        (a rank that exported nothing leaves zeros: no magic)."""
        if len(data) < _FORMAT.size:
            raise TransferError(f"export record{where}: {len(data)} bytes, need {_FORMAT.size}")
        magic, version, device, pid, pointer, nbytes, uuid, handle = \
            _FORMAT.unpack_from(bytes(data[:_FORMAT.size]))
        if magic != _MAGIC:
            raise TransferError(f"no device export record{where} (magic {magic!r}): the peer's "
                                f"pool is not in device memory")
        if version != 1 or nbytes <= 0:
            raise TransferError(f"export record{where}: version {version}, nbytes {nbytes}")
        return cls(device=device, pid=pid, pointer=pointer, nbytes=nbytes, uuid=uuid,
                   handle=handle, version=version)


class _Owner:
    """Holds a device allocation (or an opened handle) for as long as any tensor views it;
    ``release`` runs once, when the last view is gone."""

    def __init__(self, pointer: int, nbytes: int, release) -> None:
        self.pointer = pointer
        self.nbytes = nbytes
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 2,
                                         "strides": None}
        weakref.finalize(self, release)


def cuda_array(pointer: int, nbytes: int) -> Any:
    """An object exposing ``__cuda_array_interface__`` for ``nbytes`` at ``pointer`` (what
    ucxx and torch take for device memory they do not own)."""
    return _View(pointer, nbytes)


class _View:
    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 2,
                                         "strides": None}


class Backend:
    """The CUDA operations a rank's device memory needs; :class:`CudaBackend` is the real one.

    - ``allocate(nbytes, device)`` -> ``(tensor, record)``: a zeroed uint8 tensor of a fresh
      allocation of its own, and its :class:`ExportRecord`;
    - ``open(record, device)`` -> a uint8 tensor over a same-host peer's pool (read by this
      process, never written);
    - ``stream(device)``, ``event(stream)`` (recorded on it), ``done(event)``, ``launch(stream)``
      (a context manager: launches inside go to ``stream``);
    - ``gather(src, dst, template, bases)``: the one-launch gather
      (:func:`statebridge.kernels.pack.gather`), launched inside ``launch``;
    - ``device_memory(device)``: whether a rank on ``device`` holds its pool through this
      backend (the real one: CUDA devices; an emulation may take the CPU).
    """

    name = "?"

    def device_memory(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def gather(self, src: torch.Tensor, dst: torch.Tensor, template: Any, bases: list) -> None:
        from statebridge.kernels.pack import gather

        gather(src, dst, template, bases)

    def allocate(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, ExportRecord]:
        raise NotImplementedError

    def open(self, record: ExportRecord, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def stream(self, device: torch.device) -> Any:
        raise NotImplementedError

    def event(self, stream: Any) -> Any:
        raise NotImplementedError

    def done(self, event: Any) -> bool:
        raise NotImplementedError

    def launch(self, stream: Any):
        raise NotImplementedError


def _runtime():
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        raise ConfigError("device memory needs cuda-bindings (CUDA Python, installed with "
                          f"ucxx-cu12): {e}") from None
    return runtime


def _call(result: tuple, what: str, error: type = ConfigError):
    """The value of a cuda-bindings call, or ``error`` naming the CUDA error."""
    status, *value = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        rt = _runtime()
        name = rt.cudaGetErrorName(status)[1]
        raise error(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return value[0] if len(value) == 1 else (tuple(value) or None)


#: Live allocations of this process by pointer: a peer in the same process uses them directly.
_LOCAL: "weakref.WeakValueDictionary[int, _Owner]" = weakref.WeakValueDictionary()


class CudaBackend(Backend):
    """``cudaMalloc`` / ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` through
    cuda-bindings; streams and events through torch."""

    name = "cuda"

    def allocate(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, ExportRecord]:
        rt = _runtime()
        index = _index(device)
        _call(rt.cudaSetDevice(index), f"cudaSetDevice({index})")
        size = max(int(nbytes), 1)
        pointer = int(_call(rt.cudaMalloc(size), f"cudaMalloc({size}) on cuda:{index}"))

        def free() -> None:
            rt.cudaSetDevice(index)
            rt.cudaFree(pointer)

        owner = _Owner(pointer, size, free)
        try:
            _call(rt.cudaMemset(pointer, 0, size), "cudaMemset")
            _call(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            handle = _call(rt.cudaIpcGetMemHandle(pointer), "cudaIpcGetMemHandle")
            props = _call(rt.cudaGetDeviceProperties(index), "cudaGetDeviceProperties")
            uuid = bytes(props.uuid.bytes)[:16].ljust(16, b"\0")
        except BaseException:
            del owner
            raise
        _LOCAL[pointer] = owner
        tensor = torch.as_tensor(owner, device=device)[:nbytes]
        return tensor, ExportRecord(device=index, pid=os.getpid(), pointer=pointer,
                                    nbytes=int(nbytes), uuid=uuid, handle=bytes(handle.reserved))

    def open(self, record: ExportRecord, device: torch.device) -> torch.Tensor:
        if record.pid == os.getpid():
            owner = _LOCAL.get(record.pointer)
            if owner is None:
                raise TransferError(f"device pool at {record.pointer:#x} of this process is gone")
            return torch.as_tensor(owner, device=f"cuda:{record.device}")[:record.nbytes]
        rt = _runtime()
        index = _index(device)
        _call(rt.cudaSetDevice(index), f"cudaSetDevice({index})", TransferError)
        handle = rt.cudaIpcMemHandle_t()
        handle.reserved = record.handle
        pointer = int(_call(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess),
                            f"cudaIpcOpenMemHandle of pid {record.pid}'s pool (GPU "
                            f"{record.uuid.hex()}) on cuda:{index}", TransferError))

        def close() -> None:
            rt.cudaSetDevice(index)
            rt.cudaIpcCloseMemHandle(pointer)

        owner = _Owner(pointer, record.nbytes, close)
        # torch places the view on the GPU that holds the memory (the peer's).
        return torch.as_tensor(owner)

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def launch(self, stream: Any):
        return torch.cuda.stream(stream)


def _index(device: torch.device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(f"device memory needs a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


_BACKEND: Backend = CudaBackend()


def backend() -> Backend:
    """The backend in use (:class:`CudaBackend` unless a test installed another)."""
    return _BACKEND


def memory_of(device: "torch.device | str") -> str:
    """``"cuda"`` when a rank on ``device`` holds its pool in device memory (through the
    backend in use), else ``"host"``."""
    return "cuda" if backend().device_memory(torch.device(device)) else "host"


def set_backend(new: Backend) -> Backend:
    """Install ``new`` for this process (tests: an emulation on the CPU); returns the old."""
    global _BACKEND
    old, _BACKEND = _BACKEND, new
    return old


class DevicePool:
    """A rank's pool: ONE allocation of ``nbytes`` on ``device`` (:attr:`tensor`, zeroed), its
    :attr:`record` for same-host peers, and the stream its gathers run on."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        self.device = torch.device(device)
        self.backend = backend()
        self.tensor, self.record = self.backend.allocate(nbytes, self.device)
        self._stream = None

    @property
    def stream(self) -> Any:
        """The stream this rank's gathers run on (made at first use, on the loop thread)."""
        if self._stream is None:
            self._stream = self.backend.stream(self.device)
        return self._stream


@dataclass(frozen=True)
class PeerPool:
    """A same-host peer's pool, opened once: :attr:`tensor` reads it (never written)."""

    record: ExportRecord
    tensor: torch.Tensor


def open_peer(export: bytes, device: torch.device, where: str = "") -> PeerPool:
    """Open the pool a peer exported (``export``: the bytes of its record, read out of its
    shared map) on this rank's ``device``. :class:`TransferError` naming ``where`` when it
    cannot be opened."""
    record = ExportRecord.decode(export, where)
    try:
        tensor = backend().open(record, torch.device(device))
    except ConfigError as e:
        raise TransferError(f"cannot open the device pool{where}: {e}") from None
    if tensor.numel() < record.nbytes:
        raise TransferError(f"device pool{where}: opened {tensor.numel()} bytes, the record "
                            f"says {record.nbytes}")
    return PeerPool(record, tensor[:record.nbytes])
