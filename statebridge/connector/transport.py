"""The data plane: one UCX worker per rank process, bound to that rank's page buffer.

Who runs what: every TP rank process (prefill and decode) owns one :class:`Transport` over its
:class:`~statebridge.state.cache.StateCache` buffer. The control plane (zmq, not this module)
carries :attr:`Transport.address` in the handshake; each side then calls :meth:`connect` for the
peer ranks its plan pairs it with, and turns each pair's runs into a :class:`RunTemplate` once.
Per request the prefill rank calls :meth:`post_runs` "send" (or :meth:`post_send_staged`) for
each pair at the page's offset and the decode rank :meth:`post_runs` "recv" (or
:meth:`post_recv_staged`); both poll or wait the returned :class:`TransferHandle`
(:meth:`post_send` / :meth:`post_recv` take absolute runs directly). When the
control plane declares a peer dead (heartbeats), the rank calls :meth:`fail_peer`.

This is the only module of statebridge that imports ``ucxx`` (DESIGN rule), and it does so only
when the first :class:`Transport` is built -- importing ``ucxx`` sets ``UCX_*`` defaults in
``os.environ`` (``UCX_RNDV_THRESH=8192`` and others), which importing statebridge must not do.

Tags
----
Every message carries a 64-bit tag from :func:`make_tag`::

    bit 63 ............ 32 | 31 ...... 24 | 23 ................ 0
        generation (32)    | src rank (8) | index (24)

The generation is unique per request attempt, so a recycled request id (or page) with a new
generation can never match a stale message of an earlier attempt: the stale message just sits
in UCX's unexpected queue (:meth:`Transport.discard_unexpected` drains one generation; the rank's
heartbeat runs :meth:`Transport.reject_unannounced`, which receives every message no announced
receive will take into scratch memory and counts it). The index is the run
number; a staged pair's single message uses the reserved index :data:`STAGED_INDEX`, so a staged
receive never matches a zero-copy run by mistake. Tag matching in UCX is per worker, not per
endpoint: the destination rank is implicit (it is the receiving worker).

Sizes: a message LONGER than the receive it matches fails that handle with a
:class:`TransferError` (UCX truncates it; nothing lands in the page; counted as
``rejected_wrong_size``). A SHORTER one is not detected: ucxx 0.52 completes the receive with
status OK and does not expose the received length (its ``RequestTag`` length check is disabled,
rapidsai/ucxx#104), so the tail of that run keeps its old bytes. Tags only keep apart
attempts and runs; they are not authentication -- UCX has none, keep its interfaces on a
trusted network.

Why the low-level request API and not ucxx's asyncio API
--------------------------------------------------------
Callers are plain threads (the connector rank loops), so the transport offers a synchronous,
thread-safe API with pollable handles, built on ``ucxx._lib.libucxx`` requests
(``UCXEndpoint.tag_send`` / ``tag_recv``, ``UCXRequest.completed`` / ``status``): no event loop,
no futures, no notifier thread. ucxx's asyncio API costs 150-800 us per awaited message in its
default ``thread`` mode (reference/transport-limits.md) and cannot be awaited from a plain thread.

Progress
--------
``progress_mode="blocking"`` (default): callers progress the worker. :meth:`TransferHandle.done`
progresses once and never sleeps; :meth:`TransferHandle.wait` progresses, arms the worker and
sleeps in ``poll()`` on its epoll fd (plus a wake-up pipe for posts from other threads) until
UCX has an event. ``polling`` spins instead of sleeping; ``background`` runs that blocking loop
in a thread of the transport; ``thread`` is ucxx's C++ progress thread (it needs delayed
submission: without it, posts from other threads lose wake-ups and stall).

Caveat measured here: a rendezvous transfer (>= 8 KiB with ucxx's ``UCX_RNDV_THRESH=8192``;
"zero-copy read from remote" over cma) moves only while BOTH sides progress -- a receiver
progressing alone completed none of four 64 KiB messages in 2 s. A rank that computes while its
sends are in flight must keep calling :meth:`TransferHandle.done` / :meth:`progress`, or use
``background`` / ``thread``.

``benchmarks/results/transport-2026-12-02.json`` (2 shared cores, load average 1.3 at the start;
one sender and one receiver process, N messages in flight, shared memory, THP buffers), GB/s:

=============  ======  ======  ======  ======  ======
progress       8 KiB   64 KiB  1 MiB   16 MiB  64 MiB
=============  ======  ======  ======  ======  ======
blocking       0.67    3.02    4.61    5.51    6.21
polling        0.85    3.63    5.74    5.55    5.23
background     0.44    2.70    4.29    5.02    5.39
thread         0.31    1.96    4.35    5.33    5.45
perftest sm    1.15    7.06    16.97   7.53    7.51
=============  ======  ======  ======  ======  ======

``blocking`` is within 10-20% of ``polling`` below 1 MiB and as fast above, without burning a
core that the model needs on 2 cores; ``thread`` pays its hand-offs on small messages. One
message per handle, posted and waited in turn, costs 190-280 us per 8 KiB message under that load
(85 us on an idle machine): per-handle Python overhead, so a pair should be one handle with all
its runs. The ``ucx_perftest`` line rate never writes its buffers (the sender's pages are the
kernel's zero page, which cma reads fastest); out of such untouched buffers the transport reaches
0.90 of it at 64 MiB, out of filled page buffers 0.73-0.83 at >= 16 MiB.

Per-run sends vs ``send_multi``
-------------------------------
Each zero-copy run is one tagged send straight from the page and one tagged receive straight
into the page. ``tag_send_multi`` was measured and not taken: ucxx sends a header message plus
one message per frame anyway, and ``tag_recv_multi`` receives into buffers *it* allocates, so the
receive side copies. Same benchmark, blocking: 8 KiB 0.67 GB/s per run vs 0.15 multi; 64 KiB
3.02 vs 0.72; 1 MiB 4.61 vs 1.34; 64 MiB 6.21 vs 0.72. Posting costs ~10-20 us of Python + ucxx
per message here, so pairs with many small runs are staged instead (the plan marks them).

Error handling and transports
-----------------------------
``error_handling=False`` (default): endpoints from worker addresses without UCX error handling,
so UCX picks shared memory (sysv eager below 8 KiB, cma rendezvous above; ``UCX_TLS`` left at
UCX's default); UCX never reports a dead peer -- its requests just stay pending -- so the control
plane's heartbeats must call :meth:`fail_peer`. ``error_handling=True``: UCX notices a SIGKILLed
peer by itself (4-8 ms on loopback, ~30 ms through the test harness) and the affected handles
fail with :class:`PeerLostError`, but UCX then drops shared memory for TCP: 0.19 / 0.39 / 0.81 /
0.84 / 0.80 GB/s at 8 KiB / 64 KiB / 1 MiB / 16 MiB / 64 MiB, 3.5-7.8x slower from 64 KiB up
(``ucx_perftest tcp -e``: 0.30-1.11 GB/s). UCX options are passed explicitly as
``ucx_options`` or set by the process entry point with :func:`configure_ucx_env`.

Staging
-------
:meth:`post_send_staged` gathers a pair's source pieces into a pooled staging buffer and sends it
as one message; :meth:`post_recv_staged` receives into a pooled buffer and scatters it into the
page before the handle reports done. On the host the gather/scatter is
:func:`statebridge.kernels.pack.copy_runs_host`: one vectorised numpy copy per distinct run
length below 64 KiB, one slice copy per larger run (2-5 GB/s here; 300 000 two-byte runs take
~12 ms). ``statebridge.kernels.pack.pack_ref``, the pure torch reference, ran at 0.02-0.09 GB/s
on the same runs, and the Triton ``pack`` needs CUDA.
End to end a staged pair moved 0.6-1.8 GB/s (two host copies plus one message). Page buffers on
CUDA are not supported yet (ConfigError).

Huge pages: torch CPU tensors are not backed by transparent huge pages, numpy arrays are
(``madvise`` from 4 MiB). Out of non-THP buffers the same transfers ran at 3.14 / 2.70 / 3.79
GB/s (1 / 16 / 64 MiB) instead of 4.61 / 5.51 / 6.21. :func:`alloc_buffer` returns a THP-backed
uint8 tensor for ``StateCache(..., buffer=alloc_buffer(n))``.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from statebridge.errors import (
    AbortedError,
    ClosedError,
    ConfigError,
    PeerLostError,
    TransferError,
    TransferTimeoutError,
)

log = logging.getLogger(__name__)

__all__ = [
    "PROGRESS_MODES",
    "STAGED_INDEX",
    "TAG_GENERATION_BITS",
    "TAG_INDEX_BITS",
    "TAG_SRC_RANK_BITS",
    "Transport",
    "RunTemplate",
    "TransferHandle",
    "alloc_buffer",
    "configure_ucx_env",
    "make_tag",
    "split_tag",
    "wait_all",
]

# -- tags -------------------------------------------------------------------------------------

TAG_GENERATION_BITS = 32
TAG_SRC_RANK_BITS = 8
TAG_INDEX_BITS = 24
_MAX_GENERATION = (1 << TAG_GENERATION_BITS) - 1
_MAX_SRC_RANK = (1 << TAG_SRC_RANK_BITS) - 1
_MAX_INDEX = (1 << TAG_INDEX_BITS) - 1
#: Index of a staged pair's single message (never a zero-copy run index).
STAGED_INDEX = _MAX_INDEX
_MAX_RUNS = STAGED_INDEX  # zero-copy run indices are 0 .. STAGED_INDEX - 1


def _check_field(name: str, value: object, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) <= maximum:
        raise ConfigError(f"tag field {name} must be an integer in [0, {maximum}], got {value!r}")
    return int(value)


def make_tag(generation: int, src_rank: int, index: int) -> int:
    """The 64-bit tag of message ``index`` of source rank ``src_rank`` in request attempt
    ``generation`` (32 | 8 | 24 bits); out-of-range fields raise :class:`ConfigError`."""
    g = _check_field("generation", generation, _MAX_GENERATION)
    s = _check_field("src_rank", src_rank, _MAX_SRC_RANK)
    i = _check_field("index", index, _MAX_INDEX)
    return (g << 32) | (s << 24) | i


def split_tag(tag: int) -> tuple[int, int, int]:
    """``(generation, src_rank, index)`` of a tag made by :func:`make_tag`."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ConfigError(f"tag must be a 64-bit unsigned integer, got {tag!r}")
    return tag >> 32, (tag >> 24) & _MAX_SRC_RANK, tag & _MAX_INDEX


