"""A transport's posts: a rank's sends and receives of runs (zero-copy, straight from and into
its buffer), of staged pairs (one message through a pooled staging buffer) and of shared-map
notices.

:class:`Posting` is a part of :class:`~statebridge.connector.data.transport.Transport` that
holds the page buffer (its segments and the cached ucxx views of its slices). It is given the
staging pool, the handles in flight, the counters and the endpoint lookup
(:class:`PeerEndpoints`) in its constructor; what it asks of its transport is
:class:`PostingOwner` (the UCX worker while open, and being the owner of the handles it posts).

Device memory: UCX is handed device buffers as such (``__cuda_array_interface__`` views) and
moves them with its CUDA transports; a staged pair is packed on the device into a device
staging buffer (one kernel launch, waited for before UCX reads it) and unpacked the same way
before its handle reports done.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from statebridge.connector.data.device import cuda_array
from statebridge.connector.data.handle import HandleOwner, TransferHandle
from statebridge.connector.data.runs import RunTemplate, as_runs, check_span, copy_runs
from statebridge.connector.data.tags import (
    MAX_GENERATION,
    MAX_RUNS,
    MAX_SRC_RANK,
    READY_INDEX,
    STAGED_INDEX,
    make_tag,
    pack_tag,
)
from statebridge.connector.data.staging import StagingPool
from statebridge.connector.stats import Counters, ops
from statebridge.errors import ConfigError, TransferError

__all__ = ["PeerEndpoints", "Posting", "PostingOwner"]

#: Most cached buffer views of a transport (see Posting.view); ~200 B each.
_MAX_CACHED_ARRAYS = 1 << 16


class PostingOwner(HandleOwner, Protocol):
    """What :class:`Posting` asks of its transport: to own the handles it posts, and its UCX
    worker (for receives from any peer)."""

    def live_worker(self) -> Any:
        """The UCX worker; :class:`~statebridge.errors.ClosedError` once the transport is
        closed."""


class PeerEndpoints(Protocol):
    """The endpoint lookup :class:`Posting` posts through."""

    def endpoint(self, peer_id: str) -> Any:
        """The live UCX endpoint of ``peer_id`` (raises when closed, lost or unknown)."""


@dataclass(eq=False, repr=False)
class Posting:
    """A transport's posts over its page buffer (see the module docstring).

    Args:
        owner: the transport (:class:`PostingOwner`): the handles' owner.
        endpoints: the endpoint lookup (:class:`PeerEndpoints`).
        buffer: the buffer's ``(start, tensor)`` segments, checked, in address order.
        array_type: ``ucxx._lib.arr.Array``; ``tag_type``: ``UCXXTag`` (imported by the
            transport).
        pool: the staging pool of staged pairs.
        outstanding: the transport's handles in flight (id -> handle); posts add to it.
        counters: the transport's counters.
        name: label used in errors.
    """

    owner: PostingOwner
    endpoints: PeerEndpoints
    _: KW_ONLY
    buffer: InitVar[list[tuple[int, torch.Tensor]]]
    array_type: Any
    tag_type: Any
    pool: StagingPool
    outstanding: dict[int, TransferHandle]
    counters: Counters
    name: str
    #: (start, end, tensor, host memoryview or None) per segment, in address order.
    segments: list[tuple[int, int, torch.Tensor, memoryview | None]] = field(init=False)
    #: The staged pairs' buffer: the first segment (the pool); as numpy and as a memoryview
    #: when on the host (else None).
    page: torch.Tensor = field(init=False)
    page_np: np.ndarray | None = field(init=False)
    page_mv: memoryview | None = field(init=False)
    #: The whole buffer's size in bytes (the end of its last segment).
    size: int = field(init=False)
    _arrays: dict[tuple[int, int], Any] = field(init=False, default_factory=dict)  # see view()

    def __post_init__(self, buffer: list[tuple[int, torch.Tensor]]) -> None:
        self.segments = [(start, start + t.numel(), t,
                          memoryview(t.numpy()) if t.device.type == "cpu" else None)
                         for start, t in buffer]
        self.page = first = buffer[0][1]
        self.page_np = first.numpy() if first.device.type == "cpu" else None
        self.page_mv = self.segments[0][3]
        self.size = self.segments[-1][1]

    def template(self, runs: object, direction: str) -> RunTemplate:
        """``runs`` (``[R, 3]``: src offset, dst offset, length; relative to a page) as a
        checked :class:`RunTemplate` for :meth:`post_runs` in ``direction`` ("send" takes the
        source offsets, "recv" the destination offsets)."""
        if direction not in ("send", "recv"):
            raise ConfigError(f"direction must be 'send' or 'recv', got {direction!r}")
        return RunTemplate(runs, 0 if direction == "send" else 1)

    def post_runs(self, direction: str, peer_id: str | None, generation: int, src_rank: int,
                  base: int, template: RunTemplate, *,
                  request_id: str | None = None, index0: int = 0) -> TransferHandle:
        """``Transport.post_send`` / ``post_recv`` of a :class:`RunTemplate` at byte offset
        ``base`` of the buffer (a page's start): the rank's per-request post. Run ``i``
        travels with tag index ``index0 + i`` (a second post of the same pair and attempt,
        e.g. the attention KV after the recurrent runs, numbers on)."""
        send = direction == "send"
        if index0:
            if type(index0) is not int or index0 < 0 or index0 + len(template) > MAX_RUNS:
                raise ConfigError(f"runs {index0} .. {index0} + {len(template)} exceed the "
                                  f"{MAX_RUNS} a tag index can number")
        if not send and direction != "recv":
            raise ConfigError(f"direction must be 'send' or 'recv', got {direction!r}")
        if type(base) is not int or base < 0 or base + template.extent > self.size:
            raise ConfigError(template.outside(base, self.size, "send" if send else "receive",
                                               "page buffer")
                              if type(base) is int else f"base must be an int, got {base!r}")
        if type(generation) is not int or type(src_rank) is not int \
                or not 0 <= generation <= MAX_GENERATION or not 0 <= src_rank <= MAX_SRC_RANK:
            make_tag(generation, src_rank, 0)          # raises with the offending field
            generation, src_rank = int(generation), int(src_rank)
        tag0 = pack_tag(generation, src_rank, index0)
        if send:
            op = self.endpoints.endpoint(peer_id).tag_send
        elif peer_id is None:                      # a receive matching any peer
            op = self.owner.live_worker().tag_recv
        else:
            op = self.endpoints.endpoint(peer_id).tag_recv
        requests = self._post_runs(op, base, template, tag0, peer_id)
        handle = TransferHandle(self.owner, direction=direction, kind="zero_copy",
                                peer_id=peer_id, generation=generation, src_rank=src_rank,
                                nbytes=template.nbytes, messages=len(template.offsets),
                                request_id=request_id, requests=requests)
        self.outstanding[id(handle)] = handle
        return handle

    def post_send_staged(self, peer_id: str, generation: int, src_rank: int, pack_runs: object,
                         *, request_id: str | None = None) -> TransferHandle:
        """Gather ``pack_runs`` (absolute src offset, staging offset, length) into a pooled
        staging buffer and send it as ONE message (index :data:`STAGED_INDEX`). The staging
        size is ``max(staging offset + length)``."""
        pack_runs = as_runs(pack_runs, "pack_runs")
        check_span(pack_runs, 0, self.page.numel(), "pack", "page buffer")
        nbytes = int((pack_runs[:, 1] + pack_runs[:, 2]).max()) if len(pack_runs) else 0
        check_span(pack_runs, 1, nbytes, "pack", "staging buffer")
        tag = make_tag(generation, src_rank, STAGED_INDEX)
        staging = self.pool.acquire(nbytes)
        try:
            self._staged_copy(self.page, pack_runs, staging, "pack")
            endpoint = self.endpoints.endpoint(peer_id)
            requests = self.post_one(endpoint.tag_send, self._staging_view(staging, nbytes),
                                      tag, peer_id)
        except BaseException:
            self.pool.release(staging)
            raise
        return self._staged_handle("send", peer_id, generation, src_rank, nbytes, request_id,
                                   requests, staging, None)

    def post_recv_staged(self, peer_id: str | None, generation: int, src_rank: int, nbytes: int,
                         unpack_runs: object, *, request_id: str | None = None) -> TransferHandle:
        """Receive one ``nbytes`` staged message into a pooled staging buffer; when it arrives,
        scatter ``unpack_runs`` (staging offset, absolute dst offset, length) into the page.
        The handle is done only after the scatter."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        nbytes = int(nbytes)
        unpack_runs = as_runs(unpack_runs, "unpack_runs")
        check_span(unpack_runs, 0, nbytes, "unpack", "staging message")
        check_span(unpack_runs, 1, self.page.numel(), "unpack", "page buffer")
        tag = make_tag(generation, src_rank, STAGED_INDEX)
        staging = self.pool.acquire(nbytes)
        try:
            target = self.owner.live_worker() if peer_id is None \
                else self.endpoints.endpoint(peer_id)
            requests = self.post_one(target.tag_recv, self._staging_view(staging, nbytes),
                                      tag, peer_id)
        except BaseException:
            self.pool.release(staging)
            raise
        page = self.page
        return self._staged_handle("recv", peer_id, generation, src_rank, nbytes, request_id,
                                   requests, staging,
                                   lambda: self._staged_copy(staging, unpack_runs, page, "unpack"))

    def post_notice(self, direction: str, peer_id: str, generation: int, src_rank: int,
                    index: int, offset: int, nbytes: int, *,
                    request_id: str | None = None) -> TransferHandle:
        """One small tagged message of a shared-map read (``shared.py``) to or from
        ``buffer[offset:offset + nbytes]``: the "ready" notice (``index`` :data:`READY_INDEX`),
        with tag ``(generation, src_rank, index)``.
        Small enough to go eagerly: a send completes without the peer."""
        if direction not in ("send", "recv"):
            raise ConfigError(f"direction must be 'send' or 'recv', got {direction!r}")
        if index != READY_INDEX:
            raise ConfigError(f"notice index must be READY_INDEX, got {index!r}")
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes <= 0 \
                or offset + nbytes > self.size:
            raise ConfigError(f"notice [{offset!r}, +{nbytes!r}) is outside the "
                              f"{self.size}-byte buffer")
        tag = make_tag(generation, src_rank, index)
        endpoint = self.endpoints.endpoint(peer_id)
        op = endpoint.tag_send if direction == "send" else endpoint.tag_recv
        # A notice slot is the same few bytes request after request: its view is cached.
        requests = self.post_one(op, self.view(offset, nbytes), tag, peer_id)
        handle = TransferHandle(self.owner, direction=direction, kind="notice", peer_id=peer_id,
                                generation=generation, src_rank=src_rank, nbytes=nbytes,
                                messages=1, request_id=request_id, requests=requests)
        self.outstanding[id(handle)] = handle
        return handle

    def _staged_handle(self, direction: str, peer_id: str | None, generation: int,
                       src_rank: int, nbytes: int, request_id: str | None, requests: list,
                       staging: torch.Tensor, on_success) -> TransferHandle:
        handle = TransferHandle(self.owner, direction=direction, kind="staged", peer_id=peer_id,
                                generation=generation, src_rank=src_rank, nbytes=nbytes,
                                messages=1, request_id=request_id, requests=requests,
                                staging=staging, on_success=on_success)
        c = self.counters.shard()
        c["staging_buffers_used"] += 1
        c["staging_bytes"] += nbytes
        self.outstanding[id(handle)] = handle
        return handle

    def _post_runs(self, op, base: int, template: RunTemplate, tag0: int,
                   peer_id: str | None) -> list:
        """One UCX request per run of the page buffer, straight from/into its memory (views
        from :meth:`view`)."""
        Tag, view = self.tag_type, self.view
        requests: list = []
        try:
            tag = tag0
            for off, n in zip(template.offsets, template.lengths):
                requests.append(op(view(base + off, n), Tag(tag)))
                tag += 1
        except Exception as e:  # noqa: BLE001 -- ucxx raises its own exception types
            requests.clear()      # dropping ucxx's requests cancels what was posted
            raise TransferError(f"{self.name}: posting to {peer_id!r} failed: {e}",
                                peer=peer_id) from e
        ops.add("ucx_ops", len(requests))
        return requests

    def view(self, start: int, n: int):
        """The ucxx view of ``buffer[start:start + n]`` (costly to build), cached per (start,
        length): a rank posts the same few page slices and notice slots over and over. A
        device segment is handed to UCX as device memory."""
        arrays = self._arrays
        array = arrays.get((start, n))
        if array is None:
            if len(arrays) > _MAX_CACHED_ARRAYS:
                arrays.clear()
            for s0, end, tensor, mv in self.segments:
                if s0 <= start and start + n <= end:
                    break
            else:
                raise ConfigError(f"bytes [{start}, {start + n}) are not inside one segment of "
                                  f"the buffer {[(a, b) for a, b, _, _ in self.segments]}")
            if mv is not None:
                array = self.array_type(mv[start - s0:start - s0 + n])
            else:
                array = self.array_type(cuda_array(tensor.data_ptr() + start - s0, n))
            arrays[start, n] = array
        return array

    def _staging_view(self, staging: torch.Tensor, nbytes: int):
        """The ucxx view of the first ``nbytes`` of a staging buffer (host or device)."""
        if staging.device.type == "cpu":
            return self.array_type(staging.numpy()[:nbytes])
        return self.array_type(cuda_array(staging.data_ptr(), nbytes))

    @staticmethod
    def _staged_copy(frm: torch.Tensor, runs: np.ndarray, to: torch.Tensor, what: str) -> None:
        """Gather (``pack``) or scatter (``unpack``) a staged pair's checked runs: numpy on
        the host; on a device one kernel launch, waited for (UCX reads the staging buffer, or
        the handle reports done, only after it)."""
        if frm.device.type == "cpu":
            copy_runs(frm.numpy(), runs, to.numpy())
            return
        from statebridge.kernels.pack import pack

        pack(frm, runs, to)
        torch.cuda.current_stream(frm.device).synchronize()

    def post_one(self, op, array, tag: int, peer_id: str | None) -> list:
        """One UCX request on ``array``: a ucxx view of this rank's buffer or of a staging
        buffer (None: ``op`` needs no buffer)."""
        ops.add("ucx_ops")
        try:
            return [op(array, self.tag_type(tag))]
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"{self.name}: posting to {peer_id!r} failed: {e}",
                                peer=peer_id) from e
