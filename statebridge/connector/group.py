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

A group *has* its parts: the handshake record (:class:`~statebridge.connector.handshake.
GroupHandshake`), the memory report (:class:`~statebridge.connector.group_memory.GroupMemory`)
and a supervisor (:class:`~statebridge.connector.supervision.Supervisor`: a group that loses a
rank restarts or fails for good). What the group must tell the coordinator that owns it (a
rank's answer, a rank lost, peers' messages, the group stopped serving, restarted, closing)
goes to that owner's :class:`GroupEvents`, given to the constructor. The owner builds the
group, then its own parts, then calls :meth:`RankGroup.start` (the loop thread, the ranks).
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from statebridge.config import ConnectorConfig
from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.data.env import ucx_net_devices
from statebridge.connector.local import LocalRouter
from statebridge.connector.handshake import GroupHandshake, RankAnnouncement
from statebridge.connector.group_memory import GroupMemory
from statebridge.connector.launch import Launcher, RankHandle, rank_log_level, spawn_launcher
from statebridge.connector.rank import RankSetup
from statebridge.connector.stats import Counters
from statebridge.connector.supervision import Supervisor
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
__all__ = ["RankGroup", "GroupEvents", "delegate_to_group", "Launcher", "spawn_launcher",
           "RankHandle"]


@dataclass
class _RankState:
    identity: bytes | None = None
    sock: object = None              # where its hello came from: the local channel (or router)
    lost: bool = False
    #: What it said when it announced itself (its RankHello; the defaults before).
    announced: RankAnnouncement = field(default_factory=RankAnnouncement)


class GroupEvents(Protocol):
    """What a rank group tells the coordinator that owns it (the owner implements these and
    gives itself to :class:`RankGroup`); each runs on the group's loop thread."""

    def rank_done(self, rank: int, msg: m.RankDone, record: Record,
                  failure: FailureKind | None) -> None:
        """A rank answered ``record``'s request (noted in the ledger already); ``failure``:
        what the rank reports when it is the record's first failure (None: it reports
        success, or the record failed already)."""

    def rank_lost(self, rank: int) -> None:
        """A rank was declared lost: fail the requests in flight."""

    def peer_message(self, identity: bytes, msg: m.Message) -> None:
        """A message on the ROUTER from a peer: not one of the group's ranks."""

    def tick(self) -> None:
        """Every heartbeat interval, after the ranks' heartbeat and liveness checks."""

    def group_down(self, why: str) -> None:
        """The group stopped serving (restarting or failed): requests in flight have failed;
        drop the peers."""

    def group_reset(self) -> None:
        """A restart's fresh state: the old ranks are gone, the ledger is new."""

    def group_restarted(self) -> None:
        """The new generation is whole."""

    def closing(self) -> None:
        """The group closes: its ranks were told to stop; fail what is left, say goodbye."""


def delegate_to_group(*names: str):
    """Class decorator for a coordinator that has a rank group (``self.group``): each of
    ``names`` (an attribute or a method of :class:`RankGroup`, or a dotted path into one of its
    parts: ``"supervisor.fatal"``) reads as the coordinator's own under its last name,
    ``coordinator.fatal`` being ``coordinator.group.supervisor.fatal`` -- the group's face its
    users reach (its node id, address, readiness, failure, close), written once for both
    sides."""
    def decorate(cls):
        for name in names:
            get = operator.attrgetter(name)
            setattr(cls, name.rpartition(".")[2],
                    property(lambda self, get=get: get(self.group),
                             doc=f"The rank group's ``{name}`` "
                                 f"(:class:`~statebridge.connector.group.RankGroup`)."))
        return cls
    return decorate


