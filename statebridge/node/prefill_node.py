"""The prefill node: a :class:`~statebridge.connector.prefill.PrefillServer` whose rank processes
run the model (N-1 prefill of each request) and send the state to the decode ranks.

Besides the decode nodes' handshakes and requests, its control port answers the status and stats
queries of the decode node's front door (:class:`~statebridge.node.messages.StatusQuery` ->
``NodeStatus``, :class:`~statebridge.node.messages.StatsQuery` -> ``NodeStats``), so
``Client(prefill address).status()`` says whether it serves and why not (its rank group is
starting, restarting, or failed), and its pages and KV blocks can be read from outside.
"""

from __future__ import annotations

import functools
import logging

from statebridge.config import ConnectorConfig, NodeConfig
from statebridge.connector.group import Launcher, spawn_launcher
from statebridge.connector.prefill import PrefillServer
from statebridge.models.distributed import Rendezvous
from statebridge.node import messages as nm
from statebridge.node.capacity import memory_fields
from statebridge.node.checks import check_checkpoint

log = logging.getLogger(__name__)

__all__ = ["start_prefill_node", "answer_queries"]


def start_prefill_node(model_dir: str, tp_size: int, *, port: int = 0, layout: str | None = None,
                       num_pages: int | None = None, config: ConnectorConfig | None = None,
                       launcher: Launcher | None = spawn_launcher,
                       rank_model: str | None = None, node: NodeConfig | None = None,
                       kv_layout: str | None = None, block_size: int | None = None,
                       kv_blocks: int | None = None) -> PrefillServer:
    """Check the checkpoint (here, before any rank starts), start the server and its rank
    processes; returns once every rank is up (StartupError at once, with the rank's error,
    when one fails to start). Settings come from ``node`` (default :class:`NodeConfig`), the
    keyword arguments given override it."""
    nc = (node or NodeConfig()).replace(layout=layout, num_pages=num_pages,
                                        rank_model=rank_model, kv_layout=kv_layout,
                                        block_size=block_size, kv_blocks=kv_blocks)
    layout = nc.layout
    spec = check_checkpoint(model_dir, tp_size, nc.rank_model)
    # The rendezvous store binds its (kernel-assigned) port after the server bound ``port``.
    server = PrefillServer(spec, tp_size, layout, nc.num_pages, config=config, port=port,
                           launcher=launcher, model=nc.rank_model, model_dir=model_dir,
                           dist_init=functools.partial(Rendezvous.for_group, tp_size,
                                                       host=(config or ConnectorConfig()).bind_host),
                           kv_layout=nc.kv_layout, block_size=nc.block_size,
                           num_blocks=nc.num_blocks(spec, tp_size), device=nc.device)
    answer_queries(server)
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    log.info("prefill node ready on %s (TP %d, %s)", server.address, tp_size, layout)
    return server


def answer_queries(server: PrefillServer) -> None:
    """Let ``server`` answer StatusQuery and StatsQuery (on its loop thread)."""
    def status(msg: nm.StatusQuery) -> nm.NodeStatus:
        ready, why = server.whole()
        return nm.NodeStatus(node_id=server.node_id, ready=ready, reason=why, prefill_nodes=())

    def stats(msg: nm.StatsQuery) -> nm.NodeStats:
        ready, why = server.whole()
        blocks = server.group.blocks
        return nm.NodeStats(
            node_id=server.node_id, ready=ready, reason=why, prefill_nodes=(),
            pages_used=server.group.pool.num_used, pages_free=server.group.pool.num_free,
            blocks_used=blocks.num_used if blocks else 0,
            blocks_free=blocks.num_free if blocks else 0,
            running=len(server.group.ledger), waiting=len(server.waiting),
            refused_peers=int(server.group.counters.get("incompatible_peers")),
            aborted=int(server.group.counters.get("aborted_by_peer")),
            **memory_fields(server.group))
    server.on_query(nm.StatusQuery, status)
    server.on_query(nm.StatsQuery, stats)
