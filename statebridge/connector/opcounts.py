"""Process-wide operation counts: control messages and UCX operations, for benchmarks.

Every thread adds to its own :class:`collections.Counter` (no lock, no lost increments);
:func:`snapshot` sums them. Counted where the work is done:

- ``control_sent``: statebridge control messages handed to zmq (one per destination peer of
  :func:`~statebridge.connector.control.send_router_many`, one per
  :func:`~statebridge.connector.control.send_dealer`), counted before coalescing into batches;
- ``control_received``: control messages decoded from zmq frames (one per message of a batch);
- ``ucx_ops``: UCX tag sends and receives posted by :class:`~statebridge.connector.data.transport.Transport`
  (one per run posted zero-copy, one per staging buffer);
- ``unattended_sleeps``: rank loop sleeps that left UCX's events unpolled because every pending
  request was a send its receiver reads by itself (:meth:`RankWorker._before_sleep
  <statebridge.connector.rank.RankWorker._before_sleep>`);
- ``shared_map_reads``: a decode rank's copies of one request's runs from one prefill rank out
  of that rank's shared map (:meth:`RankWorker._do_reads
  <statebridge.connector.rank.RankWorker._do_reads>`); each also counts its "ready" notice
  in ``ucx_ops`` (posted by both sides; the answer is a word in the prefill rank's memory).
"""

from __future__ import annotations

import collections
import threading

__all__ = ["counter", "snapshot"]

_local = threading.local()
_registry: list[collections.Counter] = []
_lock = threading.Lock()


def counter() -> collections.Counter:
    """This thread's counter (add to it: ``counter()["ucx_ops"] += n``)."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = collections.Counter()
        with _lock:
            _registry.append(c)
    return c


def snapshot() -> dict[str, int]:
    """Totals over every thread of this process since it started."""
    with _lock:
        counters = list(_registry)
    out: collections.Counter = collections.Counter()
    for c in counters:
        out.update(dict(c))
    return dict(out)
