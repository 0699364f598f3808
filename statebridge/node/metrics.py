"""What the decode node measures of each request it served, as histograms: where the time to
its first token went before the decode node ran it (queued, prefill compute, state transfer)
and how many bytes moved. The node fills them (:class:`NodeHistograms`, loop thread); they
travel in :class:`~statebridge.node.messages.NodeStats` to whoever asks (the HTTP front door
exports them in Prometheus' text format).

Each time comes from where its events happened (see
:class:`~statebridge.connector.decode.RequestTiming`): the decode node's arrival, the
prefill ranks' compute and first post, the decode ranks' "every byte landed".

Names follow vLLM's metrics where one has a counterpart (``vllm:request_queue_time_seconds``
-> ``statebridge_request_queue_time_seconds``, with vLLM's request-latency buckets); the
transfer ones are statebridge's own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from statebridge.connector.decode import RequestTiming

__all__ = ["Histogram", "NodeHistograms", "HISTOGRAMS"]

#: vLLM's request latency buckets, from 5 ms.
_REQUEST_S = (.005, .01, .025, .05, .1, .25, .5, .8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
              30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: State transfers: from 100 us (a small state over shared memory) to 20 s.
_TRANSFER_S = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5,
               5.0, 10.0, 20.0)
#: Bytes per request: powers of 4 from 1 KiB to 16 GiB.
_BYTES = tuple(float(4 ** i) for i in range(5, 18))

#: name -> (help, bucket upper bounds) of every histogram the node keeps.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "statebridge_request_queue_time_seconds": (
        "From the request's arrival at the decode node to the start of its prefill compute "
        "(waiting for a page, for the prefill node, behind other prompts)", _REQUEST_S),
    "statebridge_request_prefill_time_seconds": (
        "Prefill compute of the prompt: from its start on the first prefill rank to the "
        "state final on the last (the decode ranks' for a local recompute)", _REQUEST_S),
    "statebridge_transfer_seconds": (
        "State transfer: from the first byte a prefill rank posted to every decode rank "
        "holding all of it", _TRANSFER_S),
    "statebridge_transfer_bytes": (
        "Recurrent state and KV bytes moved per request (all decode ranks)", _BYTES),
}


@dataclass
class Histogram:
    """Counts per bucket (``le`` upper bounds; the last count is above every bound), the sum
    and the count of what was observed."""

    buckets: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def of(cls, buckets: tuple[float, ...]) -> "Histogram":
        return cls(tuple(buckets), [0] * (len(buckets) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class NodeHistograms:
    """The decode node's per-request histograms (:data:`HISTOGRAMS`), filled from each
    request's :class:`~statebridge.connector.decode.RequestTiming`."""

    def __init__(self) -> None:
        self.by_name = {name: Histogram.of(buckets)
                        for name, (_, buckets) in HISTOGRAMS.items()}

    def observe(self, timing: RequestTiming) -> None:
        queue, prefill, transfer = timing.seconds()
        h = self.by_name
        h["statebridge_request_queue_time_seconds"].observe(queue)
        h["statebridge_request_prefill_time_seconds"].observe(prefill)
        if transfer is not None:
            h["statebridge_transfer_seconds"].observe(transfer)
            h["statebridge_transfer_bytes"].observe(timing.nbytes)

    def fields(self) -> dict:
        """The NodeStats fields that carry them."""
        names = tuple(self.by_name)
        return {"histogram_names": names,
                "histogram_counts": tuple(tuple(self.by_name[n].counts) for n in names),
                "histogram_sums": tuple(self.by_name[n].total for n in names)}
