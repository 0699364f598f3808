"""The Transport: one rank's UCX worker over its page buffer, its endpoints, posts and progress.

This is the one module of statebridge that imports ``ucxx``, and only in
:meth:`Transport.__init__` (see the package docstring).

Why the low-level request API and not ucxx's asyncio API
--------------------------------------------------------
The owner is a plain thread (a connector rank loop), so the transport offers a synchronous API
with pollable handles, built on ``ucxx._lib.libucxx`` requests (``UCXEndpoint.tag_send`` /
``tag_recv``, ``UCXRequest.completed`` / ``status``): no event loop, no futures, no notifier
thread. ucxx's asyncio API costs far more per awaited message in its default ``thread`` mode
(reference/transport-limits.md) and cannot be awaited from a plain thread.

Progress
--------
One mode: blocking progress driven by the owner thread. :meth:`TransferHandle.done` progresses
once and never sleeps; :meth:`TransferHandle.wait` progresses, arms the worker and sleeps in
``poll()`` on its epoll fd until UCX has an event; the rank loop does the same with its own
poller through :meth:`Transport.fileno` / :meth:`Transport.arm` (sleeping on the zmq socket and
UCX together) and :meth:`Transport.progress`.

Who must progress: between two processes of one host over shared memory (error handling off,
``UCX_TLS`` allowing cma), a message of 8 KiB or more (ucxx's ``UCX_RNDV_THRESH=8192``) is a
rendezvous "zero-copy read from remote": the sender posts a request-to-send inside
``tag_send``, and the RECEIVER copies the bytes out of the sender's memory (``process_vm_readv``)
and acknowledges. So once the endpoints are wired up (their first transfer needs both sides),
the receive completes while the sender sleeps, even while it is stopped
(``tests/connector/test_transport.py::test_receiver_reads_while_the_sender_is_stopped``); the
send handle completes at the sender's next progress after the acknowledgement
(:meth:`sends_complete_unattended` says when this holds). Over TCP (error handling on, another
host) the sender pushes the data and must keep progressing.

Why blocking progress: it stays close to polling on small messages and matches it on large
ones without burning a core that the model needs; a background progress thread or ucxx's
``thread`` mode pay a hand-off per small message. A handle costs Python overhead of its own,
so a pair is one handle with all its runs. The other progress modes live in
``benchmarks/bench_transport.py`` (``ModeTransport``); the comparison is in
docs/measurements.md, "Transport choices".

Error handling and transports
-----------------------------
``error_handling=False`` (default): endpoints from worker addresses without UCX error handling,
so UCX picks shared memory (sysv eager below 8 KiB, cma rendezvous above; ``UCX_TLS`` left at
UCX's default); UCX never reports a dead peer -- its requests just stay pending -- so the control
plane's heartbeats must call :meth:`Transport.fail_peer`. ``error_handling=True``: UCX notices a
SIGKILLed peer by itself within milliseconds and the affected handles fail with
:class:`PeerLostError`, but UCX then drops shared memory for TCP, several times slower on one
host (docs/measurements.md, "Transport choices"). UCX options are passed explicitly as
``ucx_options`` or set by the process entry point with :func:`configure_ucx_env`.
"""

from __future__ import annotations

import logging
import os
import select
from typing import Any, Callable, Mapping, Sequence

import torch

from statebridge.connector.data import ucxinfo
from statebridge.connector.data.endpoints import Endpoints, Peer
from statebridge.connector.data.guard import UnexpectedGuard
from statebridge.connector.data.handle import TransferHandle
from statebridge.connector.data.posting import Posting
from statebridge.connector.data.runs import RunTemplate
from statebridge.connector.data.staging import StagingPool
from statebridge.connector.stats import Counters
from statebridge.errors import ClosedError, ConfigError, kind_of

log = logging.getLogger(__name__)

__all__ = ["Transport", "TRANSPORT_COUNTERS"]


