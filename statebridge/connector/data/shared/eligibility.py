"""Which rank pairs move their state through the shared map: ONE rule, :func:`map_threshold`.

Three parties must agree on it without talking: a prefill rank choosing its buffer's memory
(a memfd a reader can map, or huge pages), the coordinator advertising its group
(:class:`~statebridge.connector.messages.GroupInfo` ``shared_map*``), and both ranks of every
pair when they plan a link. Each describes the two groups as :class:`MapSide`\\ s -- its own from
its config, the peer's from the peer's ``GroupInfo`` -- and asks this function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from statebridge.connector.data.shared.buffer import available
from statebridge.connector.data.shared.notice import MAX_PEERS
from statebridge.net import host_id

if TYPE_CHECKING:
    from statebridge.config import ConnectorConfig
    from statebridge.connector.messages import GroupInfo

__all__ = ["MapSide", "map_threshold"]


@dataclass(frozen=True)
class MapSide:
    """One group, as far as the shared map is concerned.

    ``takes_part``: its config has ``shared_map`` on and the copy is built; a prefill group
    seen from its peer: it also listed every rank's buffer (pid and descriptor).
    ``min_bytes``: a prefill group's ``shared_map_min_bytes`` (a decode group's is unused).
    ``has_kv``: it holds a KV block pool.
    ``memory``: what its pools are in, ``"host"`` or ``"cuda"`` (device memory: the decode
    rank gathers out of the prefill rank's pool, opened from its CUDA IPC handle).
    """

    role: str
    takes_part: bool
    tp_size: int
    page_size: int
    has_kv: bool
    host_id: str
    min_bytes: int = 0
    memory: str = "host"

    @classmethod
    def of_config(cls, role: str, config: "ConnectorConfig", *, tp_size: int, page_size: int,
                  has_kv: bool, memory: str = "host") -> "MapSide":
        """This process's own group (its host is this host)."""
        return cls(role=role, takes_part=bool(config.shared_map and available()),
                   tp_size=tp_size, page_size=page_size, has_kv=has_kv, host_id=host_id(),
                   min_bytes=config.shared_map_min_bytes if role == "prefill" else 0,
                   memory=memory)

    @classmethod
    def of_info(cls, info: "GroupInfo") -> "MapSide":
        """A group as its (checked) ``GroupInfo`` describes it."""
        takes_part = bool(info.shared_map) and (
            info.role != "prefill"
            or len(info.rank_pids) == len(info.rank_shm_fds) == info.tp_size)
        return cls(role=info.role, takes_part=takes_part, tp_size=info.tp_size,
                   page_size=info.page_size, has_kv=info.num_blocks > 0, host_id=info.host_id,
                   min_bytes=info.shared_map_min_bytes, memory=info.memory)


def map_threshold(prefill: MapSide, decode: MapSide | None = None) -> int | None:
    """The shared-map rule: None when no rank pair of ``prefill`` and ``decode`` reads through
    the map; else the least bytes per request a zero-copy recurrent pair must move to go that
    way (every KV pair goes too).

    - Both groups take part, run on one host and have at most :data:`MAX_PEERS` ranks (a notice
      slot per page and peer rank).
    - A hybrid link (KV pools on both sides) moves its KV and every zero-copy recurrent pair
      through the map, whatever their size (0): the pair's one notice covers both.
    - Otherwise the prefill group's ``min_bytes`` holds; a prefill group whose page is smaller
      (and that holds no KV) can serve no pair, so it takes no part at all.
    - Pools in device memory (``memory`` "cuda"): only between two such groups, and then every
      pair, whatever its size, staged pairs too (0): the decode rank gathers all of a
      request's runs in one kernel launch, whose cost does not grow with the pairs. A host
      group and a device group move their pairs over UCX.

    With ``decode`` None: whether ``prefill`` can serve any decode group -- a prefill rank's
    buffer is a memfd exactly then, and only then its coordinator lists it.
    """
    device = prefill.memory == "cuda"
    if not prefill.takes_part or prefill.tp_size > MAX_PEERS \
            or not (prefill.has_kv or device) and prefill.page_size < prefill.min_bytes:
        return None
    if decode is None:
        return 0 if prefill.has_kv or device else prefill.min_bytes
    if not decode.takes_part or decode.tp_size > MAX_PEERS or not decode.host_id \
            or decode.host_id != prefill.host_id or decode.memory != prefill.memory:
        return None
    return 0 if prefill.has_kv and decode.has_kv or device else prefill.min_bytes
