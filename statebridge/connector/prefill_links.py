"""The decode coordinator's links to prefill servers: dialing, the handshake's connection
states, keeping an address and re-dialing it with backoff, and dropping a lost one.

:class:`PrefillLinks` is a part the decode coordinator *has* (``coordinator.links``), so the
request lifecycle and the links each have a room: it uses the coordinator's rank group (its
loop, config, counters, handshake record) and runs the handshake with each prefill server
itself; what a link needs of the coordinator -- the requests' messages, failing a lost server's
requests -- is :class:`LinkOwner`.

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
from typing import Callable, Protocol

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.group import RankGroup
from statebridge.errors import (
    ConfigError,
    IncompatiblePeerError,
    NotReadyError,
    ProtocolError,
    TransferTimeoutError,
)
from statebridge.security import CurveKeys
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan

log = logging.getLogger("statebridge.connector.decode")   # one logger for the coordinator

__all__ = ["PrefillLinks", "LinkOwner", "PeerState", "REDIAL_MIN_S", "REDIAL_MAX_S"]

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


class LinkOwner(Protocol):
    """What the links call on the coordinator that owns them (loop thread)."""

    def prefill_message(self, peer: _Prefill, msg: m.Message) -> None:
        """A message of a prefill server that the links do not take themselves (they take
        the handshake's and liveness's): the requests' messages."""

    def prefill_lost(self, peer: _Prefill, why: str) -> None:
        """A prefill server was lost: fail every request it touched."""


