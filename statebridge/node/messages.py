"""The decode node's own messages: decode steps (node <-> its decode ranks) and the front door
(client <-> decode node). They travel through the connector's one codec
(:func:`statebridge.connector.messages.message`); the connector itself knows none of them.

::

    client --GenerateRequest--> decode node --RankStep--> every decode rank
    client <--GenerateTokens--- decode node <--RankStepResult-- the sampling rank (rank 0)
    client --StatusQuery------> decode node --NodeStatus--> client  (ready? which prefill peers)
    client --AbortRequest-----> decode node: drop the request, free its page and KV blocks
    client --StatsQuery-------> decode node --NodeStats--> client  (what /metrics and /health show)
"""

from __future__ import annotations

from statebridge.connector.messages import Message, message

__all__ = ["RankStep", "RankStepResult", "GenerateRequest", "GenerateTokens", "StatusQuery",
           "NodeStatus", "AbortRequest", "StatsQuery", "NodeStats"]


@message
class RankStep(Message):
    """Decode node -> every decode rank: one decode step of a batch (one token per request,
    each against its page's state; ``positions`` counts the tokens before it). With attention
    KV, ``blocks`` holds each request's KV block table, covering ``position + 1`` tokens: the
    token's K and V are written at its position. Rank 0 samples and answers with
    RankStepResult. ``logprobs``: empty when no row asked for log-probabilities, else one
    value per row: -1 (none), or how many top tokens to return with the sampled one's."""
    step: int
    request_ids: tuple[str, ...]
    pages: tuple[int, ...]
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    temperatures: tuple[float, ...]
    top_ps: tuple[float, ...]
    seeds: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[int, ...] = ()


@message
class RankStepResult(Message):
    """The sampling rank -> decode node: one token per request of the step (``kind`` empty),
    or the step failed as a whole (``kind`` a FailureKind name, ``message`` why; every request
    of the batch fails). A row that could not be served fails alone: its index is in
    ``failed_rows`` (its token is -1), with its FailureKind name and why at the same position
    of ``failed_kinds`` and ``failed_messages``; the other rows' tokens are good.

    When the step asked for log-probabilities (``RankStep.logprobs``), ``logprobs`` holds
    the sampled token's of every row (NaN for a row that did not ask or failed) and
    ``top_ids`` / ``top_logprobs`` the row's top tokens, most likely first (empty for such
    a row); all three are empty otherwise."""
    step: int
    tp_rank: int
    tokens: tuple[int, ...]
    kind: str
    message: str
    failed_rows: tuple[int, ...] = ()
    failed_kinds: tuple[str, ...] = ()
    failed_messages: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    top_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


@message
class GenerateRequest(Message):
    """Client -> decode node. ``temperature`` 0 means greedy. ``logprobs``: -1 for none, else
    each token comes with its log-probability and the ``logprobs`` most likely tokens' (at
    most :data:`~statebridge.models.sampling.MAX_LOGPROBS`), of the model's raw
    distribution (before temperature and top-p)."""
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    logprobs: int = -1


@message
class GenerateTokens(Message):
    """Decode node -> client: newly generated tokens; the last one has ``done`` set. ``kind``
    is empty on success, else a :class:`~statebridge.errors.FailureKind` name and ``message``
    says why. For a request that asked for them, ``logprobs``, ``top_ids`` and
    ``top_logprobs`` are aligned with ``tokens``: each token's log-probability and its
    step's most likely tokens with theirs (empty otherwise). ``cached_tokens``: the prompt
    tokens the prefill node took from its prefix cache instead of computing them (set on the
    last message; 0 without a hit, for a local prefill, or when the prefill node's timing
    did not come within the node's peer timeout)."""
    request_id: str
    tokens: tuple[int, ...]
    done: bool
    kind: str
    message: str
    ttft: float
    transfer_seconds: float
    transfer_bytes: int
    recomputed: bool
    logprobs: tuple[float, ...] = ()
    top_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()
    cached_tokens: int = 0


@message
class StatusQuery(Message):
    """Client -> decode node: is it serving?"""
    client: str


@message
class NodeStatus(Message):
    """Decode node -> client: ``ready`` once it can serve (ranks up and at least one prefill
    node connected; or it can recompute); ``reason`` says what it waits for otherwise."""
    node_id: str
    ready: bool
    reason: str
    prefill_nodes: tuple[str, ...]


@message
class AbortRequest(Message):
    """Client -> decode node: the client gave up on ``request_id`` (it disconnected, or met a
    stop string). The node drops it wherever it is (waiting, transferring, decoding) and frees
    its page and KV blocks; the client hears a last GenerateTokens with ``kind`` ``aborted``.
    Only the client that sent the request can abort it; an unknown id is ignored."""
    request_id: str
    reason: str


@message
class StatsQuery(Message):
    """Client -> decode node: the node's gauges and counters (the HTTP front door's /metrics
    and /health)."""
    client: str


@message
class NodeStats(Message):
    """Decode node -> client: readiness as in NodeStatus, and what the node holds now: pages
    and KV blocks (per rank, the same on every rank) used and free, requests decoding and
    waiting for a page, connected prefill peers, ``refused_peers``: prefill nodes whose
    handshake failed (incompatible, or they refused us), ``refused_clients``: clients of
    the zmq front door refused by CURVE authentication, and (``--verify-transfers``)
    ``transfers_verified`` / ``transfer_mismatches``: decode-rank digests of landed transfers
    compared with the prefill node's, and those that differed, since the node started; the
    memory of each rank (the ``rank_*`` tuples:
    :func:`statebridge.node.capacity.memory_fields`), and the histograms of where its requests'
    time went before decoding."""
    node_id: str
    ready: bool
    reason: str
    prefill_nodes: tuple[str, ...]
    pages_used: int
    pages_free: int
    blocks_used: int
    blocks_free: int
    running: int
    waiting: int
    refused_peers: int
    aborted: int
    refused_clients: int = 0
    transfers_verified: int = 0
    transfer_mismatches: int = 0
    #: Per rank (rank 0 first), the bytes it holds: its weights (private, and resident pages of
    #: the checkpoint mapped into it), its state pages, its KV pool.
    rank_weights_private: tuple[int, ...] = ()
    rank_weights_mapped: tuple[int, ...] = ()
    rank_pages_bytes: tuple[int, ...] = ()
    rank_kv_pool_bytes: tuple[int, ...] = ()

    #: The node's per-request histograms (:mod:`statebridge.node.metrics`): names, the
    #: counts per bucket of each (its buckets are ``HISTOGRAMS[name]``'s, and one more above
    #: them all), and the sum of the values observed.
    histogram_names: tuple[str, ...] = ()
    histogram_counts: tuple[tuple[int, ...], ...] = ()
    histogram_sums: tuple[float, ...] = ()

    #: Prefix caching, in tokens since the node started: the prompt tokens of its finished
    #: requests and those of them its prefill nodes' caches served (vLLM's
    #: ``prefix_cache_queries`` / ``prefix_cache_hits``); requests whose last message went
    #: without the prefill node's count (it came later than the peer timeout).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_tokens_late: int = 0
    #: What each connected prefill node's cache holds (from its announcements), aligned with
    #: ``prefix_nodes``: checkpoint pages and KV blocks per rank, units evicted so far.
    prefix_nodes: tuple[str, ...] = ()
    prefix_pages_cached: tuple[int, ...] = ()
    prefix_blocks_cached: tuple[int, ...] = ()
    prefix_evictions: tuple[int, ...] = ()
