"""When a request's state was made and moved: the decode coordinator joins the prefill side's
half (:class:`~statebridge.connector.messages.TransferTimes`: compute began, state final, first
byte posted) with its own (arrival, every decode rank landed) into one
:class:`RequestTiming` per request and hands it to the ``on_timing`` callback (the decode
node's histograms).

:class:`TimingJoin` is a part the decode coordinator *has* (``coordinator.timing``): it holds
the callback and the halves waiting for the other; the coordinator gives it each half.
:class:`TransferResult` (what a request's transfer produced on the decode side) is here too,
the lower of the two modules that use it; :mod:`~statebridge.connector.decode` exports it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from statebridge.connector import messages as m
from statebridge.connector.ledger import Record, RequestKey

log = logging.getLogger("statebridge.connector.decode")   # one logger for the coordinator

__all__ = ["RequestTiming", "TimingJoin", "TransferResult"]


@dataclass(frozen=True)
class TransferResult:
    """A request whose state every decode rank holds in ``page``."""

    request_id: str
    generation: int
    page: int
    prefill_node: str
    seconds: float                  # submit -> every decode rank holds the state
    nbytes: int                     # payload bytes received by all decode ranks
    blocks: tuple[int, ...] = ()    # the request's KV block table (spec with KV)
    landed_at: float = 0.0          # wall clock: the last decode rank held all of it


@dataclass(frozen=True)
class RequestTiming:
    """When a request's state was made and moved, each time taken where it happened
    (wall-clock seconds; see :class:`~statebridge.connector.messages.RankDone`):

    - ``arrived_at``: the caller got the request (``start(arrived_at=)``);
    - ``computed_from`` / ``state_final_at``: the first rank computing it began, the last
      one's state was final (prefill ranks; the decode ranks for a ``local`` prefill);
    - ``posted_at``: the first prefill rank posted its first byte; ``landed_at``: every
      decode rank held all of it (both 0.0 for a local prefill: nothing moved).

    So queue time is ``computed_from - arrived_at``, prefill compute ``state_final_at -
    computed_from``, transfer ``landed_at - posted_at`` (see :meth:`seconds`).
    ``cached_tokens``: prompt tokens the prefill node took from its prefix cache (not
    computed; :class:`~statebridge.connector.messages.TransferTimes`)."""

    request_id: str
    arrived_at: float
    computed_from: float
    state_final_at: float
    posted_at: float
    landed_at: float
    nbytes: int
    local: bool
    cached_tokens: int = 0

    def seconds(self) -> tuple[float, float, float | None]:
        """(queue, prefill compute, transfer or None for a local prefill), each at least 0
        (clocks of other machines may disagree by their offset)."""
        transfer = None if self.local else max(0.0, self.landed_at - self.posted_at)
        return (max(0.0, self.computed_from - self.arrived_at),
                max(0.0, self.state_final_at - self.computed_from), transfer)


class TimingJoin:
    """The timing half of the decode coordinator (see the module docstring): ``node_id`` names
    it in the log; a half waits ``limit`` seconds for the other (transfer_timeout +
    peer_timeout)."""

    def __init__(self, node_id: str, limit: float) -> None:
        self.node_id = node_id
        self.limit = limit
        #: on_timing's callback, and the halves of request timings waiting for the other:
        #: key -> (monotonic when kept, the prefill side's TransferTimes) or (monotonic,
        #: arrived_at, the TransferResult)
        self._on_timing: Callable[[RequestTiming], None] | None = None
        self._halves: dict[RequestKey, tuple] = {}

    @property
    def wanted(self) -> bool:
        """Whether anybody takes timings (a callback is set)."""
        return self._on_timing is not None

    def on_timing(self, callback: "Callable[[RequestTiming], None] | None") -> None:
        """Call ``callback`` (loop thread) with the :class:`RequestTiming` of every request
        whose state every decode rank holds, once both sides said when their events
        happened (a prefill node's :class:`~statebridge.connector.messages.TransferTimes` may
        come after the request finished). Without a callback nothing is kept."""
        self._on_timing = callback
        if callback is None:
            self._halves.clear()

    def decode_half(self, record: Record, done: list, result: TransferResult) -> None:
        """The decode side's half of a request's timing: complete at once for a local
        prefill (the decode ranks computed it), else joined with the prefill side's."""
        if record.peer is None:
            self._timed(RequestTiming(
                request_id=record.request_id, arrived_at=record.arrived_at,
                computed_from=min((d.computed_from for d in done if d.computed_from),
                                  default=0.0),
                state_final_at=max(d.state_final_at for d in done), posted_at=0.0,
                landed_at=0.0, nbytes=0, local=True))
            return
        times = self._halves.pop(record.key, None)
        if times is None:
            self._halves[record.key] = (time.monotonic(), record.arrived_at, result)
        else:
            self._join(times[1], record.arrived_at, result)

    def prefill_half(self, prefill_node: str, msg: m.TransferTimes) -> None:
        """The prefill side's half (its node's TransferTimes)."""
        if self._on_timing is None:
            return
        key = RequestKey(prefill_node, msg.request_id, msg.generation)
        half = self._halves.pop(key, None)
        if half is None:
            self._halves[key] = (time.monotonic(), msg)
        else:
            self._join(msg, half[1], half[2])

    def _join(self, times: m.TransferTimes, arrived_at: float, result: TransferResult) -> None:
        self._timed(RequestTiming(
            request_id=result.request_id, arrived_at=arrived_at,
            computed_from=times.computed_from, state_final_at=times.state_final_at,
            posted_at=times.posted_at, landed_at=result.landed_at, nbytes=result.nbytes,
            local=False, cached_tokens=times.cached_tokens))

    def _timed(self, timing: "RequestTiming") -> None:
        try:
            self._on_timing(timing)
        except Exception:  # noqa: BLE001 -- the caller's callback must not break the loop
            log.exception("%s: on_timing of %s failed", self.node_id, timing.request_id)

    def expire(self, now: float) -> None:
        """Halves whose other half never comes (the request failed on one side only)."""
        if not self._halves:
            return
        for key in [k for k, half in self._halves.items() if now - half[0] > self.limit]:
            del self._halves[key]
