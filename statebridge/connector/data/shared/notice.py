"""The notice slot: how a prefill rank tells a same-host decode rank that a request's state can
be copied out of its shared map, and how that reader says it is done.

Every rank buffer ends in control words (:class:`NoticeSlots`): one :class:`NoticeSlot` per
(page, peer rank) -- on a prefill rank the slot of (its page, the decode rank), on a decode
rank the slot of (its page, the prefill rank). A read of one request by one rank pair:

1. The prefill rank, once the request's state is final, :meth:`NoticeSlot.write`\\ s its slot:
   the notice words and, in the answer word, :data:`PENDING` ``|`` the request's serial. It
   then sends the notice (the slot's first :data:`NOTICE_BYTES`) as one small UCX message
   (tag index ``READY_INDEX``) into the decode rank's slot of the request.
2. The decode rank, when that message arrived, :meth:`NoticeSlot.read`\\ s its slot, copies the
   runs out of its read-only map of the prefill rank's buffer, then :meth:`Notice.answer`\\ s:
   one compare-and-swap of the answer word the notice names (through a read-write map of the
   prefill buffer's control words only), from ``PENDING | serial`` to ``serial``.
3. The prefill rank sees :meth:`NoticeSlot.answered` when it next looks at its pending requests
   (no message, no wake-up) and frees its page.

A late answer -- a reader frozen while a request timed out, resumed after the page (and so the
slot) went to a later request -- finds the later request's mark, not its own, and writes
nothing; so does an answer with any other serial. No reader ever maps a page or KV block of
the prefill rank writable: the answer word is the only word it can write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from statebridge.errors import ConfigError

if TYPE_CHECKING:
    from statebridge.connector.data.shared.buffer import PeerMap

__all__ = ["MAX_PEERS", "SLOT_BYTES", "NOTICE_BYTES", "PENDING", "PAGE_OFFSET", "SERIAL",
           "KV_BASE", "FIRST_BLOCK", "ANSWER_OFFSET", "ANSWER", "Notice", "NoticeSlot",
           "NoticeSlots", "next_serial"]

#: The words of a slot, by index (see the diagram of :class:`NoticeSlot`).
PAGE_OFFSET, SERIAL, KV_BASE, FIRST_BLOCK, ANSWER_OFFSET, ANSWER = range(6)
#: Most ranks of a peer group: the control words hold a slot per page and peer rank.
MAX_PEERS = 64
#: Bytes of one slot (the notice, the answer word, two spare words).
SLOT_BYTES = 64
#: Bytes of the notice a prefill rank sends: the words before the answer word.
NOTICE_BYTES = ANSWER * 8
#: The answer word holds ``PENDING | serial`` while its reader has not answered.
PENDING = 1 << 62
#: Serials are 32-bit and wrap around.
_SERIAL_MASK = 0xFFFF_FFFF


def next_serial(serial: int) -> int:
    """The serial after ``serial`` (32-bit, wrapping)."""
    return (serial + 1) & _SERIAL_MASK


@dataclass(frozen=True, slots=True)
class Notice:
    """What a decode rank read out of its slot (see :class:`NoticeSlot` for the words)."""

    page_offset: int        # the request's page in the prefill rank's buffer (bytes)
    serial: int             # the prefill rank's number of the request
    kv_base: int            # where the prefill rank's KV pool starts in its buffer (bytes)
    first_block: int        # the request's first KV block there (its table is one range)
    answer_offset: int      # the answer word's byte offset in the prefill rank's buffer

    def answer(self, peer: "PeerMap") -> bool:
        """Decode rank, after its copy: swap the pending mark of this notice's request for its
        serial in the prefill rank's buffer (``peer``, the map of that buffer). False when the
        word holds anything else (the prefill rank no longer waits for this request): nothing
        is written then, and for a serial no prefill rank writes (not 32 bits).
        :class:`~statebridge.errors.TransferError` when the word cannot be reached."""
        serial = self.serial
        if not 0 <= serial <= _SERIAL_MASK:
            return False
        return peer.answer(self.answer_offset, PENDING | serial, serial)


class NoticeSlot:
    """One slot of a rank's control words, at byte :attr:`offset` of the rank's buffer::

        word  0             1        2         3             4               5         6  7
            +-------------+--------+---------+-------------+---------------+---------+-----+
            | page_offset | serial | kv_base | first_block | answer_offset | answer  |     |
            +-------------+--------+---------+-------------+---------------+---------+-----+
            |<----------- the notice: NOTICE_BYTES (sent over UCX) -------->|
                                                            points at ------^
                        answer: PENDING | serial (waiting) -> serial (answered)

    The word indices are the module's constants :data:`PAGE_OFFSET` ... :data:`ANSWER`.
    ``page_offset``, ``kv_base`` and ``answer_offset`` are byte offsets into the prefill rank's
    buffer; ``answer_offset`` is the slot's own offset + :data:`NOTICE_BYTES` (word 5). All words
    are int64 in the machine's byte order (both sides run on one host). The decode rank's slot
    of a request receives the notice only: its own answer word is never used.
    """

    __slots__ = ("offset", "_words", "_w")

    def __init__(self, words: np.ndarray, w: int, offset: int) -> None:
        self._words = words          # int64 view of the control words
        self._w = w                  # this slot's first word in ``words``
        self.offset = offset         # this slot's byte offset in the rank's buffer

    @property
    def answer_offset(self) -> int:
        """Byte offset of this slot's answer word in the rank's buffer."""
        return self.offset + NOTICE_BYTES

    def write(self, page_offset: int, serial: int, kv_base: int, first_block: int) -> None:
        """Prefill rank, before it sends the notice: the notice words, and the pending mark of
        request ``serial`` in the answer word (replacing whatever an earlier request left)."""
        words, w = self._words, self._w
        words[w + PAGE_OFFSET] = page_offset
        words[w + SERIAL] = serial
        words[w + KV_BASE] = kv_base
        words[w + FIRST_BLOCK] = first_block
        words[w + ANSWER_OFFSET] = self.offset + NOTICE_BYTES
        words[w + ANSWER] = PENDING | serial

    def read(self) -> Notice:
        """Decode rank, once the notice arrived in this slot: its words."""
        words, w = self._words, self._w
        return Notice(page_offset=int(words[w + PAGE_OFFSET]), serial=int(words[w + SERIAL]),
                      kv_base=int(words[w + KV_BASE]), first_block=int(words[w + FIRST_BLOCK]),
                      answer_offset=int(words[w + ANSWER_OFFSET]))

    def answered(self, serial: int) -> bool:
        """Prefill rank: whether the reader of request ``serial`` answered."""
        return self._words[self._w + ANSWER] == serial

    @property
    def answer_word(self) -> int:
        """The answer word as it is now (``PENDING | serial`` or ``serial``)."""
        return int(self._words[self._w + ANSWER])

    def __repr__(self) -> str:
        return f"NoticeSlot(offset={self.offset}, answer={self.answer_word:#x})"


class NoticeSlots:
    """The control words of a rank buffer: a :class:`NoticeSlot` per (page, peer rank).

    ``words`` is an int64 view of the control words, which start at byte ``base`` of the
    buffer (a page boundary: a reader maps them, and nothing before them, writable);
    :meth:`nbytes` of ``num_pages`` is their size.
    """

    def __init__(self, words: np.ndarray, base: int, num_pages: int) -> None:
        if len(words) * 8 < self.nbytes(num_pages):
            raise ConfigError(f"{len(words)} control words cannot hold the notice slots of "
                              f"{num_pages} pages ({self.nbytes(num_pages)} bytes)")
        self._words = words
        self.base = base
        self.num_pages = num_pages
        self._slots: dict[tuple[int, int], NoticeSlot] = {}

    @staticmethod
    def nbytes(num_pages: int) -> int:
        """Bytes of the control words of ``num_pages`` pages."""
        return num_pages * MAX_PEERS * SLOT_BYTES

    def slot(self, page: int, peer_rank: int) -> NoticeSlot:
        """The slot of ``page`` for peer rank ``peer_rank`` (:class:`ConfigError` naming them
        when either is out of range)."""
        slot = self._slots.get((page, peer_rank))
        if slot is None:
            if not (_is_int(page) and _is_int(peer_rank) and 0 <= page < self.num_pages
                    and 0 <= peer_rank < MAX_PEERS):
                raise ConfigError(f"no notice slot for page {page!r} and peer rank "
                                  f"{peer_rank!r} ({self.num_pages} pages, {MAX_PEERS} peers)")
            index = page * MAX_PEERS + peer_rank
            page, peer_rank = int(page), int(peer_rank)
            slot = self._slots[page, peer_rank] = NoticeSlot(
                self._words, index * (SLOT_BYTES // 8), self.base + index * SLOT_BYTES)
        return slot


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
