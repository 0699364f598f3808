"""One worker rank's data plane inside vLLM: a thread that owns the UCX transport over vLLM's
registered memory and the side channel (:mod:`statebridge.vllm.wire`).

The vLLM worker thread only hands it work and reads its results (thread-safe queues and sets);
the agent thread alone posts, progresses and closes (a :class:`Transport` has one owner).

Producer (prefill) rank ``s``: a ROUTER on ``port + s`` answers hellos and serves pulls by
posting sends of the request's runs straight from vLLM's blocks. A request the scheduler handed
off (:meth:`Agent.hold`) is reported done (:meth:`Agent.take_finished`) once every consumer rank
pulled it and its sends completed, or when its lease ends -- never earlier, so no block is
reused while a consumer may still read it.

Consumer (decode) rank ``d``: on :meth:`Agent.load` it greets the producer ranks it has not
met, posts receives straight into vLLM's blocks, then pulls. A load is done when every receive
completed; it fails (and its receives are cancelled before vLLM hears of it, so nothing lands
in blocks vLLM may reuse) on a producer error, a lost peer or its deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field

import numpy as np
import zmq

from statebridge.connector.codec import decode, encode
from statebridge.errors import ConfigError, IncompatiblePeerError, StatebridgeError
from statebridge.state.paged import PagedPlan
from statebridge.state.spec import StateSpec
from statebridge.vllm.describe import Layers
from statebridge.vllm.settings import Settings
from statebridge.vllm.threads import name_os_thread, on_every_cpu
from statebridge.vllm.wire import VllmHello, VllmMeta, VllmPull, VllmPullReply

# Under "vllm.": vLLM's handlers print it beside its own lines (a library configures none).
log = logging.getLogger("vllm." + __name__)

__all__ = ["Agent", "Load"]


@dataclass
class Load:
    """One request a consumer rank loads."""

    request_id: str                      # local (this engine's) id
    remote_request_id: str
    engine_id: str
    host: str
    port: int
    remote_tp: int
    remote_blocks: tuple                 # per producer transfer group (clipped)
    local_blocks: tuple                  # per local transfer group (clipped)
    tokens: int                          # prompt tokens that move (N - 1)
    computed_tokens: int = 0             # of those, held by this instance's prefix cache
    abort: bool = False                  # release the producer's blocks, read nothing
    deadline: float = 0.0
    started: float = 0.0
    generation: int = 0
    posted: bool = False                 # its receives are posted (the handshake is done)
    handles: dict = field(default_factory=dict)
    checksums: dict = field(default_factory=dict)
    expected: dict = field(default_factory=dict)


@dataclass
class _Remote:
    """A producer engine as a consumer rank knows it."""

    engine_id: str
    host: str
    port: int
    tp: int
    sockets: dict = field(default_factory=dict)       # src rank -> DEALER
    meta: dict = field(default_factory=dict)          # src rank -> (peer id, geometry, groups)
    plan: PagedPlan | None = None
    error: str = ""
    started: float = 0.0
    waiting: list = field(default_factory=list)


@dataclass
class _Held:
    """A request a producer rank holds for its consumers."""

    deadline: float
    known: bool = False                 # the scheduler handed it off (its blocks are held)
    dst_tp: int = 0
    done: set = field(default_factory=set)
    sends: dict = field(default_factory=dict)         # (peer, dst rank) -> handle


class Agent:
    """The data-plane thread of one worker rank (see the module docstring)."""

    def __init__(self, layers: Layers, *, tp_rank: int, tp_size: int, engine_id: str,
                 producer: bool, consumer: bool, settings: Settings) -> None:
        from statebridge.connector.data.transport import Transport

        self.layers, self.tp_rank, self.tp_size = layers, tp_rank, tp_size
        self.engine_id, self.settings = engine_id, settings
        self.producer, self.consumer = producer, consumer
        self.peer_id = f"{engine_id}-{tp_rank}-{uuid.uuid4().hex[:8]}"
        self._spec_json = layers.spec.to_json()
        self._describe = layers.describe()
        with on_every_cpu():             # UCX's and zmq's threads start here
            self._transport = Transport(list(layers.segments), name=f"vllm-{self.peer_id}")
            self._ctx = zmq.Context()
            self._router = None
            if producer:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                endpoint = f"tcp://{settings.host}:{settings.port + tp_rank}"
                try:
                    self._router.bind(endpoint)
                except zmq.ZMQError as e:
                    self._transport.close()
                    self._ctx.destroy(linger=0)
                    raise ConfigError(f"statebridge connector: cannot listen on {endpoint}: {e} "
                                      f"(side_channel_port {settings.port} + TP rank {tp_rank}; "
                                      f"give each prefill instance its own)") from None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._open: set[str] = set()        # loaded or held, not yet reported finished
        self._reported = threading.Event()  # something to report since take_finished
        self._generations = itertools.count(1)
        self._remotes: dict[str, _Remote] = {}
        self._loads: dict[str, Load] = {}
        self._peers: dict[str, tuple[PagedPlan, int]] = {}     # consumer peer -> (plan, dst tp)
        self._held: dict[str, _Held] = {}
        self._stop = threading.Event()
        self._dead = ""                     # why the agent thread stopped, once it has
        self._poller: zmq.Poller | None = None
        self._sockets: dict = {}
        self.counters = {"pulls_served": 0, "loads_done": 0, "loads_failed": 0,
                         "runs_sent": 0, "runs_received": 0, "bytes_sent": 0,
                         "bytes_received": 0, "leases_expired": 0, "control_messages": 0,
                         "kv_blocks_kept": 0,
                         "load_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name=f"sb-vllm-{tp_rank}",
                                        daemon=True)
        with on_every_cpu():
            self._thread.start()

    # -- the vLLM worker thread's side ---------------------------------------------------
    def load(self, load: Load) -> None:
        if not load.abort:
            with self._lock:
                self._open.add(load.request_id)
        self._submit(("load", load))

    def hold(self, request_id: str, lease_s: float | None = None) -> None:
        """The scheduler handed ``request_id`` off: hold its blocks until every consumer rank
        read them or the lease ends."""
        with self._lock:
            self._open.add(request_id)
        self._submit(("hold", request_id, lease_s or self.settings.lease_s))

    def wait_for_transfers(self, timeout: float) -> None:
        """Sleep until a transfer ends or ``timeout`` passes; at once if none is open or one
        ended since the last :meth:`take_finished`."""
        with self._lock:
            if not self._open:
                return
        self._reported.wait(timeout)

    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call; a
        failed load is in both of the last two (vLLM's contract)."""
        with self._lock:
            out = (self._finished_sending, self._finished_recving | self._failed_recving,
                   self._failed_recving)
            self._finished_sending, self._finished_recving = set(), set()
            self._failed_recving = set()
            self._open -= out[0] | out[1]
            self._reported.clear()
        return out

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._reported.set()
        self._wake()
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _submit(self, task) -> None:
        if self._stop.is_set():
            raise StatebridgeError("statebridge connector: the agent is closed")
        with self._lock:                  # after _dead is set nothing is queued any more
            queued = not self._dead
            if queued:
                self._tasks.put(task)
        if not queued:                    # else the thread, or its last drain, takes it
            self._refuse(task)
        self._wake()

    def _refuse(self, task) -> None:
        """The data plane is gone: a load fails at once, a hold is released (nothing can read
        its blocks any more)."""
        with self._lock:
            if task[0] == "hold":
                self._finished_sending.add(task[1])
            elif not task[1].abort:
                self._failed_recving.add(task[1].request_id)
                log.error("statebridge connector rank %d: request %s failed to load: %s",
                          self.tp_rank, task[1].request_id, self._dead)
            self._reported.set()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # -- the agent thread --------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(f"sb-vllm-{self.tp_rank}")
        try:
            while not self._stop.is_set():
                self._step()
        except Exception:  # noqa: BLE001 -- the thread must say why it died
            log.exception("statebridge connector rank %d: the data-plane thread failed",
                          self.tp_rank)
            self._fail_all("the data-plane thread failed")
        finally:
            with self._lock:
                self._dead = "the data-plane thread has stopped"
            for remote in self._remotes.values():
                for sock in remote.sockets.values():
                    sock.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            self._transport.close()
            self._ctx.term()
            # Nothing moves any more: release what is held, refuse what was queued.
            for request_id, held in self._held.items():
                if held.known:
                    self._refuse(("hold", request_id))
            while True:
                try:
                    self._refuse(self._tasks.get_nowait())
                except queue.Empty:
                    break

    def _step(self) -> None:
        poller = self._poller
        if poller is None:
            # Built again only when sockets come or go: every call into zmq or UCX from this
            # thread may wait for the GIL behind vLLM's spinning worker thread.
            poller = self._poller = zmq.Poller()
            poller.register(self._wake_r, zmq.POLLIN)
            poller.register(self._transport.fileno(), zmq.POLLIN)
            if self._router is not None:
                poller.register(self._router, zmq.POLLIN)
            self._sockets = {}
            for remote in self._remotes.values():
                for s, sock in remote.sockets.items():
                    poller.register(sock, zmq.POLLIN)
                    self._sockets[sock] = (remote, s)
        sockets = self._sockets
        busy = bool(self._loads or any(h.sends for h in self._held.values()))
        timeout = 0 if not self._transport.arm() else (5 if busy else 200)
        events = dict(poller.poll(timeout))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task[0] == "load":
                self._start_load(task[1])
            else:
                self._hold(task[1], task[2])
        # Every socket each turn, not only those poll() named: a lost wakeup costs <= 200 ms.
        if self._router is not None:
            self._serve()
        for sock, (remote, s) in sockets.items():
            if not sock.closed:           # a load of this turn may have dropped its remote
                self._answer(remote, s, sock)
        self._transport.progress()
        now = time.monotonic()
        self._check_remotes(now)
        self._check_loads(now)
        self._check_held(now)

    # -- producer ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["control_messages"] += 1
            ident, payload = frames[0], frames[-1]
            try:
                msg = decode(payload)
            except StatebridgeError as e:
                log.warning("statebridge connector rank %d: bad side-channel message: %s",
                            self.tp_rank, e)
                continue
            log.debug("statebridge connector rank %d: %s from %s", self.tp_rank,
                      type(msg).__name__, getattr(msg, "peer", "?"))
            if isinstance(msg, VllmHello):
                reply = self._hello(msg)
            elif isinstance(msg, VllmPull):
                reply = self._pull(msg)
            else:
                log.warning("statebridge connector rank %d: unexpected %s on the side channel",
                            self.tp_rank, type(msg).__name__)
                continue
            if reply is not None:
                self._router.send_multipart([ident, encode(reply)])

    def _hello(self, msg: VllmHello) -> VllmMeta:
        error = ""
        try:
            if msg.spec != self._spec_json:
                raise IncompatiblePeerError(
                    f"model state differs: this prefill instance serves "
                    f"{self.layers.spec.fingerprint()}, the decode instance "
                    f"{StateSpec.from_json(msg.spec).fingerprint()}")
            geometry, _, _ = Layers.parse(self.layers.spec, msg.geometry)
            plan = PagedPlan(self.layers.geometry, geometry)
            self._transport.connect(msg.peer, msg.address)
            self._peers[msg.peer] = (plan, msg.dst_tp)
        except StatebridgeError as e:
            error = str(e)
            log.error("statebridge connector rank %d: refusing decode rank %d of %d (%s): %s",
                      self.tp_rank, msg.dst_rank, msg.dst_tp, msg.peer, error)
        else:
            log.info("statebridge connector rank %d: decode rank %d of %d connected (%s)",
                     self.tp_rank, msg.dst_rank, msg.dst_tp, msg.peer)
        return VllmMeta(engine_id=self.engine_id, src_rank=self.tp_rank, src_tp=self.tp_size,
                        address=self._transport.address,
                        geometry="" if error else self._describe, error=error,
                        verify=self.settings.verify_transfers)

    def _pull(self, msg: VllmPull) -> VllmPullReply | None:
        held = self._held.get(msg.request_id)
        if held is None:
            held = self._held[msg.request_id] = _Held(time.monotonic() + self.settings.lease_s)
        held.dst_tp = msg.dst_tp
        key = (msg.peer, msg.dst_rank)
        if msg.abort:
            held.done.add(key)
            return None
        error, checksum = "", -1
        try:
            if msg.peer not in self._peers:
                raise ConfigError(f"unknown decode rank {msg.peer!r} (no hello)")
            plan, _ = self._peers[msg.peer]
            n = msg.kv_blocks
            src_kv = {layer: msg.src_kv[i * n:(i + 1) * n] for i, layer in enumerate(msg.kv_layers)}
            dst_kv = {layer: msg.dst_kv[i * n:(i + 1) * n] for i, layer in enumerate(msg.kv_layers)}
            runs = plan.runs(self.tp_rank, msg.dst_rank, dict(zip(msg.state_layers, msg.src_state)),
                             dict(zip(msg.state_layers, msg.dst_state)), src_kv, dst_kv)
            if len(runs):
                if self.settings.verify_transfers:
                    checksum = _crc(self._transport.posting, runs, 0)
                held.sends[key] = self._transport.post_send(msg.peer, msg.generation,
                                                            self.tp_rank, runs,
                                                            request_id=msg.request_id)
                self.counters["runs_sent"] += len(runs)
                self.counters["bytes_sent"] += int(runs[:, 2].sum())
            else:
                held.done.add(key)
            self.counters["pulls_served"] += 1
        except StatebridgeError as e:
            error = str(e)
            held.done.add(key)
            log.error("statebridge connector rank %d: cannot serve request %s to decode rank "
                      "%d: %s", self.tp_rank, msg.request_id, msg.dst_rank, error)
        if error or checksum >= 0:
            return VllmPullReply(request_id=msg.request_id, generation=msg.generation,
                                 src_rank=self.tp_rank, error=error, checksum=checksum)
        return None

    def _hold(self, request_id: str, lease_s: float) -> None:
        held = self._held.setdefault(request_id, _Held(0.0))
        held.known = True
        held.deadline = time.monotonic() + lease_s

    def _check_held(self, now: float) -> None:
        finished = []
        for request_id, held in self._held.items():
            for key, handle in list(held.sends.items()):
                if handle.finished():
                    if not handle.ok:
                        log.warning("statebridge connector rank %d: sending request %s to %s "
                                    "failed: %s", self.tp_rank, request_id, key[0], handle.error)
                    del held.sends[key]
                    held.done.add(key)
            complete = held.dst_tp and len({d for _, d in held.done}) >= held.dst_tp \
                and not held.sends
            if held.known and complete:
                finished.append(request_id)
            elif now > held.deadline:
                if held.known:
                    log.warning("statebridge connector rank %d: request %s: lease of %.0f s "
                                "ended with %d of %s decode ranks done; its blocks are freed",
                                self.tp_rank, request_id, self.settings.lease_s,
                                len(held.done), held.dst_tp or "?")
                    self.counters["leases_expired"] += 1
                for handle in held.sends.values():
                    handle.cancel()
                finished.append(request_id)
        for request_id in finished:
            held = self._held.pop(request_id)
            if held.known:
                with self._lock:
                    self._finished_sending.add(request_id)
                    self._reported.set()

    # -- consumer ----------------------------------------------------------------------------
    def _start_load(self, load: Load) -> None:
        log.debug("statebridge connector rank %d: load %s from engine %s", self.tp_rank,
                  load.request_id, load.engine_id)
        load.started = time.monotonic()
        load.deadline = load.started + self.settings.transfer_timeout_s
        self._loads[load.request_id] = load
        remote = self._remotes.get(load.engine_id)
        if remote is None or remote.error:
            remote = self._connect(load)
        if remote.plan is None and not remote.error:
            remote.waiting.append(load.request_id)
            return
        self._pull_from(remote, load)

    def _connect(self, load: Load) -> _Remote:
        old = self._remotes.pop(load.engine_id, None)
        if old is not None:
            for sock in old.sockets.values():
                sock.close(linger=0)
        remote = _Remote(load.engine_id, load.host, load.port, load.remote_tp,
                         started=time.monotonic())
        hello = encode(VllmHello(peer=self.peer_id, address=self._transport.address,
                                 dst_rank=self.tp_rank, dst_tp=self.tp_size,
                                 spec=self._spec_json, geometry=self._describe))
        for s in range(load.remote_tp):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{load.host}:{load.port + s}")
            sock.send(hello)
            self.counters["control_messages"] += 1
            remote.sockets[s] = sock
        self._remotes[load.engine_id] = remote
        self._poller = None
        return remote

    def _answer(self, remote: _Remote, s: int, sock) -> None:
        while True:
            try:
                payload = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["control_messages"] += 1
            try:
                msg = decode(payload)
            except StatebridgeError as e:
                log.warning("statebridge connector rank %d: bad message from prefill rank %d: "
                            "%s", self.tp_rank, s, e)
                continue
            if isinstance(msg, VllmMeta):
                self._met(remote, s, msg)
            elif isinstance(msg, VllmPullReply):
                self._replied(msg)

    def _met(self, remote: _Remote, s: int, msg: VllmMeta) -> None:
        try:
            if msg.error:
                raise IncompatiblePeerError(f"prefill rank {s} refused: {msg.error}")
            if msg.engine_id != remote.engine_id:
                raise IncompatiblePeerError(
                    f"{remote.host}:{remote.port + s} is engine {msg.engine_id!r}, the request "
                    f"names {remote.engine_id!r} (two prefill instances on one port?)")
            if msg.src_tp != remote.tp or msg.src_rank != s:
                raise IncompatiblePeerError(f"prefill rank {msg.src_rank} of TP {msg.src_tp} "
                                            f"answered for rank {s} of TP {remote.tp}")
            if msg.verify != self.settings.verify_transfers:
                raise IncompatiblePeerError(
                    f"verify_transfers is {msg.verify} on the prefill instance and "
                    f"{self.settings.verify_transfers} here: set it alike on both")
            geometry, groups, state_group = Layers.parse(self.layers.spec, msg.geometry)
            peer = f"{remote.engine_id}/{s}"
            self._transport.connect(peer, msg.address)
            remote.meta[s] = (peer, geometry, groups, state_group)
            if len(remote.meta) == remote.tp:
                remote.plan = PagedPlan(geometry, self.layers.geometry)
                log.info("statebridge connector rank %d: connected to prefill engine %s (TP %d "
                         "-> %d)", self.tp_rank, remote.engine_id, remote.tp, self.tp_size)
        except StatebridgeError as e:
            remote.error = str(e)
            log.error("statebridge connector rank %d: prefill engine %s at %s:%d: %s",
                      self.tp_rank, remote.engine_id, remote.host, remote.port, remote.error)
        if remote.plan is not None or remote.error:
            waiting, remote.waiting = remote.waiting, []
            for request_id in waiting:
                load = self._loads.get(request_id)
                if load is not None:
                    self._pull_from(remote, load)

    def _pull_from(self, remote: _Remote, load: Load) -> None:
        if remote.error:
            self._fail(load, remote.error)
            return
        _, _, groups, state_group = remote.meta[0]
        block_size = self.layers.geometry.block_size or 1
        n_kv = -(-load.tokens // block_size) if self.layers.spec.kv is not None else 0
        # KV blocks this instance's prefix cache already holds are shared: never written
        first = min(load.computed_tokens // block_size, n_kv)
        try:
            src_state, src_kv = self.layers.tables(groups, state_group, load.remote_blocks,
                                                   n_kv, first) if not load.abort else ({}, {})
            dst_state, dst_kv = self.layers.tables(self.layers.groups, self.layers.state_group,
                                                   load.local_blocks, n_kv, first) \
                if not load.abort else ({}, {})
            load.generation = next(self._generations) & 0xFFFFFFFF
            state_layers = tuple(sorted(dst_state))
            kv_layers = tuple(sorted(dst_kv))
            self.counters["kv_blocks_kept"] += first * len(kv_layers)
            for s in range(remote.tp):
                if load.abort:
                    continue
                runs = remote.plan.runs(s, self.tp_rank, src_state, dst_state, src_kv, dst_kv)
                if len(runs):
                    peer = remote.meta[s][0]
                    load.handles[s] = self._transport.post_recv(peer, load.generation, s, runs,
                                                                request_id=load.request_id)
                    load.expected[s] = runs
                    self.counters["runs_received"] += len(runs)
            for s in range(remote.tp):
                pull = VllmPull(
                    request_id=load.remote_request_id, generation=load.generation,
                    peer=self.peer_id, dst_rank=self.tp_rank, dst_tp=self.tp_size,
                    state_layers=state_layers,
                    src_state=tuple(src_state[i] for i in state_layers),
                    dst_state=tuple(dst_state[i] for i in state_layers),
                    kv_layers=kv_layers, kv_blocks=n_kv - first,
                    src_kv=tuple(b for i in kv_layers for b in src_kv[i]),
                    dst_kv=tuple(b for i in kv_layers for b in dst_kv[i]),
                    abort=load.abort or s not in load.handles)
                remote.sockets[s].send(encode(pull))
                self.counters["control_messages"] += 1
        except StatebridgeError as e:
            self._fail(load, str(e))
            return
        load.posted = True
        if load.abort or not load.handles:
            self._loads.pop(load.request_id, None)
            if not load.abort:
                self._succeed(load)

    def _replied(self, msg: VllmPullReply) -> None:
        load = next((x for x in self._loads.values()
                     if x.generation == msg.generation), None)
        if load is None:
            return
        if msg.error:
            self._fail(load, f"prefill rank {msg.src_rank}: {msg.error}")
        else:
            load.checksums[msg.src_rank] = msg.checksum
            self._maybe_done(load)

    def _check_remotes(self, now: float) -> None:
        for remote in list(self._remotes.values()):
            if remote.plan is None and not remote.error \
                    and now - remote.started > self.settings.handshake_timeout_s:
                missing = sorted(set(range(remote.tp)) - set(remote.meta))
                remote.error = (f"no answer from prefill ranks {missing} at {remote.host}:"
                                f"{remote.port}+rank within {self.settings.handshake_timeout_s}"
                                f" s")
                log.error("statebridge connector rank %d: %s", self.tp_rank, remote.error)
                waiting, remote.waiting = remote.waiting, []
                for request_id in waiting:
                    load = self._loads.get(request_id)
                    if load is not None:
                        self._fail(load, remote.error)

    def _check_loads(self, now: float) -> None:
        for load in list(self._loads.values()):
            if any(h.finished() and not h.ok for h in load.handles.values()):
                bad = next(h for h in load.handles.values() if h.finished() and not h.ok)
                self._fail(load, f"receive failed: {bad.error}")
            elif now > load.deadline:
                remote = self._remotes.get(load.engine_id)
                if remote is not None and remote.plan is not None:
                    remote.error = "state did not arrive in time (peer lost or frozen?)"
                    self._remotes.pop(load.engine_id, None)   # greet it anew next time
                    for sock in remote.sockets.values():
                        sock.close(linger=0)
                    self._poller = None
                self._fail(load, f"state did not arrive within "
                                 f"{self.settings.transfer_timeout_s} s")
            else:
                self._maybe_done(load)

    def _maybe_done(self, load: Load) -> None:
        if not load.posted or load.request_id not in self._loads \
                or not all(h.finished() for h in load.handles.values()):
            return
        if self.settings.verify_transfers:
            if set(load.checksums) != set(load.handles):
                return
            for s, runs in load.expected.items():
                got = _crc(self._transport.posting, runs, 1)
                if got != load.checksums[s]:
                    self._fail(load, f"verification failed: bytes from prefill rank {s} have "
                                     f"crc32 {got:#010x}, the prefill rank sent "
                                     f"{load.checksums[s]:#010x}")
                    return
        self._loads.pop(load.request_id)
        self.counters["bytes_received"] += sum(h.nbytes for h in load.handles.values())
        self._succeed(load)

    def _succeed(self, load: Load) -> None:
        self.counters["loads_done"] += 1
        self.counters["load_seconds"] += time.monotonic() - load.started
        log.debug("statebridge connector rank %d: request %s loaded from engine %s: %s",
                  self.tp_rank, load.request_id, load.engine_id,
                  {s: (h.messages, h.nbytes) for s, h in load.handles.items()})
        with self._lock:
            self._finished_recving.add(load.request_id)
            self._reported.set()

    def _fail(self, load: Load, reason: str) -> None:
        for handle in load.handles.values():
            if not handle.finished():
                handle.cancel()
        self._loads.pop(load.request_id, None)
        self.counters["loads_failed"] += 1
        log.error("statebridge connector rank %d: request %s (prefill request %s of engine "
                  "%s) failed to load: %s", self.tp_rank, load.request_id,
                  load.remote_request_id, load.engine_id, reason)
        with self._lock:
            self._failed_recving.add(load.request_id)
            self._reported.set()

    def _fail_all(self, reason: str) -> None:
        for load in list(self._loads.values()):
            self._fail(load, reason)


def _crc(posting, runs: np.ndarray, column: int) -> int:
    """crc32 of the bytes of ``runs`` (column 0: source offsets, 1: destination) in the
    transport's buffer, in run order."""
    value = 0
    for row in runs:
        value = zlib.crc32(_bytes(posting, int(row[column]), int(row[2])), value)
    return value


def _bytes(posting, start: int, n: int) -> memoryview:
    for s0, end, _tensor, mv in posting.segments:
        if s0 <= start and start + n <= end:
            return mv[start - s0:start - s0 + n]
    raise ConfigError(f"bytes [{start}, {start + n}) outside the registered memory")