class RankGroup:
    """A coordinator's view of its TP group: the rank processes, their sockets and liveness.

    ``events``: the owner (:class:`GroupEvents`). ``role``: ``"prefill"`` or ``"decode"``.
    ``model``: ``module:Class`` of the :class:`~statebridge.connector.rank.RankModel` every rank
    runs (None: none -- the ranks move state and compute nothing; the nodes name the real
    model, tests their stand-in). ``probes``: the instrumentation switch of the ranks, for
    benchmarks and tests (:class:`~statebridge.connector.messages.RankProbe`; "" off).

    The sockets are bound and the pools made here; :meth:`start` starts the loop thread and
    the ranks once the owner's parts are built.
    """

    def __init__(self, events: GroupEvents, role: str, spec: StateSpec, tp_size: int,
                 layout: "Layout | str", num_pages: int, *,
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
        self.events = events
        self.role = role
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
        self.node_id = node_id or f"{role}-{uuid.uuid4().hex[:8]}"
        #: When the group started (monotonic): "ready in N s" counts from here.
        self.started_at = time.monotonic()
        #: The group's half of the handshake with a peer group.
        self.handshake = GroupHandshake(
            node_id=self.node_id, role=role, spec=spec, tp_size=tp_size, layout=self.layout,
            geometry=self.geometry, region_align=region_align, num_pages=num_pages,
            kv_layout=self.kv_layout, block_size=block_size, num_blocks=self.num_blocks,
            memory=self.memory, config=self.config)
        #: What the ranks hold in memory (:meth:`memory_line`, :meth:`rank_memory`).
        self.memory_report = GroupMemory(
            node_id=self.node_id, tp_size=tp_size, geometry=self.geometry, num_pages=num_pages,
            kv_geometry=self.kv_geometry, num_blocks=self.num_blocks, block_size=block_size)
        log.info("%s", self.memory_report.memory_line())
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
        self._lost_why: dict[int, str] = {}
        self._closed = False
        #: Heartbeats sent to the ranks so far (the owner's heartbeats to its peers too).
        self.heartbeats = 0
        #: Handlers of rank messages the group does not know itself (a layer above the
        #: connector, e.g. the decode node's step results), by type: ``fn(rank, msg)`` on the
        #: loop thread. See :meth:`on_rank_message`.
        self._rank_handlers: dict[type, Callable[[int, m.Message], None]] = {}
        self._rank_lost_handlers: list[Callable[[int], None]] = []
        self.on_rank_message(m.RankTransports, self._on_rank_transports)
        #: Restarts or fails the group when it loses a rank (connector/supervision.py).
        self.supervisor = Supervisor(self, self.config, self.counters)
        self.handles: list[RankHandle] = []
        self._launcher = launcher
        self._dist_init = dist_init
        self._rank_args = dict(region_align=region_align, probes=probes, model_dir=model_dir,
                               block_size=block_size, model=model or "")

    def start(self) -> None:
        """Start the loop thread and the rank processes (the owner calls it once, after it
        built its own parts: nothing runs on the loop before)."""
        self.loop.call_every(self.config.heartbeat_interval, self._tick)
        self.loop.start()
        if self._launcher is not None:
            self.handles = self.launch_ranks()
        elif callable(self._dist_init):
            _, self.dist_store = self._dist_init()

    def launch_ranks(self) -> list[RankHandle]:
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

    @property
    def address(self) -> str:
        return f"{self.config.bind_host}:{self.port}"

    @property
    def closed(self) -> bool:
        """:meth:`close` was called."""
        return self._closed

    # -- what the ranks said -----------------------------------------------------------------
    def announcements(self) -> list[RankAnnouncement]:
        """What each rank said when it announced itself (the defaults for one that did not)."""
        return [s.announced for s in self.ranks]

    @property
    def rank_addresses(self) -> tuple[bytes, ...]:
        return tuple(s.announced.address for s in self.ranks)

    def group_info(self) -> m.GroupInfo:
        """The group's handshake record (:class:`~statebridge.connector.handshake.
        GroupHandshake`) with what its ranks announced."""
        return self.handshake.group_info(self.announcements())

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV one rank's pool holds (0 without attention KV)."""
        return self.memory_report.kv_tokens

    def rank_memory(self) -> list[dict[str, int]]:
        """Per rank, the bytes it holds (:meth:`GroupMemory.rank_memory
        <statebridge.connector.group_memory.GroupMemory.rank_memory>`)."""
        return self.memory_report.rank_memory(self.announcements())

    def memory_line(self) -> str:
        """What this node's ranks hold, in one line (:meth:`GroupMemory.memory_line
        <statebridge.connector.group_memory.GroupMemory.memory_line>`)."""
        return self.memory_report.memory_line(self.announcements())

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
        supervisor = self.supervisor
        if supervisor.fatal:
            return False, f"{self.role} group {self.node_id} failed: {supervisor.fatal}"
        if supervisor.restarting:
            return False, (f"{self.role} ranks of {self.node_id} restarting after "
                           f"{supervisor.restarting}: waiting for ranks {missing} (generation "
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
        self.supervisor.on_fatal(handler)

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
                self.events.peer_message(identity, msg)

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
        self.ranks[r] = _RankState(identity, sock=sock, announced=RankAnnouncement(
            address=msg.address, pid=msg.pid, shm_fd=msg.shm_fd,
            weights_private=msg.weights_private, weights_mapped=msg.weights_mapped,
            chunked_prefill=msg.chunked_prefill))
        self._by_identity[identity] = r
        self.rank_watch.heard(r)
        if all(s.identity is not None for s in self.ranks) and not self._start_errors:
            log.info("%s: all %d ranks up after %.1f s", self.node_id, self.tp_size,
                     time.monotonic() - self.started_at)
            self._ready.set()
            self._started.set()

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

    def _on_rank_done(self, rank: int, msg: m.RankDone) -> None:
        """A rank answered a request: noted in the ledger. A stale answer (no request of this
        generation waits for it) is counted; else the owner hears of it."""
        record = self.ledger.answer(rank, msg)
        if record is None:
            self.counters.add("stale_rank_done")
            return
        failure = FailureKind.parse(msg.kind) if msg.kind and record.failure is None else None
        self.events.rank_done(rank, msg, record, failure)

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
        self.heartbeats += 1
        self.to_ranks(m.Heartbeat(node_id=self.node_id, seq=self.heartbeats))
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
        self.events.tick()

    def _rank_lost(self, r: int, why: str = "") -> None:
        if self.ranks[r].lost:
            return
        self.ranks[r].lost = True
        self.ledger.lost.add(r)
        self.healthy = False
        self._lost_why[r] = why or "lost"
        self.counters.add("ranks_lost")
        log.error("%s: rank %d lost (%s)", self.node_id, r, why or "lost")
        self.events.rank_lost(r)
        for handler in self._rank_lost_handlers:
            handler(r)
        if self._ready.is_set():          # (a rank lost while the group starts fails the start)
            self.supervisor.supervise(f"rank {r} lost ({why or 'lost'})")

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

    # -- for the supervisor (supervision.Supervised) -------------------------------------------
    @property
    def can_restart(self) -> bool:
        return self._launcher is not None

    def stop_serving(self, why: str, shutdown: str) -> None:
        """Loop thread: the group stops serving: the owner drops its peers (``why``), every
        rank is told to stop (``shutdown``)."""
        self.healthy = False
        self.events.group_down(why)
        self.to_ranks(m.RankShutdown(reason=shutdown))

    def retire_ranks(self) -> list[RankHandle]:
        """Loop thread: the old ranks are the restarter's now: nothing here watches or counts
        them again. Returns their handles."""
        old, self.handles = self.handles, []
        for r, st in enumerate(self.ranks):
            st.lost = True
            self.rank_watch.forget(r)
        return old

    def close_dist_store(self) -> None:
        store, self.dist_store = self.dist_store, None
        if store is not None:
            store.close()

    def reset_generation(self) -> None:
        """Loop thread, once no old rank process is left that could write into a page or a
        block: fresh pools, ledger and rank slots for the next generation."""
        self.pool = PagePool(self.num_pages)
        if self.blocks is not None:
            self.blocks = BlockPool(self.num_blocks)
        self.ledger = Ledger(self.tp_size, self.pool, self.blocks)
        self.ranks = [_RankState() for _ in range(self.tp_size)]
        self._by_identity.clear()
        for r in range(self.tp_size):
            self.rank_watch.forget(r)
        self._ready.clear()
        self._started.clear()
        self._start_errors.clear()
        self._lost_why.clear()
        self.healthy = True
        self.handles = []
        self.generation += 1
        self.events.group_reset()

    def adopt_ranks(self, handles: list[RankHandle]) -> None:
        if self._closed:
            raise ClosedError(f"{self.node_id} closed while its ranks restarted")
        self.handles = handles

    def lost_ranks(self) -> dict[int, str]:
        return dict(self._lost_why)

    def group_restarted(self) -> None:
        self.events.group_restarted()

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the ranks and the loop (idempotent); never leaves orphan processes."""
        if self._closed:
            return
        self._closed = True
        self.supervisor.join(timeout)      # a restart sees _closed; bounded by its steps
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
        self.close_dist_store()

    def _shutdown_ranks(self) -> None:
        self.to_ranks(m.RankShutdown(reason="coordinator closing"))
        self.events.closing()

    def page_stats(self, in_flight: int | None = None) -> dict:
        """Page accounting shared by both sides' stats() (loop thread): the pool, and per rank
        the pages it may still touch (requests without its RankDone). ``in_flight``: the
        owner's count of requests in flight (default: every request that holds a page)."""
        return {"pages_used": self.pool.num_used, "pages_free": self.pool.num_free,
                "pages_total": self.num_pages,
                "blocks_used": self.blocks.num_used if self.blocks else 0,
                "blocks_free": self.blocks.num_free if self.blocks else 0,
                "blocks_total": self.num_blocks,
                "rank_pages_busy": self.ledger.busy_pages(),
                "requests_in_flight": len(self.ledger) if in_flight is None else in_flight,
                # where the pools are, and per rank and peer node the transports UCX chose
                "memory": self.memory, "device": self.device,
                "transports": {r: dict(peers) for r, peers in self.rank_transports.items()},
                "host_staging": self.host_staging}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
