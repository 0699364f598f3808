"""The part of the connector that lives in each TP rank process (both sides).

(Being split into one module per concern; for now everything lives in :mod:`.worker`.)
"""

from statebridge.connector.rank.worker import (  # noqa: F401 -- re-exported
    KVBlocks,
    RankModel,
    RankSetup,
    RankWorker,
    _PENDING,
    _generation_after,
    kv_checksum,
    load_callable,
    rank_main,
)

__all__ = ["RankSetup", "RankWorker", "RankModel", "KVBlocks", "rank_main",
           "load_callable", "kv_checksum"]
