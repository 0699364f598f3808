"""The decode coordinator's links to prefill servers: dialing, the handshake's connection
states, keeping an address and re-dialing it with backoff, and dropping a lost one.

:class:`PrefillLinks` is a part of :class:`~statebridge.connector.decode.DecodeCoordinator`
(its base class), split out so the request lifecycle and the links each have a room: it uses
the coordinator's loop, config, counters and ledger, and calls its ``_on_prefill_message``
(the protocol's dispatcher) and ``_fail``.

Reconnect: an address given to :meth:`PrefillLinks.connect` (after its first handshake
succeeded, or at once with ``wait=False``: a node started before its prefill nodes) is kept and
dialled until its server answers, and re-dialed when its server is lost -- a fresh socket and a
fresh handshake every ``REDIAL_MIN_S`` .. ``REDIAL_MAX_S`` seconds (doubling), each attempt
bounded by ``handshake_timeout``. A server whose group is not whole refuses the handshake
(``not_ready``): that is a failed attempt like any other, re-dialed with the same backoff.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Callable

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.errors import (
    FailureKind,
    IncompatiblePeerError,
    NotReadyError,
    ProtocolError,
    TransferTimeoutError,
)
from statebridge.security import CurveKeys
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan

log = logging.getLogger("statebridge.connector.decode")   # one logger for the coordinator

__all__ = ["PrefillLinks", "PeerState", "REDIAL_MIN_S", "REDIAL_MAX_S"]

REDIAL_MIN_S = 0.5     # first re-dial of a lost prefill server, after this many seconds
REDIAL_MAX_S = 2.0     # the wait doubles per failed attempt, up to this


class PeerState(enum.Enum):
    """Where a prefill connection is: ``HELLO`` (our Hello sent) -> ``INFO`` (GroupInfo sent)
    -> ``READY`` (serving) -> ``LOST``; or ``FAILED`` (its handshake failed or was dropped)."""

    HELLO = "hello"
    INFO = "info"
    READY = "ready"
    FAILED = "failed"
    LOST = "lost"


class _Prefill:
    """One connected prefill server, as the decode coordinator sees it."""

    def __init__(self, address: str, sock: zmq.Socket) -> None:
        self.address = address
        self.sock = sock
        self.node_id = ""
        self.state = PeerState.HELLO
        self.error: Exception | None = None
        self.event = threading.Event()
        self.geometry: PageGeometry | None = None
        self.plan: TransferPlan | None = None
        self.deadline = 0.0                          # monotonic end of a re-dial's handshake
        self.info: m.GroupInfo | None = None         # the peer group, once it sent it
        self.opened_at = time.monotonic()


class _Dial:
    """A prefill address the coordinator keeps connected: re-dialed while its server is lost."""

    def __init__(self, address: str, peer: _Prefill | None) -> None:
        self.address = address
        self.peer: _Prefill | None = peer            # the live connection or the attempt
        self.node_id = peer.node_id if peer else ""  # of the last successful handshake
        self.connected = peer is not None            # a handshake ever succeeded
        self.wait = REDIAL_MIN_S
        self.next_at = 0.0
        self.attempts = 0                            # since the connection was lost
        self.lost_at = 0.0
        self.last_why = ""                           # logged once per change


class PrefillLinks:
    """The prefill-server side of the decode coordinator (see the module docstring)."""

    def connect(self, address: str, timeout: float | None = None, *,
                redial: bool = True, wait: bool = True) -> str | None:
        """Handshake with the prefill server at ``host:port``; returns its node id.

        With ``redial`` (the default) the address is kept once this handshake succeeded: when
        its server is lost later, the coordinator re-dials it with backoff until it answers
        again (or :meth:`close`). A failed first handshake raises and keeps nothing.

        With ``wait=False`` the address is kept at once and dialled in the background with
        the same backoff until its server answers (a node started before its prefill nodes);
        returns None. Meanwhile requests fail with :class:`NotReadyError`; see :meth:`status`.
        """
        self.wait_ready()
        if not wait:
            self.loop.call(self._dial_later, address)
            return None
        timeout = self.config.handshake_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            peer = self.loop.call(self._open, address)
            if not peer.event.wait(max(0.0, deadline - time.monotonic())):
                self.loop.call(self._drop_prefill, peer, "handshake timed out")
                raise TransferTimeoutError(f"handshake with prefill server {address} did not "
                                           f"finish within {timeout} s: no answer (the server "
                                           f"may be down or unreachable, or refusing us because "
                                           f"of authentication: check keys_dir/--keys on both "
                                           f"sides)", peer=address)
            if peer.state is PeerState.READY:
                break
            if not isinstance(peer.error, NotReadyError) or time.monotonic() >= deadline:
                raise peer.error or IncompatiblePeerError(f"handshake with {address} failed")
            time.sleep(min(REDIAL_MIN_S, max(0.0, deadline - time.monotonic())))
        if redial:
            self.loop.call(self._keep, address, peer)
        return peer.node_id

    def _dial_later(self, address: str) -> None:
        if self._closed or address in self._dials:
            return
        dial = self._dials[address] = _Dial(address, None)
        dial.lost_at = time.monotonic()
        log.info("%s: dialling prefill %s (every %.1f-%.1f s until it answers)", self.node_id,
                 address, REDIAL_MIN_S, REDIAL_MAX_S)
        dial.attempts = 1
        dial.peer = self._open(address)
        dial.peer.deadline = dial.lost_at + self.config.handshake_timeout

    def dialled(self) -> bool:
        """Loop thread: whether every kept prefill address has answered at least once."""
        return all(d.connected for d in self._dials.values())

    def on_prefill_connected(self, handler: "Callable[[m.GroupInfo], None]") -> None:
        """Call ``handler(info)`` on the loop thread after each handshake with a prefill node
        succeeded, with that node's group (its TP size, pages, KV pool)."""
        self._prefill_handlers.append(handler)


    def status(self) -> tuple[bool, str]:
        """(ready, why not) on the loop thread: ready once the group is whole (:meth:`whole`)
        and a prefill server is connected; else the reason: the missing ranks, or the
        addresses still being dialled."""
        whole, why = self.whole()
        if not whole:
            return False, why
        if any(p.state is PeerState.READY for p in self.prefills.values()):
            return True, ""
        dialling = [f"{d.address} ({d.attempts} attempts" +
                    (f", last: {d.last_why})" if d.last_why else ")")
                    for d in self._dials.values()]
        return False, ("no prefill server connected" +
                       (f"; dialling {', '.join(dialling)}" if dialling else ""))

    def _keep(self, address: str, peer: _Prefill) -> None:
        if self._closed:
            return
        dial = self._dials.get(address)
        if dial is None:
            dial = self._dials[address] = _Dial(address, peer)
        elif dial.peer is not peer:
            # connect() again while a re-dial was pending: this connection is the kept one,
            # the re-dial's attempt (if any) is dropped without scheduling another.
            attempt, dial.peer = dial.peer, peer
            if attempt is not None:
                attempt.state = PeerState.FAILED
                self._drop_prefill(attempt, "superseded by connect()")
            self._redialed(peer)
        if peer.state is not PeerState.READY:        # lost between handshake and here
            dial.peer = None
            self._schedule_redial(dial, f"prefill {peer.node_id} lost")

    def _schedule_redial(self, dial: _Dial, why: str) -> None:
        now = time.monotonic()
        if dial.attempts == 0 and not dial.lost_at:
            dial.lost_at = now
            log.info("%s: prefill %s at %s lost (%s); re-dialing every %.1f-%.1f s",
                     self.node_id, dial.node_id, dial.address, why, REDIAL_MIN_S, REDIAL_MAX_S)
        elif why != dial.last_why:
            log.warning("%s: re-dial %d of %s failed: %s", self.node_id, dial.attempts,
                        dial.address, why)
        else:
            log.debug("%s: re-dial %d of %s failed: %s", self.node_id, dial.attempts,
                      dial.address, why)
        dial.last_why = why
        dial.next_at = now + dial.wait
        dial.wait = min(2 * dial.wait, REDIAL_MAX_S)

    def _redial(self) -> None:
        """On every tick: start due re-dials, time out attempts that hang (none while the
        group is not whole: it re-dials once it is)."""
        if self.restarting or self.fatal or self._closed:
            return
        now = time.monotonic()
        for dial in self._dials.values():
            peer = dial.peer
            if peer is None:
                if now >= dial.next_at:
                    dial.attempts += 1
                    log.debug("%s: re-dial %d of %s", self.node_id, dial.attempts, dial.address)
                    dial.peer = self._open(dial.address)
                    dial.peer.deadline = now + self.config.handshake_timeout
            elif peer.state in (PeerState.HELLO, PeerState.INFO) and peer.deadline and \
                    now > peer.deadline:
                peer.state = PeerState.FAILED
                self._drop_prefill(peer, f"handshake did not finish within "
                                         f"{self.config.handshake_timeout} s")

    def _redialed(self, peer: _Prefill) -> None:
        """A handshake finished: if it was a re-dial, the kept address is connected again."""
        dial = self._dials.get(peer.address)
        if dial is None or dial.peer is not peer:
            return
        if dial.lost_at and not dial.connected:
            log.info("%s: prefill %s at %s connected after %d attempts (%.1f s)",
                     self.node_id, peer.node_id, dial.address, dial.attempts,
                     time.monotonic() - dial.lost_at)
        elif dial.lost_at:
            log.info("%s: prefill %s at %s connected again after %d attempts (%.1f s); was %s",
                     self.node_id, peer.node_id, dial.address, dial.attempts,
                     time.monotonic() - dial.lost_at, dial.node_id)
            self.counters.add("prefills_reconnected")
        dial.connected = True
        dial.node_id = peer.node_id
        dial.wait, dial.attempts, dial.lost_at, dial.last_why = REDIAL_MIN_S, 0, 0.0, ""
        peer.deadline = 0.0

    def _open(self, address: str) -> _Prefill:
        keys = CurveKeys.from_config(self.config)
        sock, watch = c.dial_dealer(self.loop.context, address, keys=keys)
        peer = _Prefill(address, sock)
        c.watch_handshake(self.loop, watch, lambda e: peer.state is PeerState.HELLO
                          and self._handshake_failed(peer, e))
        self._by_sock[sock] = peer
        self.loop.add_reader(sock, lambda: self._on_prefill_socket(peer))
        c.send_dealer(sock, m.Hello(compat_hash=m.compat_hash(self.spec.to_json()),
                                    node_id=self.node_id, role=self.role))
        return peer

    def _on_prefill_socket(self, peer: _Prefill) -> None:
        while not peer.sock.closed:                  # a Goodbye below drops (closes) it
            msg = c.recv_dealer(peer.sock, self.config.max_message_bytes)
            if msg is None:
                return
            if isinstance(msg, ProtocolError):
                self.counters.add("protocol_errors")
                log.warning("%s: bad message from %s: %s", self.node_id, peer.address, msg)
                continue
            if peer.node_id:
                self.prefill_watch.heard(peer.node_id)
            self._on_prefill_message(peer, msg)

    def _handshake_failed(self, peer: _Prefill, error: Exception) -> None:
        self.counters.add("refused_peers")
        peer.state = PeerState.FAILED
        peer.error = error
        self._drop_prefill(peer, str(error))
        peer.event.set()

    def _drop_prefill(self, peer: _Prefill, why: str) -> None:
        self.loop.remove_reader(peer.sock)
        self._by_sock.pop(peer.sock, None)
        c.flush(peer.sock)          # e.g. a queued Goodbye
        peer.sock.close(0)
        if peer.node_id and self.prefills.get(peer.node_id) is peer:
            del self.prefills[peer.node_id]
            self.prefill_watch.forget(peer.node_id)
        dial = self._dials.get(peer.address)
        if dial is not None and dial.peer is peer:
            dial.peer = None
            if not self._closed:
                self._schedule_redial(dial, why)

    def _prefill_lost(self, peer: _Prefill, why: str) -> None:
        if peer.state is PeerState.LOST:
            return
        peer.state = PeerState.LOST
        self.counters.add("prefills_lost")
        log.warning("%s: prefill %s lost (%s)", self.node_id, peer.node_id, why)
        for record in self.ledger.of_peer(peer.node_id):
            self._fail(record, FailureKind.PEER_LOST, f"prefill {peer.node_id} lost ({why})",
                       notify=False, lost_node=peer.node_id)
        self._drop_prefill(peer, why)

    def prefill_nodes(self) -> list[str]:
        """The node ids of the prefill servers serving us (any thread)."""
        return self.loop.call(self.ready_prefills)

    def ready_prefills(self) -> list[str]:
        """Loop thread: the node ids of the prefill servers serving us, sorted."""
        return sorted(n for n, p in self.prefills.items() if p.state is PeerState.READY)
