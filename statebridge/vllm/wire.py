"""The connector's side channel: a decode (consumer) worker rank and a prefill (producer) worker
rank, over zmq DEALER -> ROUTER, in the package's one codec (:mod:`statebridge.connector.codec`).

::

    consumer rank d                                   producer rank s (ROUTER on port + s)
      VllmHello(peer, address, geometry, ...)   ->
                                                <-    VllmMeta(engine, address, geometry, ...)
      (posts its receives for the request)
      VllmPull(request, generation, blocks)     ->    posts its sends of the same runs
                                                <-    VllmPullReply(request, error | checksum)
                                                       (only on an error, or with verification)

Both sides compute the same runs from the same two geometries and block tables
(:class:`~statebridge.state.paged.PagedPlan`), so a pull carries block ids, never offsets.
Every consumer rank pulls from every producer rank of the request (a pull without runs when the
pair moves nothing), so each producer rank knows when every consumer rank is done with it.
"""

from __future__ import annotations

from statebridge.connector.codec import Message, message

__all__ = ["VllmHello", "VllmMeta", "VllmPull", "VllmPullReply"]


@message
class VllmHello(Message):
    """A consumer rank introduces itself to a producer rank (first request for that engine)."""

    peer: str                 # the consumer rank's id (its UCX endpoint on the producer)
    address: bytes            # its UCX worker address
    dst_rank: int
    dst_tp: int
    spec: str                 # StateSpec JSON (the compatibility check)
    geometry: str             # its layer memory (JSON: PagedGeometry.describe + groups)


@message
class VllmMeta(Message):
    """The producer rank's answer: who it is and where its layers live."""

    engine_id: str
    src_rank: int
    src_tp: int
    address: bytes
    geometry: str             # "" when ``error`` is set
    error: str                # why the producer refuses this consumer ("" when it accepts)
    verify: bool              # the producer sends checksums of what it sends


@message
class VllmPull(Message):
    """Send request ``request_id``'s runs for rank pair (s, dst_rank) with tags of
    ``generation``. Block tables are per layer, in the order of ``state_layers`` /
    ``kv_layers``; ``kv_blocks`` blocks of each attention layer move."""

    request_id: str
    generation: int
    peer: str
    dst_rank: int
    dst_tp: int
    state_layers: tuple[int, ...]
    src_state: tuple[int, ...]
    dst_state: tuple[int, ...]
    kv_layers: tuple[int, ...]
    kv_blocks: int
    src_kv: tuple[int, ...]   # len(kv_layers) x kv_blocks, layer-major
    dst_kv: tuple[int, ...]
    abort: bool               # nothing will be read: release the request's blocks


@message
class VllmPullReply(Message):
    """Why the producer could not serve a pull (``error``), or with verification on the
    crc32 of the bytes it sent (``checksum``; -1 when not verifying)."""

    request_id: str
    generation: int
    src_rank: int
    error: str
    checksum: int