class PrefillLinks:
    """The prefill-server side of the decode coordinator (see the module docstring)."""

    def __init__(self, group: RankGroup, owner: LinkOwner) -> None:
        self.group = group
        self.owner = owner
        self.prefills: dict[str, _Prefill] = {}      # node id (or address before Hello) -> peer
        self._by_sock: dict[zmq.Socket, _Prefill] = {}
        self.prefill_watch = c.PeerWatch(group.config.peer_timeout, group.loop)
        self._dials: dict[str, _Dial] = {}           # address -> kept connection
        self._prefill_handlers: list[Callable[[m.GroupInfo], None]] = []

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
        group = self.group
        group.wait_ready()
        if not wait:
            group.loop.call(self._dial_later, address)
            return None
        timeout = group.config.handshake_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            peer = group.loop.call(self._open, address)
            if not peer.event.wait(max(0.0, deadline - time.monotonic())):
                group.loop.call(self._drop_prefill, peer, "handshake timed out")
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
            group.loop.call(self._keep, address, peer)
        return peer.node_id

    def _dial_later(self, address: str) -> None:
        if self.group.closed or address in self._dials:
            return
        dial = self._dials[address] = _Dial(address, None)
        dial.lost_at = time.monotonic()
        log.info("%s: dialling prefill %s (every %.1f-%.1f s until it answers)",
                 self.group.node_id, address, REDIAL_MIN_S, REDIAL_MAX_S)
        dial.attempts = 1
        dial.peer = self._open(address)
        dial.peer.deadline = dial.lost_at + self.group.config.handshake_timeout

    def dialled(self) -> bool:
        """Loop thread: whether every kept prefill address has answered at least once."""
        return all(d.connected for d in self._dials.values())

    def on_prefill_connected(self, handler: "Callable[[m.GroupInfo], None]") -> None:
        """Call ``handler(info)`` on the loop thread after each handshake with a prefill node
        succeeded, with that node's group (its TP size, pages, KV pool)."""
        self._prefill_handlers.append(handler)

    def status(self) -> tuple[bool, str]:
        """(ready, why not) on the loop thread: ready once the group is whole
        (:meth:`RankGroup.whole`) and a prefill server is connected; else the reason: the
        missing ranks, or the addresses still being dialled."""
        whole, why = self.group.whole()
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
        if self.group.closed:
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
        node_id = self.group.node_id
        if dial.attempts == 0 and not dial.lost_at:
            dial.lost_at = now
            log.info("%s: prefill %s at %s lost (%s); re-dialing every %.1f-%.1f s",
                     node_id, dial.node_id, dial.address, why, REDIAL_MIN_S, REDIAL_MAX_S)
        elif why != dial.last_why:
            log.warning("%s: re-dial %d of %s failed: %s", node_id, dial.attempts,
                        dial.address, why)
        else:
            log.debug("%s: re-dial %d of %s failed: %s", node_id, dial.attempts,
                      dial.address, why)
        dial.last_why = why
        dial.next_at = now + dial.wait
        dial.wait = min(2 * dial.wait, REDIAL_MAX_S)

    def _redial(self) -> None:
        """On every tick: start due re-dials, time out attempts that hang (none while the
        group is not whole: it re-dials once it is)."""
        group = self.group
        if group.supervisor.restarting or group.supervisor.fatal or group.closed:
            return
        now = time.monotonic()
        for dial in self._dials.values():
            peer = dial.peer
            if peer is None:
                if now >= dial.next_at:
                    dial.attempts += 1
                    log.debug("%s: re-dial %d of %s", group.node_id, dial.attempts,
                              dial.address)
                    dial.peer = self._open(dial.address)
                    dial.peer.deadline = now + group.config.handshake_timeout
            elif peer.state in (PeerState.HELLO, PeerState.INFO) and peer.deadline and \
                    now > peer.deadline:
                peer.state = PeerState.FAILED
                self._drop_prefill(peer, f"handshake did not finish within "
                                         f"{group.config.handshake_timeout} s")

    def _redialed(self, peer: _Prefill) -> None:
        """A handshake finished: if it was a re-dial, the kept address is connected again."""
        dial = self._dials.get(peer.address)
        if dial is None or dial.peer is not peer:
            return
        if dial.lost_at and not dial.connected:
            log.info("%s: prefill %s at %s connected after %d attempts (%.1f s)",
                     self.group.node_id, peer.node_id, dial.address, dial.attempts,
                     time.monotonic() - dial.lost_at)
        elif dial.lost_at:
            log.info("%s: prefill %s at %s connected again after %d attempts (%.1f s); was %s",
                     self.group.node_id, peer.node_id, dial.address, dial.attempts,
                     time.monotonic() - dial.lost_at, dial.node_id)
            self.group.counters.add("prefills_reconnected")
        dial.connected = True
        dial.node_id = peer.node_id
        dial.wait, dial.attempts, dial.lost_at, dial.last_why = REDIAL_MIN_S, 0, 0.0, ""
        peer.deadline = 0.0

    def _open(self, address: str) -> _Prefill:
        group = self.group
        keys = CurveKeys.from_config(group.config)
        sock, watch = c.dial_dealer(group.loop.context, address, keys=keys)
        peer = _Prefill(address, sock)
        c.watch_handshake(group.loop, watch, lambda e: peer.state is PeerState.HELLO
                          and self._handshake_failed(peer, e))
        self._by_sock[sock] = peer
        group.loop.add_reader(sock, lambda: self._on_prefill_socket(peer))
        c.send_dealer(sock, m.Hello(compat_hash=m.compat_hash(group.spec.to_json()),
                                    node_id=group.node_id, role=group.role))
        return peer

    def _on_prefill_socket(self, peer: _Prefill) -> None:
        while not peer.sock.closed:                  # a Goodbye below drops (closes) it
            msg = c.recv_dealer(peer.sock, self.group.config.max_message_bytes)
            if msg is None:
                return
            if isinstance(msg, ProtocolError):
                self.group.counters.add("protocol_errors")
                log.warning("%s: bad message from %s: %s", self.group.node_id, peer.address,
                            msg)
                continue
            if peer.node_id:
                self.prefill_watch.heard(peer.node_id)
            self._on_prefill_message(peer, msg)

    def _on_prefill_message(self, peer: _Prefill, msg: m.Message) -> None:
        """The handshake's and liveness's messages; the rest is the owner's."""
        group = self.group
        if isinstance(msg, m.Reject):
            group.counters.add("rejected_handshakes")
            if msg.code == "not_ready":          # its group is not whole: dial again later
                group.counters.add("prefill_not_ready")
                peer.state = PeerState.FAILED
                peer.error = NotReadyError(f"prefill server {peer.address} is not ready: "
                                           f"{msg.reason}", peer=peer.address)
                self._drop_prefill(peer, f"not ready: {msg.reason}")
                peer.event.set()
                return
            self._handshake_failed(peer, IncompatiblePeerError(
                f"prefill server {peer.address} rejected us: {msg.reason}"))
        elif isinstance(msg, m.Hello) and peer.state is PeerState.HELLO:
            if msg.compat_hash != m.compat_hash(group.spec.to_json()) or msg.role != "prefill":
                self._handshake_failed(peer, IncompatiblePeerError(
                    f"prefill server {peer.address} is incompatible: hash {msg.compat_hash!r}, "
                    f"role {msg.role!r}"))
                return
            peer.state = PeerState.INFO
            c.send_dealer(peer.sock, group.group_info())
        elif isinstance(msg, m.GroupInfo) and peer.state is PeerState.INFO:
            self._on_group_info(peer, msg)
        elif isinstance(msg, m.Goodbye):
            self._prefill_lost(peer, "said goodbye")
        elif isinstance(msg, m.Error):
            group.counters.add("peer_errors")
            log.warning("%s: prefill %s reported: %s %s", group.node_id, peer.address,
                        msg.kind, msg.message)
        elif isinstance(msg, m.Heartbeat):
            pass
        else:
            self.owner.prefill_message(peer, msg)

    def _on_group_info(self, peer: _Prefill, msg: m.GroupInfo) -> None:
        group = self.group
        try:
            peer.geometry = group.handshake.check_peer_info(msg)
            peer.plan = TransferPlan(peer.geometry, group.geometry)
        except (IncompatiblePeerError, ConfigError) as e:
            self._handshake_failed(peer, e)
            return
        if msg.node_id in self.prefills:
            self._handshake_failed(peer, IncompatiblePeerError(
                f"prefill node id {msg.node_id!r} is already connected"))
            return
        peer.node_id = msg.node_id
        self.prefills[msg.node_id] = peer
        self.prefill_watch.heard(msg.node_id)
        group.to_ranks(group.handshake.rank_connect(msg))
        peer.state = PeerState.READY
        peer.info = msg
        log.info("%s: handshake with prefill group %s done in %.1f s (TP %d, %s): %d "
                 "messages, %d bytes per request", group.node_id, msg.node_id,
                 time.monotonic() - peer.opened_at, msg.tp_size, msg.layout,
                 peer.plan.messages_per_request, peer.plan.bytes_per_request)
        self._redialed(peer)
        peer.event.set()
        for handler in self._prefill_handlers:
            try:
                handler(msg)
            except Exception:  # noqa: BLE001 -- a report must not break the handshake
                log.exception("%s: prefill-connected handler failed", group.node_id)

    def _handshake_failed(self, peer: _Prefill, error: Exception) -> None:
        self.group.counters.add("refused_peers")
        peer.state = PeerState.FAILED
        peer.error = error
        self._drop_prefill(peer, str(error))
        peer.event.set()

    def _drop_prefill(self, peer: _Prefill, why: str) -> None:
        self.group.loop.remove_reader(peer.sock)
        self._by_sock.pop(peer.sock, None)
        c.flush(peer.sock)          # e.g. a queued Goodbye
        peer.sock.close(0)
        if peer.node_id and self.prefills.get(peer.node_id) is peer:
            del self.prefills[peer.node_id]
            self.prefill_watch.forget(peer.node_id)
        dial = self._dials.get(peer.address)
        if dial is not None and dial.peer is peer:
            dial.peer = None
            if not self.group.closed:
                self._schedule_redial(dial, why)

    def _prefill_lost(self, peer: _Prefill, why: str) -> None:
        if peer.state is PeerState.LOST:
            return
        peer.state = PeerState.LOST
        self.group.counters.add("prefills_lost")
        log.warning("%s: prefill %s lost (%s)", self.group.node_id, peer.node_id, why)
        self.owner.prefill_lost(peer, why)
        self._drop_prefill(peer, why)

    # -- the coordinator's ticks and its group's turns ------------------------------------------
    def tick(self) -> None:
        """Loop thread, every heartbeat interval: heartbeat the servers serving us, lose the
        silent ones, re-dial."""
        group = self.group
        hb = m.Heartbeat(node_id=group.node_id, seq=group.heartbeats)
        for peer in list(self.prefills.values()):
            if peer.state is PeerState.READY:
                c.send_dealer(peer.sock, hb)
        for node in self.prefill_watch.expired():
            peer = self.prefills.get(node)
            if peer is not None:
                self._prefill_lost(peer, f"silent for {group.config.peer_timeout} s")
        self._redial()

    def hang_up(self, why: str, *, lost: bool) -> None:
        """Loop thread: every connection ends -- a Goodbye to each server serving us, then
        each socket dropped (``lost``: marked lost first); kept addresses stay kept."""
        for peer in list(self.prefills.values()):
            if peer.state is PeerState.READY:
                c.send_dealer(peer.sock, m.Goodbye(node_id=self.group.node_id))
        for peer in list(self._by_sock.values()):
            if lost:
                peer.state = PeerState.LOST
            self._drop_prefill(peer, why)

    def redial_now(self) -> None:
        """Loop thread: the group is whole again: every kept address that has no connection
        is re-dialed at the next tick, its backoff from the start."""
        for dial in self._dials.values():
            if dial.peer is None:
                dial.next_at, dial.wait = 0.0, REDIAL_MIN_S

    def close(self) -> None:
        """Loop thread, closing: every connection ends; no address is kept."""
        self.hang_up("closing", lost=False)
        self._dials.clear()

    def prefill_nodes(self) -> list[str]:
        """The node ids of the prefill servers serving us (any thread)."""
        return self.group.loop.call(self.ready_prefills)

    def ready_prefills(self) -> list[str]:
        """Loop thread: the node ids of the prefill servers serving us, sorted."""
        return sorted(n for n, p in self.prefills.items() if p.state is PeerState.READY)
