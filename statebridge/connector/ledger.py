"""The request ledger: how a coordinator (prefill server or decode coordinator) tracks each
request attempt from its first message until its page may be reused.

Runs on the coordinator's loop thread only (no locks).

One key everywhere
------------------
A request attempt is :class:`RequestKey` ``(peer_node, request_id, generation)`` on every
process that touches it: ``peer_node`` is the node on the OTHER side of the transfer (on the
prefill side the decode node that asked; on the decode side the prefill node that computes,
or ``""`` for a local recompute). The decode node numbers its attempts with fresh generations,
so the key is unique on both sides, and two decode nodes that use the same request id (their
generations both start at 1) never collide on a prefill node or its ranks.

One lifecycle
-------------
::

    ACTIVE --every rank answered ok--> DONE --(prefill: at once / decode: released)--> freed
       \\--first failure--> FAILED --every live rank confirmed nothing touches the page--> freed

A page -- and the request's KV blocks, freed with it -- is freed only when no rank can still
write into it (or send from it): every rank that is not lost has answered ``RankDone``. A
failure is recorded once (the first kind wins).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Iterator

from statebridge.connector import messages as m
from statebridge.errors import ConfigError, FailureKind
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockPool

__all__ = ["RequestKey", "Phase", "Record", "Ledger"]


@dataclass(frozen=True, slots=True)
class RequestKey:
    """One request attempt: the node on the other side, the request id, the generation."""

    peer_node: str
    request_id: str
    generation: int

    def __str__(self) -> str:
        return f"{self.request_id}#{self.generation}@{self.peer_node or 'local'}"


class Phase(enum.Enum):
    """Where a request attempt stands (see the module docstring)."""

    ACTIVE = "active"       # ranks work on it
    DONE = "done"           # every rank finished its part; the page holds (or held) the state
    FAILED = "failed"       # failed; the page waits for every rank to confirm


@dataclass(eq=False)
class Record:
    """A request attempt as a coordinator tracks it, until its page is freed."""

    key: RequestKey
    page: int
    deadline: float                                  # monotonic; lease or transfer bound
    started: float = field(default_factory=time.perf_counter)
    phase: Phase = Phase.ACTIVE
    done: dict[int, m.RankDone] = field(default_factory=dict)   # rank -> its answer
    failure: tuple[FailureKind, str] | None = None
    #: What the request produced once DONE (the decode side's TransferResult).
    result: object = None
    #: The side's handle of the node on the other side (the connection it came from).
    peer: object = None
    #: The request's KV block table (ids the same on every rank of the group); freed with
    #: the page.
    blocks: list[int] = field(default_factory=list)
    #: Wall clock: when the caller got the request (the decode side's queue time starts).
    arrived_at: float = 0.0

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def generation(self) -> int:
        return self.key.generation

    @property
    def peer_node(self) -> str:
        return self.key.peer_node


class Ledger:
    """Every request attempt of one TP group, keyed by :class:`RequestKey`, with the pages of
    ``pool``. ``lost`` ranks (dead processes) are never waited for."""

    def __init__(self, tp_size: int, pool: PagePool, blocks: BlockPool | None = None) -> None:
        self.tp_size = tp_size
        self.pool = pool
        self.blocks = blocks
        self.lost: set[int] = set()
        self._records: dict[RequestKey, Record] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(list(self._records.values()))

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._records

    def get(self, key: RequestKey) -> Record | None:
        return self._records.get(key)

    def of_peer(self, peer_node: str) -> list[Record]:
        return [r for r in self._records.values() if r.key.peer_node == peer_node]

    def open(self, key: RequestKey, deadline: float, peer: object = None, *,
             num_blocks: int = 0, contiguous: bool = False) -> Record:
        """Allocate the request's page and ``num_blocks`` KV blocks (``contiguous``: one range
        of consecutive ids) (:class:`~statebridge.errors.CacheFullError` naming the numbers
        when either is short: back-pressure; nothing is held then) and track it."""
        if key in self._records:
            raise ConfigError(f"request {key} is already tracked")
        if num_blocks and self.blocks is None:
            raise ConfigError(f"request {key} wants {num_blocks} KV blocks; the group has no "
                              f"KV block pool")
        page = self.pool.allocate()
        blocks: list[int] = []
        if num_blocks:
            try:
                blocks = self.blocks.allocate(num_blocks, contiguous=contiguous)
            except BaseException:
                self.pool.free(page)
                raise
        record = Record(key, page, deadline, peer=peer, blocks=blocks)
        self._records[key] = record
        return record

    def grow(self, record: Record, num_blocks: int) -> list[int]:
        """Extend ``record``'s block table to ``num_blocks`` blocks (contiguous after its last
        block where free); CacheFullError naming the numbers when short (nothing taken).
        Returns the blocks added."""
        if self.blocks is None:
            raise ConfigError("the group has no KV block pool")
        more = num_blocks - len(record.blocks)
        if more <= 0:
            return []
        added = self.blocks.allocate(more, after=record.blocks[-1] if record.blocks else None)
        record.blocks.extend(added)
        return added

    def pending_ranks(self, record: Record) -> list[int]:
        """The live ranks that have not answered: they may still touch the page."""
        return [r for r in range(self.tp_size) if r not in record.done and r not in self.lost]

    def answer(self, rank: int, msg: m.RankDone) -> Record | None:
        """Rank ``rank`` finished its part of the request ``msg`` names (None: unknown, e.g.
        already freed). The record turns DONE when every rank answered ok."""
        record = self._records.get(RequestKey(msg.peer_node, msg.request_id, msg.generation))
        if record is None:
            return None
        record.done[rank] = msg
        if record.phase is Phase.ACTIVE and not msg.kind and len(record.done) == self.tp_size \
                and all(not d.kind for d in record.done.values()):
            record.phase = Phase.DONE
        return record

    def fail(self, record: Record, kind: FailureKind, message: str) -> bool:
        """Record the first failure of ``record``; False if it had one already."""
        if record.failure is not None:
            return False
        record.failure = (kind, message)
        record.phase = Phase.FAILED
        return True

    def quiet(self, record: Record) -> bool:
        """Whether no live rank can still touch the record's page."""
        return not self.pending_ranks(record)

    def free(self, record: Record) -> bool:
        """Forget ``record`` and free its page; False if it was freed already. Callers free
        only a quiet record."""
        if self._records.get(record.key) is not record:
            return False
        del self._records[record.key]
        if record.page >= 0:                   # -1: the prefill side's prefix cache took it
            self.pool.free(record.page)
        if record.blocks:
            self.blocks.free(record.blocks)
        return True

    def busy_pages(self) -> list[int]:
        """Per rank, how many pages it may still touch (requests without its answer)."""
        busy = [0] * self.tp_size
        for record in self._records.values():
            for r in self.pending_ranks(record):
                busy[r] += 1
        return busy
