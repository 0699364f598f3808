"""The decode node: the front door for clients, continuous batching of decode steps.

::

    client --GenerateRequest--> front door (ROUTER, this process)
        DecodeCoordinator.submit(prompt[:-1])  -> prefill node computes, state lands in a page
        running batch += (page, last token = prompt[-1])
        every step: RankStep(batch) -> all decode ranks; rank 0 samples -> RankStepResult
    client <--GenerateTokens-- one message per step per request; the last has done=True

When a transfer fails the request follows the node's policy: ``fail`` (a typed error to the
client) or ``recompute`` (the decode ranks prefill the prompt locally, then decode as usual).
Requests that find no free page wait (back-pressure) instead of failing.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field

from statebridge.config import ConnectorConfig
from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector._group import Launcher, spawn_launcher
from statebridge.connector.decode import DecodeCoordinator, TransferResult
from statebridge.errors import CacheFullError, ConfigError, StatebridgeError, TransferError
from statebridge.net import free_port
from statebridge.security import CurveKeys
from statebridge.state.spec import StateSpec

log = logging.getLogger(__name__)

__all__ = ["DecodeNode", "POLICIES"]

POLICIES = ("fail", "recompute")


@dataclass
class _Gen:
    """One client request inside the decode node."""

    request_id: str
    client: bytes
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    arrived: float = field(default_factory=time.perf_counter)
    page: int = -1
    next_token: int = 0
    generated: list[int] = field(default_factory=list)
    ttft: float = 0.0
    transfer: TransferResult | None = None
    recomputed: bool = False


class DecodeNode:
    """Decode coordinator + front door + scheduler, in the decode node's main process."""

    def __init__(self, model_dir: str, tp_size: int, prefill: list[str], *, port: int = 0,
                 layout: str = "DLS", num_pages: int = 64, max_batch: int = 32,
                 policy: str = "fail", max_prompt_len: int = 8192, max_new_tokens: int = 4096,
                 config: ConnectorConfig | None = None, launcher: Launcher | None = spawn_launcher,
                 dist_init: str = "",
                 rank_model: str = "statebridge.node.rank_model:ModelRankModel") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"unknown failure policy {policy!r}; expected one of {POLICIES}")
        self.config = config or ConnectorConfig()
        self.policy = policy
        self.max_batch = max_batch
        self.max_prompt_len = max_prompt_len
        self.max_new_tokens = max_new_tokens
        spec = StateSpec.from_pretrained(model_dir)
        self.coordinator = DecodeCoordinator(
            spec, tp_size, layout, num_pages, config=self.config, launcher=launcher,
            model=rank_model, model_dir=model_dir,
            dist_init=dist_init or f"tcp://127.0.0.1:{free_port()}")
        self.coordinator.rank_message_hook = self._on_rank_message
        self.loop = c.EventLoop("decode-front")
        self.counters = c.Counters()
        self.router, self.port = c.bind_router(
            self.loop.context, self.config.bind_host, port, counters=self.counters,
            keys=CurveKeys.from_config(self.config, listen=True), name="decode front door",
            max_message_bytes=self.config.max_message_bytes)
        self.loop.add_reader(self.router, self._on_client)
        self.gens: dict[str, _Gen] = {}
        self.waiting: collections.deque[_Gen] = collections.deque()   # no free page yet
        self.running: list[_Gen] = []
        self.step_in_flight: tuple[int, list[_Gen]] | None = None
        self._steps = itertools.count(1)
        self.ready = False
        self.loop.start()
        self.coordinator.wait_ready()
        for address in prefill:
            self.coordinator.connect(address)
        self.ready = True
        log.info("decode node ready on %s:%d (TP %d, %s, prefill %s)", self.config.bind_host,
                 self.port, tp_size, layout, ", ".join(prefill))

    @property
    def address(self) -> str:
        return f"{self.config.bind_host}:{self.port}"

    def add_prefill(self, address: str) -> str:
        """Connect one more prefill node (e.g. a replacement for a dead one); returns its id."""
        return self.coordinator.connect(address)

    # -- clients -----------------------------------------------------------------------------
    def _on_client(self) -> None:
        while True:
            got = c.recv_router(self.router, self.config.max_message_bytes)
            if got is None:
                return
            identity, msg = got
            if isinstance(msg, StatebridgeError):
                self.counters.add("protocol_errors")
                c.send_router(self.router, identity,
                              m.Error(kind=type(msg).__name__, message=str(msg)))
            elif isinstance(msg, m.Heartbeat):
                c.send_router(self.router, identity, m.Heartbeat(
                    node_id=self.coordinator.node_id, seq=int(self.ready)))
            elif isinstance(msg, m.GenerateRequest):
                self._on_generate(identity, msg)
            else:
                self.counters.add("unexpected_messages")
                c.send_router(self.router, identity, m.Error(
                    kind="ProtocolError", message=f"unexpected {type(msg).__name__}"))

    def _reply(self, gen: _Gen, tokens: tuple[int, ...], done: bool, kind: str = "",
               message: str = "") -> None:
        t = gen.transfer
        c.send_router(self.router, gen.client, m.GenerateTokens(
            request_id=gen.request_id, tokens=tokens, done=done, kind=kind, message=message,
            ttft=gen.ttft, transfer_seconds=t.seconds if t else 0.0,
            transfer_bytes=t.nbytes if t else 0, recomputed=gen.recomputed))

    def _on_generate(self, identity: bytes, msg: m.GenerateRequest) -> None:
        problem = None
        if not msg.prompt:
            problem = "prompt is empty"
        elif len(msg.prompt) > self.max_prompt_len:
            problem = f"prompt of {len(msg.prompt)} tokens exceeds the limit of {self.max_prompt_len}"
        elif not 1 <= msg.max_new_tokens <= self.max_new_tokens:
            problem = f"max_new_tokens {msg.max_new_tokens} not in [1, {self.max_new_tokens}]"
        elif msg.temperature < 0 or not 0 < msg.top_p <= 1:
            problem = f"temperature {msg.temperature} / top_p {msg.top_p} out of range"
        elif msg.request_id in self.gens:
            problem = f"request id {msg.request_id!r} is already in flight"
        elif not self.ready or not self.coordinator.healthy:
            problem = "decode node is not serving (a decode rank was lost)"
        gen = _Gen(msg.request_id, identity, msg.prompt, msg.max_new_tokens, msg.temperature,
                   msg.top_p, msg.seed)
        if problem is not None:
            self.counters.add("rejected")
            self._reply(gen, (), True, "invalid_request", problem)
            return
        self.gens[gen.request_id] = gen
        self.counters.add("requests")
        self._start_transfer(gen)

    # -- the prompt's state ------------------------------------------------------------------
    def _start_transfer(self, gen: _Gen, local: bool = False) -> None:
        submit = self.coordinator.submit_local if local else self.coordinator.submit
        # A recompute is a new attempt under its own id: the failed transfer's page is freed
        # only once every decode rank confirmed nothing can still land in it.
        attempt = f"{gen.request_id}#recompute" if local else gen.request_id
        try:
            future = submit(attempt, gen.prompt[:-1])
        except CacheFullError:
            self.waiting.append(gen)              # back-pressure: retried when a page frees
            gen.recomputed = local
            return
        except TransferError as e:
            self._transfer_failed(gen, e, local)
            return
        gen.recomputed = local
        future.add_done_callback(lambda f: self.loop.call_soon(self._transfer_done, gen, f, local))

    def _transfer_done(self, gen: _Gen, future, local: bool) -> None:
        error = future.exception()
        if error is not None:
            self._transfer_failed(gen, error, local)
            return
        result: TransferResult = future.result()
        gen.transfer = result
        gen.page = result.page
        gen.next_token = gen.prompt[-1]
        self.running.append(gen)
        self._maybe_step()

    def _transfer_failed(self, gen: _Gen, error: BaseException, local: bool) -> None:
        kind = error.kind if isinstance(error, TransferError) else "transfer_error"
        self.counters.add(f"transfer_failed_{kind}")
        if self.policy == "recompute" and not local:
            log.warning("%s: transfer failed (%s), recomputing locally", gen.request_id, error)
            self._start_transfer(gen, local=True)
            return
        self._finish(gen, kind, str(error))

    # -- decode steps -------------------------------------------------------------------------
    def _maybe_step(self) -> None:
        if self.step_in_flight is not None or not self.running:
            return
        batch = self.running[:self.max_batch]
        step = next(self._steps)
        self.step_in_flight = (step, batch)
        self.coordinator.send_to_ranks(m.RankStep(
            step=step, request_ids=tuple(g.request_id for g in batch),
            pages=tuple(g.page for g in batch), tokens=tuple(g.next_token for g in batch),
            positions=tuple(len(g.prompt) + len(g.generated) - 1 for g in batch),
            temperatures=tuple(float(g.temperature) for g in batch),
            top_ps=tuple(float(g.top_p) for g in batch),
            seeds=tuple(int(g.seed) for g in batch)))

    def _on_rank_message(self, rank: int, msg: m.Message | None) -> None:
        # Called on the coordinator's loop thread: hand over to the front-door loop.
        self.loop.call_soon(self._on_rank_event, rank, msg)

    def _on_rank_event(self, rank: int, msg: m.Message | None) -> None:
        if msg is None:                                   # a decode rank died
            for gen in list(self.running):
                self._finish(gen, "peer_lost", f"decode rank {rank} died", release=False)
            self.step_in_flight = None
            return
        if not isinstance(msg, m.RankStepResult) or self.step_in_flight is None:
            return
        step, batch = self.step_in_flight
        if msg.step != step:
            self.counters.add("stale_step_results")
            return
        self.step_in_flight = None
        if msg.kind:
            for gen in batch:
                self._finish(gen, msg.kind, f"decode step failed: {msg.message}")
            self._maybe_step()
            return
        now = time.perf_counter()
        # Requests that finish are taken out first; the rest rotate to the back so a batch
        # larger than max_batch is served round robin.
        for gen, token in zip(batch, msg.tokens):
            if not gen.generated:
                gen.ttft = now - gen.arrived
            gen.generated.append(token)
            gen.next_token = token
            if len(gen.generated) >= gen.max_new_tokens:
                self._finish(gen, "", "", last=(token,))
            else:
                self._reply(gen, (token,), False)
        served = [g for g in batch if g in self.running]
        self.running = [g for g in self.running if g not in served] + served
        self._maybe_step()

    def _finish(self, gen: _Gen, kind: str, message: str, *, last: tuple[int, ...] = (),
                release: bool = True) -> None:
        if gen in self.running:
            self.running.remove(gen)
        self.gens.pop(gen.request_id, None)
        if gen.transfer is not None and release:
            try:
                self.coordinator.release(gen.transfer)
            except StatebridgeError as e:
                log.warning("%s: release failed: %s", gen.request_id, e)
        self.counters.add("finished_ok" if not kind else f"finished_{kind}")
        self._reply(gen, last, True, kind, message)
        while self.waiting and self.coordinator.pool.num_free:
            waiting = self.waiting.popleft()
            self._start_transfer(waiting, local=waiting.recomputed)

    # -- lifecycle ----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting),
                **self.counters.snapshot(), "coordinator": self.coordinator.stats()}

    def close(self) -> None:
        try:
            self.loop.call(self._fail_all)
        except StatebridgeError:
            pass
        self.loop.stop()
        self.router.close(0)
        self.coordinator.close()

    def _fail_all(self) -> None:
        for gen in list(self.gens.values()):
            self._finish(gen, "aborted", "decode node shutting down", release=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