def _done_counters(kinds: tuple[str, ...]) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(direction, handle kind) -> the counters a completed handle adds to."""
    return {(d, k): (f"messages_{side}", f"bytes_{side}", f"{k}_messages_{side}")
            for d, side in (("send", "sent"), ("recv", "received")) for k in kinds}


#: Handle kinds a completed handle is counted under.
_DONE = _done_counters(("zero_copy", "staged", "notice"))

#: :attr:`Transport.counters` (:class:`~statebridge.connector.stats.Counters`): messages and
#: bytes of completed handles (``messages_sent`` ... ``notice_messages_received``, by handle
#: kind), staging buffers used and their bytes (0 while only zero-copy runs were posted),
#: completed handles, peers declared lost, UCX endpoint errors, messages of a drained
#: generation discarded, unannounced messages rejected (and their announced bytes), messages of
#: the wrong size. Failed handles count as ``failed_<kind>`` (``failed_timeout``: waits that
#: timed out), reported by :meth:`Transport.stats` as ``failures``.
TRANSPORT_COUNTERS = (
    *dict.fromkeys(name for names in _DONE.values() for name in names),
    "staging_buffers_used", "staging_bytes", "handles_completed", "peers_failed",
    "ucx_peer_errors", "stale_messages_discarded", "rejected_unannounced",
    "rejected_unannounced_bytes", "rejected_wrong_size")


def _segments(buffer: object) -> list[tuple[int, torch.Tensor]]:
    """``buffer`` as ``(start, tensor)`` segments: contiguous 1-D uint8 tensors on the CPU or
    a CUDA device, in address order, not overlapping, the first at 0."""
    segments = [(0, buffer)] if isinstance(buffer, torch.Tensor) else list(buffer)
    if not segments:
        raise ConfigError("buffer must be a tensor or a non-empty list of (start, tensor)")
    end = 0
    for i, item in enumerate(segments):
        start, t = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 \
                or not t.is_contiguous():
            raise ConfigError(f"buffer must be a contiguous 1-D uint8 tensor, got "
                              f"{getattr(t, 'dtype', type(t).__name__)} "
                              f"{list(getattr(t, 'shape', []))}")
        if t.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"buffers on {t.device} are not supported (cpu or cuda)")
        if type(start) is not int or start < end or (i == 0 and start != 0):
            raise ConfigError(f"segment {i} starts at {start!r}: segments start at 0 and follow "
                              f"each other in address order (the previous one ends at {end})")
        end = start + t.numel()
    return segments


_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    """Log ``text`` as a warning the first time this process sees it (ranks in one process
    share their hosts' UCX)."""
    key = text.split(": ", 1)[-1]
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", text)


class Transport:
    """One rank's UCX worker over its page ``buffer``.

    Args:
        buffer: the :class:`~statebridge.state.cache.StateCache` buffer (a 1-D contiguous
            uint8 tensor, host or device memory), or a rank buffer in pieces: ``(start,
            tensor)`` segments of one address space (a device pool at 0, host control words
            after it). Every run offset is an absolute byte offset into it
            (``PairPlan.runs_at(src_base, dst_base)``).
        error_handling: UCX endpoint error handling (see the module docstring: detects dead
            peers in milliseconds, but forces TCP, several times slower on one host).
        ucx_options: UCX configuration for this worker's context, without the ``UCX_`` prefix
            (e.g. ``{"TLS": "sm,self"}``); environment variables still apply to unset keys.
        staging_pool_bytes: most bytes of free staging buffers kept for reuse.
        name: label used in logs and errors.

    It holds its parts, each with its own state: :attr:`endpoints`
    (:class:`~statebridge.connector.data.endpoints.Endpoints`: connecting, losing peers, UCX
    errors) and :attr:`posting` (:class:`~statebridge.connector.data.posting.Posting`: the page
    buffer and every post), plus the guard of unexpected messages and the staging pool. This
    class keeps the worker, lifecycle, progress and counters; its post and peer methods hand
    over to the parts. The parts call back into it through small protocols
    (:class:`~statebridge.connector.data.endpoints.WorkerOwner`,
    :class:`~statebridge.connector.data.posting.PostingOwner`,
    :class:`~statebridge.connector.data.handle.HandleOwner`).

    One thread owns a Transport: it posts, progresses (:meth:`progress`, :meth:`arm`, the
    handles' :meth:`~TransferHandle.done` / :meth:`~TransferHandle.wait`), fails peers and closes;
    nothing in here locks. Other threads may only read :meth:`stats` and :attr:`staging_bytes`
    (plain counters, a moment stale). UCX's own callbacks (endpoint errors) run inside the
    owner's progress calls.
    """

    #: (direction, handle kind) -> the counters a completed handle adds to.
    _DONE_COUNTERS = _DONE

    def __init__(self, buffer: "torch.Tensor | Sequence[tuple[int, torch.Tensor]]", *,
                 error_handling: bool = False,
                 ucx_options: Mapping[str, str] | None = None,
                 staging_pool_bytes: int = 256 * 1024 * 1024, name: str = "transport") -> None:
        segments = _segments(buffer)
        if not isinstance(error_handling, bool):
            raise ConfigError(f"error_handling must be a bool, got {error_handling!r}")
        if isinstance(staging_pool_bytes, bool) or not isinstance(staging_pool_bytes, int) \
                or staging_pool_bytes < 0:
            raise ConfigError(f"staging_pool_bytes must be a non-negative integer, got "
                              f"{staging_pool_bytes!r}")

        # Imported here, not at module level: importing ucxx edits os.environ (package docs).
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self._ucx = ucx_api
        self._Array = Array
        self.name = name
        self.error_handling = error_handling
        first = segments[0][1]
        #: "cuda" when a segment is device memory, else "host".
        self.memory = "cuda" if any(t.device.type == "cuda" for _, t in segments) else "host"

        options = {str(k): str(v) for k, v in (ucx_options or {}).items()}
        tls = options.get("TLS", os.environ.get("UCX_TLS", ""))
        self._context = ucx_api.UCXContext(
            options, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker: Any = None
        self._poller: Any = None
        self._start_worker()
        self._address = self._worker.address.tobytes()

        self._closed = False
        self._outstanding: dict[int, TransferHandle] = {}
        self._pool = StagingPool(staging_pool_bytes, device=first.device)
        #: This transport's counters (:data:`TRANSPORT_COUNTERS`); any thread may read them.
        self.counters = Counters(TRANSPORT_COUNTERS)
        #: Its endpoints to its peers (connect, lost peers, UCX endpoint errors).
        self.endpoints = Endpoints(self, ucx_api, error_handling=error_handling, tls=tls,
                                   outstanding=self._outstanding, counters=self.counters,
                                   name=name)
        #: Its page buffer and every post.
        self.posting = Posting(self, self.endpoints, buffer=segments, array_type=Array,
                               tag_type=ucx_api.UCXXTag, pool=self._pool,
                               outstanding=self._outstanding, counters=self.counters, name=name)
        self._guard = UnexpectedGuard(self._worker, ucx_api, Array, name, self.counters)
        #: The UCX context's transports (``tl/device``; [] when UCX could not be asked), the
        #: transports each peer's endpoint chose (:meth:`lanes`), and why device memory sent
        #: to another host would go through host memory ("" when it would not).
        self.resources: list[str] = ucxinfo.context_resources(self._context.handle)
        self.host_staging = ucxinfo.device_path(self.memory, self.resources)
        if self.host_staging and "cuda_copy" not in {r.split("/")[0] for r in self.resources}:
            self.close()
            raise ConfigError(f"{name}: {self.host_staging}")
        if self.host_staging:
            _warn_once(f"{name}: {self.host_staging}")
        log.info("%s: UCX worker ready (%d-byte buffer in %s memory, error_handling=%s, "
                 "transports %s)", name, self.posting.size, self.memory, error_handling,
                 ",".join(self.resources) or "unknown")

    def _start_worker(self) -> None:
        """The UCX worker, in blocking progress mode, and a poller on its epoll fd."""
        self._worker = self._ucx.UCXWorker(self._context, enable_delayed_submission=False)
        self._worker.init_blocking_progress_mode()
        self._poller = select.poll()
        self._poller.register(self._worker.epoll_file_descriptor, select.POLLIN)

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
        return self.endpoints.peer_ids()

    def live_worker(self) -> Any:
        """The UCX worker; :class:`ClosedError` once closed (what the parts ask of their
        transport)."""
        if self._closed:
            raise ClosedError(f"{self.name}: transport is closed")
        return self._worker

    def close(self) -> None:
        """Cancel everything outstanding (handles raise :class:`ClosedError`), close every
        endpoint and the worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        peers = self.endpoints.take_all()
        for h in list(self._outstanding.values()):
            h._fail(ClosedError(f"{self.name}: transport closed while {h._describe()} was in "
                                f"flight"))
        self._shutdown(peers)
        self._pool.clear()
        log.info("%s: closed", self.name)

    def _shutdown(self, peers: list[Peer]) -> None:
        """Close the endpoints of ``peers``, then drop the worker and the context."""
        for peer in peers:
            self.endpoints.close_endpoint(peer)
        self._guard.close()
        self.endpoints.drop_abandoned()
        self._poller = None
        # Destroying the worker cancels what is left and drains unexpected messages.
        self._worker = None
        self._context = None

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Transport({self.name!r}, {self.posting.size} B, "
                f"peers={self.endpoints.peer_count()}, "
                f"outstanding={len(self._outstanding)}, error_handling={self.error_handling}"
                f"{', closed' if self._closed else ''})")

    # -- progress ---------------------------------------------------------------------------------
    def progress(self, timeout: float = 0.0) -> None:
        """Drive UCX progress once; with ``timeout`` > 0 sleep up to that long for an event
        first. Senders that do not wait on their handles should call this (or
        :meth:`TransferHandle.done`) from their loop so rendezvous sends complete."""
        self._drive(max(0.0, float(timeout)), None)

    def fileno(self) -> int:
        """A file descriptor that becomes readable when UCX has work, for the owner's poller
        (the rank loop); call :meth:`arm` before sleeping on it."""
        return self.live_worker().epoll_file_descriptor

    def arm(self) -> bool:
        """Progress, then arm the worker: True when nothing is pending and it is safe to sleep
        on :meth:`fileno`; False means progress again first."""
        worker = self.live_worker()
        worker.progress()
        return bool(worker.arm())

    def _drive(self, block_s: float, ready: Callable[[], bool] | None) -> None:
        """One progress round, sleeping up to ``block_s`` in ``poll()`` on the worker's epoll fd
        for UCX events. ``ready()`` (optional) says whether the caller's wait is over, so a
        round never sleeps past a completion."""
        endpoints = self.endpoints
        if endpoints.events:
            endpoints.process_events()
        if self._closed:
            return
        worker = self._worker
        worker.progress()
        if block_s > 0 and (ready is None or not ready()):
            if worker.arm():
                self._poller.poll(max(1, int(block_s * 1000)))
            worker.progress()
        if endpoints.events:
            endpoints.process_events()

    # -- messages nobody announced ---------------------------------------------------------------
    def discard_unexpected(self, generation: int, src_rank: int | None = None, *,
                           timeout: float = 1.0) -> int:
        """Receive and drop messages of ``generation`` (and ``src_rank``) that arrived with no
        matching receive, e.g. of an aborted attempt. Returns how many were dropped."""
        self.live_worker()                 # raises once closed
        return self._guard.discard(generation, src_rank, timeout=timeout, drive=self._drive)

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
        Cheap when the queue is empty: one probe. Returns how many messages this call
        rejected (0 once closed).
        """
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
            raise ConfigError(f"grace must be a non-negative number of seconds, got {grace!r}")
        if self._closed:
            return 0
        return self._guard.reject_unannounced(may_arrive, grace=grace, max_messages=max_messages)

    # -- counters -------------------------------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        """Bytes that went through staging buffers so far."""
        return int(self.counters.get("staging_bytes"))

    def lanes(self, peer_id: str) -> list[str]:
        """The transports (``tl/device``) UCX chose for ``peer_id``'s endpoint when it was
        connected ([] when unknown)."""
        return self.endpoints.lanes(peer_id)

    def stats(self) -> dict[str, Any]:
        """:attr:`counters` (plain data; every name of :data:`TRANSPORT_COUNTERS`, failed
        handles as ``failures``: kind -> count) with the transport's gauges: staging buffers
        allocated, pooled and quarantined bytes, handles outstanding, peers connected, and
        ``lanes`` (peer id -> the transports UCX chose for it)."""
        counts = self.counters.snapshot()
        failures = {name[len("failed_"):]: counts.pop(name)
                    for name in [n for n in counts if n.startswith("failed_")]}
        pool = self._pool
        return {**counts, "failures": failures,
                "staging_buffers_allocated": pool.allocations,
                "staging_pool_bytes": pool.cached_bytes,
                "staging_quarantined_bytes": pool.quarantined_bytes,
                "handles_outstanding": len(self._outstanding),
                "peers": self.endpoints.peer_count(),
                "lanes": self.endpoints.all_lanes()}

    # -- peers (:attr:`endpoints`) -------------------------------------------------------------
    def connect(self, peer_id: str, address: bytes) -> None:
        """Endpoint to the peer worker at ``address`` (:meth:`Endpoints.connect
        <statebridge.connector.data.endpoints.Endpoints.connect>`)."""
        self.endpoints.connect(peer_id, address)

    def fail_peer(self, peer_id: str, reason: str) -> int:
        """The control plane declared ``peer_id`` dead (:meth:`Endpoints.fail_peer
        <statebridge.connector.data.endpoints.Endpoints.fail_peer>`): its handles fail with
        :class:`PeerLostError`. Returns how many handles failed."""
        return self.endpoints.fail_peer(peer_id, reason)

    def sends_complete_unattended(self, same_host: bool) -> bool:
        """Whether sends to a peer on this host move without this side's progress
        (:meth:`Endpoints.sends_complete_unattended
        <statebridge.connector.data.endpoints.Endpoints.sends_complete_unattended>`)."""
        return self.endpoints.sends_complete_unattended(same_host)

    # -- posts (:attr:`posting`) ---------------------------------------------------------------
    # post_send / post_recv go through self.post_runs, so a subclass that hooks post_runs (the
    # benchmark's ModeTransport) sees every zero-copy post.
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
        """``runs`` as a checked :class:`RunTemplate` for :meth:`post_runs` in ``direction``
        (:meth:`Posting.template <statebridge.connector.data.posting.Posting.template>`)."""
        return self.posting.template(runs, direction)

    def post_runs(self, direction: str, peer_id: str | None, generation: int, src_rank: int,
                  base: int, template: RunTemplate, *,
                  request_id: str | None = None, index0: int = 0) -> TransferHandle:
        """A :class:`RunTemplate` at byte offset ``base`` of the buffer, zero-copy: the rank's
        per-request post (:meth:`Posting.post_runs
        <statebridge.connector.data.posting.Posting.post_runs>`)."""
        return self.posting.post_runs(direction, peer_id, generation, src_rank, base, template,
                                      request_id=request_id, index0=index0)

    def post_send_staged(self, peer_id: str, generation: int, src_rank: int, pack_runs: object,
                         *, request_id: str | None = None) -> TransferHandle:
        """Gather ``pack_runs`` into a staging buffer and send it as ONE message
        (:meth:`Posting.post_send_staged
        <statebridge.connector.data.posting.Posting.post_send_staged>`)."""
        return self.posting.post_send_staged(peer_id, generation, src_rank, pack_runs,
                                             request_id=request_id)

    def post_recv_staged(self, peer_id: str | None, generation: int, src_rank: int, nbytes: int,
                         unpack_runs: object, *, request_id: str | None = None) -> TransferHandle:
        """Receive one staged message and scatter ``unpack_runs`` into the page
        (:meth:`Posting.post_recv_staged
        <statebridge.connector.data.posting.Posting.post_recv_staged>`)."""
        return self.posting.post_recv_staged(peer_id, generation, src_rank, nbytes, unpack_runs,
                                             request_id=request_id)

    def post_notice(self, direction: str, peer_id: str, generation: int, src_rank: int,
                    index: int, offset: int, nbytes: int, *,
                    request_id: str | None = None) -> TransferHandle:
        """One small tagged message of a shared-map read (:meth:`Posting.post_notice
        <statebridge.connector.data.posting.Posting.post_notice>`)."""
        return self.posting.post_notice(direction, peer_id, generation, src_rank, index, offset,
                                        nbytes, request_id=request_id)

    # -- internals (what handles and parts call back into) -------------------------------------
    def _classify(self, handle: TransferHandle, request) -> BaseException:
        """The error of a request that completed with a non-OK status."""
        return self.endpoints.classify(handle, request)

    def _finished(self, handle: TransferHandle, staging: torch.Tensor | None,
                  quiescent: bool) -> None:
        """Bookkeeping when a handle leaves flight."""
        if staging is not None:
            self._pool.release(staging, quiescent=quiescent)
        self._outstanding.pop(id(handle), None)
        if handle.ok:
            c = self.counters.shard()
            c["handles_completed"] += 1
            messages, nbytes, kind_messages = self._DONE_COUNTERS[handle.direction, handle.kind]
            c[messages] += handle.messages
            c[nbytes] += handle.nbytes
            c[kind_messages] += handle.messages
        else:
            self.counters.add(f"failed_{kind_of(handle.error).value}")

    def _count_failure(self, kind: str) -> None:
        self.counters.add(f"failed_{kind}")
