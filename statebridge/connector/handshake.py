"""A group's half of the handshake between a prefill and a decode group: the one record it
sends (:class:`~statebridge.connector.messages.GroupInfo`, with the shared-map fields the
same-host rule allows) and the checks of the peer's record, each refusal an
:class:`~statebridge.errors.IncompatiblePeerError` naming the value. The record is forwarded to
the ranks as it came (one handshake record between the groups and inside them).

:class:`GroupHandshake` holds the facts of a rank group that do not change while it lives (its
spec, geometry, pools, config, node id); what its ranks said when they announced themselves
(:class:`RankAnnouncement`, one per rank) is given to :meth:`GroupHandshake.group_info` as it
stands then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from statebridge.config import ConnectorConfig
from statebridge.connector import messages as m
from statebridge.errors import ConfigError, IncompatiblePeerError, StatebridgeError
from statebridge.net import host_id
from statebridge.state.kv import BlockGeometry
from statebridge.state.layout import Layout, PageGeometry
from statebridge.state.spec import StateSpec

__all__ = ["GroupHandshake", "RankAnnouncement"]


@dataclass(frozen=True)
class RankAnnouncement:
    """What a rank said when it announced itself (:class:`~statebridge.connector.messages.
    RankHello`): its UCX worker address, its process and shared-map fd, what its model's
    weights cost its process, and whether its model prefills from a state. A rank that did not announce itself yet: the defaults."""

    address: bytes = b""
    pid: int = 0
    shm_fd: int = -1
    weights_private: int = 0
    weights_mapped: int = 0
    #: Its model prefills from a state (what a prefix cache hit needs).
    chunked_prefill: bool = False


@dataclass(frozen=True)
class GroupHandshake:
    """The handshake record of a rank group and the checks of its peer's (module docstring)."""

    node_id: str
    role: str
    spec: StateSpec
    tp_size: int
    layout: Layout
    geometry: PageGeometry
    region_align: int
    num_pages: int
    kv_layout: str
    block_size: int
    num_blocks: int
    memory: str
    config: ConnectorConfig

    def group_info(self, ranks: Sequence[RankAnnouncement]) -> m.GroupInfo:
        """The group's record, with what its ``ranks`` announced (one per rank)."""
        return m.GroupInfo(node_id=self.node_id, role=self.role, tp_size=self.tp_size,
                           layout=self.layout.name, page_size=self.geometry.page_size,
                           region_align=self.region_align, num_pages=self.num_pages,
                           spec_json=self.spec.to_json(),
                           rank_addresses=tuple(r.address for r in ranks),
                           kv_layout=self.kv_layout, block_size=self.block_size,
                           num_blocks=self.num_blocks, host_id=host_id(),
                           memory=self.memory, verify_transfers=self.config.verify_transfers,
                           **self._shared_map_info(ranks))

    def _shared_map_info(self, ranks: Sequence[RankAnnouncement]) -> dict:
        """GroupInfo's shared-map fields: a decode group reads shared maps when its config
        says so; a prefill group serves them when the shared-map rule lets it serve some decode
        group (its ranks chose memfd buffers by the same rule) and every rank listed one."""
        from statebridge.connector.data import shared

        own = shared.MapSide.of_config(self.role, self.config, tp_size=self.tp_size,
                                       page_size=self.geometry.page_size,
                                       has_kv=self.num_blocks > 0, memory=self.memory)
        if self.role != "prefill":
            return {"shared_map": True} if own.takes_part else {}
        fds = tuple(r.shm_fd for r in ranks)
        if shared.map_threshold(own) is None or any(fd < 0 for fd in fds):
            return {}
        return {"shared_map": True, "rank_pids": tuple(r.pid for r in ranks),
                "rank_shm_fds": fds, "shared_map_min_bytes": self.config.shared_map_min_bytes}

    def rank_connect(self, info: m.GroupInfo) -> m.GroupInfo:
        """What the ranks get to plan and connect to the (checked) peer group ``info``: that
        record itself, forwarded as it came -- one handshake record between the groups and
        inside them, no copy of its fields to keep in step."""
        return info

    def check_peer_info(self, info: m.GroupInfo) -> PageGeometry:
        """The peer's page geometry, or IncompatiblePeerError/ConfigError naming the value."""
        expected_role = "decode" if self.role == "prefill" else "prefill"
        if info.memory not in ("host", "cuda"):
            raise IncompatiblePeerError(f"peer {info.node_id!r} has pools in {info.memory!r} "
                                        f"memory, expected 'host' or 'cuda'")
        if info.role != expected_role:
            raise IncompatiblePeerError(f"peer {info.node_id!r} has role {info.role!r}, "
                                        f"expected {expected_role!r}")
        try:
            spec = StateSpec.from_json(info.spec_json)
        except ConfigError as e:
            raise IncompatiblePeerError(f"peer {info.node_id!r}: {e}") from None
        if spec.kv != self.spec.kv:
            raise IncompatiblePeerError(f"peer {info.node_id!r} has KV spec {spec.kv}, we have "
                                        f"{self.spec.kv}")
        if self.spec.kv is not None:
            if info.block_size != self.block_size:
                raise IncompatiblePeerError(f"peer {info.node_id!r} has KV blocks of "
                                            f"{info.block_size} tokens, we have "
                                            f"{self.block_size}")
            try:
                BlockGeometry(self.spec.kv, info.tp_size, info.kv_layout, info.block_size,
                              info.num_blocks)
            except StatebridgeError as e:
                raise IncompatiblePeerError(f"peer {info.node_id!r}: KV block pool "
                                            f"{info.kv_layout!r} x {info.num_blocks}: {e}") \
                    from None
        if spec.to_dict() != self.spec.to_dict():
            raise IncompatiblePeerError(f"peer {info.node_id!r} serves spec {spec.fingerprint()}, "
                                        f"we serve {self.spec.fingerprint()}")
        if len(info.rank_addresses) != info.tp_size:
            raise IncompatiblePeerError(f"peer {info.node_id!r}: {len(info.rank_addresses)} "
                                        f"addresses for TP size {info.tp_size}")
        if (info.rank_pids or info.rank_shm_fds) and not (
                len(info.rank_pids) == len(info.rank_shm_fds) == info.tp_size
                and all(p > 0 for p in info.rank_pids)
                and all(fd >= 0 for fd in info.rank_shm_fds)):
            raise IncompatiblePeerError(f"peer {info.node_id!r}: shared-map pids "
                                        f"{list(info.rank_pids)} / fds {list(info.rank_shm_fds)} "
                                        f"for TP size {info.tp_size}")
        if info.verify_transfers != self.config.verify_transfers and (
                info.role == "decode" and info.verify_transfers
                or info.role == "prefill" and self.config.verify_transfers):
            decode, prefill = (info.node_id, self.node_id) if info.role == "decode" \
                else (self.node_id, info.node_id)
            raise IncompatiblePeerError(
                f"decode node {decode!r} verifies transfers (--verify-transfers) but prefill "
                f"node {prefill!r} does not send transfer digests: start the prefill node with "
                f"--verify-transfers too (or the decode node without it)")
        if info.shared_map_min_bytes < 0:
            raise IncompatiblePeerError(f"peer {info.node_id!r}: shared_map_min_bytes "
                                        f"{info.shared_map_min_bytes} < 0")
        try:
            return PageGeometry(spec, info.tp_size, info.layout, region_align=info.region_align,
                                page_size=info.page_size)
        except ConfigError as e:
            raise IncompatiblePeerError(f"peer {info.node_id!r}: {e}") from None
