"""The prefill node: a :class:`~statebridge.connector.prefill.PrefillServer` whose rank processes
run the model (N-1 prefill of each request) and send the state to the decode ranks.

Besides the decode nodes' handshakes and requests, its control port answers the status and stats
queries of the decode node's front door (:class:`~statebridge.node.messages.StatusQuery` ->
``NodeStatus``, :class:`~statebridge.node.messages.StatsQuery` -> ``NodeStats``), so
``Client(prefill address).status()`` says whether it serves and why not (its rank group is
starting, restarting, or failed), and its pages and KV blocks can be read from outside.

Prefix caching is on unless ``NodeConfig.prefix_cache`` is False (``--no-enable-prefix-caching``):
the server keeps a recurrent-state checkpoint at each prompt's end, where a prompt branches off
an earlier one, and every ``prefix_stride`` tokens if set, with the full KV blocks before it, in a share of its page and KV pools
(``prefix_cache_gib`` per node, split over its ranks; default half of each pool).
"""

from __future__ import annotations

import functools
import logging

from statebridge.config import ConnectorConfig, NodeConfig
from statebridge.errors import ConfigError
from statebridge.connector.group import Launcher, spawn_launcher
from statebridge.connector.prefill import PrefillServer
from statebridge.connector.rank.startup import fmt_bytes
from statebridge.models.distributed import Rendezvous
from statebridge.node import messages as nm
from statebridge.node.capacity import memory_fields
from statebridge.node.checks import check_checkpoint

log = logging.getLogger(__name__)

__all__ = ["start_prefill_node", "answer_queries", "prefix_cache_bytes", "prefix_memory_text"]


def start_prefill_node(model_dir: str, tp_size: int, *, port: int = 0, layout: str | None = None,
                       num_pages: int | None = None, config: ConnectorConfig | None = None,
                       launcher: Launcher | None = spawn_launcher,
                       rank_model: str | None = None, node: NodeConfig | None = None,
                       kv_layout: str | None = None, block_size: int | None = None,
                       kv_blocks: int | None = None,
                       prefix_cache: bool | None = None) -> PrefillServer:
    """Check the checkpoint (here, before any rank starts), start the server and its rank
    processes; returns once every rank is up (StartupError at once, with the rank's error,
    when one fails to start). Settings come from ``node`` (default :class:`NodeConfig`), the
    keyword arguments given override it."""
    nc = (node or NodeConfig()).replace(layout=layout, num_pages=num_pages,
                                        rank_model=rank_model, kv_layout=kv_layout,
                                        block_size=block_size, kv_blocks=kv_blocks,
                                        prefix_cache=prefix_cache)
    layout = nc.layout
    spec = check_checkpoint(model_dir, tp_size, nc.rank_model)
    # The rendezvous store binds its (kernel-assigned) port after the server bound ``port``.
    server = PrefillServer(spec, tp_size, layout, nc.num_pages, config=config, port=port,
                           launcher=launcher, model=nc.rank_model, model_dir=model_dir,
                           dist_init=functools.partial(Rendezvous.for_group, tp_size,
                                                       host=(config or ConnectorConfig()).bind_host),
                           kv_layout=nc.kv_layout, block_size=nc.block_size,
                           num_blocks=nc.num_blocks(spec, tp_size), device=nc.device,
                           prefix_cache=nc.prefix_cache, prefix_stride=nc.prefix_stride,
                           prefix_cache_bytes=prefix_cache_bytes(nc, tp_size))
    answer_queries(server)
    try:
        memory = server.group.memory_report
        check_prefix_budget(nc, tp_size, memory.pages_bytes + memory.kv_bytes,
                            server.group.geometry.page_size)
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    log.info("prefill node ready on %s (TP %d, %s)", server.address, tp_size, layout)
    return server


def prefix_cache_bytes(nc: NodeConfig, tp_size: int) -> int | None:
    """The prefix cache's budget per rank: ``prefix_cache_gib`` split evenly over the ranks;
    None (the server's default: half of the page and KV pools) when not given."""
    if not nc.prefix_cache or not nc.prefix_cache_gib:
        return None
    return int(nc.prefix_cache_gib * (1 << 30)) // tp_size


def prefix_memory_text(nc: NodeConfig, tp_size: int, *, page_bytes: int, num_pages: int,
                       block_bytes: int, num_blocks: int) -> str:
    """The prefix cache's share of a rank's pools, for the startup memory line: "" when off;
    else its stride and its budget (``prefix_cache_gib``'s share, or half of the pages and
    half of the KV blocks)."""
    if not nc.prefix_cache:
        return "; prefix cache off"
    budget = prefix_cache_bytes(nc, tp_size)
    if budget is None:
        pages, blocks = num_pages // 2, num_blocks // 2
        budget = pages * page_bytes + blocks * block_bytes
        held = f"{pages} pages" + (f" + {blocks:,} KV blocks" if num_blocks else "")
        size = f"up to {held} = {fmt_bytes(budget)}"
    else:
        size = f"up to {fmt_bytes(budget)} (--prefix-cache-gib {nc.prefix_cache_gib:g})"
    where = (f"prompt ends, branch points and every {nc.prefix_stride} tokens"
             if nc.prefix_stride else "prompt ends and branch points")
    return f"; prefix cache (checkpoints at {where}): {size} per rank of these pools"


def check_prefix_budget(nc: NodeConfig, tp_size: int, pool_bytes: int, page_bytes: int) -> None:
    """ConfigError naming ``prefix_cache_gib`` when its share per rank holds no checkpoint
    (one page of ``page_bytes``) or exceeds the rank's page and KV pools (``pool_bytes``)."""
    budget = prefix_cache_bytes(nc, tp_size)
    if budget is None:
        return
    if budget < page_bytes:
        raise ConfigError(f"prefix_cache_gib={nc.prefix_cache_gib:g} gives each of the {tp_size} "
                          f"ranks {budget:,} B, less than one checkpoint page of "
                          f"{page_bytes:,} B")
    if budget > pool_bytes:
        raise ConfigError(f"prefix_cache_gib={nc.prefix_cache_gib:g} gives each of the {tp_size} "
                          f"ranks {budget:,} B, more than its page and KV pools "
                          f"({pool_bytes:,} B): the cache lives in them; give a smaller size "
                          f"or larger pools (--num-pages, --kv-tokens)")


def answer_queries(server: PrefillServer) -> None:
    """Let ``server`` answer StatusQuery and StatsQuery (on its loop thread)."""
    def status(msg: nm.StatusQuery) -> nm.NodeStatus:
        ready, why = server.whole()
        return nm.NodeStatus(node_id=server.node_id, ready=ready, reason=why, prefill_nodes=())

    def stats(msg: nm.StatsQuery) -> nm.NodeStats:
        ready, why = server.whole()
        blocks = server.group.blocks
        cached = server.prefix.stats()        # what the prefix cache holds is not in use
        return nm.NodeStats(
            node_id=server.node_id, ready=ready, reason=why, prefill_nodes=(),
            pages_used=server.group.pool.num_used - cached["pages_cached"],
            pages_free=server.group.pool.num_free,
            blocks_used=(blocks.num_used - cached["blocks_cached"]) if blocks else 0,
            blocks_free=blocks.num_free if blocks else 0,
            running=len(server.group.ledger), waiting=len(server.waiting),
            refused_peers=int(server.group.counters.get("incompatible_peers")),
            aborted=int(server.group.counters.get("aborted_by_peer")),
            **memory_fields(server.group))
    server.on_query(nm.StatusQuery, status)
    server.on_query(nm.StatsQuery, stats)
