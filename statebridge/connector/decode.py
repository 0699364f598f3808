"""The decode side: the coordinator that connects to prefill servers, and its rank processes.

Runs in the decode node's main process (:class:`DecodeCoordinator`) and in each decode rank
process (:class:`~statebridge.connector._rank.RankWorker` with role ``"decode"``).

Per request (N-1 protocol)::

    submit(request_id, prompt[:-1])
      allocate one page id (same on every decode rank), next generation
      --RankRecv-->        every decode rank: post receives of its runs into the page
      --TransferRequest--> the prefill server (round robin over connected ones)
      <--RankDone--        every decode rank (all receives complete, or failed/cancelled)
      future resolves to a TransferResult;  --TransferComplete--> prefill (its lease ends)
    release(result)        the caller is done with the page (decoding finished)

Failures become typed errors on the request's future (``PeerLostError``,
``TransferTimeoutError``, ``AbortedError``, ``TransferError``) as soon as they are known; the page
is freed only after every decode rank confirmed that none of its receives can still write into
it. A prefill server that goes silent for ``peer_timeout`` seconds (or says Goodbye) fails every
request it touched; other prefill servers keep serving.

Reconnect: an address given to :meth:`DecodeCoordinator.connect` (after its first handshake
succeeded) is kept and re-dialed when its server is lost -- a fresh socket and a fresh handshake
every ``REDIAL_MIN_S`` .. ``REDIAL_MAX_S`` seconds (doubling), each attempt bounded by
``handshake_timeout``. Nothing of the old connection can land after a reconnect: its requests
already failed (and their pages were freed only once every decode rank confirmed its receives
were cancelled), and new requests carry new generations, hence new tags.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector._group import RankGroup, RequestState
from statebridge.security import CurveKeys
from statebridge.errors import (
    CacheFullError,
    ClosedError,
    ConfigError,
    IncompatiblePeerError,
    PeerLostError,
    ProtocolError,
    StatebridgeError,
    TransferTimeoutError,
    transfer_error,
)
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan

log = logging.getLogger(__name__)

__all__ = ["DecodeCoordinator", "TransferResult"]

REDIAL_MIN_S = 0.5     # first re-dial of a lost prefill server, after this many seconds
REDIAL_MAX_S = 2.0     # the wait doubles per failed attempt, up to this


@dataclass(frozen=True)
class TransferResult:
    """A request whose state every decode rank holds in ``page``."""

    request_id: str
    generation: int
    page: int
    prefill_node: str
    seconds: float                  # submit -> every decode rank holds the state
    nbytes: int                     # payload bytes received by all decode ranks
    messages: int                   # messages received by all decode ranks
    checksums: tuple[str, ...]      # per decode rank, when the group computes them
    rank_seconds: tuple[float, ...]
    rank_staging_bytes: tuple[int, ...]   # each decode rank's transport staging counter (total)


class _Prefill:
    """One connected prefill server, as the decode coordinator sees it."""

    def __init__(self, address: str, sock: zmq.Socket) -> None:
        self.address = address
        self.sock = sock
        self.node_id = ""
        self.state = "hello"                         # hello -> info -> ready | failed | lost
        self.error: Exception | None = None
        self.event = threading.Event()
        self.geometry: PageGeometry | None = None
        self.plan: TransferPlan | None = None
        self.deadline = 0.0                          # monotonic end of a re-dial's handshake


class _Dial:
    """A prefill address the coordinator keeps connected: re-dialed while its server is lost."""

    def __init__(self, address: str, peer: _Prefill) -> None:
        self.address = address
        self.peer: _Prefill | None = peer            # the live connection or the attempt
        self.node_id = peer.node_id                  # of the last successful handshake
        self.wait = REDIAL_MIN_S
        self.next_at = 0.0
        self.attempts = 0                            # since the connection was lost
        self.lost_at = 0.0
        self.last_why = ""                           # logged once per change


class _Request(RequestState):
    pass


class DecodeCoordinator(RankGroup):
    """The decode group's coordinator: the N-1 transfer of each request into its ranks."""

    role = "decode"

    def _init_state(self) -> None:
        self.prefills: dict[str, _Prefill] = {}      # node id (or address before Hello) -> peer
        self._by_sock: dict[zmq.Socket, _Prefill] = {}
        self.requests: dict[tuple[str, int], RequestState] = {}
        self.futures: dict[tuple[str, int], concurrent.futures.Future] = {}
        self.current: dict[str, int] = {}            # request id -> live generation
        self.results: dict[str, TransferResult] = {}
        self._generations = itertools.count(1)
        self._rr = itertools.count()
        self.prefill_watch = c.PeerWatch(self.config.peer_timeout)
        self._dials: dict[str, _Dial] = {}           # address -> kept connection

    # -- prefill servers -------------------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None, *,
                redial: bool = True) -> str:
        """Handshake with the prefill server at ``host:port``; returns its node id.

        With ``redial`` (the default) the address is kept once this handshake succeeded: when
        its server is lost later, the coordinator re-dials it with backoff until it answers
        again (or :meth:`close`). A failed first handshake raises and keeps nothing."""
        self.wait_ready()
        timeout = self.config.handshake_timeout if timeout is None else timeout
        peer = self.loop.call(self._open, address)
        if not peer.event.wait(timeout):
            self.loop.call(self._drop_prefill, peer, "handshake timed out")
            raise TransferTimeoutError(f"handshake with prefill server {address} did not "
                                       f"finish within {timeout} s: no answer (the server may "
                                       f"be down or unreachable, or refusing us because of "
                                       f"authentication: check keys_dir/--keys on both sides)",
                                       peer=address)
        if peer.state != "ready":
            raise peer.error or IncompatiblePeerError(f"handshake with {address} failed")
        if redial:
            self.loop.call(self._keep, address, peer)
        return peer.node_id

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
                attempt.state = "failed"
                self._drop_prefill(attempt, "superseded by connect()")
            self._redialed(peer)
        if peer.state != "ready":                    # lost between handshake and here
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
        """On every tick: start due re-dials, time out attempts that hang."""
        now = time.monotonic()
        for dial in self._dials.values():
            peer = dial.peer
            if peer is None:
                if now >= dial.next_at:
                    dial.attempts += 1
                    log.debug("%s: re-dial %d of %s", self.node_id, dial.attempts, dial.address)
                    dial.peer = self._open(dial.address)
                    dial.peer.deadline = now + self.config.handshake_timeout
            elif peer.state in ("hello", "info") and peer.deadline and now > peer.deadline:
                peer.state = "failed"
                self._drop_prefill(peer, f"handshake did not finish within "
                                         f"{self.config.handshake_timeout} s")

    def _redialed(self, peer: _Prefill) -> None:
        """A handshake finished: if it was a re-dial, the kept address is connected again."""
        dial = self._dials.get(peer.address)
        if dial is None or dial.peer is not peer:
            return
        if dial.lost_at:
            log.info("%s: prefill %s at %s connected again after %d attempts (%.1f s); was %s",
                     self.node_id, peer.node_id, dial.address, dial.attempts,
                     time.monotonic() - dial.lost_at, dial.node_id)
            self.counters.add("prefills_reconnected")
        dial.node_id = peer.node_id
        dial.wait, dial.attempts, dial.lost_at, dial.last_why = REDIAL_MIN_S, 0, 0.0, ""
        peer.deadline = 0.0

    def _open(self, address: str) -> _Prefill:
        keys = CurveKeys.from_config(self.config)
        sock, watch = c.dial_dealer(self.loop.context, address, keys=keys)
        peer = _Prefill(address, sock)
        c.watch_handshake(self.loop, watch, lambda e: peer.state == "hello"
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

    def _on_prefill_message(self, peer: _Prefill, msg: m.Message) -> None:
        if isinstance(msg, m.Reject):
            self.counters.add("rejected_handshakes")
            self._handshake_failed(peer, IncompatiblePeerError(
                f"prefill server {peer.address} rejected us: {msg.reason}"))
        elif isinstance(msg, m.Hello) and peer.state == "hello":
            if msg.compat_hash != m.compat_hash(self.spec.to_json()) or msg.role != "prefill":
                self._handshake_failed(peer, IncompatiblePeerError(
                    f"prefill server {peer.address} is incompatible: hash {msg.compat_hash!r}, "
                    f"role {msg.role!r}"))
                return
            peer.state = "info"
            c.send_dealer(peer.sock, self.group_info())
        elif isinstance(msg, m.GroupInfo) and peer.state == "info":
            try:
                peer.geometry = self.check_peer_info(msg)
                peer.plan = TransferPlan(peer.geometry, self.geometry)
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
            self.to_ranks(m.RankConnect(peer_node=msg.node_id, peer_role=msg.role,
                                        peer_tp_size=msg.tp_size, peer_layout=msg.layout,
                                        peer_page_size=msg.page_size,
                                        peer_region_align=msg.region_align,
                                        peer_addresses=msg.rank_addresses))
            peer.state = "ready"
            log.info("%s: prefill group %s connected (TP %d, %s): %d messages, %d bytes per "
                     "request", self.node_id, msg.node_id, msg.tp_size, msg.layout,
                     peer.plan.messages_per_request, peer.plan.bytes_per_request)
            self._redialed(peer)
            peer.event.set()
        elif isinstance(msg, m.TransferFailed):
            req = self.requests.get((msg.request_id, msg.generation))
            if req is None:
                self.counters.add("stale_messages")
                return
            # Only this request: the server still talks to us, so its endpoints stay. (Failing
            # them here -- lost_node -- would leave every later request of this connection
            # posting to a peer the ranks consider lost, with no RankConnect to revive it.)
            self._fail(req, msg.kind, f"prefill {peer.node_id}: {msg.message}", notify=False)
        elif isinstance(msg, m.Goodbye):
            self._prefill_lost(peer, "said goodbye")
        elif isinstance(msg, m.Error):
            self.counters.add("peer_errors")
            log.warning("%s: prefill %s reported: %s %s", self.node_id, peer.address, msg.kind,
                        msg.message)
        elif isinstance(msg, m.Heartbeat):
            pass
        else:
            self.counters.add("unexpected_messages")

    def _handshake_failed(self, peer: _Prefill, error: Exception) -> None:
        peer.state = "failed"
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
        if peer.state == "lost":
            return
        peer.state = "lost"
        self.counters.add("prefills_lost")
        log.warning("%s: prefill %s lost (%s)", self.node_id, peer.node_id, why)
        for req in [r for r in self.requests.values() if r.peer == peer.node_id]:
            self._fail(req, "peer_lost", f"prefill {peer.node_id} lost ({why})", notify=False,
                       lost_node=peer.node_id)
        self._drop_prefill(peer, why)

    def prefill_nodes(self) -> list[str]:
        return self.loop.call(lambda: [n for n, p in self.prefills.items() if p.state == "ready"])

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: Sequence[int], *,
               prefill: str | None = None) -> concurrent.futures.Future:
        """Start moving the state of ``prompt`` (the N-1 prefix) into a page of every decode
        rank; the future resolves to a :class:`TransferResult` or a typed error."""
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = tuple(int(t) for t in prompt)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call(self._submit, request_id, prompt, prefill, future)
        return future

    def submit_many(self, items: Sequence[tuple[str, Sequence[int]]], *,
                    prefill: str | None = None) -> list[concurrent.futures.Future]:
        """:meth:`submit` for many requests in one hop to the loop thread (a caller keeping
        many requests in flight pays one thread handoff per batch, not per request).

        Requests start in order until the page pool is full: the futures of the ones started
        are returned (fewer than ``items`` means back-pressure), and CacheFullError is raised
        only when not even the first could start. Any other refusal (a duplicate request id,
        no prefill server) fails that request's future.
        """
        prepared = []
        for request_id, prompt in items:
            if not isinstance(request_id, str) or not request_id:
                raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")
            prepared.append((request_id, tuple(int(t) for t in prompt),
                             concurrent.futures.Future()))

        def run() -> list[concurrent.futures.Future]:
            started = []
            for request_id, prompt, future in prepared:
                try:
                    self._submit(request_id, prompt, prefill, future)
                except CacheFullError:
                    if not started:
                        raise
                    break
                except StatebridgeError as e:
                    future.set_exception(e)
                started.append(future)
            return started
        return self.loop.call(run) if prepared else []

    def release_many(self, results: Sequence["TransferResult | str"]) -> None:
        """:meth:`release` for many completed requests in one hop to the loop thread; raises
        ConfigError naming the ids that were not completed requests (the others are freed)."""
        ids = [r if isinstance(r, str) else r.request_id for r in results]

        def run() -> None:
            unknown = [rid for rid in ids if not self._release(rid)]
            if unknown:
                raise ConfigError(f"no completed request {unknown[:5]!r}"
                                  f"{f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else ''}"
                                  f" to release")
        if ids:
            self.loop.call(run)

    def _submit(self, request_id: str, prompt: tuple[int, ...], prefill: str | None,
                future: concurrent.futures.Future) -> None:
        self._check_can_start(request_id)
        ready = [p for p in self.prefills.values() if p.state == "ready"]
        if prefill is not None:
            ready = [p for p in ready if p.node_id == prefill]
        if not ready:
            raise PeerLostError(f"no prefill server connected{f' named {prefill!r}' if prefill else ''}",
                                request_id=request_id)
        peer = ready[next(self._rr) % len(ready)]
        page, generation = self._register(request_id, peer.node_id, future, "requests")
        self.to_ranks(m.RankRecv(request_id=request_id, generation=generation, dst_page=page,
                                 peer_node=peer.node_id))
        c.send_dealer(peer.sock, m.TransferRequest(request_id=request_id, generation=generation,
                                                   prompt=prompt, dst_page=page))

    def _check_can_start(self, request_id: str) -> None:
        if self._closed:
            raise ClosedError(f"{self.node_id} is closed")
        if request_id in self.current:
            raise ConfigError(f"request id {request_id!r} is already in flight")
        if not self.healthy:
            raise PeerLostError(f"decode group {self.node_id} lost a rank", request_id=request_id)

    def _register(self, request_id: str, peer: str, future: concurrent.futures.Future,
                  counter: str) -> tuple[int, int]:
        """Allocate the page (CacheFullError: back-pressure) and a fresh generation, and track
        the request; returns (page, generation)."""
        page = self.pool.allocate()
        generation = next(self._generations) & 0xFFFFFFFF
        key = (request_id, generation)
        self.requests[key] = RequestState(
            request_id, generation, page, peer,
            deadline=time.monotonic() + self.config.transfer_timeout)
        self.futures[key] = future
        self.current[request_id] = generation
        self.counters.add(counter)
        return page, generation

    def submit_local(self, request_id: str, prompt: Sequence[int]) -> concurrent.futures.Future:
        """Compute the state of ``prompt`` on the decode ranks themselves (the ``recompute``
        policy when a transfer failed); resolves like :meth:`submit`."""
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = tuple(int(t) for t in prompt)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call(self._submit_local, request_id, prompt, future)
        return future

    def _submit_local(self, request_id: str, prompt: tuple[int, ...],
                      future: concurrent.futures.Future) -> None:
        self._check_can_start(request_id)
        page, generation = self._register(request_id, "", future, "local_prefills")
        self.to_ranks(m.RankLocalPrefill(request_id=request_id, generation=generation,
                                         prompt=prompt, page=page))

    def abort(self, request_id: str, reason: str = "aborted by caller") -> None:
        """Abort a request in flight: its future fails with AbortedError."""
        def run() -> None:
            generation = self.current.get(request_id)
            req = self.requests.get((request_id, generation)) if generation is not None else None
            if req is None or req.failure is not None or req.complete:
                return
            self._fail(req, "aborted", reason, notify=True)
        self.loop.call(run)

    def release(self, result: "TransferResult | str") -> None:
        """The caller is done with a completed request's page."""
        request_id = result if isinstance(result, str) else result.request_id

        def run() -> None:
            if not self._release(request_id):
                raise ConfigError(f"no completed request {request_id!r} to release")
        self.loop.call(run)

    def _release(self, request_id: str) -> bool:
        done = self.results.pop(request_id, None)
        if done is None:
            return False
        self.pool.free(done.page)
        self.current.pop(request_id, None)
        return True

    def _on_rank_done(self, rank: int, msg: m.RankDone) -> None:
        req = self.requests.get((msg.request_id, msg.generation))
        if req is None:
            self.counters.add("stale_rank_done")
            return
        req.done[rank] = msg
        if msg.kind and req.failure is None:
            self._fail(req, msg.kind, f"decode rank {rank}: {msg.message}", notify=True)
        self._settle(req)

    def _fail(self, req: RequestState, kind: str, message: str, *, notify: bool,
              lost_node: str = "") -> None:
        if not self._mark_failed(req, kind, message):
            return
        future = self.futures.pop((req.request_id, req.generation), None)
        if future is not None and not future.done():
            future.set_exception(transfer_error(kind, message, request_id=req.request_id,
                                                peer=str(req.peer)))
        self.cancel_on_ranks(req, kind, message, lost_node)
        peer = self.prefills.get(str(req.peer))
        if notify and peer is not None and peer.state == "ready":
            c.send_dealer(peer.sock, m.Abort(request_id=req.request_id,
                                             generation=req.generation, reason=message))
        self._settle(req)

    def _settle(self, req: RequestState) -> None:
        """Finish ``req`` once no decode rank can still write into its page."""
        if req.ranks_pending(self):
            return
        key = (req.request_id, req.generation)
        if self.requests.get(key) is not req:
            return                                   # settled already (_fail settles too)
        del self.requests[key]
        if req.failure is not None:
            self.pool.free(req.page)
            if self.current.get(req.request_id) == req.generation:
                del self.current[req.request_id]
            return
        done = [req.done[r] for r in range(self.tp_size)]
        result = TransferResult(
            request_id=req.request_id, generation=req.generation, page=req.page,
            prefill_node=str(req.peer), seconds=time.perf_counter() - req.started,
            nbytes=sum(d.nbytes for d in done), messages=sum(d.messages for d in done),
            checksums=tuple(d.checksum for d in done),
            rank_seconds=tuple(d.seconds for d in done),
            rank_staging_bytes=tuple(d.staging_bytes for d in done))
        self.results[req.request_id] = result
        self.counters.add("transfers_ok")
        self.counters.add("bytes", result.nbytes)
        peer = self.prefills.get(str(req.peer))
        if peer is not None and peer.state == "ready":
            c.send_dealer(peer.sock, m.TransferComplete(request_id=req.request_id,
                                                        generation=req.generation))
        future = self.futures.pop(key, None)
        if future is not None and not future.done():
            future.set_result(result)

    # -- liveness ------------------------------------------------------------------------------
    def _on_tick(self) -> None:
        hb = m.Heartbeat(node_id=self.node_id, seq=0)
        for peer in list(self.prefills.values()):
            if peer.state == "ready":
                c.send_dealer(peer.sock, hb)
        for node in self.prefill_watch.expired():
            peer = self.prefills.get(node)
            if peer is not None:
                self._prefill_lost(peer, f"silent for {self.config.peer_timeout} s")
        self._redial()
        now = time.monotonic()
        for req in list(self.requests.values()):
            if req.failure is None and now > req.deadline + self.config.peer_timeout:
                # The ranks enforce transfer_timeout themselves; this catches a rank that never
                # answers at all.
                self._fail(req, "timeout", f"no answer within {self.config.transfer_timeout} s",
                           notify=True)

    def _on_rank_lost(self, rank: int) -> None:
        for req in list(self.requests.values()):
            self._fail(req, "peer_lost", f"decode rank {rank} of {self.node_id} died",
                       notify=True)

    def _on_close(self) -> None:
        for req in list(self.requests.values()):
            self._fail(req, "aborted", f"{self.node_id} closing", notify=True)
        for peer in list(self.prefills.values()):
            if peer.state == "ready":
                c.send_dealer(peer.sock, m.Goodbye(node_id=self.node_id))
        for peer in list(self._by_sock.values()):
            self._drop_prefill(peer, "closing")
        self._dials.clear()

    def stats(self) -> dict:
        def collect():
            return {**self._page_stats(),
                    "completed_unreleased": len(self.results),
                    "prefills": sorted(n for n, p in self.prefills.items()
                                       if p.state == "ready"),
                    "healthy": self.healthy, **self.counters.snapshot()}
        return self.loop.call(collect)

