"""The request ledger on its own: a request attempt's page and KV blocks, its answers from the
ranks, its first failure, lost ranks, and when its page may be freed."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from statebridge.connector import messages as m
from statebridge.connector.ledger import Ledger, Phase, RequestKey
from statebridge.errors import CacheFullError, ConfigError, FailureKind
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockPool

KEY = RequestKey("decode-a", "req-1", 7)


def done(rank: int, key: RequestKey = KEY, kind: str = "") -> m.RankDone:
    """Rank ``rank``'s answer for ``key`` (``kind``: a failure's wire name). The ledger reads
    the key and ``kind``; every other field the message requires gets a zero."""
    zero = {str: "", int: 0, float: 0.0, bool: False}
    hints = typing.get_type_hints(m.RankDone)
    values = {f.name: zero[hints[f.name]] for f in dataclasses.fields(m.RankDone)
              if f.default is dataclasses.MISSING}
    values.update(tp_rank=rank, peer_node=key.peer_node, request_id=key.request_id,
                  generation=key.generation, kind=kind, message=f"rank {rank}: {kind}")
    return m.RankDone(**values)


def ledger(tp_size: int = 3, num_pages: int = 4, num_blocks: int | None = 16) -> Ledger:
    return Ledger(tp_size, PagePool(num_pages),
                  BlockPool(num_blocks) if num_blocks is not None else None)


def test_key_names_the_attempt_and_the_other_side():
    assert str(KEY) == "req-1#7@decode-a"
    assert str(RequestKey("", "req-1", 2)) == "req-1#2@local"
    # the generation and the other node are part of the key: a retry or another node's
    # request of the same id is another attempt
    assert len({KEY, RequestKey("decode-a", "req-1", 8), RequestKey("decode-b", "req-1", 7),
                RequestKey("decode-a", "req-1", 7)}) == 3


def test_open_takes_a_page_and_the_blocks_and_tracks_the_attempt():
    book = ledger(num_pages=4, num_blocks=16)
    peer = object()
    record = book.open(KEY, deadline=12.5, peer=peer, num_blocks=3, contiguous=True)
    assert record.phase is Phase.ACTIVE and record.failure is None and record.done == {}
    assert (record.key, record.request_id, record.generation, record.peer_node) == (
        KEY, "req-1", 7, "decode-a")
    assert (record.deadline, record.peer) == (12.5, peer)
    assert book.pool.is_allocated(record.page) and book.pool.num_used == 1
    assert record.blocks == [0, 1, 2] and book.blocks.num_used == 3
    assert len(book) == 1 and KEY in book and book.get(KEY) is record
    assert list(book) == [record] and book.of_peer("decode-a") == [record]
    # a request without KV takes a page and no block
    other = book.open(RequestKey("decode-b", "req-2", 1), deadline=1.0)
    assert other.blocks == [] and other.page != record.page and book.blocks.num_used == 3
    assert book.of_peer("decode-b") == [other] and len(book) == 2


def test_unknown_keys_are_no_one():
    book = ledger()
    record = book.open(KEY, deadline=1.0)
    for unknown in (RequestKey("decode-a", "req-1", 8),       # another generation
                    RequestKey("decode-b", "req-1", 7),       # another node's id
                    RequestKey("decode-a", "req-9", 7)):
        assert unknown not in book and book.get(unknown) is None
        assert book.answer(0, done(0, unknown)) is None
    assert book.of_peer("decode-z") == []
    # the answers for unknown keys touched nothing
    assert record.done == {} and record.phase is Phase.ACTIVE
    assert book.pending_ranks(record) == [0, 1, 2]


def test_open_refuses_a_tracked_key_holding_nothing_more():
    book = ledger()
    book.open(KEY, deadline=1.0, num_blocks=2)
    with pytest.raises(ConfigError, match="req-1#7@decode-a"):
        book.open(KEY, deadline=2.0, num_blocks=2)
    assert (book.pool.num_used, book.blocks.num_used, len(book)) == (1, 2, 1)


def test_open_back_pressure_holds_nothing():
    book = ledger(num_pages=1, num_blocks=4)
    with pytest.raises(CacheFullError, match="5 KV blocks wanted, 4 free of 4"):
        book.open(KEY, deadline=1.0, num_blocks=5)
    assert (book.pool.num_used, book.blocks.num_used, len(book)) == (0, 0, 0)
    book.open(KEY, deadline=1.0, num_blocks=1)
    with pytest.raises(CacheFullError, match="all 1 pages"):
        book.open(RequestKey("decode-a", "req-2", 8), deadline=1.0, num_blocks=1)
    assert (book.pool.num_used, book.blocks.num_used, len(book)) == (1, 1, 1)


def test_open_contiguous_refuses_scattered_blocks_and_returns_the_page():
    book = ledger(num_pages=4, num_blocks=6)
    first = book.open(RequestKey("d", "a", 1), deadline=1.0, num_blocks=2)    # 0, 1
    book.open(RequestKey("d", "b", 2), deadline=1.0, num_blocks=2)           # 2, 3
    book.free(first)                                                         # 0, 1 | 4, 5
    with pytest.raises(CacheFullError, match="3 contiguous KV blocks wanted, longest free "
                                             "range 2"):
        book.open(KEY, deadline=1.0, num_blocks=3, contiguous=True)
    assert (book.pool.num_used, book.blocks.num_used, len(book)) == (1, 2, 1)


def test_blocks_without_a_block_pool_are_refused_before_a_page_is_taken():
    book = ledger(num_blocks=None)
    with pytest.raises(ConfigError, match="wants 2 KV blocks; the group has no KV block pool"):
        book.open(KEY, deadline=1.0, num_blocks=2)
    assert book.pool.num_used == 0 and len(book) == 0
    record = book.open(KEY, deadline=1.0)
    with pytest.raises(ConfigError, match="no KV block pool"):
        book.grow(record, 1)


def test_done_only_when_every_rank_answered_ok():
    book = ledger(tp_size=3)
    record = book.open(KEY, deadline=1.0, num_blocks=1)
    for rank, pending in ((2, [0, 1]), (0, [1])):
        assert book.answer(rank, done(rank)) is record
        assert record.phase is Phase.ACTIVE
        assert book.pending_ranks(record) == pending and not book.quiet(record)
    assert book.answer(1, done(1)) is record
    assert record.phase is Phase.DONE and record.failure is None
    assert book.pending_ranks(record) == [] and book.quiet(record)
    assert sorted(record.done) == [0, 1, 2] and record.done[1].tp_rank == 1


def test_a_failed_answer_never_makes_the_attempt_done():
    """A rank that answers with a failure kind leaves the attempt ACTIVE for its coordinator to
    fail (the ledger records no failure by itself); it is quiet once every rank answered."""
    book = ledger(tp_size=2)
    record = book.open(KEY, deadline=1.0)
    book.answer(0, done(0, kind=FailureKind.TIMEOUT.value))
    book.answer(1, done(1))
    assert record.phase is Phase.ACTIVE and record.failure is None
    assert book.quiet(record)


def test_the_first_failure_wins_and_answers_after_it_do_not_complete():
    book = ledger(tp_size=2)
    record = book.open(KEY, deadline=1.0)
    assert book.fail(record, FailureKind.TIMEOUT, "lease expired") is True
    assert record.phase is Phase.FAILED
    assert book.fail(record, FailureKind.PEER_LOST, "peer gone") is False      # double fail
    assert record.failure == (FailureKind.TIMEOUT, "lease expired")
    # the ranks had finished before they heard of the failure: still FAILED, now quiet
    book.answer(0, done(0))
    book.answer(1, done(1))
    assert record.phase is Phase.FAILED and book.quiet(record)


def test_a_failed_page_and_its_blocks_wait_for_every_live_rank():
    """The rule of the module docstring: a page (and the KV blocks freed with it) waits until
    no rank that is not lost can still touch it; a lost rank is never waited for."""
    book = ledger(tp_size=3, num_pages=2, num_blocks=8)
    record = book.open(KEY, deadline=1.0, num_blocks=3)
    book.fail(record, FailureKind.ABORTED, "aborted by caller")
    assert book.pending_ranks(record) == [0, 1, 2] and not book.quiet(record)
    book.answer(1, done(1, kind=FailureKind.ABORTED.value))       # rank 1 cancelled its part
    assert book.pending_ranks(record) == [0, 2] and not book.quiet(record)
    assert book.busy_pages() == [1, 0, 1]
    book.answer(0, done(0, kind=FailureKind.ABORTED.value))
    assert book.pending_ranks(record) == [2] and not book.quiet(record)
    # while a rank may still touch them, the page and blocks stay held
    assert book.pool.is_allocated(record.page) and book.blocks.num_used == 3
    book.lost.add(2)                                              # rank 2's process died
    assert book.pending_ranks(record) == [] and book.quiet(record)
    assert book.busy_pages() == [0, 0, 0]
    assert book.free(record) is True
    assert not book.pool.is_allocated(record.page) and book.pool.num_used == 0
    assert book.blocks.num_used == 0 and len(book) == 0 and KEY not in book


def test_a_lost_rank_is_not_waited_for_but_cannot_complete_an_attempt():
    """Without a lost rank's answer an attempt never turns DONE (its part of the state is
    missing), though nothing is pending on it."""
    book = ledger(tp_size=2)
    book.lost.add(1)
    record = book.open(KEY, deadline=1.0)
    assert book.pending_ranks(record) == [0] and book.busy_pages() == [1, 0]
    book.answer(0, done(0))
    assert record.phase is Phase.ACTIVE and book.quiet(record)


def test_free_twice_and_a_stale_record_free_nothing():
    book = ledger(num_pages=2, num_blocks=8)
    record = book.open(KEY, deadline=1.0, num_blocks=2)
    assert book.free(record) is True
    assert book.free(record) is False                            # double free: no error either
    assert (book.pool.num_used, book.blocks.num_used) == (0, 0)
    # the same key opened again (a new record): the old record object frees nothing of it
    again = book.open(KEY, deadline=2.0, num_blocks=2)
    assert book.free(record) is False
    assert book.get(KEY) is again and book.pool.is_allocated(again.page)
    assert book.blocks.num_used == 2
    # nor does an answer for the key reach the old record
    assert book.answer(0, done(0)) is again and record.done == {}


def test_grow_extends_the_table_after_its_last_block():
    book = ledger(num_pages=4, num_blocks=10)
    record = book.open(KEY, deadline=1.0, num_blocks=2)                     # 0, 1
    book.open(RequestKey("decode-a", "other", 8), deadline=1.0, num_blocks=1)  # 2
    assert book.grow(record, 2) == [] and book.grow(record, 1) == []        # never shrinks
    assert record.blocks == [0, 1]
    added = book.grow(record, 5)            # 2 is taken: the first free range after it
    assert added == [3, 4, 5] and record.blocks == [0, 1, 3, 4, 5]
    assert book.grow(record, 7) == [6, 7] and record.blocks == [0, 1, 3, 4, 5, 6, 7]
    assert book.blocks.num_used == 8
    with pytest.raises(CacheFullError, match="3 KV blocks wanted, 2 free of 10"):
        book.grow(record, 10)
    assert record.blocks == [0, 1, 3, 4, 5, 6, 7] and book.blocks.num_used == 8   # nothing taken
    # every grown block is freed with the page
    book.free(record)
    assert book.blocks.num_used == 1 and book.pool.num_used == 1


def test_busy_pages_counts_each_ranks_unanswered_requests():
    book = ledger(tp_size=3, num_pages=4)
    a = book.open(RequestKey("d", "a", 1), deadline=1.0)
    b = book.open(RequestKey("d", "b", 2), deadline=1.0)
    c = book.open(RequestKey("d", "c", 3), deadline=1.0)
    assert book.busy_pages() == [3, 3, 3]
    for rank in range(3):
        book.answer(rank, done(rank, a.key))          # a: DONE, nobody busy with it
    book.answer(0, done(0, b.key))
    book.answer(2, done(2, c.key, kind=FailureKind.TRANSFER_ERROR.value))
    assert a.phase is Phase.DONE
    assert book.busy_pages() == [1, 2, 1]
    book.lost.add(1)
    assert book.busy_pages() == [1, 0, 1]


def test_iteration_is_a_snapshot_the_caller_may_free_from():
    """Coordinators fail and free records while they walk the ledger."""
    book = ledger(tp_size=1, num_pages=3)
    keys = [RequestKey("d", f"r{i}", i + 1) for i in range(3)]
    for key in keys:
        book.open(key, deadline=1.0)
    seen = []
    for record in book:
        seen.append(record.key)
        book.fail(record, FailureKind.CLOSED, "closing")
        book.answer(0, done(0, record.key, kind=FailureKind.CLOSED.value))
        assert book.quiet(record) and book.free(record)
    assert seen == keys and len(book) == 0 and book.pool.num_used == 0
