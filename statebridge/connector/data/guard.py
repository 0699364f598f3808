"""The data plane accepts only transfers the control plane announced.

A receive is posted (into page memory) only for a request the rank was told about, so a message
whose tag matches no posted receive sits in UCX's unexpected queue: a stale message of a
finished or aborted attempt, or one nobody announced (rogue or corrupt). :class:`UnexpectedGuard`
takes such messages out of the queue into scratch memory -- never the page buffer -- and counts
them. It serves :meth:`Transport.reject_unannounced` (the rank's heartbeat sweep) and
:meth:`Transport.discard_unexpected` (drain one generation).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from statebridge.connector.data.tags import split_tag, tag_match

if TYPE_CHECKING:
    from statebridge.connector.stats import Counters

log = logging.getLogger(__name__)

__all__ = ["UnexpectedGuard"]

#: Most bytes of a rejected unannounced message that are received (into scratch); UCX
#: truncates the rest.
REJECT_SCRATCH_BYTES = 64 * 1024


class UnexpectedGuard:
    """Receives unmatched messages of one UCX worker into scratch memory and counts them.

    ``ucx_api`` is ``ucxx._lib.libucxx`` and ``array`` ucxx's ``Array`` (the transport imported
    them). It counts in its transport's ``counters``: ``rejected_unannounced`` /
    ``rejected_unannounced_bytes`` (unannounced messages and their announced lengths),
    ``stale_messages_discarded`` (messages of a drained generation). Used by its transport's
    owner thread only; :meth:`close` drops the worker.
    """

    def __init__(self, worker: Any, ucx_api: Any, array: Any, name: str,
                 counters: "Counters") -> None:
        self._worker = worker
        self._ucx = ucx_api
        self._Array = array
        self.name = name
        self.counters = counters
        self._rejecting: list[tuple[Any, np.ndarray]] = []   # receives not yet completed
        self._head: tuple[int, float] | None = None          # (tag, first seen) of the head

    def reject_unannounced(self, may_arrive: Callable[[int, int], bool], *, grace: float,
                           max_messages: int) -> int:
        """One sweep of the head of the unexpected queue (see
        :meth:`Transport.reject_unannounced`); returns how many messages it rejected."""
        ucx, worker = self._ucx, self._worker
        self._rejecting = [(r, b) for r, b in self._rejecting if not r.completed]
        rejected = 0
        now = time.monotonic()
        while rejected < max_messages:
            probe = worker.tag_probe(ucx.UCXXTag(0), ucx.UCXXTagMask(0), remove=False)
            if not probe.matched:
                self._head = None
                break
            tag = int(probe.sender_tag.value)
            generation, src_rank, _ = split_tag(tag)
            if may_arrive(generation, src_rank):
                head = self._head
                if head is None or head[0] != tag:
                    self._head = (tag, now)
                    break
                if now - head[1] < grace:
                    break
            # The oldest message with this exact tag: the head we looked at.
            probe = worker.tag_probe(ucx.UCXXTag(tag), ucx.UCXXTagMaskFull, remove=True)
            if not probe.matched:        # a receive posted meanwhile took it
                continue
            nbytes = int(probe.length)
            scratch = np.empty(max(1, min(nbytes, REJECT_SCRATCH_BYTES)), dtype=np.uint8)
            request = worker.tag_recv_with_handle(self._Array(scratch), probe)
            self._rejecting.append((request, scratch))
            self._head = None
            self.counters.add("rejected_unannounced")
            self.counters.add("rejected_unannounced_bytes", nbytes)
            rejected += 1
            log.debug("%s: rejected an unannounced message of %d bytes (generation %d, "
                      "src_rank %d)", self.name, nbytes, generation, src_rank)
        return rejected

    def discard(self, generation: int, src_rank: int | None, *, timeout: float,
                drive: Callable[[float, Callable[[], bool] | None], None]) -> int:
        """Receive and drop the unexpected messages of ``generation`` (and ``src_rank``),
        progressing with ``drive(block_s, ready)`` until each has landed in scratch memory or
        ``timeout`` passed. Returns how many were dropped."""
        tag, mask = tag_match(generation, src_rank)
        ucx, worker = self._ucx, self._worker
        count = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            drive(0.0, None)
            probe = worker.tag_probe(ucx.UCXXTag(tag), ucx.UCXXTagMask(mask), remove=True)
            if not probe.matched:
                break
            scratch = np.empty(probe.length, dtype=np.uint8)
            request = worker.tag_recv_with_handle(self._Array(scratch), probe)
            while not request.completed and time.monotonic() < deadline:
                drive(0.001, lambda: request.completed)
            count += 1
        self.counters.add("stale_messages_discarded", count)
        return count

    def close(self) -> None:
        """Drop the scratch receives and the worker (the transport is closing)."""
        self._rejecting.clear()
        self._worker = None
