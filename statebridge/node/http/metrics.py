"""The HTTP server's Prometheus registry: what it measures of each request itself (time to
first token, inter-token latency, ...) and, at each scrape, the decode node's gauges, counters
and per-request histograms from its NodeStats. Names are vLLM's with ``statebridge_`` for
``vllm:``."""

from __future__ import annotations

from statebridge.node import messages as nm

__all__ = ["Metrics"]

#: Buckets of whole-request latencies (vLLM's request latency buckets, from 0.01 s).
_REQUEST_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480,
                    960, 1920)
#: Buckets of the time between two tokens of one request.
_TOKEN_BUCKETS = (.001, .0025, .005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5,
                  5, 10)


class Metrics:
    """The server's Prometheus registry: its own (several servers in one process never
    collide). What the HTTP server sees of a request it measures itself (from the request's
    arrival here); what happened at the decode node, its prefill node and their ranks comes
    from the NodeStats fetched for each scrape (:class:`NodeCollector`)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("statebridge_requests", "HTTP API requests by endpoint and "
                                "outcome", ("endpoint", "outcome"), registry=r)
        self.success = Counter("statebridge_request_success", "Generations that finished, by "
                               "finish reason", ("finished_reason",), registry=r)
        self.prompt_tokens = Counter("statebridge_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("statebridge_generation_tokens", "Tokens generated "
                                         "for finished requests", registry=r)
        self.ttft = Histogram("statebridge_time_to_first_token_seconds", "From the HTTP "
                              "request's arrival to its first token", registry=r, buckets=(
                                  .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5,
                                  7.5, 10, 20, 40, 80, 160, 640))
        self.itl = Histogram("statebridge_inter_token_latency_seconds", "Between two "
                             "consecutive tokens of one request", registry=r,
                             buckets=_TOKEN_BUCKETS)
        self.tpot = Histogram("statebridge_request_time_per_output_token_seconds", "Per "
                              "request: from its first token to its last, over the tokens "
                              "after the first", registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("statebridge_e2e_request_latency_seconds", "From the HTTP "
                             "request's arrival to its last token", registry=r,
                             buckets=_REQUEST_BUCKETS)
        self.decode_time = Histogram("statebridge_request_decode_time_seconds", "Per request: "
                                     "from its first token to its last", registry=r,
                                     buckets=_REQUEST_BUCKETS)
        self.node: nm.NodeStats | None = None
        self.inflight = 0
        r.register(NodeCollector(self))

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def finished(self, reason: str, *, prompt_tokens: int, tokens: int, arrived: float,
                 first_token_at: float, now: float) -> None:
        """A generation of ``prompt_tokens`` and ``tokens`` generated ones met its finish
        ``reason`` at ``now``; it arrived at ``arrived`` and had its first token at
        ``first_token_at`` (0.0: none). Times from ``time.perf_counter``."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        self.success.labels(reason).inc()
        self.e2e.observe(now - arrived)
        if first_token_at:
            self.decode_time.observe(now - first_token_at)
            if tokens > 1:
                self.tpot.observe((now - first_token_at) / (tokens - 1))


class NodeCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.metrics.node
        yield GaugeMetricFamily("statebridge_http_requests_in_flight",
                                "HTTP generations in flight", value=self.metrics.inflight)
        yield GaugeMetricFamily("statebridge_node_up", "1 when the decode node answered this "
                                "scrape", value=0 if s is None else 1)
        if s is None:
            return
        for name, help_, value in (
                ("statebridge_node_ready", "1 once a prefill node is connected", int(s.ready)),
                ("statebridge_pages_used", "State pages in use (per rank)", s.pages_used),
                ("statebridge_pages_free", "State pages free (per rank)", s.pages_free),
                ("statebridge_kv_blocks_used", "KV blocks in use (per rank)", s.blocks_used),
                ("statebridge_kv_blocks_free", "KV blocks free (per rank)", s.blocks_free),
                ("statebridge_requests_running", "Requests decoding", s.running),
                ("statebridge_requests_waiting", "Requests waiting for a page or blocks",
                 s.waiting),
                ("statebridge_prefill_peers_connected", "Prefill nodes connected",
                 len(s.prefill_nodes))):
            yield GaugeMetricFamily(name, help_, value=value)
        yield CounterMetricFamily("statebridge_refused_peers", "Prefill peers whose handshake "
                                  "failed", value=s.refused_peers)
        yield CounterMetricFamily("statebridge_refused_clients", "Clients of the zmq front "
                                  "door refused by CURVE authentication", value=s.refused_clients)
        yield CounterMetricFamily("statebridge_node_aborted_requests", "Requests aborted at "
                                  "the decode node", value=s.aborted)
        memory = GaugeMetricFamily("statebridge_rank_memory_bytes", "Bytes a decode rank "
                                   "holds, by part: weights_private, weights_mapped (resident "
                                   "checkpoint pages), pages, kv_pool, total",
                                   labels=["rank", "part"])
        for r, parts in enumerate(zip(s.rank_weights_private, s.rank_weights_mapped,
                                      s.rank_pages_bytes, s.rank_kv_pool_bytes)):
            for part, value in zip(("weights_private", "weights_mapped", "pages", "kv_pool",
                                    "total"), (*parts, sum(parts))):
                memory.add_metric([str(r), part], value)
        yield memory
        yield CounterMetricFamily("statebridge_transfers_verified", "Decode-rank digests of "
                                  "landed transfers compared with the prefill node's "
                                  "(--verify-transfers)", value=s.transfers_verified)
        yield CounterMetricFamily("statebridge_transfer_checksum_mismatches", "Decode-rank "
                                  "digests of landed transfers that differed from the prefill "
                                  "node's: the request failed or was recomputed",
                                  value=s.transfer_mismatches)
        yield from prefix_cache(s)
        yield from node_histograms(s)


def prefix_cache(s: nm.NodeStats):
    """Prefix caching: vLLM's token counters and, per prefill node (label ``prefill``), what
    its cache holds and has evicted."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield CounterMetricFamily("statebridge_prefix_cache_queries", "Prompt tokens of finished "
                              "requests (the prefix cache was asked for them)",
                              value=s.prefix_cache_queries)
    yield CounterMetricFamily("statebridge_prefix_cache_hits", "Prompt tokens of finished "
                              "requests that a prefill node's prefix cache served",
                              value=s.prefix_cache_hits)
    yield CounterMetricFamily("statebridge_prefix_cache_late", "Finished requests whose "
                              "cached-token count did not come within the peer timeout "
                              "(reported as 0)", value=s.cached_tokens_late)
    families = (
        GaugeMetricFamily("statebridge_prefix_cache_pages", "Recurrent-state checkpoints "
                          "(pages, per rank) a prefill node's prefix cache holds",
                          labels=["prefill"]),
        GaugeMetricFamily("statebridge_prefix_cache_kv_blocks", "KV blocks (per rank) a "
                          "prefill node's prefix cache holds", labels=["prefill"]),
        CounterMetricFamily("statebridge_prefix_cache_evictions", "Cached units (a "
                            "checkpoint and its KV blocks) a prefill node evicted",
                            labels=["prefill"]))
    for node, *values in zip(s.prefix_nodes, s.prefix_pages_cached, s.prefix_blocks_cached,
                             s.prefix_evictions):
        for family, value in zip(families, values):
            family.add_metric([node], value)
    yield from families


def node_histograms(s: nm.NodeStats):
    """The node's per-request histograms (:mod:`statebridge.node.metrics`) as Prometheus
    histograms (cumulative buckets)."""
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    from statebridge.node.metrics import HISTOGRAMS

    for name, counts, total in zip(s.histogram_names, s.histogram_counts, s.histogram_sums):
        known = HISTOGRAMS.get(name)
        if known is None or len(counts) != len(known[1]) + 1:
            continue                    # (a node of another version)
        help_, bounds = known
        cumulative, running = [], 0
        for bound, count in zip((*bounds, float("inf")), counts):
            running += count
            cumulative.append((floatToGoString(bound), running))
        yield HistogramMetricFamily(name, help_, buckets=cumulative, sum_value=total)
