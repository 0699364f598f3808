"""The part of the connector that lives in each TP rank process (both sides).

A rank owns its :class:`~statebridge.state.cache.StateCache` (page memory) and its
:class:`~statebridge.connector.data.Transport` (UCX worker). It talks only to its group's
coordinator over one DEALER socket: it announces itself (``RankHello`` with its UCX address),
heartbeats, and executes ``GroupInfo`` (a peer group to connect to, forwarded by the
coordinator) / ``RankPrefill`` / ``RankRecv`` / ``RankCancel``, answering each request with
exactly one ``RankDone`` -- sent only once nothing of the request can still touch the page
(transfers complete or cancelled). A request is named by its
:class:`~statebridge.connector.ledger.RequestKey` ``(peer_node, request_id, generation)``, as on
the coordinator.

The model (a :class:`RankModel`) runs on the rank's compute thread. Besides ``prefill`` it may
serve messages of its own (:meth:`RankModel.handlers`; the decode node's batched decode steps are
one), in arrival order with the prefills; the connector knows nothing of what they mean.
A rank that cannot start (model, checkpoint, UCX) tells its coordinator ``RankFailed`` with the
error before it exits, so the node fails at once with that message.

A rank shuts itself down when its coordinator is gone: its local channel closed, or the
coordinator's process (its parent) exited -- so a killed node leaves no orphans. A coordinator
that is merely silent (stopped by SIGSTOP, or busy) is waited for: the rank logs it and serves
on, and the coordinator decides whether the rank is still one of its group.

This module is the process entry (:func:`rank_main`) and re-exports the extension points
(:class:`RankModel`, :class:`RankSetup`, :class:`KVBlocks`, :func:`kv_checksum`,
:func:`load_callable`, defined in ``model``) and :class:`RankWorker`. Inside a rank, one
concern per module:

- ``model``: the extension points and the types the rank's modules share;
- ``worker``: :class:`RankWorker` -- the loop, its handlers, connecting, lifecycle;
- ``memory``: the ONE rank buffer (pages | KV pool | notice slots) and its memory kind;
- ``routes``: the rank's pairs with each peer group, and the ONE posting path of a request;
- ``pending``: pending transfers -- scan, settle, expire, fail -- and how the loop sleeps;
- ``shared_map``: the rank's side of the same-host shared-map protocol;
- ``compute``: the compute thread (the model's work in order, prefills batched into steps of
  ``max_prefill_tokens`` that the group's ranks agree on) and its thread rule;
- ``digest``: transfer digests (``--verify-transfers``): what a prefill rank reports it sends
  each decode rank (``RankDigest``), what a decode rank found landed (``RankDone.digest``).
"""

from __future__ import annotations

import logging

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.rank.model import (
    KVBlocks,
    PrefillChunk,
    RankModel,
    RankSetup,
    kv_checksum,
    load_callable,
)
from statebridge.connector.rank.worker import RankWorker
from statebridge.security import CurveKeys

log = logging.getLogger(__name__)

__all__ = ["RankSetup", "RankWorker", "RankModel", "PrefillChunk", "KVBlocks", "rank_main",
           "load_callable", "kv_checksum"]


def rank_main(setup: RankSetup) -> None:
    """Entry point of a rank process. A rank that cannot start tells its coordinator why
    (``RankFailed``), then exits with status 1."""
    if setup.log_level:
        # A spawned process has no logging configured; the node's CLI passes its level on.
        # (Library use leaves the rank's logging to the embedding application.)
        logging.basicConfig(level=setup.log_level,
                            format=f"%(asctime)s {setup.role}-rank{setup.tp_rank} %(levelname)s "
                                   f"%(name)s: %(message)s")
    try:
        worker = RankWorker(setup)
    except Exception as e:  # noqa: BLE001 -- reported to the coordinator, then the rank exits
        log.exception("%s rank %d failed to start", setup.role, setup.tp_rank)
        _report_start_failure(setup, f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    worker.run()


def _report_start_failure(setup: RankSetup, message: str) -> None:
    """Best effort: one RankFailed to the coordinator, over the channel the rank would have
    used (the local channel, when it has one: the coordinator takes it from nowhere else),
    flushed before the process exits."""
    failed = m.RankFailed(tp_rank=setup.tp_rank, message=message[:4000])
    where = setup.local_coordinator.lstrip("\0") or setup.coordinator
    try:
        if setup.local_coordinator:
            from statebridge.connector.local import LocalDealer

            local = LocalDealer(setup.local_coordinator,
                                name=f"{setup.role}-rank{setup.tp_rank}",
                                max_frame=c.frame_cap(setup.config.max_message_bytes))
            try:
                c.send_dealer(local, failed)      # no loop here: written at once (it is small)
            finally:
                local.close()
            return
        import zmq

        # A context of its own, terminated here: term() returns once the message left (or
        # the linger ran out). A forked rank ends in os._exit, which flushes nothing.
        ctx = zmq.Context()
        try:
            sock = c.connect_dealer(ctx, setup.coordinator,
                                    keys=CurveKeys.from_config(setup.config))
            try:
                c.send_dealer(sock, failed)
                c.flush(sock)
            finally:
                sock.close(linger=2000)
        finally:
            ctx.term()
    except Exception as e:  # noqa: BLE001 -- the coordinator also sees the process exit
        log.warning("could not report the start failure to %s: %s", where, e)
