"""Transfer digests: the cheap checksum of the bytes one rank pair moves for a request
(``ConnectorConfig.verify_transfers``).

The bytes of a pair, in wire order, are its **stream**: the zero-copy runs in plan order, or a
staged pair's staging buffer (the pack runs on the sending side, the unpack runs on the
receiving side, both in staging order). The digest of a stream of bytes is::

    D = sum_k w[k] * (2 * (k // 16) + 1)   mod 2**64

over its little-endian 64-bit words ``w[k]`` (the last one zero-padded): the words of each
128-byte chunk are summed, and the chunk sums weighted by their chunk's position. The odd
weight makes every changed word change ``D``; the weight by position makes a chunk that landed
in the wrong place (a wrong layout, a swapped run, another request's block) change it too; a
stale or half-written page is a set of changed words. A rank's digest of a request is the sum
(mod 2**64) of its pairs' digests: the prefill rank computes it per destination rank from its
page and blocks, the decode rank from what landed in its own, each through its own side of
the same runs.

How it is computed: device-agnostic torch reductions over ``int64`` views of the rank buffer,
one pass over the bytes and no copy where every run is whole chunks on this side (each run's
length and stream position a multiple of 128 bytes, its address of 8: every real layout). A
group of equally long runs at one stride is one 3-D view ``[runs, chunks, 16 words]``; its
chunk sums times their weights is one dot product. Other streams (odd sizes) are gathered into
one padded copy first -- the same value, by definition.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["MASK", "CHUNK_BYTES", "StreamDigest", "total"]

#: Digests are unsigned 64-bit numbers.
MASK = (1 << 64) - 1
#: Bytes of a chunk (its words share one weight).
CHUNK_BYTES = 128
_CHUNK = CHUNK_BYTES // 8
#: Most chunks one reduction covers (bounds the temporaries: 8 MiB of chunk sums).
_MAX_ROWS = 1 << 20
#: ``2 m + 1`` for chunk index m, per device (grown on demand).
_ODD: dict[str, torch.Tensor] = {}


def _odd(device: torch.device, n: int) -> torch.Tensor:
    key = str(device)
    w = _ODD.get(key)
    if w is None or w.numel() < n:
        w = _ODD[key] = torch.arange(max(n, 1 << 12), dtype=torch.int64, device=device) * 2 + 1
    return w


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` of int64 vectors, wrapping mod 2**64 (no temporary on the CPU)."""
    return torch.dot(a, b) if a.device.type == "cpu" else (a * b).sum()


class StreamDigest:
    """The digest plan of one stream: its runs on this rank's side, ``offsets`` and ``lengths``
    in bytes (relative to a base added per request), in stream order. Built once per route
    (per KV block count), used per request by :meth:`of`."""

    __slots__ = ("offsets", "lengths", "nbytes", "whole", "blocks", "max_rows")

    def __init__(self, offsets, lengths) -> None:
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        keep = lengths > 0
        self.offsets, self.lengths = offsets[keep], lengths[keep]
        self.nbytes = int(self.lengths.sum())
        #: Every run is whole chunks at an 8-byte address: views, no copy.
        self.whole = bool(np.all(self.offsets % 8 == 0)
                          and np.all(self.lengths % CHUNK_BYTES == 0))
        #: (word offset, runs, run stride in words, chunks per run, first chunk index)
        self.blocks: list[tuple[int, int, int, int, int]] = []
        if self.whole:
            self.blocks = _blocks(self.offsets // 8, self.lengths // 8)
        self.max_rows = max((b[1] * b[3] for b in self.blocks), default=1)

    def of(self, buffer: torch.Tensor, base: int) -> torch.Tensor:
        """The digest of the stream in ``buffer`` (a 1-D ``uint8`` tensor on any device) at
        byte offset ``base``, as a 0-d ``int64`` tensor on the buffer's device (no host
        synchronization: sum several, then read them at once with :func:`total`)."""
        if self.whole and base % 8 == 0 and buffer.storage_offset() % 8 == 0 \
                and buffer.numel() % 8 == 0:
            return _digest_blocks(buffer.view(torch.int64), self.blocks, base // 8,
                                  self.max_rows)
        pieces = [buffer[base + o:base + o + n]
                  for o, n in zip(self.offsets.tolist(), self.lengths.tolist())]
        pad = -self.nbytes % CHUNK_BYTES
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=buffer.device))
        if not pieces:
            return torch.zeros((), dtype=torch.int64, device=buffer.device)
        words = torch.cat(pieces).view(torch.int64)
        rows = words.numel() // _CHUNK
        blocks = [(r0 * _CHUNK, 1, 0, min(_MAX_ROWS, rows - r0), r0)
                  for r0 in range(0, rows, _MAX_ROWS)]
        return _digest_blocks(words, blocks, 0, min(rows, _MAX_ROWS))


def _blocks(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """Runs of whole chunks (in words) as blocks of 3-D views: consecutive runs of one length
    at one stride are one block (the strided pieces of a layer-major layout), cut so that no
    block covers more than ``_MAX_ROWS`` chunks."""
    out: list[tuple[int, int, int, int, int]] = []
    chunk = 0                                       # the stream's chunks so far
    i, n = 0, len(offsets)
    while i < n:
        length = int(lengths[i])
        j = i + 1
        stride = int(offsets[j] - offsets[i]) if j < n else length
        while j < n and lengths[j] == length and offsets[j] - offsets[j - 1] == stride > 0:
            j += 1
        count, rows = j - i, length // _CHUNK
        if count == 1:
            stride = 0
        if rows > _MAX_ROWS:                        # a long run: pieces of _MAX_ROWS chunks
            for r in range(count):
                off = int(offsets[i]) + r * stride
                for r0 in range(0, rows, _MAX_ROWS):
                    out.append((off + r0 * _CHUNK, 1, 0, min(_MAX_ROWS, rows - r0), chunk + r0))
                chunk += rows
        else:
            per = max(1, _MAX_ROWS // rows)
            for c0 in range(0, count, per):
                c = min(per, count - c0)
                out.append((int(offsets[i]) + c0 * stride, c, stride, rows, chunk))
                chunk += c * rows
        i = j
    return out


def _digest_blocks(words: torch.Tensor, blocks, base: int, max_rows: int) -> torch.Tensor:
    odd = _odd(words.device, max_rows)
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    start = words.storage_offset() + base
    for off, count, stride, rows, chunk in blocks:
        x = words.as_strided((count, rows, _CHUNK), (stride, _CHUNK, 1), start + off)
        sums = x.sum(2).reshape(-1)                 # chunk sums, in stream order
        # weights 2 (chunk + m) + 1 = odd[m] + 2 chunk
        acc += _dot(sums, odd[:sums.numel()])
        if chunk:
            acc += sums.sum() * (2 * chunk)
    return acc


def total(digests: list[torch.Tensor]) -> int:
    """The sum of ``digests`` (0-d tensors from :meth:`StreamDigest.of`) mod 2**64: one read."""
    if not digests:
        return 0
    return int(torch.stack(digests).sum().item()) & MASK
