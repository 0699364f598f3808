"""The decode node: the front door for clients, continuous batching of decode steps.

::

    client --GenerateRequest--> front door (ROUTER)
        DecodeCoordinator.start(prompt[:-1])  -> prefill node computes, state lands in a page
        running batch += (page, last token = prompt[-1])
        every step: RankStep(batch) -> all decode ranks; rank 0 samples -> RankStepResult
    client <--GenerateTokens-- one message per step per request; the last has done=True
    client --StatusQuery-->  <--NodeStatus-- ready?  (ranks up, a prefill node connected)
    client --AbortRequest--> the request is dropped wherever it is, its page and blocks freed
    client --StatsQuery-->   <--NodeStats-- pages / blocks used and free, peers (for /metrics)

Two front doors, one set of methods: :meth:`DecodeNode.serve` handles every front-door
message (GenerateRequest, AbortRequest, StatusQuery, StatsQuery, Heartbeat) on the loop thread
and answers through the sender's ``deliver``. The zmq door (the ROUTER that
:class:`~statebridge.node.client.Client` dials) is a thin adapter: decode, :meth:`serve` with
the sender's identity, encode the answers. The OpenAI-compatible HTTP API
(:mod:`statebridge.node.http`, with ``http``) runs in a thread of its own in this process and
hands its messages to :meth:`DecodeNode.post` (the loop's thread-safe inbox): no socket between
the two, and the same validation and behaviour as a zmq client gets.

One event loop per process: the front door, the scheduler and the coordinator (prefill
connections, rank sockets, the request ledger) all run on the coordinator's loop thread, so a
zmq client's request and its tokens cross no thread boundary (``EventLoop.handoffs`` stays 0
while serving them); an HTTP request crosses once in (and once more to abort it), and its
tokens once per loop iteration back to the HTTP thread.

When a transfer fails the request follows the node's policy: ``fail`` (a typed error to the
client) or ``recompute`` (the decode ranks prefill the prompt locally under a new generation of
the same request id, then decode as usual). Requests that find no free page or KV blocks wait
(back-pressure) instead of failing.

With attention KV every request owns a block table; each step writes the token's K and V at
its position, so before a step a request whose table is full gets one more block
(``coordinator.grow``). When none is free the request follows the policy again: ``fail``
(``cache_full`` to the client, its page and blocks freed) or ``recompute`` (preempted: its page
and blocks are freed, it waits at the front of the queue and is resumed by a local prefill of
its prompt and the tokens generated so far). Either way no other request is touched. A node
started before its prefill nodes keeps dialling them (with backoff) and answers ``not_ready``
meanwhile.

Ready means it can serve: its decode rank group is whole and at least one prefill node is
connected (with the ``recompute`` policy a whole group is enough); :meth:`DecodeNode.status`
names the missing part otherwise (the HTTP door's ``/health`` says it). A decode rank lost
fails every request in flight (``peer_lost``); the group then restarts or fails for good
(:mod:`statebridge.connector.group`): :attr:`DecodeNode.fatal` says why, and the node's
command exits non-zero.

The scheduling -- a request's transfer, waiting for a page, decode steps, KV growth and
preemption -- is :class:`~statebridge.node.scheduler.DecodeScheduler`, the node's
:attr:`~DecodeNode.scheduler`; this module holds the front doors, start-up, status and
lifecycle.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from statebridge.config import ConnectorConfig, NodeConfig
from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.group import Launcher, spawn_launcher
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.stats import Counters
from statebridge.errors import FailureKind, StatebridgeError, TransferTimeoutError
from statebridge.hf_config import ModelConfig
from statebridge.models.distributed import Rendezvous
from statebridge.models.sampling import MAX_LOGPROBS, sampling_problem
from statebridge.node import capacity
from statebridge.node import messages as nm
from statebridge.node.checks import check_checkpoint
from statebridge.node.metrics import NodeHistograms
from statebridge.node.requests import FrontDoorClient, _Gen
from statebridge.node.scheduler import DecodeScheduler
from statebridge.security import CurveKeys

log = logging.getLogger(__name__)

__all__ = ["DecodeNode", "FrontDoorClient", "POLICIES"]

POLICIES = NodeConfig.POLICIES

#: How often requests waiting for a page retry (a failed request's page frees only once every
#: decode rank confirmed, which the node does not otherwise hear about).
_RETRY_WAITING_S = 0.05


def _front_door(setting: str, http, config: ConnectorConfig) -> tuple[bool, str]:
    """Whether the zmq front door listens (NodeConfig.front_door), and why not: ``auto``
    keeps it closed when the HTTP API requires an API key and the control plane has no CURVE
    keys, since anyone reaching the door could generate without the key."""
    if setting == "off":
        return False, "--front-door off"
    keyed_http = http is not None and http.port is not None and bool(http.api_key)
    if setting == "on":
        if keyed_http and not config.keys_dir:
            log.warning("the zmq front door on %s accepts generation requests WITHOUT "
                        "authentication while the HTTP API requires an API key (--front-door "
                        "on, no --keys)", config.bind_host)
        return True, ""
    if keyed_http and not config.keys_dir:
        return False, ("the HTTP API requires an API key and the control plane has no CURVE "
                       "keys; --keys DIR or --front-door on opens it")
    return True, ""


@dataclass(frozen=True)
class _RouterClient:
    """A client of the zmq door: its ROUTER identity."""

    router: object
    identity: bytes

    def deliver(self, message: m.Message) -> None:
        c.send_router(self.router, self.identity, message)


class DecodeNode:
    """Decode coordinator + front door + scheduler, in the decode node's main process."""

    def __init__(self, model_dir: str, tp_size: int, prefill: list[str], *, port: int = 0,
                 layout: str | None = None, num_pages: int | None = None,
                 max_batch: int | None = None, policy: str | None = None,
                 max_prompt_len: int | None = None, max_new_tokens: int | None = None,
                 node: NodeConfig | None = None, config: ConnectorConfig | None = None,
                 launcher: Launcher | None = spawn_launcher, dist_init: str = "",
                 rank_model: str | None = None, wait_prefill: float | None = None,
                 kv_layout: str | None = None, block_size: int | None = None,
                 kv_blocks: int | None = None, http=None,
                 prefix_routing: bool = True) -> None:
        """Validates the checkpoint here (before any rank starts), starts the decode ranks and
        waits for them (:class:`~statebridge.errors.StartupError` at once if one fails to
        start, with its error), then dials ``prefill`` in the background: the node serves as
        soon as one answers, and answers ``not_ready`` until then. The constructor waits up
        to ``wait_prefill`` seconds (default ``handshake_timeout``) for every prefill node to
        answer, and returns either way (see :meth:`status`). ``http``: an
        :class:`~statebridge.config.HttpConfig` whose ``port`` is set starts the HTTP front
        door once the node listens (:attr:`http`, closed with the node). With prefix caching
        on (``node.prefix_cache``, the default) the node asks its prefill nodes for cache hits
        and, with ``prefix_routing``, sends each request to the one holding the longest
        prefix of its prompt (False: round robin, the benchmark's comparison)."""
        self.node_config = (node or NodeConfig()).replace(
            layout=layout, num_pages=num_pages, max_batch=max_batch, policy=policy,
            max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
            rank_model=rank_model, kv_layout=kv_layout, block_size=block_size,
            kv_blocks=kv_blocks)
        nc = self.node_config
        self.config = config or ConnectorConfig()
        self.started_at = time.monotonic()
        self._up = False                  # the constructor finished (loop thread's view)
        #: Seconds from construction to serving (0.0 until it first serves).
        self.ready_after = 0.0
        spec = check_checkpoint(model_dir, tp_size, nc.rank_model)
        #: Prompt token ids must be below it (the model's embedding rows), at every door.
        self.vocab_size = ModelConfig.load(model_dir).vocab_size
        self.coordinator = DecodeCoordinator(
            spec, tp_size, nc.layout, nc.num_pages, config=self.config, launcher=launcher,
            model=nc.rank_model, model_dir=model_dir,
            dist_init=functools.partial(Rendezvous.for_group, tp_size, dist_init or "",
                                        host=self.config.bind_host),
            kv_layout=nc.kv_layout, block_size=nc.block_size,
            num_blocks=nc.num_blocks(spec, tp_size), device=nc.device,
            prefix_cache=nc.prefix_cache, prefix_routing=prefix_routing)
        self.kv = spec.kv is not None
        #: The longest request (prompt + new tokens) served: the limits', capped at the tokens
        #: one decode rank's KV pool holds (a longer one could never get its blocks).
        self.max_model_len = capacity.max_model_len(nc.max_model_len,
                                                    self.coordinator.group.kv_tokens)
        if self.max_model_len < nc.max_model_len:
            log.warning("%s: the KV pool holds %d tokens per rank, fewer than max_prompt_len + "
                        "max_new_tokens = %d: requests are limited to %d tokens "
                        "(max_model_len); more with --kv-tokens or --kv-gib",
                        self.coordinator.node_id, self.coordinator.group.kv_tokens,
                        nc.max_model_len, self.max_model_len)
        self.loop = self.coordinator.group.loop
        self.counters = Counters()
        #: Each request from its transfer to its last token (on the loop thread).
        self.scheduler = DecodeScheduler(self.coordinator, nc, self.config, kv=self.kv,
                                         counters=self.counters)
        self.http = None
        self.router, self.port = None, 0
        door, why = _front_door(nc.front_door, http, self.config)
        try:
            if door:
                self.router, self.port = c.bind_router(
                    self.loop.context, self.config.bind_host, port, counters=self.counters,
                    keys=CurveKeys.from_config(self.config, listen=True),
                    name="decode front door", max_message_bytes=self.config.max_message_bytes)
            else:
                log.warning("zmq front door off (%s): clients use the HTTP API", why)
        except BaseException:
            self.coordinator.close()
            raise
        #: Where each request's time went before decoding (the node's /metrics histograms).
        self.histograms = NodeHistograms()
        self.coordinator.on_timing(self._on_timing)
        self.coordinator.group.on_rank_message(nm.RankStepResult, self.scheduler.on_step_result)
        self.coordinator.group.on_rank_lost(self.scheduler.on_rank_lost)
        self.coordinator.on_prefill_connected(self._on_prefill_connected)

        def attach() -> None:
            if self.router is not None:
                self.loop.add_reader(self.router, self._on_client)
            self.loop.call_every(_RETRY_WAITING_S, self.scheduler.start_waiting)
            self.loop.call_every(self.config.heartbeat_interval, self.scheduler.check_step)
        try:
            self.loop.call(attach)
            self.coordinator.wait_ready()
            for address in prefill:
                self.coordinator.connect(address, wait=False)
            self._wait_prefill(self.config.handshake_timeout if wait_prefill is None
                               else wait_prefill)
            if http is not None and http.port is not None:
                from statebridge.node.http import HttpServer

                self.http = HttpServer.for_node(self, model_dir, http)
        except BaseException:
            self.close()
            raise
        ready, why = self.loop.call(self._finish_start)
        if ready:
            log.info("decode node ready on %s (TP %d, %s), prefill %s: ready in %.1f s",
                     self.address, tp_size, nc.layout, ", ".join(prefill), self.ready_after)
        else:
            log.warning("decode node up on %s (TP %d, %s) but not serving yet: %s",
                        self.address, tp_size, nc.layout, why)

    def _finish_start(self) -> tuple[bool, str]:
        """Loop thread, once the constructor is done: from now on a prefill handshake that
        makes the node serve says "ready in"; the status now (noted when ready)."""
        self._up = True
        ready, why = self._status()
        if ready:
            self._served()
        return ready, why

    def _served(self) -> bool:
        """Loop thread: note the first time the node serves; True that time."""
        if self.ready_after or self.scheduler.closed:
            return False
        self.ready_after = time.monotonic() - self.started_at
        return True

    def _on_prefill_connected(self, info: m.GroupInfo) -> None:
        """Loop thread, after a handshake: log what the pair holds at once, naming the
        binding pool; the first one that makes the node serve logs "ready in N s"."""
        co, nc = self.coordinator, self.node_config
        bounds = capacity.pair_bounds(
            decode_id=co.node_id, decode_tp=co.group.tp_size, decode_pages=co.group.num_pages,
            decode_blocks=co.group.num_blocks, prefill_id=info.node_id, prefill_tp=info.tp_size,
            prefill_pages=info.num_pages, prefill_blocks=info.num_blocks,
            block_size=co.group.block_size, max_prompt_len=nc.max_prompt_len,
            max_model_len=self.max_model_len)
        warn, line = capacity.capacity_message(bounds)
        log.log(logging.WARNING if warn else logging.INFO, "%s + prefill %s: %s", co.node_id,
                info.node_id, line)
        if self._up and self._status()[0] and self._served():
            log.info("decode node %s ready in %.1f s (prefill %s connected)", co.node_id,
                     self.ready_after, info.node_id)

    def _on_timing(self, timing) -> None:
        """Loop thread: a request's RequestTiming -- the histograms, and the prompt tokens its
        prefill node's cache served (the request's ``cached_tokens``)."""
        self.histograms.observe(timing)
        self.scheduler.on_timing(timing.request_id, timing.cached_tokens)

    def _wait_prefill(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.loop.call(self.coordinator.dialled):
                return
            time.sleep(0.02)

    @property
    def address(self) -> str:
        return f"{self.config.bind_host}:{self.port}"

    @property
    def policy(self) -> str:
        return self.node_config.policy

    def status(self) -> tuple[bool, str]:
        """(ready, why not): ready once the decode rank group is whole and a prefill node is
        connected (``recompute``: once the group is whole)."""
        return self.loop.call(self._status)

    def _status(self) -> tuple[bool, str]:
        if self.scheduler.closed:
            return False, "decode node is closing"
        ready, why = self.coordinator.status()
        if not ready and self.policy == "recompute" and self.coordinator.whole()[0]:
            return True, ""                    # no prefill node: it prefills locally
        return ready, why

    @property
    def fatal(self) -> str:
        """Why the node cannot serve any more ("" while it serves or heals): its rank group
        failed for good (see :mod:`statebridge.connector.group`). Its command exits non-zero
        on it; a library user closes the node and starts a new one."""
        return self.coordinator.fatal

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the node serves (a prefill node connected); TransferTimeoutError with
        the reason otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            ready, why = self.status()
            if ready:
                return
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(f"decode node {self.address} not ready within "
                                           f"{timeout} s: {why}")
            time.sleep(0.05)

    def add_prefill(self, address: str) -> str | None:
        """Connect one more prefill node (e.g. a replacement for a dead one); returns its id."""
        return self.coordinator.connect(address)

    # -- the front door ----------------------------------------------------------------------
    def post(self, client: FrontDoorClient, message: m.Message) -> None:
        """Hand a front-door message to the node from any thread (the loop's inbox; the
        in-process doors' way in): :meth:`serve` runs it on the loop thread soon.
        :class:`~statebridge.errors.ClosedError` once the node's loop is closed."""
        self.loop.call_soon(self.serve, client, message)

    def serve(self, client: FrontDoorClient, msg: m.Message) -> None:
        """Loop thread: one front-door message from ``client``, whichever door it came
        through; answers go to ``client.deliver``."""
        if isinstance(msg, nm.GenerateRequest):
            self._on_generate(client, msg)
        elif isinstance(msg, nm.AbortRequest):
            self._on_abort(client, msg)
        elif isinstance(msg, nm.StatsQuery):
            client.deliver(self._node_stats())
        elif isinstance(msg, nm.StatusQuery):
            client.deliver(self._node_status())
        elif isinstance(msg, m.Heartbeat):
            client.deliver(m.Heartbeat(node_id=self.coordinator.node_id, seq=msg.seq))
        else:
            self.counters.add("unexpected_messages")
            client.deliver(m.Error(kind="ProtocolError",
                                   message=f"unexpected {type(msg).__name__}"))

    def _on_client(self) -> None:
        """The zmq door: decode what its ROUTER got, serve it with the sender's identity."""
        while True:
            got = c.recv_router(self.router, self.config.max_message_bytes)
            if got is None:
                return
            identity, msg = got
            if isinstance(msg, StatebridgeError):
                self.counters.add("protocol_errors")
                c.send_router(self.router, identity,
                              m.Error(kind=type(msg).__name__, message=str(msg)))
            else:
                self.serve(_RouterClient(self.router, identity), msg)

    def _node_status(self) -> nm.NodeStatus:
        ready, why = self._status()
        return nm.NodeStatus(node_id=self.coordinator.node_id, ready=ready, reason=why,
                             prefill_nodes=tuple(self.coordinator.ready_prefills()))

    def _node_stats(self) -> nm.NodeStats:
        ready, why = self._status()
        g = self.coordinator.gauges()
        return nm.NodeStats(
            node_id=self.coordinator.node_id, ready=ready, reason=why,
            prefill_nodes=g.prefill_nodes, pages_used=g.pages_used, pages_free=g.pages_free,
            blocks_used=g.blocks_used, blocks_free=g.blocks_free,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            refused_peers=g.refused_peers, aborted=int(self.counters.get("finished_aborted")),
            refused_clients=int(self.counters.get("auth_refused")),
            transfers_verified=g.transfers_verified, transfer_mismatches=g.transfer_mismatches,
            **capacity.memory_fields(self.coordinator.group), **self.histograms.fields(),
            **self._prefix_fields())

    def _prefix_fields(self) -> dict:
        """The prefix-cache fields of NodeStats: the node's token counters, and what each
        prefill node announced it holds."""
        count = self.counters.get
        nodes = {node: info["prefix"] for node, info in
                 self.coordinator.stats().get("prefill_nodes", {}).items()
                 if info.get("prefix")}
        return {"prefix_cache_queries": int(count("prefix_cache_queries")),
                "prefix_cache_hits": int(count("prefix_cache_hits")),
                "cached_tokens_late": int(count("cached_tokens_late")),
                "prefix_nodes": tuple(nodes),
                "prefix_pages_cached": tuple(int(p["pages_cached"]) for p in nodes.values()),
                "prefix_blocks_cached": tuple(int(p["blocks_cached"]) for p in nodes.values()),
                "prefix_evictions": tuple(int(p["evictions"]) for p in nodes.values())}

    def _on_abort(self, client: FrontDoorClient, msg: nm.AbortRequest) -> None:
        """Drop a client's request wherever it is (:meth:`DecodeScheduler.abort`); only the
        client that sent it may."""
        gen = self.scheduler.gens.get(msg.request_id)
        if gen is None or gen.client != client:
            self.counters.add("abort_unknown")
            return
        why = f"aborted by the client: {msg.reason}" if msg.reason else "aborted by the client"
        self.scheduler.abort(gen, why)

    def _problem(self, msg: nm.GenerateRequest) -> str | None:
        """Why ``msg`` cannot be served, or None: the one check of a request, whichever door
        it came through, of every value as the ranks will use it (token ids against the
        model's vocabulary, sampling values in float32: :func:`sampling_problem`), so a
        request that passes can fail no batch. Cheap: a prompt over the limit is refused from
        its length, the ids of one under it are scanned in C."""
        nc = self.node_config
        if not msg.request_id:
            return "request_id is empty"
        if not msg.prompt:
            return "prompt is empty"
        if len(msg.prompt) > nc.max_prompt_len:
            return f"prompt of {len(msg.prompt)} tokens exceeds the limit of {nc.max_prompt_len}"
        low, high = min(msg.prompt), max(msg.prompt)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            return (f"prompt token id {bad} is outside the model's vocabulary of "
                    f"{self.vocab_size}")
        if not 1 <= msg.max_new_tokens <= nc.max_new_tokens:
            return f"max_new_tokens {msg.max_new_tokens} not in [1, {nc.max_new_tokens}]"
        problem = sampling_problem(msg.temperature, msg.top_p, msg.seed)
        if problem is not None:
            return problem[1]
        if not -1 <= msg.logprobs <= MAX_LOGPROBS:
            return f"logprobs {msg.logprobs} not in [-1 (none), {MAX_LOGPROBS}]"
        if msg.request_id in self.scheduler.gens:
            return f"request id {msg.request_id!r} is already in flight"
        if self.kv:
            co = self.coordinator
            need = co.blocks_for(len(msg.prompt) + msg.max_new_tokens)
            if need > co.group.num_blocks:
                return (f"prompt of {len(msg.prompt)} + {msg.max_new_tokens} new tokens needs "
                        f"{need} KV blocks of {co.group.block_size} tokens; the pool has "
                        f"{co.group.num_blocks}")
        return None

    def _on_generate(self, client: FrontDoorClient, msg: nm.GenerateRequest) -> None:
        gen = _Gen(msg.request_id, client, msg.prompt, msg.max_new_tokens, msg.temperature,
                   msg.top_p, msg.seed, msg.logprobs)
        problem = self._problem(msg)
        if problem is not None:
            self.counters.add("rejected")
            self.counters.add(f"rejected_{FailureKind.INVALID_REQUEST}")
            gen.reply((), True, FailureKind.INVALID_REQUEST, problem)
            return
        ready, why = self._status()
        if not ready and self.policy != "recompute":
            self.counters.add("rejected")
            self.counters.add(f"rejected_{FailureKind.NOT_READY}")
            gen.reply((), True, FailureKind.NOT_READY, f"decode node is not ready: {why}")
            return
        self.scheduler.submit(gen, local=not ready)

    # -- lifecycle ----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.loop.call(lambda: {"running": len(self.scheduler.running),
                                          "waiting": len(self.scheduler.waiting),
                                          "handoffs": self.loop.handoffs,
                                          **self.counters.snapshot()}),
                "coordinator": self.coordinator.stats()}

    def close(self) -> None:
        """Fail what is in flight (clients hear ``aborted``), stop the ranks (idempotent)."""
        if self.scheduler.closed:
            return
        if self.http is not None:
            self.http.close()              # first: its requests end while the node still runs
            self.http = None
        try:
            self.loop.call(self.scheduler.close)
        except StatebridgeError:
            pass
        self.coordinator.close()
        if getattr(self, "router", None) is not None:
            self.router.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
