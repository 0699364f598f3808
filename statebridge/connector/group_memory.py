"""What a rank group's processes hold in memory, per rank: the weights (private and
file-mapped, as each rank process measured them at start), its state pages and its KV pool;
the node's startup line and its stats report them (:meth:`GroupMemory.memory_line`,
:meth:`GroupMemory.rank_memory`).

:class:`GroupMemory` is a part of :class:`~statebridge.connector.group.RankGroup` (its base
class): it reads the group's geometry, pools and rank slots.
"""

from __future__ import annotations

from statebridge.connector.rank.startup import fmt_bytes

__all__ = ["GroupMemory"]


class GroupMemory:
    """Per-rank memory of a rank group (module docstring)."""

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

    def rank_memory(self) -> list[dict[str, int]]:
        """Per rank, the bytes it holds: ``weights_private`` and ``weights_mapped`` (as its
        process reported them when it started; 0 before), ``pages``, ``kv_pool`` and
        ``total`` (all four)."""
        from statebridge.connector.group import _RankState   # (group imports this module)

        out = []
        for st in getattr(self, "ranks", None) or [_RankState()] * self.tp_size:
            row = {"weights_private": st.weights_private, "weights_mapped": st.weights_mapped,
                   "pages": self.pages_bytes, "kv_pool": self.kv_bytes}
            row["total"] = sum(row.values())
            out.append(row)
        return out

    def memory_line(self) -> str:
        """What this node's ranks hold, in one line: per rank its weights (private and
        file-mapped, once the ranks reported them), its pages, its KV pool, and the total."""
        line = (f"{self.node_id}: TP {self.tp_size} memory per rank: pages {self.num_pages} x "
                f"{self.geometry.page_size:,} B ({self.layout.name}) = "
                f"{fmt_bytes(self.pages_bytes)}")
        if self.kv_geometry is not None:
            geo = self.kv_geometry
            line += (f", KV pool {self.kv_tokens:,} tokens ({geo.num_blocks:,} blocks x "
                     f"{geo.block_size} tokens x {geo.bytes_per_block:,} B, {geo.layout.name})"
                     f" = {fmt_bytes(self.kv_bytes)}")
        rows = self.rank_memory()
        if not any(r["weights_private"] or r["weights_mapped"] for r in rows):
            return line + (f"; total {fmt_bytes(rows[0]['total'])} per rank without weights "
                           f"(not loaded yet or none)")
        per_rank = "; ".join(
            f"rank {r}: weights {fmt_bytes(row['weights_private'])} private + "
            f"{fmt_bytes(row['weights_mapped'])} file-mapped, total {fmt_bytes(row['total'])}"
            for r, row in enumerate(rows))
        return line + f"; {per_rank}; node total {fmt_bytes(sum(r['total'] for r in rows))}"
