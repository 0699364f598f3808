"""What the prefill server and the decode coordinator share: their TP group of rank processes.

A coordinator binds one ROUTER socket; its rank processes connect to it, announce themselves
(``RankHello``) and heartbeat. The coordinator broadcasts commands to all ranks, collects one
``RankDone`` per rank per request, and declares a rank lost when it goes silent for
``peer_timeout`` seconds or its process exits -- whichever comes first.

Both sides track their requests in one :class:`~statebridge.connector.ledger.Ledger`; what
failing a request means on the ranks (cancel where still pending, free the page only once every
live rank confirmed) is written here once. A rank that cannot start says so (``RankFailed``)
or exits; either fails :meth:`RankGroup.wait_ready` at once with that rank's error, and so does
``rank_start_timeout`` running out.

Supervision (a group that loses a rank restarts or fails for good) is
:mod:`~statebridge.connector.supervision`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from statebridge.config import ConnectorConfig
from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.data.env import ucx_net_devices
from statebridge.connector.local import LocalRouter
from statebridge.connector.handshake import GroupHandshake
from statebridge.connector.group_memory import GroupMemory
from statebridge.connector.launch import Launcher, RankHandle, rank_log_level, spawn_launcher
from statebridge.connector.rank import RankSetup
from statebridge.connector.stats import Counters
from statebridge.connector.supervision import Supervision
from statebridge.connector.ledger import Ledger, Record
from statebridge.connector.data.device import memory_of
from statebridge.devices import DeviceSpec, rank_device
from statebridge.errors import (
    ClosedError,
    ConfigError,
    FailureKind,
    LoopTimeoutError,
    ProtocolError,
    StartupError,
)
from statebridge.security import CurveKeys
from statebridge.state.cache import PagePool
from statebridge.state.kv import DEFAULT_BLOCK_SIZE, DEFAULT_KV_LAYOUT, BlockGeometry, BlockPool
from statebridge.state.layout import Layout, PageGeometry
from statebridge.state.spec import StateSpec

log = logging.getLogger(__name__)

# Launching lives in connector/launch.py; its names stay importable from here.
__all__ = ["RankGroup", "Launcher", "spawn_launcher", "RankHandle"]


@dataclass
class _RankState:
    identity: bytes | None = None
    address: bytes = b""
    pid: int = 0
    shm_fd: int = -1
    lost: bool = False
    sock: object = None              # where its hello came from: the local channel (or router)
    weights_private: int = 0         # what its model's weights cost its process (RankHello)
    weights_mapped: int = 0


class RankGroup(GroupHandshake, GroupMemory, Supervision):
    """A coordinator's view of its TP group: the rank processes, their sockets and liveness.

    ``model``: ``module:Class`` of the :class:`~statebridge.connector.rank.RankModel` every rank
    runs (None: none -- the ranks move state and compute nothing; the nodes name the real
    model, tests their stand-in). ``probes``: the instrumentation switch of the ranks, for
    benchmarks and tests (:class:`~statebridge.connector.messages.RankProbe`; "" off).

    Subclasses get :meth:`_on_rank_done`, :meth:`_on_rank_lost`, :meth:`_on_peer_message`
    and the supervision hooks :meth:`_on_group_down` (the group stopped serving: drop peers)
    and :meth:`_on_group_reset` (a restart's fresh state, old ranks gone).
    """

    role = "?"
    #: Seconds an old rank gets to exit after RankShutdown before a restart terminates it.
    RANK_STOP_S = 2.0

    def __init__(self, spec: StateSpec, tp_size: int, layout: "Layout | str", num_pages: int, *,
                 config: ConnectorConfig | None = None, node_id: str | None = None,
                 port: int = 0, launcher: Launcher | None = spawn_launcher,
                 region_align: int = 16, model: str | None = None, model_dir: str = "",
                 dist_init: "str | Callable[[], tuple[str, Any]]" = "",
                 probes: str = "",
                 kv_layout: str = DEFAULT_KV_LAYOUT, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, device: str = "cpu") -> None:
        # ``dist_init`` as a callable: called once this group's sockets are bound, it returns
        # (init_method, store) -- the node's rendezvous store (models.Rendezvous), kept while
        # the ranks live and closed after they stopped.
        self.dist_store: Any = None
        if probes not in m.PROBES:
            raise ConfigError(f"probes must be one of {m.PROBES} (see messages.RankProbe), "
                              f"got {probes!r}")
        self.config = config or ConnectorConfig()
        # Where the ranks run (statebridge.devices): each rank resolves it for itself; the
        # group tells its peers what the pools are in.
        self.device = str(DeviceSpec.parse(device))
        self.memory = memory_of(rank_device(self.device, 0))
        #: rank -> peer node -> (peer rank -> transports UCX chose), from RankTransports.
        self.rank_transports: dict[int, dict[str, dict[int, str]]] = {}
        #: Why device memory sent to another host would go through host memory ("": it
        #: would not), as the ranks' UCX said.
        self.host_staging = ""
        self.spec = spec
        self.tp_size = tp_size
        self.layout = Layout.parse(layout)
        self.geometry = PageGeometry(spec, tp_size, self.layout, region_align=region_align)
        self.region_align = region_align
        self.num_pages = num_pages
        self.pool = PagePool(num_pages)
        # The attention KV (specs with ``spec.kv``): a block pool per rank beside the pages,
        # block ids the same on every rank (this allocator). Without KV: none, 0 blocks.
        self.block_size = block_size
        self.kv_geometry: BlockGeometry | None = None
        self.blocks: BlockPool | None = None
        if spec.kv is not None:
            num_blocks = num_pages * 8 if num_blocks is None else num_blocks
            self.kv_geometry = BlockGeometry(spec.kv, tp_size, kv_layout, block_size, num_blocks)
            self.blocks = BlockPool(num_blocks)
        self.kv_layout = self.kv_geometry.layout.name if self.kv_geometry else str(kv_layout)
        self.num_blocks = self.kv_geometry.num_blocks if self.kv_geometry else 0
        self.node_id = node_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        #: When the group started (monotonic): "ready in N s" counts from here.
        self.started_at = time.monotonic()
        log.info("%s", self.memory_line())
        self.counters = Counters()
        keys = CurveKeys.from_config(self.config, listen=True)   # bad keys: nothing to clean up
        # The ranks' UCX workers listen on the interface of the bind address only (an operator's
        # UCX_NET_DEVICES wins); an address no interface holds fails here, before anything runs.
        self.ucx_net_devices = "" if launcher is None or "UCX_NET_DEVICES" in os.environ \
            else ucx_net_devices(self.config.bind_host)
        self.loop = c.EventLoop(self.node_id)
        try:
            self.router, self.port = c.bind_router(self.loop.context, self.config.bind_host, port,
                                                   keys=keys, counters=self.counters,
                                                   name=self.node_id,
                                                   max_message_bytes=self.config.max_message_bytes)
        except BaseException:
            self.loop.stop()
            raise
        self.loop.add_reader(self.router, self._on_router)
        # The ranks' channel: a Unix socket the loop thread serves itself (connector/local.py:
        # no zmq I/O-thread wake-ups on the 10 per-request messages between ranks and us).
        try:
            self.local = LocalRouter(self.node_id,
                                     max_frame=c.frame_cap(self.config.max_message_bytes))
        except BaseException:
            self.loop.stop()
            self.router.close(0)
            raise
        self.loop.add_fd(self.local.fileno(), functools.partial(self._on_router, self.local))
        self.ranks = [_RankState() for _ in range(tp_size)]
        self._by_identity: dict[bytes, int] = {}
        self.rank_watch = c.PeerWatch(self.config.peer_timeout, self.loop)
        self.ledger = Ledger(tp_size, self.pool, self.blocks)
        self._ready = threading.Event()
        self._started = threading.Event()        # all ranks up, or one failed to start
        self._start_errors: dict[int, str] = {}
        #: No rank of this generation was lost.
        self.healthy = True
        #: Rank groups started so far: 1, then + 1 per restart.
        self.generation = 1
        #: Why the group is restarting ("" when it is not).
        self.restarting = ""
        #: Why the group failed for good ("" while it serves or heals); see the module doc.
        self.fatal = ""
        self._lost_why: dict[int, str] = {}
        self._restarts: list[float] = []          # monotonic times of recent restarts
        self._restarter: threading.Thread | None = None
        self._fatal_handlers: list[Callable[[str], None]] = []
        self._closed = False
        self._heartbeats = 0
        #: Handlers of rank messages the group does not know itself (a layer above the
        #: connector, e.g. the decode node's step results), by type: ``fn(rank, msg)`` on the
        #: loop thread. See :meth:`on_rank_message`.
        self._rank_handlers: dict[type, Callable[[int, m.Message], None]] = {}
        self._rank_lost_handlers: list[Callable[[int], None]] = []
        self.on_rank_message(m.RankTransports, self._on_rank_transports)
        self._init_state()
        self.loop.call_every(self.config.heartbeat_interval, self._tick)
        self.loop.start()
        self.handles: list[RankHandle] = []
        self._launcher = launcher
        self._dist_init = dist_init
        self._rank_args = dict(region_align=region_align, probes=probes, model_dir=model_dir,
                               block_size=block_size, model=model or "")
        if launcher is not None:
            self.handles = self._launch()
        elif callable(dist_init):
            _, self.dist_store = dist_init()

    def _launch(self) -> list[RankHandle]:
        """Start this generation's rank processes, with a rendezvous store of their own when
        ``dist_init`` is a callable (one store per group: a restarted group gets a new one)."""
        dist_init = self._dist_init
        if callable(dist_init):
            dist_init, self.dist_store = dist_init()
        setups = [RankSetup(role=self.role, coordinator=f"{self.config.bind_host}:{self.port}",
                            tp_rank=r, tp_size=self.tp_size, spec_json=self.spec.to_json(),
                            layout=self.layout.name, num_pages=self.num_pages,
                            node_id=self.node_id, config=self.config, dist_init=dist_init,
                            local_coordinator=(self.local.address
                                               if self.config.local_ranks else ""),
                            kv_layout=self.kv_layout, num_blocks=self.num_blocks,
                            log_level=rank_log_level(), coordinator_pid=os.getpid(),
                            ucx_net_devices=self.ucx_net_devices, device=self.device,
                            **self._rank_args)
                  for r in range(self.tp_size)]
        log.info("%s: spawning %d %s rank processes ...", self.node_id, self.tp_size, self.role)
        started = time.monotonic()
        handles = self._launcher(setups)
        log.info("%s: spawning done in %.1f s; waiting for the ranks (pools, UCX, rendezvous, "
                 "weights; bounded by rank_start_timeout %g s)", self.node_id,
                 time.monotonic() - started, self.config.rank_start_timeout)
        return handles

    def _init_state(self) -> None:
        """Subclass state, set up before the loop thread starts."""

    @property
    def address(self) -> str:
        return f"{self.config.bind_host}:{self.port}"

    # -- readiness ---------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every rank has announced itself. A rank that fails to start (it sent
        ``RankFailed`` or its process exited) raises :class:`StartupError` at once, with that
        rank's error; so does ``timeout`` running out (default
        ``config.rank_start_timeout``), naming the ranks that did not announce themselves."""
        timeout = self.config.rank_start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self._started.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if self._closed:
                raise ClosedError(f"{self.node_id} closed while its ranks started")
            if time.monotonic() >= deadline:
                missing = [r for r, s in enumerate(self.ranks) if s.identity is None]
                raise StartupError(f"{self.node_id}: ranks {missing} did not start within "
                                   f"{timeout:g} s (model load and TP rendezvous; see the "
                                   f"ranks' output; rank_start_timeout / "
                                   f"--rank-start-timeout)")
        if self._start_errors:
            raise StartupError(f"{self.node_id}: " + "; ".join(
                f"rank {r} failed to start: {why}" for r, why in sorted(self._start_errors.items())))
        if not self.healthy:
            raise ClosedError(f"{self.node_id}: a rank was lost during start-up")

    def whole(self) -> tuple[bool, str]:
        """Loop thread: (True, "") while every rank of the group is up and none was lost;
        else False and why, naming the missing ranks."""
        if self._closed:
            return False, f"{self.node_id} is closed"
        missing = [r for r, st in enumerate(self.ranks) if st.identity is None or st.lost]
        if self.fatal:
            return False, f"{self.role} group {self.node_id} failed: {self.fatal}"
        if self.restarting:
            return False, (f"{self.role} ranks of {self.node_id} restarting after "
                           f"{self.restarting}: waiting for ranks {missing} (generation "
                           f"{self.generation})")
        if not self.healthy:
            lost = "; ".join(f"rank {r}: {why}" for r, why in sorted(self._lost_why.items()))
            return False, f"{self.role} group {self.node_id} lost a rank ({lost})"
        if not self._ready.is_set():
            return False, f"{self.role} ranks of {self.node_id} are starting: waiting for ranks " \
                          f"{missing}"
        return True, ""

    def on_fatal(self, handler: Callable[[str], None]) -> None:
        """Call ``handler(why)`` on the loop thread when the group fails for good."""
        self._fatal_handlers.append(handler)

    # -- messages --------------------------------------------------------------------------
    def _on_router(self, sock=None) -> None:
        """Messages from the ROUTER (peers; ranks started without a local channel) or, with
        ``sock``, from the ranks' local channel: dispatched alike."""
        sock = self.router if sock is None else sock
        while True:
            got = c.recv_router(sock, self.config.max_message_bytes)
            if got is None:
                return
            identity, msg = got
            if isinstance(msg, ProtocolError):
                self.counters.add("protocol_errors")
                log.warning("%s: bad message from %r: %s", self.node_id, identity, msg)
                c.send_router(sock, identity,
                              m.Error(kind=type(msg).__name__, message=str(msg)))
                continue
            rank = self._by_identity.get(identity)
            if isinstance(msg, m.RankHello):
                self._on_rank_hello(identity, msg, sock)
            elif isinstance(msg, m.RankFailed):
                self._on_rank_failed(identity, msg, sock)
            elif rank is not None:
                if not self.ranks[rank].lost:
                    self.rank_watch.heard(rank)
                if isinstance(msg, m.RankDone):
                    self._on_rank_done(rank, msg)
                elif not isinstance(msg, m.Heartbeat):
                    handler = self._rank_handlers.get(type(msg))
                    if handler is None:
                        self.counters.add("unexpected_messages")
                    else:
                        handler(rank, msg)
            else:
                self._on_peer_message(identity, msg)

    def _from_network(self, sock, identity: bytes, what: str) -> bool:
        """Whether a rank's message ``what`` came over the network while this group's ranks
        use its local channel: then it cannot be one of our ranks (a network peer could
        otherwise take a rank slot, or fail our start); refused with an Error and counted."""
        if not (self.config.local_ranks and sock is self.router):
            return False
        self.counters.add("protocol_errors")
        c.send_router(sock, identity, m.Error(
            kind="ProtocolError", message=f"{what} over the network: this node's ranks "
                                          f"connect over its local channel"))
        return True

    def _on_rank_hello(self, identity: bytes, msg: m.RankHello, sock=None) -> None:
        r = msg.tp_rank
        sock = self.router if sock is None else sock
        if self._from_network(sock, identity, f"RankHello for rank {r}"):
            return
        if not 0 <= r < self.tp_size or self.ranks[r].identity not in (None, identity):
            self.counters.add("protocol_errors")
            c.send_router(sock, identity, m.Error(
                kind="ProtocolError", message=f"rank {r} is not a free rank of TP {self.tp_size}"))
            return
        self.ranks[r] = _RankState(identity, msg.address, msg.pid, msg.shm_fd, sock=sock,
                                   weights_private=msg.weights_private,
                                   weights_mapped=msg.weights_mapped)
        self._by_identity[identity] = r
        self.rank_watch.heard(r)
        if all(s.identity is not None for s in self.ranks) and not self._start_errors:
            log.info("%s: all %d ranks up after %.1f s", self.node_id, self.tp_size,
                     time.monotonic() - self.started_at)
            self._ready.set()
            self._started.set()
            self._on_group_ready()

    def _on_rank_failed(self, identity: bytes, msg: m.RankFailed, sock=None) -> None:
        """A rank could not start. Taken only from where this group's ranks connect (its
        local channel, when they use it), for a rank of the group that did not announce
        itself under another identity, before the group is up."""
        r = msg.tp_rank
        sock = self.router if sock is None else sock
        if self._from_network(sock, identity, f"RankFailed for rank {r}"):
            return
        if not 0 <= r < self.tp_size or self._ready.is_set() \
                or self.ranks[r].identity not in (None, identity):
            self.counters.add("protocol_errors")
            return
        log.error("%s: rank %d failed to start: %s", self.node_id, r, msg.message)
        self._start_errors[r] = msg.message
        self._rank_lost(r, f"failed to start: {msg.message}")
        self._started.set()

    def _on_group_ready(self) -> None:
        pass

    def to_rank(self, rank: int, msg: m.Message) -> None:
        state = self.ranks[rank]
        if state.identity is not None and not state.lost:
            c.send_router(state.sock, state.identity, msg)

    def to_ranks(self, msg: m.Message) -> None:
        live = [s for s in self.ranks if s.identity is not None and not s.lost]
        if live and all(s.sock is live[0].sock for s in live):
            c.send_router_many(live[0].sock, [s.identity for s in live], msg)
            return
        for s in live:                  # ranks on both channels (a hand-made setup)
            c.send_router(s.sock, s.identity, msg)

    def fail_on_ranks(self, record: Record, kind: FailureKind, message: str,
                      lost_node: str = "") -> bool:
        """Record the first failure of ``record`` (counted by kind) and tell every rank still
        working on it to cancel it (each answers RankDone once nothing of it can touch the page
        any more). False if it had failed already."""
        if not self.ledger.fail(record, kind, message):
            return False
        self.counters.add(f"failed_{kind}")
        key = record.key
        cancel = m.RankCancel(peer_node=key.peer_node, request_id=key.request_id,
                              generation=key.generation, kind=kind.value, reason=message,
                              lost_node=lost_node)
        for r in self.ledger.pending_ranks(record):
            self.to_rank(r, cancel)
        return True

    def _tick(self) -> None:
        self._heartbeats += 1
        self.to_ranks(m.Heartbeat(node_id=self.node_id, seq=self._heartbeats))
        if self._closed:
            return
        lost = {r: f"silent for {self.config.peer_timeout:g} s"
                for r in self.rank_watch.expired()}
        for r, handle in enumerate(self.handles):
            if not self.ranks[r].lost and not handle.is_alive():
                code = getattr(handle, "exitcode", None)
                lost[r] = f"its process exited with code {code}"
                if not self._ready.is_set() and r not in self._start_errors:
                    self._start_errors[r] = (f"its process exited (code {code}) before it "
                                             f"announced itself; see its output")
        for r in sorted(lost):
            self._rank_lost(r, lost[r])
        if self._start_errors:
            self._started.set()
        self._on_tick()

    def _rank_lost(self, r: int, why: str = "") -> None:
        if self.ranks[r].lost:
            return
        self.ranks[r].lost = True
        self.ledger.lost.add(r)
        self.healthy = False
        self._lost_why[r] = why or "lost"
        self.counters.add("ranks_lost")
        log.error("%s: rank %d lost (%s)", self.node_id, r, why or "lost")
        self._on_rank_lost(r)
        for handler in self._rank_lost_handlers:
            handler(r)
        if self._ready.is_set():          # (a rank lost while the group starts fails the start)
            self._supervise(f"rank {r} lost ({why or 'lost'})")

    def on_rank_message(self, msg_type: type, handler: Callable[[int, m.Message], None]) -> None:
        """Route rank messages of ``msg_type`` to ``handler(rank, msg)`` on the loop thread
        (call before the ranks can send them, e.g. before :meth:`wait_ready`)."""
        self._rank_handlers[msg_type] = handler

    def _on_rank_transports(self, rank: int, msg: m.RankTransports) -> None:
        """A rank connected to a peer group: note (and log once) the transports UCX chose."""
        lanes = dict(zip(msg.peer_ranks, msg.lanes))
        self.rank_transports.setdefault(rank, {})[msg.peer_node] = lanes
        log.info("%s rank %d -> %s: %s", self.node_id, rank, msg.peer_node,
                 ", ".join(f"rank {r} over {t or '?'}" for r, t in lanes.items()))
        if msg.host_staging:
            self.host_staging = msg.host_staging

    def on_rank_lost(self, handler: Callable[[int], None]) -> None:
        """Call ``handler(rank)`` on the loop thread after a rank was declared lost."""
        self._rank_lost_handlers.append(handler)

    def _on_tick(self) -> None:
        pass

    def _on_rank_done(self, rank: int, msg: m.RankDone) -> None:
        raise NotImplementedError

    def _on_rank_lost(self, rank: int) -> None:
        raise NotImplementedError

    def _on_peer_message(self, identity: bytes, msg: m.Message) -> None:
        self.counters.add("unexpected_messages")

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the ranks and the loop (idempotent); never leaves orphan processes."""
        if self._closed:
            return
        self._closed = True
        if self._restarter is not None:
            self._restarter.join(timeout)      # it sees _closed; bounded by its steps
        told = False
        if self.loop.running:
            try:
                self.loop.call(self._shutdown_ranks, timeout=timeout)
                told = True
            except (ClosedError, LoopTimeoutError):
                pass
        if not told:
            timeout = 0.5      # nobody told the ranks to stop: do not wait for them politely
        deadline = time.monotonic() + timeout
        for h in self.handles:
            h.stop(max(0.1, deadline - time.monotonic()))
        self.loop.stop()
        self.router.close(0)
        self.local.close()
        if self.dist_store is not None:
            self.dist_store.close()
            self.dist_store = None

    def _shutdown_ranks(self) -> None:
        self.to_ranks(m.RankShutdown(reason="coordinator closing"))
        self._on_close()

    def _on_close(self) -> None:
        pass

    def _page_stats(self) -> dict:
        """Page accounting shared by both sides' stats() (loop thread): the pool, and per rank
        the pages it may still touch (requests without its RankDone)."""
        return {"pages_used": self.pool.num_used, "pages_free": self.pool.num_free,
                "pages_total": self.num_pages,
                "blocks_used": self.blocks.num_used if self.blocks else 0,
                "blocks_free": self.blocks.num_free if self.blocks else 0,
                "blocks_total": self.num_blocks,
                "rank_pages_busy": self.ledger.busy_pages(),
                "requests_in_flight": self._in_flight(),
                # where the pools are, and per rank and peer node the transports UCX chose
                "memory": self.memory, "device": self.device,
                "transports": {r: dict(peers) for r, peers in self.rank_transports.items()},
                "host_staging": self.host_staging}

    def _in_flight(self) -> int:
        """Requests that still hold a page for the transfer (both sides: until freed)."""
        return len(self.ledger)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
