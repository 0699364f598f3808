"""The shared-map protocol itself (connector/data/shared/notice.py and eligibility.py), without
UCX or rank processes: a prefill rank's slot in a memfd buffer, the notice copied into a decode
rank's slot as UCX would, and the reader's answer through a map of the prefill buffer.

Checked: the words land where the layout says; a reader frozen while its request was given up
and the page reused answers nothing that counts; a stale or foreign serial writes nothing; the
answer word is the only byte a reader ever changes; and the one eligibility rule."""

from __future__ import annotations

import dataclasses
import mmap
import os

import numpy as np
import pytest

from statebridge.bench.ab import with_switches
from statebridge.config import ConnectorConfig
from statebridge.connector.data import shared
from statebridge.connector.data.shared import (
    MAX_PEERS,
    NOTICE_BYTES,
    PENDING,
    SLOT_BYTES,
    MapSide,
    NoticeSlots,
    map_threshold,
    next_serial,
)
from statebridge.connector.data.shared import notice as nt
from statebridge.errors import ConfigError

NUM_PAGES = 3
PAGES_BYTES = 2 * mmap.PAGESIZE               # what stands for the pages and the KV pool


class Rank:
    """A rank buffer: "pages" (random bytes), then the control words from a page boundary."""

    def __init__(self, seed: int) -> None:
        self.base = PAGES_BYTES
        self.buffer = shared.SharedBuffer(self.base + NoticeSlots.nbytes(NUM_PAGES))
        self.bytes = self.buffer.tensor.numpy()
        self.bytes[:self.base] = np.random.default_rng(seed).integers(0, 256, self.base,
                                                                      dtype=np.uint8)
        self.slots = NoticeSlots(self.bytes[self.base:].view(np.int64), self.base, NUM_PAGES)

    def deliver(self, slot: nt.NoticeSlot, to: "Rank", page: int, peer_rank: int):
        """What UCX does with a notice: the slot's first NOTICE_BYTES into ``to``'s slot."""
        dst = to.slots.slot(page, peer_rank)
        to.bytes[dst.offset:dst.offset + NOTICE_BYTES] = \
            self.bytes[slot.offset:slot.offset + NOTICE_BYTES]
        return dst


@pytest.fixture
def link():
    """A prefill rank (rank 1 of its group), a decode rank (rank 0), the decode rank's map of
    the prefill buffer (this process maps its own memfd, as a same-host peer would)."""
    prefill, decode = Rank(1), Rank(2)
    return prefill, decode, shared.PeerMap(os.getpid(), prefill.buffer.fd)


