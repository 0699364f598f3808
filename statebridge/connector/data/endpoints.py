"""A transport's endpoints: connecting to peers, declaring them lost, UCX's endpoint errors and
how a failed UCX request is classified.

:class:`Endpoints` is a part of :class:`~statebridge.connector.data.transport.Transport` with
state of its own (the peers, those declared lost, the lanes UCX chose, endpoint events recorded
by UCX's callbacks, endpoints of lost peers still closing). What it asks of its transport is
:class:`WorkerOwner` (the UCX worker while the transport is open); the handles it fails and the
counters it adds to are given to its constructor. See the transport's docstring for why error
handling is a choice and what each choice costs.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol

from statebridge.connector.data import ucxinfo
from statebridge.connector.data.handle import TransferHandle
from statebridge.connector.stats import Counters
from statebridge.errors import (
    AbortedError,
    ConfigError,
    PeerLostError,
    TransferError,
)

log = logging.getLogger("statebridge.connector.data.transport")

__all__ = ["Endpoints", "Peer", "WorkerOwner"]

# -- UCX status classification (ucs/type/status.h) ---------------------------------------------

_UCS_ERR_CANCELED = -16
_UCS_ERR_MESSAGE_TRUNCATED = -9     # a message longer than the posted receive
# The peer or the network is gone: unreachable, not connected, connection reset, link and
# endpoint failures.
_PEER_STATUSES = frozenset([-6, -24, -25, *range(-89, -39)])


class WorkerOwner(Protocol):
    """What :class:`Endpoints` asks of its transport."""

    def live_worker(self) -> Any:
        """The UCX worker; :class:`~statebridge.errors.ClosedError` once the transport is
        closed."""


@dataclass(slots=True, eq=False)
class Peer:
    """One connected peer: its id, worker address, UCX endpoint and connection serial."""

    peer_id: str
    address: bytes
    endpoint: Any
    serial: int
    closing: bool = False


@dataclass(eq=False, repr=False)
class Endpoints:
    """A transport's endpoints to its peers (see the module docstring).

    Args:
        owner: the transport (:class:`WorkerOwner`).
        ucx_api: ``ucxx._lib.libucxx`` (imported by the transport).
        error_handling: UCX endpoint error handling of every endpoint.
        tls: ``UCX_TLS`` of the transport's context ("" when unset).
        outstanding: the transport's handles in flight (id -> handle); :meth:`fail_peer`
            fails those of a lost peer.
        counters: the transport's counters.
        name: label used in logs and errors.
    """

    owner: WorkerOwner
    ucx_api: Any
    _: KW_ONLY
    error_handling: bool
    tls: str
    outstanding: dict[int, TransferHandle]
    counters: Counters
    name: str
    #: (peer id, serial) recorded by UCX's callbacks, processed by :meth:`process_events`.
    events: collections.deque = field(init=False, default_factory=collections.deque)
    _peers: dict[str, Peer] = field(init=False, default_factory=dict)
    _lost: dict[str, str] = field(init=False, default_factory=dict)   # peer id -> why lost
    _lanes: dict[str, list[str]] = field(init=False, default_factory=dict)
    _serial: int = field(init=False, default=0)
    #: Endpoints of lost peers, closed without waiting.
    _abandoned: list[Peer] = field(init=False, default_factory=list)

    # -- what the transport reads -----------------------------------------------------------------
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def peer_count(self) -> int:
        return len(self._peers)

    def lanes(self, peer_id: str) -> list[str]:
        """The transports (``tl/device``) UCX chose for ``peer_id``'s endpoint ([] when
        unknown)."""
        return list(self._lanes.get(peer_id, ()))

    def all_lanes(self) -> dict[str, str]:
        """peer id -> the transports UCX chose for it, comma-separated."""
        return {peer: ",".join(lanes) for peer, lanes in self._lanes.items()}

    def take_all(self) -> list[Peer]:
        """Every connected peer, forgotten (the transport is closing; it closes them)."""
        peers = list(self._peers.values())
        self._peers.clear()
        return peers

    def drop_abandoned(self) -> None:
        """Forget the endpoints of lost peers that were closed without waiting."""
        self._abandoned.clear()


    def connect(self, peer_id: str, address: bytes) -> None:
        """Endpoint to the peer worker at ``address`` (idempotent for the same address).

        A peer declared lost (:meth:`fail_peer`) may be connected again, e.g. after a restart;
        a live peer id with a different address is a :class:`ConfigError`.
        """
        if not isinstance(peer_id, str) or not peer_id:
            raise ConfigError(f"peer_id must be a non-empty string, got {peer_id!r}")
        if not isinstance(address, (bytes, bytearray, memoryview)) or len(address) == 0:
            raise ConfigError(f"address of peer {peer_id!r} must be non-empty bytes, got "
                              f"{type(address).__name__}")
        address = bytes(address)
        worker = self.owner.live_worker()
        peer = self._peers.get(peer_id)
        if peer is not None:
            if peer.address == address:
                return
            raise ConfigError(f"peer {peer_id!r} is already connected with another address; "
                              f"fail_peer() it first")
        try:
            ucx_address = self.ucx_api.UCXAddress.create_from_buffer(address)
            endpoint = worker.create_endpoint_from_worker_address(
                ucx_address, self.error_handling)
        except Exception as e:  # noqa: BLE001 -- ucxx raises its own exception types
            raise TransferError(f"{self.name}: cannot create an endpoint to {peer_id!r}: {e}",
                                peer=peer_id) from e
        self._serial += 1
        peer = Peer(peer_id, address, endpoint, self._serial)
        if self.error_handling:
            endpoint.set_close_callback(self._on_endpoint_closed,
                                        cb_args=(peer_id, peer.serial))
        self._peers[peer_id] = peer
        self._lost.pop(peer_id, None)
        # What UCX chose for this peer, from UCX itself (ucp_ep_print_info): the lanes of an
        # endpoint made from a worker address are fixed when it is created.
        lanes = self._lanes[peer_id] = ucxinfo.endpoint_lanes(endpoint.handle)
        log.info("%s: connected to %s over %s", self.name, peer_id,
                 ",".join(lanes) or "transports UCX did not report")

    def fail_peer(self, peer_id: str, reason: str) -> int:
        """The control plane declared ``peer_id`` dead: cancel every outstanding request
        involving it; those handles raise :class:`PeerLostError` (with ``peer`` set). Later
        posts to it raise at once until it is connected again. Receives posted with peer None
        belong to no peer and are not touched (cancel or time them out). Returns how many
        handles failed."""
        self._lost[peer_id] = str(reason)
        peer = self._peers.pop(peer_id, None)
        handles = [h for h in self.outstanding.values() if h.peer_id == peer_id]
        self.counters.add("peers_failed")
        if peer is not None:
            # Closing the endpoint cancels the requests registered on it (status CANCELED). The
            # peer is dead or unreachable: a blocking close would wait for a flush that never
            # completes (seconds behind a cut link, stalling this rank's heartbeats), so the
            # close is only started here and the endpoint kept until the transport closes.
            self.close_endpoint(peer, blocking=False)
        for h in handles:
            h._fail(PeerLostError(f"{self.name}: peer {peer_id!r} lost ({reason}) during "
                                  f"{h._describe()}", request_id=h.request_id, peer=peer_id))
        if handles:
            log.warning("%s: peer %s lost (%s): %d transfers failed", self.name, peer_id, reason,
                        len(handles))
        return len(handles)

    def sends_complete_unattended(self, same_host: bool) -> bool:
        """Whether this transport's sends to a peer on this host (``same_host``) move without
        this side's progress: the receiver reads them (cma rendezvous; see the module
        docstring), so a sender may sleep through them and reap the completions later. False
        with endpoint error handling (UCX then uses TCP, where the sender pushes the bytes)
        or when ``UCX_TLS`` leaves out cma."""
        if not same_host or self.error_handling:
            return False
        tls = [t.strip() for t in self.tls.split(",") if t.strip()]
        if not tls:
            return True
        if tls[0].startswith("^"):                 # an exclusion list
            excluded = {tls[0][1:], *tls[1:]}
            return not excluded & {"cma", "sm", "shm"}
        return bool(set(tls) & {"all", "cma", "sm", "shm"})

    def endpoint(self, peer_id: str):
        """The live endpoint of ``peer_id``."""
        self.owner.live_worker()
        peer = self._peers.get(peer_id)
        if peer is not None:
            return peer.endpoint
        if peer_id in self._lost:
            raise PeerLostError(f"{self.name}: peer {peer_id!r} was declared lost "
                                f"({self._lost[peer_id]})", peer=peer_id)
        raise ConfigError(f"{self.name}: unknown peer {peer_id!r}; connect() it first "
                          f"(known: {sorted(self._peers)})")

    def classify(self, handle: TransferHandle, request) -> BaseException:
        """The error of a request that completed with a non-OK status."""
        status = int(request.status)
        try:
            request.check_error()
            detail = f"UCX status {status}"
        except Exception as e:  # noqa: BLE001 -- ucxx's exception types
            detail = f"{type(e).__name__}: {e}"
        peer_id = handle.peer_id
        lost = self._lost.get(peer_id) if peer_id is not None else None
        peer = self._peers.get(peer_id) if peer_id is not None else None
        if lost is None and peer is not None and self.error_handling \
                and not peer.endpoint.alive:
            lost = "UCX endpoint error"
            self.events.append((peer_id, peer.serial))
        if lost is not None or status in _PEER_STATUSES:
            return PeerLostError(f"{self.name}: peer {peer_id!r} lost ({lost or detail}) during "
                                 f"{handle._describe()}", request_id=handle.request_id,
                                 peer=peer_id)
        if status == _UCS_ERR_MESSAGE_TRUNCATED:
            self.counters.add("rejected_wrong_size")
            return TransferError(f"{self.name}: {handle._describe()}: message {handle._checked} "
                                 f"of {handle.messages} is longer than its posted receive "
                                 f"({handle.nbytes} bytes posted in all; {detail})",
                                 request_id=handle.request_id, peer=peer_id)
        if status == _UCS_ERR_CANCELED:
            return AbortedError(f"{self.name}: {handle._describe()} was cancelled ({detail})",
                                request_id=handle.request_id, peer=peer_id)
        return TransferError(f"{self.name}: {handle._describe()} failed: {detail}",
                             request_id=handle.request_id, peer=peer_id)

    def _on_endpoint_closed(self, peer_id: str, serial: int) -> None:
        # Called by ucxx from inside progress: only record it.
        self.events.append((peer_id, serial))

    def process_events(self) -> None:
        """Fail the peers whose endpoints UCX reported closed (recorded in :attr:`events`)."""
        while self.events:
            peer_id, serial = self.events.popleft()
            peer = self._peers.get(peer_id)
            if peer is None or peer.serial != serial or peer.closing:
                continue
            self.counters.add("ucx_peer_errors")
            try:
                peer.endpoint.raise_on_error()
                detail = "endpoint closed by UCX"
            except Exception as e:  # noqa: BLE001
                detail = f"{type(e).__name__}: {e}"
            self.fail_peer(peer_id, f"UCX endpoint error: {detail}")

    def close_endpoint(self, peer: Peer, *, blocking: bool = True) -> None:
        if peer.closing:
            return
        peer.closing = True
        try:
            if self.error_handling:
                peer.endpoint.remove_close_callback()
            if not blocking and not self.error_handling:
                # Without error handling a close flushes first, which never ends behind a cut
                # link. (With it UCX closes in force mode at once; and a non-blocking close of
                # an endpoint UCX already failed crashes ucxx 0.52.)
                self._abandoned.append(peer)
                peer.endpoint.close()
                return
            # period/attempts bound the close only in ucxx's thread progress mode.
            peer.endpoint.close_blocking(period=1_000_000_000, max_attempts=3)
        except Exception as e:  # noqa: BLE001 -- closing a dead peer's endpoint may complain
            log.debug("%s: closing endpoint to %s: %s", self.name, peer.peer_id, e)
