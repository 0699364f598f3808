"""The data plane: one UCX worker per rank process, bound to that rank's page buffer.

Who runs what: every TP rank process (prefill and decode) owns one :class:`Transport` over its
:class:`~statebridge.state.cache.StateCache` buffer, driven by the rank loop's thread (one
thread owns a Transport; it progresses it in blocking mode, sleeping on :meth:`Transport.fileno`
with its other sockets). The control plane (zmq, not this package) carries
:attr:`Transport.address` in the handshake; each side then calls :meth:`Transport.connect` for
the peer ranks its plan pairs it with, and turns each pair's runs into a :class:`RunTemplate`
once. Per request the prefill rank calls :meth:`Transport.post_runs` "send" (or
:meth:`Transport.post_send_staged`) for each pair at the page's offset and the decode rank
:meth:`Transport.post_runs` "recv" (or :meth:`Transport.post_recv_staged`); both poll or wait the
returned :class:`TransferHandle` (:meth:`Transport.post_send` / :meth:`Transport.post_recv` take
absolute runs directly). When the control plane declares a peer dead (heartbeats), the rank
calls :meth:`Transport.fail_peer`.

This is the only package of statebridge that imports ``ucxx`` (DESIGN rule), and it does so only
when the first :class:`Transport` is built -- importing ``ucxx`` sets ``UCX_*`` defaults in
``os.environ`` (``UCX_RNDV_THRESH=8192`` and others), which importing statebridge must not do.

One concern per module:

- ``tags``: the 64-bit message tag (generation | src rank | index), its one bit layout
  (``pack_tag``), :func:`make_tag`, :func:`split_tag`, :data:`STAGED_INDEX`;
- ``env``: :func:`configure_ucx_env`, :func:`alloc_buffer` (transparent huge pages);
- ``runs``: :class:`RunTemplate`, run checks, the host gather/scatter (its one implementation is
  :func:`statebridge.kernels.pack.copy_runs_host`);
- ``handle``: :class:`TransferHandle`, :class:`HandleState`;
- ``staging``: the pool of staging buffers of staged pairs;
- ``guard``: messages no announced receive takes (UCX's unexpected queue);
- ``endpoints``: :class:`~statebridge.connector.data.endpoints.Endpoints`, a transport's part
  holding its peers (connect, lost peers, UCX errors);
- ``posting``: :class:`~statebridge.connector.data.posting.Posting`, a transport's part holding
  its page buffer and every post;
- ``transport``: :class:`Transport` -- worker, lifecycle, progress, counters (with the
  measurements behind its choices: progress, error handling); it holds an ``endpoints`` and a
  ``posting`` part and hands its peer and post methods over to them;
- ``shared/``: same-host shared-map reads -- a prefill rank's buffer as a memfd, a decode
  rank's read-only map of it, the run copy (``_copy.c``), the notice slots and the one rule
  of which pairs go that way; UCX carries their small notices.

Sizes: a message LONGER than the receive it matches fails that handle with a
:class:`~statebridge.errors.TransferError` (UCX truncates it; nothing lands in the page; counted
as ``rejected_wrong_size``). A SHORTER one is not detected: ucxx 0.52 completes the receive with
status OK and does not expose the received length (its ``RequestTag`` length check is disabled,
rapidsai/ucxx#104), so the tail of that run keeps its old bytes.

Per-run sends vs ``send_multi``: each zero-copy run is one tagged send straight from the page and
one tagged receive straight into the page. ``tag_send_multi`` was not taken: ucxx sends a
header message plus one message per frame anyway, and ``tag_recv_multi`` receives into buffers
*it* allocates, so the receive side copies (``benchmarks/bench_transport.py`` keeps that path
for comparison; results in docs/measurements.md, "Transport choices"). Each posted message
costs Python and ucxx work of its own, so pairs with many small runs are staged instead (the
plan marks them).
"""

from statebridge.connector.data.env import alloc_buffer, configure_ucx_env
from statebridge.connector.data.handle import HandleState, TransferHandle
from statebridge.connector.data.runs import RunTemplate
from statebridge.connector.data.tags import (
    STAGED_INDEX,
    TAG_GENERATION_BITS,
    TAG_INDEX_BITS,
    TAG_SRC_RANK_BITS,
    make_tag,
    split_tag,
)
from statebridge.connector.data.transport import Transport

__all__ = [
    "STAGED_INDEX",
    "TAG_GENERATION_BITS",
    "TAG_INDEX_BITS",
    "TAG_SRC_RANK_BITS",
    "HandleState",
    "RunTemplate",
    "TransferHandle",
    "Transport",
    "alloc_buffer",
    "configure_ucx_env",
    "make_tag",
    "split_tag",
]
