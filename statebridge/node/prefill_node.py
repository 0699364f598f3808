"""The prefill node: a :class:`~statebridge.connector.prefill.PrefillServer` whose rank processes
run the model (N-1 prefill of each request) and send the state to the decode ranks."""

from __future__ import annotations

import logging

from statebridge.config import ConnectorConfig
from statebridge.connector.group import Launcher, spawn_launcher
from statebridge.connector.prefill import PrefillServer
from statebridge.net import free_port
from statebridge.node.checks import check_checkpoint

log = logging.getLogger(__name__)

__all__ = ["start_prefill_node"]


def start_prefill_node(model_dir: str, tp_size: int, *, port: int = 0, layout: str = "DLS",
                       num_pages: int = 64, config: ConnectorConfig | None = None,
                       launcher: Launcher | None = spawn_launcher,
                       rank_model: str = "statebridge.node.rank_model:ModelRankModel"
                       ) -> PrefillServer:
    """Check the checkpoint (here, before any rank starts), start the server and its rank
    processes; returns once every rank is up (StartupError at once, with the rank's error,
    when one fails to start)."""
    spec = check_checkpoint(model_dir, tp_size, rank_model)
    server = PrefillServer(spec, tp_size, layout, num_pages, config=config, port=port,
                           launcher=launcher, model=rank_model,
                           model_dir=model_dir, dist_init=f"tcp://127.0.0.1:{free_port()}")
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    log.info("prefill node ready on %s (TP %d, %s)", server.address, tp_size, layout)
    return server
