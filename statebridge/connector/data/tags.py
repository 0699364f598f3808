"""Message tags: which request attempt, source rank and run a data-plane message belongs to.

Every message carries a 64-bit tag from :func:`make_tag`::

    bit 63 ............ 32 | 31 ...... 24 | 23 ................ 0
        generation (32)    | src rank (8) | index (24)

The generation is unique per request attempt, so a recycled request id (or page) with a new
generation can never match a stale message of an earlier attempt: the stale message just sits
in UCX's unexpected queue (:meth:`Transport.discard_unexpected` drains one generation; the rank's
heartbeat runs :meth:`Transport.reject_unannounced`, which receives every message no announced
receive will take into scratch memory and counts it; see ``guard.py``). The index is the run
number; a staged pair's single message uses the reserved index :data:`STAGED_INDEX`, so a staged
receive never matches a zero-copy run by mistake. Tag matching in UCX is per worker, not per
endpoint: the destination rank is implicit (it is the receiving worker).

Tags only keep apart attempts and runs; they are not authentication -- UCX has none, keep its
interfaces on a trusted network.
"""

from __future__ import annotations

import numpy as np

from statebridge.errors import ConfigError

__all__ = [
    "READY_INDEX",
    "STAGED_INDEX",
    "TAG_GENERATION_BITS",
    "TAG_INDEX_BITS",
    "TAG_SRC_RANK_BITS",
    "make_tag",
    "pack_tag",
    "split_tag",
    "tag_match",
]

TAG_GENERATION_BITS = 32
TAG_SRC_RANK_BITS = 8
TAG_INDEX_BITS = 24
MAX_GENERATION = (1 << TAG_GENERATION_BITS) - 1
MAX_SRC_RANK = (1 << TAG_SRC_RANK_BITS) - 1
MAX_INDEX = (1 << TAG_INDEX_BITS) - 1
_SRC_RANK_SHIFT = TAG_INDEX_BITS
_GENERATION_SHIFT = TAG_INDEX_BITS + TAG_SRC_RANK_BITS
#: Index of a staged pair's single message (never a zero-copy run index).
STAGED_INDEX = MAX_INDEX
#: Shared-map reads (``shared/``): the prefill rank's "ready" notice of a rank pair (the
#: tag's generation and source rank as for its runs). The decode rank answers in memory.
READY_INDEX = MAX_INDEX - 1
#: Most zero-copy runs of one post: their indices are 0 .. MAX_RUNS - 1.
MAX_RUNS = READY_INDEX


def check_field(name: str, value: object, maximum: int) -> int:
    """``value`` as an int in ``[0, maximum]``; :class:`ConfigError` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) <= maximum:
        raise ConfigError(f"tag field {name} must be an integer in [0, {maximum}], got {value!r}")
    return int(value)


def pack_tag(generation: int, src_rank: int, index: int) -> int:
    """The tag of fields already known to be in range -- the ONE place the bit layout is
    written (:func:`make_tag` checks first; the transport's posting path checks its own)."""
    return (generation << _GENERATION_SHIFT) | (src_rank << _SRC_RANK_SHIFT) | index


def make_tag(generation: int, src_rank: int, index: int) -> int:
    """The 64-bit tag of message ``index`` of source rank ``src_rank`` in request attempt
    ``generation`` (32 | 8 | 24 bits); out-of-range fields raise :class:`ConfigError`."""
    return pack_tag(check_field("generation", generation, MAX_GENERATION),
                    check_field("src_rank", src_rank, MAX_SRC_RANK),
                    check_field("index", index, MAX_INDEX))


def tag_match(generation: int, src_rank: int | None = None) -> tuple[int, int]:
    """``(tag, mask)`` matching every message of ``generation`` (of ``src_rank`` only, when
    given), whatever its index; out-of-range fields raise :class:`ConfigError`."""
    tag = pack_tag(check_field("generation", generation, MAX_GENERATION), 0, 0)
    mask = pack_tag(MAX_GENERATION, 0, 0)
    if src_rank is not None:
        tag |= pack_tag(0, check_field("src_rank", src_rank, MAX_SRC_RANK), 0)
        mask |= pack_tag(0, MAX_SRC_RANK, 0)
    return tag, mask


def split_tag(tag: int) -> tuple[int, int, int]:
    """``(generation, src_rank, index)`` of a tag made by :func:`make_tag`."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ConfigError(f"tag must be a 64-bit unsigned integer, got {tag!r}")
    return tag >> _GENERATION_SHIFT, (tag >> _SRC_RANK_SHIFT) & MAX_SRC_RANK, tag & MAX_INDEX
