"""The decode coordinator's prefix routing (issue 41): which prefill node a request goes to when
several serve it -- the one where the longest part of its prompt is cached, balanced by the
prefill tokens queued there.

:class:`PrefixRouter` is a part the decode coordinator *has* (``coordinator.router``). Per
prefill node that keeps a prefix cache (its ``GroupInfo.prefix_*``) it holds the checkpoint
keys that node announced (:class:`~statebridge.connector.messages.PrefixAnnounce`: a ``reset``
after the handshake, then the changes with its heartbeats) with their token counts, and a
:class:`~statebridge.state.prefix.PrefixHasher` made like the node's, so a prompt is hashed as
that node does: the longest hit is the largest announced count ``n <= len - 1`` whose key
``key_at(n)`` of the prompt is held (an announcement has no anchors, so the counts are tried
from the largest down: one small hash each). A node's index goes when its link
goes (lost, restarted, re-dialed: a new handshake starts from a new reset), so what it holds
cannot be wrong for longer than a heartbeat; a stale entry costs one miss there, never a wrong
token (the prefill node looks the prompt up in its own cache).

:meth:`PrefixRouter.pick`: cost = prefill tokens queued on the node + prompt tokens - tokens
it holds; the lowest wins, ties round robin. With no cache anywhere (or ``routing`` off, the
A/B switch), exactly the round robin of before.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from statebridge.connector import messages as m
from statebridge.connector.ledger import Ledger, Phase, RequestKey
from statebridge.errors import ConfigError
from statebridge.state.prefix import HashedPrompt, PrefixHasher

if TYPE_CHECKING:
    from statebridge.connector.prefill_links import _Prefill

__all__ = ["PrefixRouter", "NodePrefix"]


@dataclass(eq=False)
class NodePrefix:
    """What one prefill node holds, as its announcements say: key -> tokens, and how many
    keys of each token count."""

    hasher: PrefixHasher
    keys: dict[bytes, int] = field(default_factory=dict)
    counts: collections.Counter = field(default_factory=collections.Counter)
    seq: int = -1
    pages_cached: int = 0
    blocks_cached: int = 0
    evictions: int = 0

    def apply(self, msg: m.PrefixAnnounce) -> None:
        if msg.reset:
            self.keys.clear()
            self.counts.clear()
        for key in msg.removed_keys:
            tokens = self.keys.pop(key, None)
            if tokens is not None:
                self.counts[tokens] -= 1
                if not self.counts[tokens]:
                    del self.counts[tokens]
        for key, tokens in zip(msg.added_keys, msg.added_tokens):
            if key not in self.keys and tokens > 0:
                self.keys[key] = tokens
                self.counts[tokens] += 1
        self.seq = msg.seq
        self.pages_cached, self.blocks_cached = msg.pages_cached, msg.blocks_cached
        self.evictions = msg.evictions

    def longest(self, prompt: HashedPrompt) -> int:
        """Tokens of the longest held prefix of ``prompt`` (at most ``len - 1``)."""
        limit = len(prompt) - 1
        for n in sorted((n for n in self.counts if n <= limit), reverse=True):
            if prompt.key_at(n) in self.keys:
                return n
        return 0

    def stats(self) -> dict[str, int]:
        return {"pages_cached": self.pages_cached, "blocks_cached": self.blocks_cached,
                "evictions": self.evictions, "checkpoints": len(self.keys)}


class PrefixRouter:
    """The decode coordinator's routing by prefix (module docstring). ``enabled``: the decode
    node asks prefill nodes for their cache (``prefix_cache``); ``routing``: route by it
    (False: round robin, for A/B comparisons)."""

    def __init__(self, *, enabled: bool = True, routing: bool = True) -> None:
        self.enabled = bool(enabled)
        self.routing = bool(routing)
        self.nodes: dict[str, NodePrefix] = {}
        self._rr = itertools.count()
        #: requests sent to a prefill node and still prefilling there -> their prompt tokens
        self._queued: dict[RequestKey, int] = {}
        self.routed = 0                   # requests routed to a node that holds a prefix
        self.routed_tokens = 0            # prompt tokens those hits cover (as announced)

    # -- what the prefill nodes say ------------------------------------------------------------
    def connected(self, info: m.GroupInfo) -> None:
        """A handshake with a prefill node succeeded: it starts empty (its reset follows)."""
        self.nodes.pop(info.node_id, None)
        if not info.prefix_cache or not info.prefix_salt or info.prefix_stride < 0:
            return
        try:
            hasher = PrefixHasher(info.prefix_salt, info.block_size, stride=info.prefix_stride)
        except ConfigError:
            return
        self.nodes[info.node_id] = NodePrefix(hasher)

    def announced(self, node_id: str, msg: m.PrefixAnnounce) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.apply(msg)

    def lost(self, node_id: str) -> None:
        """A prefill node's link went down: what it held is forgotten."""
        self.nodes.pop(node_id, None)

    # -- where a request goes ------------------------------------------------------------------
    def pick(self, ready: Sequence["_Prefill"], prompt: bytes, ledger: Ledger) -> "_Prefill":
        """The prefill node for ``prompt`` among ``ready`` (not empty)."""
        turn = next(self._rr)
        if len(ready) == 1:                    # nothing to choose: no hashing
            return ready[0]
        caching = [p for p in ready if p.node_id in self.nodes]
        if not (self.enabled and self.routing and caching):
            return ready[turn % len(ready)]
        tokens = np.frombuffer(prompt, dtype="<i4")
        best, hit = self.choose([p.node_id for p in ready], tokens,
                                self._queued_tokens(ledger), turn)
        if hit:
            self.routed += 1
            self.routed_tokens += hit
        return ready[best]

    def choose(self, node_ids: Sequence[str], tokens: np.ndarray,
               queued: Mapping[str, int], turn: int) -> tuple[int, int]:
        """``(index into node_ids, prefix tokens it holds)`` of the lowest cost -- prefill
        tokens ``queued`` there + prompt tokens - tokens it holds -- trying the nodes from
        ``turn`` on, so ties go round robin (:meth:`pick`; the vLLM proxy calls it with its
        own instances)."""
        hashed: dict[tuple[bytes, int], HashedPrompt | None] = {}
        n = len(node_ids)
        best, best_cost, best_hit = 0, None, 0
        for i in range(n):                     # from the round robin's turn: ties go round
            index = (turn + i) % n
            node = self.nodes.get(node_ids[index])
            hit = 0
            if node is not None and len(tokens) > 1:
                h = node.hasher
                k = (h.salt, h.block_size)
                if k not in hashed:
                    try:
                        hashed[k] = h.prompt(tokens)
                    except ConfigError:
                        hashed[k] = None
                if hashed[k] is not None:
                    hit = node.longest(hashed[k])
            cost = queued.get(node_ids[index], 0) + len(tokens) - hit
            if best_cost is None or cost < best_cost:
                best, best_cost, best_hit = index, cost, hit
        return best, best_hit

    def sent(self, key: RequestKey, tokens: int) -> None:
        """A request went to prefill node ``key.peer_node``: queued there until it lands."""
        if key.peer_node:
            self._queued[key] = tokens

    def _queued_tokens(self, ledger: Ledger) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in list(self._queued):
            record = ledger.get(key)
            if record is None or record.phase is not Phase.ACTIVE:
                del self._queued[key]
                continue
            out[key.peer_node] = out.get(key.peer_node, 0) + self._queued[key]
        return out

    def reset(self) -> None:
        """The decode group restarted: every link is new."""
        self.nodes.clear()
        self._queued.clear()

    def node_stats(self, node_id: str) -> dict[str, int]:
        """What prefill node ``node_id``'s latest announcement said (zeros: none)."""
        node = self.nodes.get(node_id)
        return node.stats() if node is not None else {
            "pages_cached": 0, "blocks_cached": 0, "evictions": 0, "checkpoints": 0}
