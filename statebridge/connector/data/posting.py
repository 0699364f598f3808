"""The posting half of :class:`~statebridge.connector.data.transport.Transport`: a rank's
sends and receives of runs (zero-copy, straight from and into its buffer), of staged pairs
(one message through a pooled staging buffer) and of shared-map notices.

:class:`Posting` holds methods only; they work on the state :class:`Transport` sets up
(``_worker``, ``_segments``, ``_data``, ``_np``, ``_arrays``, ``_size``, ``_pool``,
``_outstanding``, ``counters``, ``_Array``, ``_Tag``, ``name``) and its endpoints
(:class:`~statebridge.connector.data.endpoints.Endpoints`).

Device memory: UCX is handed device buffers as such (``__cuda_array_interface__`` views) and
moves them with its CUDA transports; a staged pair is packed on the device into a device
staging buffer (one kernel launch, waited for before UCX reads it) and unpacked the same way
before its handle reports done.
"""

from __future__ import annotations


import numpy as np
import torch

from statebridge.connector.data.device import cuda_array
from statebridge.connector.data.handle import TransferHandle
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
from statebridge.connector.stats import ops
from statebridge.errors import ConfigError, TransferError

__all__ = ["Posting"]

#: Most cached buffer views of a transport (see Posting._view); ~200 B each.
_MAX_CACHED_ARRAYS = 1 << 16