# -- environment and memory helpers --------------------------------------------------------------

def configure_ucx_env(*, tls: str | None = None, proto_info: bool = False,
                      quiet_unused_env_warnings: bool = True,
                      environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``UCX_*`` variables for this process; call it from a process entry point before the
    first :class:`Transport` (never called on import). Returns what it set.

    - ``tls``: ``UCX_TLS`` (e.g. ``"sm,self"`` or ``"tcp,self"``); None leaves UCX's choice.
    - ``proto_info``: ``UCX_PROTO_INFO=y`` prints which transport each protocol uses.
    - ``quiet_unused_env_warnings``: ``UCX_WARN_UNUSED_ENV_VARS=n``; ucxx sets
      ``UCX_MEMTYPE_CACHE`` on import, which this libucx build does not know and warns about.
    """
    environ = os.environ if environ is None else environ
    changes: dict[str, str] = {}
    if tls is not None:
        changes["UCX_TLS"] = tls
    if proto_info:
        changes["UCX_PROTO_INFO"] = "y"
    if quiet_unused_env_warnings:
        changes["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    environ.update(changes)
    return changes


def alloc_buffer(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed 1-D uint8 CPU tensor of ``nbytes`` for a page buffer or staging.

    With ``huge_pages`` the memory comes from numpy, which asks the kernel for transparent huge
    pages (``madvise``) on allocations of 4 MiB and more; plain torch CPU tensors do not, and
    shared-memory transfers out of 4 KiB pages run at about half the speed.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    if huge_pages:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return torch.zeros(nbytes, dtype=torch.uint8)


# -- byte runs ----------------------------------------------------------------------------------

def _as_runs(runs: object, what: str) -> np.ndarray:
    """``runs`` as a C-contiguous int64 ``[R, 3]`` array; :class:`ConfigError` otherwise."""
    if type(runs) is np.ndarray and runs.dtype == np.int64 and runs.ndim == 2 \
            and runs.shape[1] == 3 and runs.flags.c_contiguous:
        return runs                          # what PairPlan.runs_at() returns
    if isinstance(runs, torch.Tensor):
        runs = runs.detach().cpu().numpy()
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 3 \
            or not np.issubdtype(runs.dtype, np.integer):
        raise ConfigError(f"{what} must be an integer array [R, 3], got "
                          f"{getattr(runs, 'shape', type(runs).__name__)} "
                          f"{getattr(runs, 'dtype', '')}")
    return np.ascontiguousarray(runs, dtype=np.int64)


def _check_span(runs: np.ndarray, col: int, size: int, what: str, side: str) -> None:
    """Every ``runs[:, col] .. + len`` must lie inside ``[0, size)``."""
    if len(runs) == 0:
        return
    off, length = runs[:, col], runs[:, 2]
    end = off + length
    if off.min() >= 0 and length.min() >= 0 and end.max() <= size:
        return
    bad = np.flatnonzero((off < 0) | (length < 0) | (end > size))
    if bad.size:
        i = int(bad[0])
        raise ConfigError(f"{what} run {i} {runs[i].tolist()} lies outside the {side} "
                          f"({size} bytes)")


#: Most cached buffer views of a transport (see Transport._post_runs); ~200 B each.
_MAX_CACHED_ARRAYS = 1 << 16


class RunTemplate:
    """The zero-copy runs of one rank pair with offsets relative to a page, checked once.

    A rank posts the same runs for every request; only the page moves. Build the template once
    per peer (:meth:`Transport.template`) and post it at a page's byte offset with
    :meth:`Transport.post_runs`: per post only the page's bounds are checked.
    """

    __slots__ = ("runs", "col", "offsets", "lengths", "nbytes", "extent")

    def __init__(self, runs: object, col: int, what: str = "runs") -> None:
        runs = _as_runs(runs, what)
        if len(runs) > _MAX_RUNS:
            raise ConfigError(f"{len(runs)} runs exceed the {_MAX_RUNS} a tag index can number")
        offsets, lengths = runs[:, col], runs[:, 2]
        if len(runs) and (offsets.min() < 0 or lengths.min() < 0):
            i = int(np.flatnonzero((offsets < 0) | (lengths < 0))[0])
            raise ConfigError(f"{what} run {i} {runs[i].tolist()} has a negative offset or "
                              f"length")
        self.runs = runs
        self.col = col
        self.offsets: list[int] = offsets.tolist()
        self.lengths: list[int] = lengths.tolist()
        self.nbytes = int(lengths.sum())
        self.extent = int((offsets + lengths).max()) if len(runs) else 0

    def __len__(self) -> int:
        return len(self.offsets)

    def outside(self, base: int, size: int, what: str, side: str) -> str:
        """The error message for posting at ``base`` in a ``size``-byte buffer."""
        for i, (off, n) in enumerate(zip(self.offsets, self.lengths)):
            if not 0 <= base + off <= base + off + n <= size:
                row = self.runs[i].tolist()
                row[self.col] += base
                return f"{what} run {i} {row} lies outside the {side} ({size} bytes)"
        return f"{what} runs at offset {base} lie outside the {side} ({size} bytes)"


def _copy_runs(frm: np.ndarray, runs: np.ndarray, to: np.ndarray) -> None:
    """``to[b:b+n] = frm[a:a+n]`` for every run ``(a, b, n)``; runs must already be checked
    against both buffers. The one host copy is :func:`statebridge.kernels.pack.copy_runs_host`
    (imported on first use: statebridge.kernels imports triton)."""
    from statebridge.kernels.pack import copy_runs_host

    copy_runs_host(frm, runs, to)


# -- UCX status classification ---------------------------------------------------------------

_UCS_OK = 0
_UCS_ERR_CANCELED = -16
_UCS_ERR_MESSAGE_TRUNCATED = -9     # a message longer than the posted receive
#: Most bytes of a rejected unannounced message that are received (into scratch); UCX
#: truncates the rest.
_REJECT_SCRATCH_BYTES = 64 * 1024
# The peer or the network is gone: unreachable, not connected, connection reset, link and
# endpoint failures (ucs/type/status.h).
_PEER_STATUSES = frozenset([-6, -24, -25, *range(-89, -39)])

PROGRESS_MODES = ("blocking", "polling", "background", "thread")

_PENDING, _DONE, _FAILED = 0, 1, 2
#: (direction, handle kind) -> the counters a completed handle adds to (Transport._finished).
_DONE_COUNTERS = {(d, k): (f"messages_{side}", f"bytes_{side}", f"{k}_messages_{side}")
                  for d, side in (("send", "sent"), ("recv", "received"))
                  for k in ("zero_copy", "staged", "multi")}


def _failure_kind(error: BaseException) -> str:
    if isinstance(error, TransferError):
        return error.kind
    if isinstance(error, ClosedError):
        return "closed"
    return "transfer_error"


class TransferHandle:
    """One posted transfer of one rank pair: a zero-copy run list or one staged message.

    Thread-safe and pollable: :meth:`done` says whether it is no longer in flight (it progresses
    the transport once, never sleeps); :meth:`wait` returns when it completed and raises when it
    failed. A staged receive is done only after its staging buffer was scattered into the page.
    """

    __slots__ = ("_transport", "direction", "kind", "peer_id", "generation", "src_rank",
                 "nbytes", "messages", "request_id", "posted_at", "finished_at", "_requests",
                 "_checked", "_staging", "_on_success", "_state", "_error", "_timed_out",
                 "_lock", "__weakref__")

    def __init__(self, transport: "Transport", *, direction: str, kind: str,
                 peer_id: str | None, generation: int, src_rank: int, nbytes: int,
                 messages: int, request_id: str | None, requests: list,
                 staging: torch.Tensor | None = None, on_success=None) -> None:
        self._transport = transport
        self.direction = direction          # "send" | "recv"
        self.kind = kind                    # "zero_copy" | "staged" | "multi"
        self.peer_id = peer_id
        self.generation = generation
        self.src_rank = src_rank
        self.nbytes = nbytes
        self.messages = messages
        self.request_id = request_id
        self.posted_at = time.monotonic()
        self.finished_at: float | None = None
        self._requests = requests
        self._checked = 0                   # requests[:_checked] are known complete and OK
        self._staging = staging
        self._on_success = on_success       # e.g. the scatter of a staged receive
        self._state = _PENDING
        self._error: BaseException | None = None
        self._timed_out = False
        self._lock = threading.Lock()

    # -- public ------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the transfer completed or failed (then :meth:`wait` returns or raises)."""
        if self._state != _PENDING:
            return True
        self._transport._drive(0.0, None)
        return self._update()

    def finished(self) -> bool:
        """Like :meth:`done` without progressing UCX: for a caller that checks many handles
        after one :meth:`Transport.progress` (one progress per handle costs O(handles))."""
        if self._state != _PENDING:
            return True
        reqs = self._requests
        if reqs and not reqs[-1].completed:     # the common "not yet": no lock, no loop
            return False
        return self._update()

    def wait(self, timeout: float) -> None:
        """Block until done, at most ``timeout`` seconds.

        Raises :class:`TransferTimeoutError` when still in flight after ``timeout`` (the handle
        stays posted: wait again or :meth:`cancel`), :class:`PeerLostError` when the peer was
        declared lost (or UCX saw it die), :class:`AbortedError` after :meth:`cancel`,
        :class:`ClosedError` after the transport was closed, :class:`TransferError` with the UCX
        error otherwise.
        """
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise ConfigError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while not self._update():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._transport._drive(0.0, None)
                if self._update():
                    break
                self._note_timeout()
                raise TransferTimeoutError(
                    f"{self._describe()} not done after {timeout:g} s "
                    f"({self._checked}/{len(self._requests)} messages confirmed)",
                    request_id=self.request_id, peer=self.peer_id)
            self._transport._drive(min(remaining, 0.05), self._ready)
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Cancel the transfer (idempotent; no effect once done): its UCX requests are
        cancelled and :meth:`wait` raises :class:`AbortedError`. A receive that UCX had
        already matched may still finish writing its bytes."""
        self._fail(AbortedError(f"{self._describe()} cancelled", request_id=self.request_id,
                                peer=self.peer_id))

    @property
    def staged(self) -> bool:
        """Whether the bytes travel through a staging buffer (one message)."""
        return self.kind == "staged"

    @property
    def error(self) -> BaseException | None:
        """The failure once failed, else None."""
        return self._error

    @property
    def ok(self) -> bool:
        """True once completed successfully."""
        return self._state == _DONE

    @property
    def elapsed(self) -> float:
        """Seconds from posting to completion (or until now while in flight)."""
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.posted_at

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _DONE: "done", _FAILED: "failed"}[self._state]
        return (f"TransferHandle({self.direction} peer={self.peer_id!r} gen={self.generation} "
                f"src_rank={self.src_rank} {self.nbytes} B in {self.messages} {self.kind} msg, "
                f"{state})")

    # -- internals ----------------------------------------------------------------------------
    def _describe(self) -> str:
        peer = f" peer {self.peer_id!r}" if self.peer_id is not None else ""
        rid = f" request {self.request_id!r}" if self.request_id is not None else ""
        return (f"{self.kind.replace('_', '-')} {self.direction} of generation "
                f"{self.generation} src_rank {self.src_rank}{rid}{peer}")

    def _ready(self) -> bool:
        """Whether every UCX request has completed (cheap; no state change)."""
        if self._state != _PENDING:
            return True
        reqs = self._requests
        i = self._checked
        while i < len(reqs) and reqs[i].completed:
            i += 1
        return i == len(reqs)

    def _update(self) -> bool:
        """Advance the state from the UCX requests; True once no longer in flight."""
        if self._state != _PENDING:
            return True
        with self._lock:
            if self._state != _PENDING:
                return True
            reqs = self._requests
            i = self._checked
            failed = None
            while i < len(reqs) and reqs[i].completed:
                if reqs[i].status != _UCS_OK:
                    failed = reqs[i]
                    break
                i += 1
            self._checked = i
            if failed is None and i < len(reqs):
                return False
            if failed is None:
                try:
                    if self._on_success is not None:
                        self._on_success()
                except Exception as e:  # noqa: BLE001 -- becomes the handle's error
                    failed_error: BaseException = TransferError(
                        f"{self._describe()}: scatter into the page failed: {e}",
                        request_id=self.request_id, peer=self.peer_id)
                    self._finish_locked(_FAILED, failed_error, quiescent=True)
                    return True
                self._finish_locked(_DONE, None, quiescent=True)
                return True
            error = self._transport._classify(self, failed)
        self._fail(error)
        return True

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            # Dropping ucxx's request objects cancels them (ucp_request_cancel in __dealloc__).
            quiescent = all(r.completed for r in self._requests)
            self._finish_locked(_FAILED, error, quiescent=quiescent)

    def _finish_locked(self, state: int, error: BaseException | None, *, quiescent: bool) -> None:
        self._state = state
        self._error = error
        self.finished_at = time.monotonic()
        self._requests = []
        self._on_success = None
        staging, self._staging = self._staging, None
        self._transport._finished(self, staging, quiescent)

    def _note_timeout(self) -> None:
        if not self._timed_out:
            self._timed_out = True
            self._transport._count_failure("timeout")


def wait_all(handles: Iterable[TransferHandle], timeout: float) -> None:
    """Wait for every handle within one shared ``timeout``; raises the first failure."""
    deadline = time.monotonic() + timeout
    for h in handles:
        h.wait(max(0.0, deadline - time.monotonic()))


# -- staging pool ---------------------------------------------------------------------------------

class _StagingPool:
    """Reusable host staging buffers in power-of-two size classes (>= 64 KiB), THP-backed.

    At most ``max_cached_bytes`` of free buffers are kept; a buffer whose transfer failed while
    UCX might still write into it is quarantined (kept alive, never reused) until close.
    """

    _MIN_CLASS = 64 * 1024

    def __init__(self, max_cached_bytes: int) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._cached = 0
        self._lock = threading.Lock()
        self.allocations = 0
        self.quarantined: list[torch.Tensor] = []

    def _size_class(self, nbytes: int) -> int:
        return max(self._MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (its full size class)."""
        size = self._size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._cached -= size
                return free.pop()
            self.allocations += 1
        return alloc_buffer(size)

    def release(self, buf: torch.Tensor, *, quiescent: bool = True) -> None:
        with self._lock:
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
        with self._lock:
            self._free.clear()
            self._cached = 0
            self.quarantined.clear()


class _Peer:
    __slots__ = ("peer_id", "address", "endpoint", "serial", "closing")

    def __init__(self, peer_id: str, address: bytes, endpoint: Any, serial: int) -> None:
        self.peer_id = peer_id
        self.address = address
        self.endpoint = endpoint
        self.serial = serial
        self.closing = False


# -- the transport ----------------------------------------------------------------------------

class Transport:
    """One rank's UCX worker over its page ``buffer`` (a 1-D contiguous uint8 CPU tensor).

    Args:
        buffer: the :class:`~statebridge.state.cache.StateCache` buffer; every run offset is an
            absolute byte offset into it (``PairPlan.runs_at(src_base, dst_base)``).
        error_handling: UCX endpoint error handling (see the module docstring: detects dead
            peers in milliseconds, but forces TCP, 3.5-8x slower on one host).
        progress_mode: ``"blocking"`` (default; callers progress in :meth:`TransferHandle.done`,
            :meth:`TransferHandle.wait` and :meth:`progress`, sleeping on the worker's epoll fd),
            ``"polling"`` (the same, spinning), ``"background"`` (a Python thread of the
            transport sleeps on the epoll fd and progresses on every event) or ``"thread"``
            (ucxx's C++ progress thread with delayed submission). Rendezvous transfers move only
            while both sides progress: a rank that computes between polls should use
            ``"background"``.
        ucx_options: UCX configuration for this worker's context, without the ``UCX_`` prefix
            (e.g. ``{"TLS": "sm,self"}``); environment variables still apply to unset keys.
        staging_pool_bytes: most bytes of free staging buffers kept for reuse.
        name: label used in logs and errors.

    Thread-safe: any thread may post, poll, wait, fail peers and close.
    """

    def __init__(self, buffer: torch.Tensor, *, error_handling: bool = False,
                 progress_mode: str = "blocking", ucx_options: Mapping[str, str] | None = None,
                 staging_pool_bytes: int = 256 * 1024 * 1024, name: str = "transport") -> None:
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 \
                or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ConfigError(f"buffer must be a contiguous 1-D uint8 tensor, got "
                              f"{getattr(buffer, 'dtype', type(buffer).__name__)} "
                              f"{list(getattr(buffer, 'shape', []))}")
        if buffer.device.type != "cpu":
            raise ConfigError(f"page buffers on {buffer.device} are not supported yet (CPU only)")
        if progress_mode not in PROGRESS_MODES:
            raise ConfigError(f"unknown progress_mode {progress_mode!r}; expected one of "
                              f"{PROGRESS_MODES}")
        if not isinstance(error_handling, bool):
            raise ConfigError(f"error_handling must be a bool, got {error_handling!r}")
        if isinstance(staging_pool_bytes, bool) or not isinstance(staging_pool_bytes, int) \
                or staging_pool_bytes < 0:
            raise ConfigError(f"staging_pool_bytes must be a non-negative integer, got "
                              f"{staging_pool_bytes!r}")

        # Imported here, not at module level: importing ucxx edits os.environ (see docstring).
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self._ucx = ucx_api
        self._Array = Array
        self._Tag = ucx_api.UCXXTag
        self.name = name
        self.error_handling = error_handling
        self.progress_mode = progress_mode
        self._buffer = buffer
        self._np = buffer.numpy()
        self._mv = memoryview(self._np)
        self._arrays: dict[tuple[int, int], Any] = {}     # see _post_runs
        self._size = buffer.numel()

        options = {str(k): str(v) for k, v in (ucx_options or {}).items()}
        self._context = ucx_api.UCXContext(
            options, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(
            self._context, enable_delayed_submission=progress_mode == "thread")
        self._poller = None
        self._wake_r = self._wake_w = -1
        if progress_mode == "thread":
            self._worker.start_progress_thread(polling_mode=False, epoll_timeout=10)
        else:
            self._worker.init_blocking_progress_mode()
            if progress_mode in ("blocking", "background"):
                self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                self._poller = select.poll()
                self._poller.register(self._worker.epoll_file_descriptor, select.POLLIN)
                self._poller.register(self._wake_r, select.POLLIN)
        self._address = self._worker.address.tobytes()

        self._lock = threading.RLock()               # peers, handles, counters, closed
        self._progress_lock = threading.Lock()       # one thread progresses/sleeps at a time
        self._round = threading.Condition(threading.Lock())   # progress rounds, for the others
        self._round_waiters = 0                      # threads waiting on _round
        self._sleeping = False
        self._posts = 0
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._lost: dict[str, str] = {}              # peer id -> why it was declared lost
        self._serial = 0
        self._ep_events: collections.deque = collections.deque()   # from UCX callbacks
        self._outstanding: dict[int, TransferHandle] = {}
        self._pool = _StagingPool(staging_pool_bytes)
        self._counters = collections.Counter()
        self._abandoned: list[_Peer] = []     # endpoints of lost peers, closed without waiting
        self._failures = collections.Counter()
        self._progress_thread: threading.Thread | None = None
        self._rejecting: list[tuple[Any, np.ndarray]] = []   # see reject_unannounced()
        self._unexpected_head: tuple[int, float] | None = None
        if progress_mode == "background":
            self._progress_thread = threading.Thread(
                target=self._progress_loop, name=f"statebridge-{name}-progress", daemon=True)
            self._progress_thread.start()
        log.info("%s: UCX worker ready (%d-byte buffer, error_handling=%s, progress=%s)",
                 name, self._size, error_handling, progress_mode)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """This worker's UCX address, for the control-plane handshake."""
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._peers)

    def connect(self, peer_id: str, address: bytes) -> None:
        """Endpoint to the peer worker at ``address`` (idempotent for the same address).

        A peer declared lost (:meth:`fail_peer`) may be connected again, e.g. after a restart;
        a live peer id with a different address is a :class:`ConfigError`.
        """
        if not isinstance(peer_id, str) or not peer_id:
            raise ConfigError(f"peer_id must be a non-empty string, got {peer_id!r}")
        if not isinstance(address, (bytes, bytearray, memoryview)) or len(address) == 0:
            raise ConfigError(f"address of peer {peer_id!r} must be non-empty bytes, got "
                              f"{type(address).__name__}")
        address = bytes(address)
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
            if peer is not None:
                if peer.address == address:
                    return
                raise ConfigError(f"peer {peer_id!r} is already connected with another address; "
                                  f"disconnect() or fail_peer() it first")
            try:
                ucx_address = self._ucx.UCXAddress.create_from_buffer(address)
                endpoint = self._worker.create_endpoint_from_worker_address(
                    ucx_address, self.error_handling)
            except Exception as e:  # noqa: BLE001 -- ucxx raises its own exception types
                raise TransferError(f"{self.name}: cannot create an endpoint to {peer_id!r}: {e}",
                                    peer=peer_id) from e
            self._serial += 1
            peer = _Peer(peer_id, address, endpoint, self._serial)
            if self.error_handling:
                endpoint.set_close_callback(self._on_endpoint_closed,
                                            cb_args=(peer_id, peer.serial))
            self._peers[peer_id] = peer
            self._lost.pop(peer_id, None)
            self._counters["connects"] += 1
        log.info("%s: connected to %s", self.name, peer_id)

    def disconnect(self, peer_id: str) -> None:
        """Close the endpoint to ``peer_id`` (idempotent); its outstanding handles fail with
        :class:`ClosedError`."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            handles = [h for h in self._outstanding.values() if h.peer_id == peer_id]
        if peer is None:
            return
        for h in handles:
            h._fail(ClosedError(f"{self.name}: peer {peer_id!r} disconnected while "
                                f"{h._describe()} was in flight"))
        self._close_endpoint(peer)

    def fail_peer(self, peer_id: str, reason: str) -> int:
        """The control plane declared ``peer_id`` dead: cancel every outstanding request
        involving it; those handles raise :class:`PeerLostError` (with ``peer`` set). Later
        posts to it raise at once until it is connected again. Receives posted with peer None
        belong to no peer and are not touched (cancel or time them out). Returns how many
        handles failed."""
        with self._lock:
            self._lost[peer_id] = str(reason)
            peer = self._peers.pop(peer_id, None)
            handles = [h for h in self._outstanding.values() if h.peer_id == peer_id]
            self._counters["peers_failed"] += 1
        if peer is not None:
            # Closing the endpoint cancels the requests registered on it (status CANCELED). The
            # peer is dead or unreachable: a blocking close would wait for a flush that never
            # completes (seconds behind a cut link, stalling this rank's heartbeats), so the
            # close is only started here and the endpoint kept until the transport closes.
            self._close_endpoint(peer, blocking=False)
        for h in handles:
            h._fail(PeerLostError(f"{self.name}: peer {peer_id!r} lost ({reason}) during "
                                  f"{h._describe()}", request_id=h.request_id, peer=peer_id))
        if handles:
            log.warning("%s: peer %s lost (%s): %d transfers failed", self.name, peer_id, reason,
                        len(handles))
        return len(handles)

    def close(self) -> None:
        """Cancel everything outstanding (handles raise :class:`ClosedError`), close every
        endpoint and the worker. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._outstanding.values())
            peers = list(self._peers.values())
            self._peers.clear()
        for h in handles:
            h._fail(ClosedError(f"{self.name}: transport closed while {h._describe()} was in "
                                f"flight"))
        if self._progress_thread is not None:
            self._wake(force=True)
            self._progress_thread.join(5.0)
        with self._progress_lock:   # no thread is inside progress() or poll() past this point
            for peer in peers:
                self._close_endpoint(peer)
            if self.progress_mode == "thread":
                self._worker.stop_progress_thread()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            self._poller = None
            self._rejecting.clear()
            self._abandoned.clear()
            # Destroying the worker cancels what is left and drains unexpected messages.
            self._worker = None
            self._context = None
        with self._round:
            self._round.notify_all()
        self._pool.clear()
        log.info("%s: closed", self.name)

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Transport({self.name!r}, {self._size} B, peers={len(self._peers)}, "
                f"outstanding={len(self._outstanding)}, error_handling={self.error_handling}, "
                f"progress={self.progress_mode}{', closed' if self._closed else ''})")

    # -- posting ----------------------------------------------------------------------------------
    def post_send(self, peer_id: str, generation: int, src_rank: int, runs: object, *,
                  request_id: str | None = None) -> TransferHandle:
        """Send every run zero-copy, one tagged message per run, straight from the buffer.

        ``runs``: int ``[R, 3]`` (local src offset, dst offset, length), absolute offsets; run
        ``i`` travels with tag ``make_tag(generation, src_rank, i)``.
        """
        return self.post_runs("send", peer_id, generation, src_rank, 0, RunTemplate(runs, 0),
                              request_id=request_id)

    def post_recv(self, peer_id: str | None, generation: int, src_rank: int, runs: object, *,
                  request_id: str | None = None) -> TransferHandle:
        """Receive every run zero-copy, straight into the buffer (``runs[:, 1]`` absolute dst
        offsets). With ``peer_id`` the receives belong to that peer (:meth:`fail_peer` and UCX
        errors fail them); with None they match the tags from any peer."""
        return self.post_runs("recv", peer_id, generation, src_rank, 0, RunTemplate(runs, 1),
                              request_id=request_id)

    def template(self, runs: object, direction: str) -> RunTemplate:
        """``runs`` (``[R, 3]``: src offset, dst offset, length; relative to a page) as a
        checked :class:`RunTemplate` for :meth:`post_runs` in ``direction`` ("send" takes the
        source offsets, "recv" the destination offsets)."""
        if direction not in ("send", "recv"):
            raise ConfigError(f"direction must be 'send' or 'recv', got {direction!r}")
        return RunTemplate(runs, 0 if direction == "send" else 1)

    def post_runs(self, direction: str, peer_id: str | None, generation: int, src_rank: int,
                  base: int, template: RunTemplate, *,
                  request_id: str | None = None) -> TransferHandle:
        """:meth:`post_send` / :meth:`post_recv` of a :class:`RunTemplate` at byte offset
        ``base`` of the buffer (a page's start): the rank's per-request post."""
        send = direction == "send"
        if not send and direction != "recv":
            raise ConfigError(f"direction must be 'send' or 'recv', got {direction!r}")
        if type(base) is not int or base < 0 or base + template.extent > self._size:
            raise ConfigError(template.outside(base, self._size, "send" if send else "receive",
                                               "page buffer")
                              if type(base) is int else f"base must be an int, got {base!r}")
        if type(generation) is not int or type(src_rank) is not int \
                or not 0 <= generation <= _MAX_GENERATION or not 0 <= src_rank <= _MAX_SRC_RANK:
            make_tag(generation, src_rank, 0)          # raises with the offending field
            generation, src_rank = int(generation), int(src_rank)
        tag0 = (generation << 32) | (src_rank << 24)
        with self._lock:
            if send:
                op = self._endpoint(peer_id).tag_send
            elif peer_id is None:                  # a receive matching any peer
                self._check_open()
                op = self._worker.tag_recv
            else:
                op = self._endpoint(peer_id).tag_recv
            requests = self._post_runs(op, base, template, tag0, peer_id)
            handle = TransferHandle(self, direction=direction, kind="zero_copy",
                                    peer_id=peer_id, generation=generation, src_rank=src_rank,
                                    nbytes=template.nbytes, messages=len(template.offsets),
                                    request_id=request_id, requests=requests)
            self._register(handle)
        return handle

    def post_send_staged(self, peer_id: str, generation: int, src_rank: int, pack_runs: object,
                         *, request_id: str | None = None) -> TransferHandle:
        """Gather ``pack_runs`` (absolute src offset, staging offset, length) into a pooled
        staging buffer and send it as ONE message (index :data:`STAGED_INDEX`). The staging
        size is ``max(staging offset + length)``."""
        pack_runs = _as_runs(pack_runs, "pack_runs")
        _check_span(pack_runs, 0, self._size, "pack", "page buffer")
        nbytes = int((pack_runs[:, 1] + pack_runs[:, 2]).max()) if len(pack_runs) else 0
        _check_span(pack_runs, 1, nbytes, "pack", "staging buffer")
        tag = make_tag(generation, src_rank, STAGED_INDEX)
        staging = self._pool.acquire(nbytes)
        try:
            _copy_runs(self._np, pack_runs, staging.numpy())
            with self._lock:
                endpoint = self._endpoint(peer_id)
                requests = self._post_one(endpoint.tag_send, staging.numpy()[:nbytes], tag,
                                          peer_id)
                handle = TransferHandle(self, direction="send", kind="staged", peer_id=peer_id,
                                        generation=generation, src_rank=src_rank, nbytes=nbytes,
                                        messages=1, request_id=request_id, requests=requests,
                                        staging=staging)
                self._counters["staging_buffers_used"] += 1
                self._counters["staging_bytes"] += nbytes
                self._register(handle)
        except BaseException:
            self._pool.release(staging)
            raise
        return handle

    def post_recv_staged(self, peer_id: str | None, generation: int, src_rank: int, nbytes: int,
                         unpack_runs: object, *, request_id: str | None = None) -> TransferHandle:
        """Receive one ``nbytes`` staged message into a pooled staging buffer; when it arrives,
        scatter ``unpack_runs`` (staging offset, absolute dst offset, length) into the page.
        The handle is done only after the scatter."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        nbytes = int(nbytes)
        unpack_runs = _as_runs(unpack_runs, "unpack_runs")
        _check_span(unpack_runs, 0, nbytes, "unpack", "staging message")
        _check_span(unpack_runs, 1, self._size, "unpack", "page buffer")
        tag = make_tag(generation, src_rank, STAGED_INDEX)
        staging = self._pool.acquire(nbytes)
        try:
            with self._lock:
                if peer_id is None:
                    self._check_open()
                target = self._worker if peer_id is None else self._endpoint(peer_id)
                requests = self._post_one(target.tag_recv, staging.numpy()[:nbytes], tag,
                                          peer_id)
                page = self._np
                handle = TransferHandle(
                    self, direction="recv", kind="staged", peer_id=peer_id,
                    generation=generation, src_rank=src_rank, nbytes=nbytes, messages=1,
                    request_id=request_id, requests=requests, staging=staging,
                    on_success=lambda: _copy_runs(staging.numpy(), unpack_runs, page))
                self._counters["staging_buffers_used"] += 1
                self._counters["staging_bytes"] += nbytes
                self._register(handle)
        except BaseException:
            self._pool.release(staging)
            raise
        return handle

    # -- measured alternative, not used by the connector ------------------------------------------
    def _post_send_multi(self, peer_id: str, generation: int, src_rank: int, runs: object, *,
                         request_id: str | None = None) -> TransferHandle:
        """All runs in one ucxx ``tag_send_multi`` (header + one message per run, same tag).

        Kept for ``benchmarks/bench_transport.py``, which shows why the connector does not use
        it: the matching :meth:`_post_recv_multi` lands in buffers ucxx allocates, so the
        receive side copies; see the module docstring for the numbers.
        """
        runs = _as_runs(runs, "runs")
        _check_span(runs, 0, self._size, "send", "page buffer")
        tag = make_tag(generation, src_rank, 0)
        with self._lock:
            endpoint = self._endpoint(peer_id)
            mv, Array = self._mv, self._Array
            arrays = tuple(Array(mv[o:o + n]) for o, n in runs[:, [0, 2]].tolist())
            requests = self._post_one(lambda _, t: endpoint.tag_send_multi(arrays, t), None,
                                      tag, peer_id)
            handle = TransferHandle(self, direction="send", kind="multi", peer_id=peer_id,
                                    generation=generation, src_rank=src_rank,
                                    nbytes=int(runs[:, 2].sum()), messages=len(runs),
                                    request_id=request_id, requests=requests)
            self._register(handle)
        return handle

    def _post_recv_multi(self, peer_id: str, generation: int, src_rank: int, runs: object, *,
                         request_id: str | None = None) -> TransferHandle:
        """Receive a :meth:`_post_send_multi` (into ucxx's buffers, then copied into the runs)."""
        runs = _as_runs(runs, "runs")
        _check_span(runs, 1, self._size, "receive", "page buffer")
        tag = make_tag(generation, src_rank, 0)
        starts = np.concatenate([[0], np.cumsum(runs[:, 2])[:-1]]).astype(np.int64)
        stage_runs = np.stack([starts, runs[:, 1], runs[:, 2]], axis=1)
        total = int(runs[:, 2].sum())
        page = self._np

        def land() -> None:
            frames = [np.asarray(b, dtype=np.uint8).reshape(-1) for b in request.py_buffers]
            data = frames[0] if len(frames) == 1 else np.concatenate(frames)
            if data.size != total:
                raise TransferError(f"multi receive got {data.size} bytes, expected {total}")
            _copy_runs(data, stage_runs, page)

        with self._lock:
            endpoint = self._endpoint(peer_id)
            (request,) = self._post_one(lambda _, t: endpoint.tag_recv_multi(t), None, tag,
                                        peer_id)
            handle = TransferHandle(self, direction="recv", kind="multi", peer_id=peer_id,
                                    generation=generation, src_rank=src_rank, nbytes=total,
                                    messages=len(runs), request_id=request_id,
                                    requests=[request], on_success=land)
            self._register(handle)
        return handle

    # -- progress ---------------------------------------------------------------------------------
    def progress(self, timeout: float = 0.0) -> None:
        """Drive UCX progress once; with ``timeout`` > 0 (blocking mode) sleep up to that long
        for an event first. Senders that do not wait on their handles should call this (or
        :meth:`TransferHandle.done`) from their loop so rendezvous sends complete."""
        self._drive(max(0.0, float(timeout)), None)

    def fileno(self) -> int:
        """A file descriptor that becomes readable when UCX has work (blocking mode), for an
        external poller; call :meth:`arm` before sleeping on it."""
        if self.progress_mode not in ("blocking", "polling"):
            raise ConfigError(f"fileno() is for caller-driven progress, not "
                              f"{self.progress_mode!r}")
        self._check_open()
        return self._worker.epoll_file_descriptor

    def arm(self) -> bool:
        """Progress, then arm the worker: True when nothing is pending and it is safe to sleep
        on :meth:`fileno`; False means progress again first."""
        if self.progress_mode not in ("blocking", "polling"):
            raise ConfigError(f"arm() is for caller-driven progress, not {self.progress_mode!r}")
        with self._progress_lock:
            self._check_open()
            self._worker.progress()
            return bool(self._worker.arm())

    def _drive(self, block_s: float, ready) -> None:
        """One progress round, sleeping up to ``block_s`` for UCX events. ``ready()`` (optional)
        says whether the caller's wait is over, so a round never sleeps past a completion.

        One thread at a time progresses (and sleeps in ``poll()`` on the worker's epoll fd and a
        wake-up pipe); the others wait for the end of its round. In ``background`` mode the
        transport's own thread is that thread; in ``thread`` mode ucxx's C++ thread progresses
        and callers only look at completion flags.
        """
        if self._ep_events:
            self._process_endpoint_events()
        if self._closed:
            return
        if self.progress_mode == "thread":
            if block_s > 0:
                time.sleep(min(block_s, 50e-6))
            return
        if not self._progress_lock.acquire(blocking=False):
            if block_s > 0:
                with self._round:   # the progressing thread notifies under this lock
                    self._round_waiters += 1
                    try:
                        if ready is None or not ready():
                            self._round.wait(min(block_s, 0.05))
                    finally:
                        self._round_waiters -= 1
            return
        try:
            self._progress_round(block_s, ready)
        finally:
            self._progress_lock.release()
            # Only when a thread waits for this round (the common case -- a rank's own loop
            # progressing -- has none; notify_all costs more than the progress itself). A
            # waiter that registers after this check tests ready() after this round anyway.
            if self._round_waiters:
                with self._round:
                    self._round.notify_all()
        if self._ep_events:
            self._process_endpoint_events()

    def _progress_round(self, block_s: float, ready) -> None:
        if self._closed:
            return
        self._worker.progress()
        if block_s <= 0 or (ready is not None and ready()):
            return
        if self.progress_mode == "polling":
            os.sched_yield()
            return
        # A post from another thread after ``seen`` either sees ``_sleeping`` and writes to
        # the wake-up pipe, or bumps ``_posts`` before the check below: no lost wake-ups.
        seen = self._posts
        self._sleeping = True
        try:
            if self._worker.arm() and self._posts == seen:
                events = self._poller.poll(max(1, int(block_s * 1000)))
                if any(fd == self._wake_r for fd, _ in events):
                    self._drain_wake()
        finally:
            self._sleeping = False
        self._worker.progress()

    def _progress_loop(self) -> None:
        """``background`` mode: progress whenever UCX (or a post) has something to do."""
        while not self._closed:
            try:
                self._drive(0.5, None)
            except Exception:  # noqa: BLE001 -- keep progressing; log once per failure
                log.exception("%s: progress thread", self.name)
                time.sleep(0.01)

    def _wake(self, force: bool = False) -> None:
        """After a post: make a thread sleeping in ``poll()`` progress it now."""
        self._posts += 1
        if (force or self._sleeping) and self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # -- stale messages -----------------------------------------------------------------------
    def discard_unexpected(self, generation: int, src_rank: int | None = None, *,
                           timeout: float = 1.0) -> int:
        """Receive and drop messages of ``generation`` (and ``src_rank``) that arrived with no
        matching receive, e.g. of an aborted attempt. Returns how many were dropped."""
        g = _check_field("generation", generation, _MAX_GENERATION)
        tag, mask = g << 32, _MAX_GENERATION << 32
        if src_rank is not None:
            tag |= _check_field("src_rank", src_rank, _MAX_SRC_RANK) << 24
            mask |= _MAX_SRC_RANK << 24
        count = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._drive(0.0, None)
            with self._lock:
                self._check_open()
                probe = self._worker.tag_probe(self._Tag(tag), self._ucx.UCXXTagMask(mask),
                                               remove=True)
                if not probe.matched:
                    break
                scratch = np.empty(probe.length, dtype=np.uint8)
                request = self._worker.tag_recv_with_handle(self._Array(scratch), probe)
            while not request.completed and time.monotonic() < deadline:
                self._drive(0.001, lambda: request.completed)
            count += 1
        with self._lock:
            self._counters["stale_messages_discarded"] += count
        return count

    def reject_unannounced(self, may_arrive: Callable[[int, int], bool], *, grace: float,
                           max_messages: int = 64) -> int:
        """Drop messages in UCX's unexpected queue that no announced receive will take.

        The data plane accepts only transfers the control plane announced: a receive is posted
        (into page memory) only for a request the rank was told about, so a message whose tag
        matches no posted receive sits in UCX's unexpected queue. This sweep looks at the head
        of that queue (``tag_probe`` with mask 0, any tag) and asks
        ``may_arrive(generation, src_rank)`` whether a receive for it may still be posted:

        - False (a finished or cancelled attempt, or a generation never announced and older
          than the announced ones): rejected now;
        - True (e.g. the rank has not yet processed the announcement that is on its way): left
          in place, but rejected once it has been the head for ``grace`` seconds.

        A rejected message is received into scratch memory, never the page buffer: its first
        64 KiB at most, the rest truncated by UCX (a rendezvous payload is then never fetched).
        The receive is not waited for here (a rogue sender may never progress); it completes
        in a later progress round and is reaped by the next sweep. Counted in :meth:`stats`
        as ``rejected_unannounced`` (messages) and ``rejected_unannounced_bytes`` (their
        announced lengths). Only the head of the queue is visible to a probe, so one sweep
        stops at a head it leaves in place; at most ``max_messages`` are rejected per call.
        Cheap when the queue is empty: one probe. Call it from the thread that progresses.
        Returns how many messages this call rejected.
        """
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
            raise ConfigError(f"grace must be a non-negative number of seconds, got {grace!r}")
        rejected = 0
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return 0
            self._rejecting = [(r, b) for r, b in self._rejecting if not r.completed]
        while rejected < max_messages:
            with self._lock:
                if self._closed:
                    break
                probe = self._worker.tag_probe(self._Tag(0), self._ucx.UCXXTagMask(0),
                                               remove=False)
                if not probe.matched:
                    self._unexpected_head = None
                    break
                tag = int(probe.sender_tag.value)
            generation, src_rank, _ = split_tag(tag)
            if may_arrive(generation, src_rank):
                head = self._unexpected_head
                if head is None or head[0] != tag:
                    self._unexpected_head = (tag, now)
                    break
                if now - head[1] < grace:
                    break
            with self._lock:
                if self._closed:
                    break
                # The oldest message with this exact tag: the head we looked at.
                probe = self._worker.tag_probe(self._Tag(tag), self._ucx.UCXXTagMaskFull,
                                               remove=True)
                if not probe.matched:        # a receive posted meanwhile took it
                    continue
                nbytes = int(probe.length)
                scratch = np.empty(max(1, min(nbytes, _REJECT_SCRATCH_BYTES)), dtype=np.uint8)
                request = self._worker.tag_recv_with_handle(self._Array(scratch), probe)
                self._rejecting.append((request, scratch))
                self._unexpected_head = None
                self._counters["rejected_unannounced"] += 1
                self._counters["rejected_unannounced_bytes"] += nbytes
            rejected += 1
            log.debug("%s: rejected an unannounced message of %d bytes (generation %d, "
                      "src_rank %d)", self.name, nbytes, generation, src_rank)
        return rejected

    # -- counters -------------------------------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        """Bytes that went through staging buffers so far (cheap: one counter)."""
        return int(self._counters["staging_bytes"])

    def stats(self) -> dict[str, Any]:
        """Counters since creation (plain data). Messages and bytes count completed transfers;
        ``staging_*`` stay 0 as long as only zero-copy runs were posted."""
        with self._lock:
            c = self._counters
            return {
                "messages_sent": c["messages_sent"],
                "bytes_sent": c["bytes_sent"],
                "messages_received": c["messages_received"],
                "bytes_received": c["bytes_received"],
                "zero_copy_messages": c["zero_copy_messages_sent"]
                + c["zero_copy_messages_received"],
                "zero_copy_messages_sent": c["zero_copy_messages_sent"],
                "zero_copy_messages_received": c["zero_copy_messages_received"],
                "staged_messages_sent": c["staged_messages_sent"],
                "staged_messages_received": c["staged_messages_received"],
                "multi_messages_sent": c["multi_messages_sent"],
                "multi_messages_received": c["multi_messages_received"],
                "staging_buffers_used": c["staging_buffers_used"],
                "staging_bytes": c["staging_bytes"],
                "staging_buffers_allocated": self._pool.allocations,
                "staging_pool_bytes": self._pool.cached_bytes,
                "staging_quarantined_bytes": self._pool.quarantined_bytes,
                "handles_posted": c["handles_posted"],
                "handles_completed": c["handles_completed"],
                "handles_failed": c["handles_failed"],
                "handles_outstanding": len(self._outstanding),
                "failures": dict(self._failures),
                "peers": len(self._peers),
                "peers_failed": c["peers_failed"],
                "ucx_peer_errors": c["ucx_peer_errors"],
                "stale_messages_discarded": c["stale_messages_discarded"],
                "rejected_unannounced": c["rejected_unannounced"],
                "rejected_unannounced_bytes": c["rejected_unannounced_bytes"],
                "rejected_wrong_size": c["rejected_wrong_size"],
                "error_handling": self.error_handling,
                "progress_mode": self.progress_mode,
            }

    # -- internals ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.name}: transport is closed")

    def _endpoint(self, peer_id: str):
        """The live endpoint of ``peer_id`` (call with the lock held)."""
        self._check_open()
        peer = self._peers.get(peer_id)
        if peer is not None:
            return peer.endpoint
        if peer_id in self._lost:
            raise PeerLostError(f"{self.name}: peer {peer_id!r} was declared lost "
                                f"({self._lost[peer_id]})", peer=peer_id)
        raise ConfigError(f"{self.name}: unknown peer {peer_id!r}; connect() it first "
                          f"(known: {sorted(self._peers)})")

    def _post_runs(self, op, base: int, template: RunTemplate, tag0: int,
                   peer_id: str | None) -> list:
        """One UCX request per run of the page buffer, straight from/into its memory. The
        buffer views (ucxx ``Array``, ~3 us each to build) are cached per (offset, length):
        a rank posts the same few page slices over and over."""
        Tag, arrays = self._Tag, self._arrays
        if len(arrays) > _MAX_CACHED_ARRAYS:
            arrays.clear()
        requests: list = []
        try:
            tag = tag0
            for off, n in zip(template.offsets, template.lengths):
                key = (base + off, n)
                array = arrays.get(key)
                if array is None:
                    start = base + off
                    array = arrays[key] = self._Array(self._mv[start:start + n])
                requests.append(op(array, Tag(tag)))
                tag += 1
        except Exception as e:  # noqa: BLE001 -- ucxx raises its own exception types
            requests.clear()      # dropping ucxx's requests cancels what was posted
            raise TransferError(f"{self.name}: posting to {peer_id!r} failed: {e}",
                                peer=peer_id) from e
        self._wake()
        return requests

    def _post_one(self, op, array: np.ndarray | None, tag: int, peer_id: str | None) -> list:
        """One UCX request for a staging buffer (``array`` None: ``op`` needs no buffer)."""
        try:
            requests = [op(None if array is None else self._Array(array), self._Tag(tag))]
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"{self.name}: posting to {peer_id!r} failed: {e}",
                                peer=peer_id) from e
        self._wake()
        return requests

    def _register(self, handle: TransferHandle) -> None:
        self._outstanding[id(handle)] = handle
        self._counters["handles_posted"] += 1

    def _finished(self, handle: TransferHandle, staging: torch.Tensor | None,
                  quiescent: bool) -> None:
        """Bookkeeping when a handle leaves flight (called under the handle's lock)."""
        if staging is not None:
            self._pool.release(staging, quiescent=quiescent)
        with self._lock:
            self._outstanding.pop(id(handle), None)
            c = self._counters
            if handle._state == _DONE:
                c["handles_completed"] += 1
                messages, nbytes, kind_messages = _DONE_COUNTERS[handle.direction, handle.kind]
                c[messages] += handle.messages
                c[nbytes] += handle.nbytes
                c[kind_messages] += handle.messages
            else:
                c["handles_failed"] += 1
                self._failures[_failure_kind(handle._error)] += 1

    def _count_failure(self, kind: str) -> None:
        with self._lock:
            self._failures[kind] += 1

    def _classify(self, handle: TransferHandle, request) -> BaseException:
        """The error of a request that completed with a non-OK status."""
        status = int(request.status)
        try:
            request.check_error()
            detail = f"UCX status {status}"
        except Exception as e:  # noqa: BLE001 -- ucxx's exception types
            detail = f"{type(e).__name__}: {e}"
        peer_id = handle.peer_id
        with self._lock:
            lost = self._lost.get(peer_id) if peer_id is not None else None
            peer = self._peers.get(peer_id) if peer_id is not None else None
        if lost is None and peer is not None and self.error_handling \
                and not peer.endpoint.alive:
            lost = "UCX endpoint error"
            self._ep_events.append((peer_id, peer.serial))
        if lost is not None or status in _PEER_STATUSES:
            return PeerLostError(f"{self.name}: peer {peer_id!r} lost ({lost or detail}) during "
                                 f"{handle._describe()}", request_id=handle.request_id,
                                 peer=peer_id)
        if status == _UCS_ERR_MESSAGE_TRUNCATED:
            with self._lock:
                self._counters["rejected_wrong_size"] += 1
            return TransferError(f"{self.name}: {handle._describe()}: message {handle._checked} "
                                 f"of {handle.messages} is longer than its posted receive "
                                 f"({handle.nbytes} bytes posted in all; {detail})",
                                 request_id=handle.request_id, peer=peer_id)
        if status == _UCS_ERR_CANCELED:
            return AbortedError(f"{self.name}: {handle._describe()} was cancelled ({detail})",
                                request_id=handle.request_id, peer=peer_id)
        return TransferError(f"{self.name}: {handle._describe()} failed: {detail}",
                             request_id=handle.request_id, peer=peer_id)

    def _on_endpoint_closed(self, peer_id: str, serial: int) -> None:
        # Called by ucxx from inside progress (any thread, GIL held): only record it.
        self._ep_events.append((peer_id, serial))

    def _process_endpoint_events(self) -> None:
        while self._ep_events:
            try:
                peer_id, serial = self._ep_events.popleft()
            except IndexError:
                return
            with self._lock:
                peer = self._peers.get(peer_id)
                if peer is None or peer.serial != serial or peer.closing:
                    continue
                self._counters["ucx_peer_errors"] += 1
                try:
                    peer.endpoint.raise_on_error()
                    detail = "endpoint closed by UCX"
                except Exception as e:  # noqa: BLE001
                    detail = f"{type(e).__name__}: {e}"
            self.fail_peer(peer_id, f"UCX endpoint error: {detail}")

    def _close_endpoint(self, peer: _Peer, *, blocking: bool = True) -> None:
        if peer.closing:
            return
        peer.closing = True
        try:
            if self.error_handling:
                peer.endpoint.remove_close_callback()
            if not blocking and not self.error_handling:
                # Without error handling a close flushes first, which never ends behind a cut
                # link. (With it UCX closes in force mode at once; and a non-blocking close of
                # an endpoint UCX already failed crashes ucxx 0.52.)
                with self._lock:
                    self._abandoned.append(peer)
                peer.endpoint.close()
                return
            # period/attempts bound the close only in thread mode (ucxx's progress thread).
            peer.endpoint.close_blocking(period=1_000_000_000, max_attempts=3)
        except Exception as e:  # noqa: BLE001 -- closing a dead peer's endpoint may complain
            log.debug("%s: closing endpoint to %s: %s", self.name, peer.peer_id, e)