def test_the_slot_layout_is_the_documented_one():
    assert (nt.PAGE_OFFSET, nt.SERIAL, nt.KV_BASE, nt.FIRST_BLOCK, nt.ANSWER_OFFSET,
            nt.ANSWER) == (0, 1, 2, 3, 4, 5)
    assert NOTICE_BYTES == 40 == nt.ANSWER * 8           # the notice: the words before the answer
    assert SLOT_BYTES == 64 and MAX_PEERS == 64
    assert NoticeSlots.nbytes(5) == 5 * 64 * 64
    words = np.zeros(NoticeSlots.nbytes(2) // 8, dtype=np.int64)
    slots = NoticeSlots(words, 4096, 2)
    assert slots.slot(0, 0).offset == 4096
    assert slots.slot(0, 1).offset == 4096 + 64
    assert slots.slot(1, 3).offset == 4096 + (64 + 3) * 64
    assert slots.slot(1, 3) is slots.slot(1, 3)
    slots.slot(1, 3).write(page_offset=11, serial=22, kv_base=33, first_block=44)
    w = (64 + 3) * 8
    assert words[w:w + 8].tolist() == [11, 22, 33, 44, 4096 + (64 + 3) * 64 + 40, PENDING | 22,
                                       0, 0]
    assert not words[:w].any() and not words[w + 8:].any()


@pytest.mark.parametrize("page, peer_rank", [(-1, 0), (2, 0), (0, -1), (0, 64), (1.5, 0)])
def test_a_slot_outside_the_control_words_is_refused_naming_it(page, peer_rank):
    slots = NoticeSlots(np.zeros(NoticeSlots.nbytes(2) // 8, dtype=np.int64), 0, 2)
    with pytest.raises(ConfigError, match=f"page {page!r} and peer rank {peer_rank!r}"):
        slots.slot(page, peer_rank)


def test_control_words_too_short_for_the_pages_are_refused():
    with pytest.raises(ConfigError, match="3 pages"):
        NoticeSlots(np.zeros(NoticeSlots.nbytes(3) // 8 - 1, dtype=np.int64), 0, 3)


def test_a_notice_is_read_as_written_and_its_answer_lands_in_the_prefill_slot(link):
    prefill, decode, peer_map = link
    pages_before = prefill.bytes[:prefill.base].copy()
    src = prefill.slots.slot(page=2, peer_rank=0)          # prefill page 2, decode rank 0
    src.write(page_offset=8192, serial=5, kv_base=4096, first_block=7)
    assert not src.answered(5) and src.answer_word == PENDING | 5
    dst = prefill.deliver(src, decode, page=1, peer_rank=1)  # decode page 1, prefill rank 1
    notice = dst.read()
    assert notice == shared.Notice(page_offset=8192, serial=5, kv_base=4096, first_block=7,
                                   answer_offset=src.answer_offset)
    assert notice.answer(peer_map)
    assert src.answered(5) and src.answer_word == 5
    # The answer word is the only thing the reader changed, on either side.
    assert np.array_equal(prefill.bytes[:prefill.base], pages_before)
    changed = np.flatnonzero(prefill.bytes[prefill.base:].view(np.int64)
                             != _written(prefill, {src: (8192, 5, 4096, 7, 5)}))
    assert changed.size == 0
    assert not notice.answer(peer_map)                     # answered once


def test_a_frozen_reader_resumed_after_its_page_was_reused_writes_nothing(link):
    """The reader of serial 5 is frozen (SIGSTOP) after it read the notice; the prefill rank
    gives the request up (transfer timeout), frees the page, and the page's next request
    (serial 6) writes the same slot. The resumed reader's answer finds serial 6's mark: no
    write, and request 6 still waits for its own reader."""
    prefill, decode, peer_map = link
    slot = prefill.slots.slot(page=0, peer_rank=0)
    slot.write(page_offset=0, serial=5, kv_base=0, first_block=0)
    frozen = prefill.deliver(slot, decode, page=0, peer_rank=1).read()
    slot.write(page_offset=0, serial=next_serial(5), kv_base=0, first_block=3)
    fresh = prefill.deliver(slot, decode, page=2, peer_rank=1).read()
    assert (frozen.serial, fresh.serial) == (5, 6)
    assert frozen.answer_offset == fresh.answer_offset    # the same word: the page was reused

    assert not frozen.answer(peer_map)                     # resumed: late, writes nothing
    assert slot.answer_word == PENDING | 6 and not slot.answered(6) and not slot.answered(5)
    assert fresh.answer(peer_map)
    assert slot.answered(6)
    assert not frozen.answer(peer_map)                     # still nothing, after the answer too
    assert slot.answer_word == 6


@pytest.mark.parametrize("serial", [4, 6, 0, PENDING | 5, 5 + (1 << 32)],
                         ids=["older", "newer", "zero", "pending-mark", "other-high-bits"])
def test_an_answer_with_a_stale_or_foreign_serial_writes_nothing(link, serial):
    prefill, decode, peer_map = link
    slot = prefill.slots.slot(page=1, peer_rank=0)
    slot.write(page_offset=4096, serial=5, kv_base=0, first_block=0)
    forged = dataclasses.replace(prefill.deliver(slot, decode, 1, 1).read(), serial=serial)
    before = prefill.bytes.copy()
    assert not forged.answer(peer_map)
    assert np.array_equal(prefill.bytes, before)
    assert slot.answer_word == PENDING | 5 and not slot.answered(5)


def test_a_reused_page_waits_for_its_new_request_only(link):
    """Request 5 of page 0 is answered; page 0 goes to request 6 with other bases. The slot
    holds request 6's notice and mark: the old answer does not count for it."""
    prefill, decode, peer_map = link
    slot = prefill.slots.slot(page=0, peer_rank=0)
    slot.write(page_offset=0, serial=5, kv_base=4096, first_block=1)
    assert prefill.deliver(slot, decode, 0, 1).read().answer(peer_map)
    assert slot.answered(5)
    slot.write(page_offset=0, serial=6, kv_base=4096, first_block=9)
    assert not slot.answered(6) and not slot.answered(5)
    notice = prefill.deliver(slot, decode, 0, 1).read()
    assert (notice.serial, notice.first_block) == (6, 9)
    assert notice.answer(peer_map) and slot.answered(6)


def test_each_peer_rank_of_a_page_has_its_own_slot(link):
    """Two decode ranks read one prefill page: each answers its own word; the request is done
    only when both did."""
    prefill, decode, peer_map = link
    slots = [prefill.slots.slot(page=1, peer_rank=r) for r in (0, 1)]
    for s in slots:
        s.write(page_offset=4096, serial=9, kv_base=0, first_block=0)
    notices = [prefill.deliver(s, decode, 2, r).read() for r, s in enumerate(slots)]
    assert notices[0].answer_offset != notices[1].answer_offset
    assert notices[1].answer(peer_map)
    assert [s.answered(9) for s in slots] == [False, True]
    assert notices[0].answer(peer_map)
    assert all(s.answered(9) for s in slots)


def test_serials_wrap_around_and_serial_zero_is_still_pending_until_answered(link):
    prefill, decode, peer_map = link
    assert next_serial(0xFFFF_FFFF) == 0 and next_serial(0) == 1
    slot = prefill.slots.slot(page=0, peer_rank=0)
    slot.write(page_offset=0, serial=0, kv_base=0, first_block=0)
    assert not slot.answered(0)                            # the mark is not the bare serial
    assert prefill.deliver(slot, decode, 0, 0).read().answer(peer_map)
    assert slot.answered(0)


def _written(rank: Rank, slots: dict) -> np.ndarray:
    """The control words as they must be: zeros, and each slot's (page offset, serial, KV
    base, first block, answer) words with its answer offset."""
    words = np.zeros(NoticeSlots.nbytes(NUM_PAGES) // 8, dtype=np.int64)
    for slot, (page_offset, serial, kv_base, first_block, answer) in slots.items():
        w = (slot.offset - rank.base) // 8
        words[w:w + 6] = [page_offset, serial, kv_base, first_block, slot.answer_offset, answer]
    return words


# -- the one eligibility rule ---------------------------------------------------------------------

HOST = "boot/pidns"
PREFILL = MapSide(role="prefill", takes_part=True, tp_size=2, page_size=8 << 20, has_kv=False,
                  host_id=HOST, min_bytes=4 << 20)
DECODE = MapSide(role="decode", takes_part=True, tp_size=4, page_size=1 << 20, has_kv=False,
                 host_id=HOST)


@pytest.mark.parametrize("prefill, decode, expected", [
    (PREFILL, DECODE, 4 << 20),
    (PREFILL, None, 4 << 20),
    (dataclasses.replace(PREFILL, has_kv=True), dataclasses.replace(DECODE, has_kv=True), 0),
    (dataclasses.replace(PREFILL, has_kv=True), DECODE, 4 << 20),
    (dataclasses.replace(PREFILL, has_kv=True), None, 0),
    (dataclasses.replace(PREFILL, page_size=(4 << 20) - 1), DECODE, None),
    (dataclasses.replace(PREFILL, page_size=(4 << 20) - 1), None, None),
    (dataclasses.replace(PREFILL, page_size=1, has_kv=True), None, 0),
    (dataclasses.replace(PREFILL, takes_part=False), DECODE, None),
    (dataclasses.replace(PREFILL, takes_part=False), None, None),
    (PREFILL, dataclasses.replace(DECODE, takes_part=False), None),
    (PREFILL, dataclasses.replace(DECODE, host_id="other"), None),
    (dataclasses.replace(PREFILL, host_id=""), dataclasses.replace(DECODE, host_id=""), None),
    (PREFILL, dataclasses.replace(DECODE, tp_size=MAX_PEERS), 4 << 20),
    (PREFILL, dataclasses.replace(DECODE, tp_size=MAX_PEERS + 1), None),
    (dataclasses.replace(PREFILL, tp_size=MAX_PEERS + 1), None, None),
], ids=["large-pages", "large-pages-alone", "hybrid", "kv-on-prefill-only", "kv-alone",
        "small-pages", "small-pages-alone", "small-pages-with-kv", "prefill-off",
        "prefill-off-alone", "decode-off", "other-host", "unknown-hosts", "64-ranks",
        "65-ranks", "65-ranks-alone"])
def test_the_eligibility_rule(prefill, decode, expected):
    assert map_threshold(prefill, decode) == expected


def test_both_sides_of_a_link_see_the_same_sides():
    """A prefill group's own side (its config) and the side its GroupInfo shows its peer are
    the same for the rule; a prefill GroupInfo that does not list every rank's buffer takes no
    part."""
    from statebridge.connector import messages as m
    from statebridge.net import host_id

    config = ConnectorConfig(shared_map_min_bytes=1 << 20)
    own = MapSide.of_config("prefill", config, tp_size=2, page_size=2 << 20, has_kv=True)
    info = m.GroupInfo(node_id="p", role="prefill", tp_size=2, layout="DLS",
                       page_size=2 << 20, region_align=16, num_pages=4, spec_json="{}",
                       rank_addresses=(b"a", b"b"), num_blocks=8, host_id=host_id(),
                       shared_map=True, rank_pids=(10, 11), rank_shm_fds=(5, 6),
                       shared_map_min_bytes=1 << 20)
    assert MapSide.of_info(info) == own
    decode = MapSide.of_config("decode", config, tp_size=1, page_size=1, has_kv=True)
    assert map_threshold(own, decode) == map_threshold(MapSide.of_info(info), decode) == 0
    unlisted = dataclasses.replace(info, rank_shm_fds=(5,))
    assert not MapSide.of_info(unlisted).takes_part
    assert map_threshold(MapSide.of_info(unlisted), decode) is None
    off = MapSide.of_config("decode", with_switches(ConnectorConfig(), shared_map=False),
                            tp_size=1, page_size=1, has_kv=True)
    assert map_threshold(own, off) is None