class Posting:
    """:class:`Transport`'s posting methods (see the module docstring)."""

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
                  request_id: str | None = None, index0: int = 0) -> TransferHandle:
        """:meth:`post_send` / :meth:`post_recv` of a :class:`RunTemplate` at byte offset
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
        if type(base) is not int or base < 0 or base + template.extent > self._size:
            raise ConfigError(template.outside(base, self._size, "send" if send else "receive",
                                               "page buffer")
                              if type(base) is int else f"base must be an int, got {base!r}")
        if type(generation) is not int or type(src_rank) is not int \
                or not 0 <= generation <= MAX_GENERATION or not 0 <= src_rank <= MAX_SRC_RANK:
            make_tag(generation, src_rank, 0)          # raises with the offending field
            generation, src_rank = int(generation), int(src_rank)
        tag0 = pack_tag(generation, src_rank, index0)
        if send:
            op = self._endpoint(peer_id).tag_send
        elif peer_id is None:                      # a receive matching any peer
            self._check_open()
            op = self._worker.tag_recv
        else:
            op = self._endpoint(peer_id).tag_recv
        requests = self._post_runs(op, base, template, tag0, peer_id)
        handle = TransferHandle(self, direction=direction, kind="zero_copy",
                                peer_id=peer_id, generation=generation, src_rank=src_rank,
                                nbytes=template.nbytes, messages=len(template.offsets),
                                request_id=request_id, requests=requests)
        self._outstanding[id(handle)] = handle
        return handle

    def post_send_staged(self, peer_id: str, generation: int, src_rank: int, pack_runs: object,
                         *, request_id: str | None = None) -> TransferHandle:
        """Gather ``pack_runs`` (absolute src offset, staging offset, length) into a pooled
        staging buffer and send it as ONE message (index :data:`STAGED_INDEX`). The staging
        size is ``max(staging offset + length)``."""
        pack_runs = as_runs(pack_runs, "pack_runs")
        check_span(pack_runs, 0, self._data.numel(), "pack", "page buffer")
        nbytes = int((pack_runs[:, 1] + pack_runs[:, 2]).max()) if len(pack_runs) else 0
        check_span(pack_runs, 1, nbytes, "pack", "staging buffer")
        tag = make_tag(generation, src_rank, STAGED_INDEX)
        staging = self._pool.acquire(nbytes)
        try:
            self._staged_copy(self._data, pack_runs, staging, "pack")
            endpoint = self._endpoint(peer_id)
            requests = self._post_one(endpoint.tag_send, self._staging_view(staging, nbytes),
                                      tag, peer_id)
        except BaseException:
            self._pool.release(staging)
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
        check_span(unpack_runs, 1, self._data.numel(), "unpack", "page buffer")
        tag = make_tag(generation, src_rank, STAGED_INDEX)
        staging = self._pool.acquire(nbytes)
        try:
            if peer_id is None:
                self._check_open()
            target = self._worker if peer_id is None else self._endpoint(peer_id)
            requests = self._post_one(target.tag_recv, self._staging_view(staging, nbytes),
                                      tag, peer_id)
        except BaseException:
            self._pool.release(staging)
            raise
        page = self._data
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
                or offset + nbytes > self._size:
            raise ConfigError(f"notice [{offset!r}, +{nbytes!r}) is outside the "
                              f"{self._size}-byte buffer")
        tag = make_tag(generation, src_rank, index)
        endpoint = self._endpoint(peer_id)
        op = endpoint.tag_send if direction == "send" else endpoint.tag_recv
        # A notice slot is the same few bytes request after request: its view is cached.
        requests = self._post_one(op, self._view(offset, nbytes), tag, peer_id)
        handle = TransferHandle(self, direction=direction, kind="notice", peer_id=peer_id,
                                generation=generation, src_rank=src_rank, nbytes=nbytes,
                                messages=1, request_id=request_id, requests=requests)
        self._outstanding[id(handle)] = handle
        return handle

    def _staged_handle(self, direction: str, peer_id: str | None, generation: int,
                       src_rank: int, nbytes: int, request_id: str | None, requests: list,
                       staging: torch.Tensor, on_success) -> TransferHandle:
        handle = TransferHandle(self, direction=direction, kind="staged", peer_id=peer_id,
                                generation=generation, src_rank=src_rank, nbytes=nbytes,
                                messages=1, request_id=request_id, requests=requests,
                                staging=staging, on_success=on_success)
        c = self.counters.shard()
        c["staging_buffers_used"] += 1
        c["staging_bytes"] += nbytes
        self._outstanding[id(handle)] = handle
        return handle

    def _post_runs(self, op, base: int, template: RunTemplate, tag0: int,
                   peer_id: str | None) -> list:
        """One UCX request per run of the page buffer, straight from/into its memory (views
        from :meth:`_view`)."""
        Tag, view = self._Tag, self._view
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

    def _view(self, start: int, n: int):
        """The ucxx view of ``buffer[start:start + n]`` (costly to build), cached per (start,
        length): a rank posts the same few page slices and notice slots over and over. A
        device segment is handed to UCX as device memory."""
        arrays = self._arrays
        array = arrays.get((start, n))
        if array is None:
            if len(arrays) > _MAX_CACHED_ARRAYS:
                arrays.clear()
            for s0, end, tensor, mv in self._segments:
                if s0 <= start and start + n <= end:
                    break
            else:
                raise ConfigError(f"bytes [{start}, {start + n}) are not inside one segment of "
                                  f"the buffer {[(a, b) for a, b, _, _ in self._segments]}")
            if mv is not None:
                array = self._Array(mv[start - s0:start - s0 + n])
            else:
                array = self._Array(cuda_array(tensor.data_ptr() + start - s0, n))
            arrays[start, n] = array
        return array

    def _staging_view(self, staging: torch.Tensor, nbytes: int):
        """The ucxx view of the first ``nbytes`` of a staging buffer (host or device)."""
        if staging.device.type == "cpu":
            return self._Array(staging.numpy()[:nbytes])
        return self._Array(cuda_array(staging.data_ptr(), nbytes))

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

    def _post_one(self, op, array, tag: int, peer_id: str | None) -> list:
        """One UCX request on ``array``: a ucxx view of this rank's buffer or of a staging
        buffer (None: ``op`` needs no buffer)."""
        ops.add("ucx_ops")
        try:
            return [op(array, self._Tag(tag))]
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"{self.name}: posting to {peer_id!r} failed: {e}",
                                peer=peer_id) from e
