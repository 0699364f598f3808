"""The decode node's ``cached_tokens``: a request's last message carries the prompt tokens its
prefill node's prefix cache served, from the request's timing; a last message whose timing has
not come waits for it, at most the peer timeout (then 0, counted), and the prefix-cache token
counters move by each finished request's prompt and cached tokens. The scheduler alone, with a
stand-in coordinator (no processes)."""

from __future__ import annotations

import time

from statebridge.config import ConnectorConfig, NodeConfig
from statebridge.connector.decode import TransferResult
from statebridge.connector.stats import Counters
from statebridge.node import messages as nm
from statebridge.node.requests import _Gen
from statebridge.node.scheduler import DecodeScheduler


class _Coordinator:
    def __init__(self) -> None:
        self.freed: list[str] = []

    def free(self, request_id: str) -> bool:
        self.freed.append(request_id)
        return True


class _Client:
    def __init__(self) -> None:
        self.got: list[nm.GenerateTokens] = []

    def deliver(self, message) -> None:
        self.got.append(message)


def scheduler(peer_timeout: float = 3.0) -> tuple[DecodeScheduler, _Coordinator, Counters]:
    co, counters = _Coordinator(), Counters()
    config = ConnectorConfig(heartbeat_interval=0.01, peer_timeout=peer_timeout)
    s = DecodeScheduler(co, NodeConfig(), config, kv=False, counters=counters)
    return s, co, counters


def running(s: DecodeScheduler, request_id: str, prompt_len: int, *,
            local: bool = False) -> _Gen:
    """A request whose state landed (its transfer started: cached_tokens unknown unless
    ``local``)."""
    gen = _Gen(request_id, _Client(), tuple(range(prompt_len)), 4, 0.0, 1.0, 0)
    gen.local = local
    gen.cached_tokens = 0 if local else None
    gen.transfer = TransferResult(request_id=request_id, generation=0, page=0,
                                  prefill_node="p", seconds=0.01, nbytes=100)
    s.gens[request_id] = gen
    s.running.append(gen)
    return gen


def test_the_timing_before_the_last_token_goes_with_it():
    s, co, counters = scheduler()
    gen = running(s, "a", 600)
    s.on_timing("a", 512)
    s.finish(gen, "", "", last=(7,))
    (last,) = gen.client.got
    assert (last.done, last.tokens, last.cached_tokens) == (True, (7,), 512)
    assert co.freed == ["a"] and not s.held
    assert (counters.get("prefix_cache_queries"), counters.get("prefix_cache_hits")) == (600, 512)


def test_a_last_message_waits_for_its_timing():
    s, co, counters = scheduler()
    gen = running(s, "a", 300)
    gen.reply((1,), False)                             # a token before the last: not held
    s.finish(gen, "", "", last=(2,))
    assert [m.tokens for m in gen.client.got] == [(1,)] and "a" in s.held
    assert co.freed == ["a"]                           # its page is free meanwhile
    s.on_timing("b", 99)                               # someone else's: nothing
    assert "a" in s.held
    s.on_timing("a", 256)
    assert [(m.tokens, m.done, m.cached_tokens) for m in gen.client.got] == \
        [((1,), False, 0), ((2,), True, 256)]
    assert not s.held and counters.get("prefix_cache_hits") == 256
    s.on_timing("a", 256)                              # a second one: ignored
    assert len(gen.client.got) == 2 and counters.get("prefix_cache_hits") == 256


def test_a_timing_that_does_not_come_within_the_peer_timeout_reports_zero():
    s, _, counters = scheduler(peer_timeout=0.05)
    gen = running(s, "a", 40)
    s.finish(gen, "", "", last=(2,))
    s.check_step()
    assert not gen.client.got                          # not yet
    time.sleep(0.06)
    s.check_step()
    (last,) = gen.client.got
    assert (last.done, last.cached_tokens) == (True, 0)
    assert counters.get("cached_tokens_late") == 1
    assert (counters.get("prefix_cache_queries"), counters.get("prefix_cache_hits")) == (40, 0)


def test_local_prefills_and_failures_are_not_held():
    s, _, counters = scheduler()
    local = running(s, "local", 10, local=True)
    s.finish(local, "", "", last=(3,))
    assert local.client.got[-1].cached_tokens == 0 and local.client.got[-1].done
    failed = running(s, "failed", 10)
    s.finish(failed, "timeout", "too slow")
    assert failed.client.got[-1].kind == "timeout" and not s.held
    # Only finished requests count; a failed one asked nothing of the cache that served.
    assert counters.get("prefix_cache_queries") == 10


def test_closing_sends_what_is_held():
    s, _, _ = scheduler()
    gen = running(s, "a", 10)
    s.finish(gen, "", "", last=(2,))
    s.close()
    assert gen.client.got[-1].done and gen.client.got[-1].kind == "" and not s.held
