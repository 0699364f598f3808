"""The memory of a shared-map read: a prefill rank's buffer as a memfd (:class:`SharedBuffer`),
a decode rank's map of it (:class:`PeerMap`: read-only, and writable over the control words
only, for its answers), and the copy of runs out of it (:func:`copy_groups`, in C:
``_copy.c``, GIL released, streaming stores for long runs).

Opening a peer's memfd (``/proc/<pid>/fd/<fd>``) needs the same permission as
``process_vm_readv`` (ptrace access to the peer): where cma works, this works.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np
import torch

from statebridge.errors import ConfigError, TransferError

try:
    from statebridge.connector.data.shared import _copy
except ImportError:  # pragma: no cover -- built by `pip install`; see available()
    _copy = None

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

__all__ = ["SharedBuffer", "PeerMap", "available", "copy_groups", "copy_runs", "process_alive",
           "streaming"]


def available() -> bool:
    """Whether the compiled copy (:mod:`statebridge.connector.data.shared._copy`) is importable."""
    return _copy is not None


def streaming() -> bool:
    """Whether large runs are copied with non-temporal stores (AVX2)."""
    return bool(_copy is not None and _copy.STREAMING)


class SharedBuffer:
    """A zeroed buffer of ``nbytes`` in a memfd mapped shared: a uint8 tensor over it
    (:attr:`tensor`) and the descriptor (:attr:`fd`) a reader on this host opens through
    ``/proc/<pid>/fd/<fd>``. Kept open for the process's life (a rank's page buffer)."""

    def __init__(self, nbytes: int, name: str = "statebridge") -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)   # readers open /proc/<pid>/fd/<fd>
        size = max(1, nbytes)
        try:
            os.ftruncate(self.fd, size)
            # libc's mmap, not Python's: mmap.mmap keeps a dup of the descriptor open for as
            # long as the mapping lives, which would keep the memfd open after close().
            addr = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                              self.fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
        except BaseException:
            os.close(self.fd)
            raise
        raw = (ctypes.c_uint8 * size).from_address(addr)
        weakref.finalize(raw, _LIBC.munmap, addr, size)     # when the last view is gone
        self.tensor = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, count=nbytes))
        # The descriptor keeps the memfd's memory alive beside the mapping: closed with the
        # buffer (close() or garbage collection), so a process that outlives its rank (a
        # test's rank host) does not hold a dead rank's pages.
        self._closer = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        """Close the descriptor (the mapping stays valid; the memory goes with it): readers
        that already mapped the buffer keep reading, new ones cannot open it."""
        self._closer()


class PeerMap:
    """A mapping of a same-host peer's :class:`SharedBuffer` (process ``pid``, descriptor
    ``fd``): read-only over the whole buffer (:attr:`address` and :attr:`nbytes` for
    :func:`copy_groups`), and read-write over the control words at its end only, mapped at the
    first :meth:`answer` (from the page of that word to the end; lower words later extend it).
    :class:`TransferError` naming the pid and fd when it cannot be opened."""

    def __init__(self, pid: int, fd: int) -> None:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise TransferError(f"cannot open the peer's shared buffer {path}: {e}") from None
        try:
            self.nbytes = os.fstat(f).st_size
            self._map = mmap.mmap(f, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            os.close(f)
            raise TransferError(f"cannot map the peer's shared buffer {path}: {e}") from None
        self.pid, self.fd, self._path = pid, fd, path
        self._fd = f
        weakref.finalize(self, os.close, f)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self._array.ctypes.data
        self._rw: mmap.mmap | None = None
        self._rw_start = self.nbytes
        self._rw_address = 0

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` of the peer's buffer from byte ``offset`` (e.g. a device pool's
        export record); :class:`TransferError` when that is outside the buffer."""
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
                or offset + nbytes > self.nbytes:
            raise TransferError(f"bytes [{offset!r}, +{nbytes!r}) are outside the "
                                f"{self.nbytes}-byte buffer of pid {self.pid}")
        return bytes(self._array[offset:offset + nbytes])

    def answer(self, offset: int, expected: int, value: int) -> bool:
        """Compare-and-swap the int64 word at byte ``offset`` of the peer's buffer from
        ``expected`` to ``value`` (``_copy.answer``); False when it held something else.
        :class:`TransferError` when the word is outside the buffer or the control words cannot
        be mapped."""
        if type(offset) is not int or not 0 <= offset <= self.nbytes - 8 or offset % 8:
            raise TransferError(f"answer word at offset {offset!r} is not an aligned word of "
                                f"the {self.nbytes}-byte buffer of pid {self.pid}")
        if offset < self._rw_start:
            start = offset - offset % mmap.PAGESIZE
            try:
                rw = mmap.mmap(self._fd, self.nbytes - start, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            except (OSError, ValueError) as e:
                raise TransferError(f"cannot map the control words of {self._path} from "
                                    f"{start}: {e}") from None
            array = np.frombuffer(rw, dtype=np.uint8)
            self._rw, self._rw_array, self._rw_start = rw, array, start
            self._rw_address = array.ctypes.data
        return _copy.answer(self._rw_address, self.nbytes - self._rw_start,
                            offset - self._rw_start, expected, value)

    def __repr__(self) -> str:
        return f"PeerMap(pid={self.pid}, fd={self.fd}, nbytes={self.nbytes})"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a mapped peer's owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def copy_runs(dst: np.ndarray, src: PeerMap, runs: np.ndarray) -> int:
    """Copy each ``(src offset, dst offset, length)`` row of ``runs`` from the peer's mapping
    into ``dst`` (this process's buffer), GIL released; every row is checked against both
    sizes first (:class:`TransferError` naming the row, nothing copied). Returns the bytes."""
    return copy_groups(dst, src, ((np.ascontiguousarray(runs, dtype=np.int64), 0, 0),))


def copy_groups(dst: np.ndarray, src: PeerMap,
                groups: "list[tuple[np.ndarray, int, int]] | tuple") -> int:
    """:func:`copy_runs` for several ``(runs, src_add, dst_add)`` groups in one call: each
    group's rows are shifted by its two bases in C, so a rank passes its cached run tables
    as they are (C-contiguous int64 ``[n, 3]``) and only a request's bases change. Every row
    of every group is checked before anything is copied."""
    if _copy is None:
        raise TransferError("statebridge.connector.data.shared._copy is not built: reinstall "
                            "statebridge (pip install -e .) with a C compiler")
    try:
        return _copy.copy_groups(dst.ctypes.data, dst.nbytes, src.address, src.nbytes, groups)
    except ValueError as e:
        raise TransferError(f"shared-map read from pid {src.pid}: {e}") from None
