"""What a rank group's processes hold in memory, per rank: the weights (private and
file-mapped, as each rank process measured them at start), its state pages and its KV pool;
the node's startup line and its stats report them (:meth:`GroupMemory.memory_line`,
:meth:`GroupMemory.rank_memory`).

:class:`GroupMemory` is given the group's geometry and pools when the group is built; what each
rank said about its weights (:class:`~statebridge.connector.handshake.RankAnnouncement`) is
given to each report as it stands then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from statebridge.connector.handshake import RankAnnouncement
from statebridge.connector.rank.startup import fmt_bytes
from statebridge.state.kv import BlockGeometry
from statebridge.state.layout import PageGeometry

__all__ = ["GroupMemory"]


@dataclass(frozen=True)
class GroupMemory:
    """Per-rank memory of a rank group (module docstring)."""

    node_id: str
    tp_size: int
    geometry: PageGeometry
    num_pages: int
    kv_geometry: BlockGeometry | None
    num_blocks: int
    block_size: int

    @property
    def pages_bytes(self) -> int:
        """Bytes of one rank's state pages."""
        return self.geometry.page_size * self.num_pages

    @property
    def kv_bytes(self) -> int:
        """Bytes of one rank's KV block pool (0 without attention KV)."""
        return self.kv_geometry.nbytes if self.kv_geometry is not None else 0

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV one rank's pool holds (every rank holds the same tokens, its heads of
        them); 0 without attention KV."""
        return self.num_blocks * self.block_size if self.kv_geometry is not None else 0

    def rank_memory(self, ranks: Sequence[RankAnnouncement] = ()) -> list[dict[str, int]]:
        """Per rank, the bytes it holds: ``weights_private`` and ``weights_mapped`` (as its
        process reported them when it started, in ``ranks``; 0 before), ``pages``,
        ``kv_pool`` and ``total`` (all four)."""
        out = []
        for st in ranks or [RankAnnouncement()] * self.tp_size:
            row = {"weights_private": st.weights_private, "weights_mapped": st.weights_mapped,
                   "pages": self.pages_bytes, "kv_pool": self.kv_bytes}
            row["total"] = sum(row.values())
            out.append(row)
        return out

    def memory_line(self, ranks: Sequence[RankAnnouncement] = ()) -> str:
        """What this node's ranks hold, in one line: per rank its weights (private and
        file-mapped, once the ranks reported them in ``ranks``), its pages, its KV pool, and
        the total."""
        line = (f"{self.node_id}: TP {self.tp_size} memory per rank: pages {self.num_pages} x "
                f"{self.geometry.page_size:,} B ({self.geometry.layout.name}) = "
                f"{fmt_bytes(self.pages_bytes)}")
        if self.kv_geometry is not None:
            geo = self.kv_geometry
            line += (f", KV pool {self.kv_tokens:,} tokens ({geo.num_blocks:,} blocks x "
                     f"{geo.block_size} tokens x {geo.bytes_per_block:,} B, {geo.layout.name})"
                     f" = {fmt_bytes(self.kv_bytes)}")
        rows = self.rank_memory(ranks)
        if not any(r["weights_private"] or r["weights_mapped"] for r in rows):
            return line + (f"; total {fmt_bytes(rows[0]['total'])} per rank without weights "
                           f"(not loaded yet or none)")
        per_rank = "; ".join(
            f"rank {r}: weights {fmt_bytes(row['weights_private'])} private + "
            f"{fmt_bytes(row['weights_mapped'])} file-mapped, total {fmt_bytes(row['total'])}"
            for r, row in enumerate(rows))
        return line + f"; {per_rank}; node total {fmt_bytes(sum(r['total'] for r in rows))}"
