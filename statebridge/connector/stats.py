"""The ONE counter system: named counters that any thread adds to and anyone reads.

Who counts what
---------------
Every component that counts owns a :class:`Counters`; its ``stats()`` reports a
:meth:`~Counters.snapshot` beside its gauges (pages used, handles outstanding, ...):

- a coordinator (``RankGroup.counters``: requests, transfers, failures by kind, protocol
  errors, refused handshakes, ...), read by :meth:`PrefillServer.stats
  <statebridge.connector.prefill.PrefillServer.stats>` and :meth:`DecodeCoordinator.stats
  <statebridge.connector.decode.DecodeCoordinator.stats>`;
- the decode node (``DecodeNode.counters``: requests, rejections, finished by kind, ...), which
  its ``/metrics`` reads;
- a rank (``RankWorker.counters``) and its UCX transport (``Transport.counters``: messages and
  bytes by handle kind, staging, failures by kind, lost peers, rejected messages; see
  :data:`~statebridge.connector.data.transport.TRANSPORT_COUNTERS`).

:data:`ops` holds the process's operation counts: what a request costs in messages and
wake-ups, summed over every component of the process (the benchmark reads them per process
class). Counted where the work is done:

- ``control_sent``: control messages handed to zmq or a local channel (one per destination
  peer of :func:`~statebridge.connector.control.send_router_many`, one per
  :func:`~statebridge.connector.control.send_dealer`), counted before coalescing into batches;
- ``control_received``: control messages decoded from frames (one per message of a batch);
- ``probes_sent``: of ``control_sent``, the :class:`~statebridge.connector.messages.RankProbe`
  messages of an instrumented rank (so that a benchmark can leave its own probes out);
- ``ucx_ops``: UCX tag sends and receives posted by a
  :class:`~statebridge.connector.data.transport.Transport` (one per run posted zero-copy, one
  per staging buffer, one per shared-map notice);
- ``unattended_sleeps``: rank loop sleeps that left UCX's events unpolled because every pending
  request was a send its receiver reads by itself
  (:meth:`~statebridge.connector.rank.pending.PendingTransfers.before_sleep`);
- ``shared_map_reads``: a decode rank's copies of one request's runs from one prefill rank out
  of that rank's shared map (:meth:`~statebridge.connector.rank.shared_map.SharedMaps.read`);
  each also counts its "ready" notice in ``ucx_ops``;
- ``transfer_digests``: a rank's digest passes over one request's bytes (transfer
  verification, :mod:`statebridge.connector.rank.digest`): a prefill rank's over what it
  sends, a decode rank's over what landed. 0 while verification is off.

How
---
Every thread adds to its own :class:`collections.Counter` (a shard: one writer each, so no lock
and no lost increment); readers sum the shards, a moment stale. :meth:`Counters.add` costs one
thread-local lookup and one dict increment, cheap enough for per-message and per-operation
counts; a loop that adds several names at once takes its shard with :meth:`Counters.shard`.
Values are ints, or floats for durations (e.g. ``compute_seconds``).
"""

from __future__ import annotations

import collections
import threading
from typing import Iterable

__all__ = ["Counters", "ops"]


class Counters:
    """Named counters, added to from any thread without a lock (see the module docstring).

    ``names``: counters that :meth:`snapshot` reports even while still 0.
    """

    __slots__ = ("_local", "_shards", "_lock", "_names")

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._local = threading.local()
        self._shards: list[collections.Counter] = []
        self._lock = threading.Lock()
        self._names = tuple(names)

    def shard(self) -> collections.Counter:
        """This thread's counter: ``shard[name] += n`` adds to ``name`` (this thread only)."""
        try:
            return self._local.c
        except AttributeError:
            c = self._local.c = collections.Counter()
            with self._lock:
                self._shards.append(c)
            return c

    def add(self, name: str, value: int | float = 1) -> None:
        try:
            c = self._local.c
        except AttributeError:
            c = self.shard()
        c[name] += value

    def get(self, name: str) -> int | float:
        """The total of ``name`` over every thread (0 if never added)."""
        with self._lock:
            shards = list(self._shards)
        return sum(s.get(name, 0) for s in shards)

    def snapshot(self) -> dict[str, int | float]:
        """Every counter's total over every thread (plain data; the declared names too)."""
        with self._lock:
            shards = list(self._shards)
        out: dict[str, int | float] = dict.fromkeys(self._names, 0)
        for s in shards:
            # dict(s): one copy under the GIL, safe while its thread adds a new name.
            for name, value in dict(s).items():
                out[name] = out.get(name, 0) + value
        return out

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()!r})"


#: The process's operation counts (see the module docstring for each name).
ops = Counters(("control_sent", "control_received", "probes_sent", "ucx_ops",
                "unattended_sleeps", "shared_map_reads", "transfer_digests"))
