"""Transfer digests: the cheap checksum of the bytes one rank pair moves for a request
(``ConnectorConfig.verify_transfers``).

The bytes of a pair, in wire order, are its **stream**: the zero-copy runs in plan order, or a
staged pair's staging buffer (the pack runs on the sending side, the unpack runs on the
receiving side, both in staging order). The digest of a stream of bytes ``b[0..n)`` is::

    D = sum_k w[k] * (2k + 1)   mod 2**64

over its little-endian 64-bit words ``w[k]`` (the last one zero-padded). The odd weight makes
every changed word change ``D``, and the weight by position makes a word that landed in the
wrong place (a wrong layout, a swapped run) change it too; a stale or half-written page is a
set of changed words. A rank's digest of a request is the sum (mod 2**64) of its pairs'
digests: the prefill rank computes it per destination rank from its page and blocks, the
decode rank from what landed in its own, each through its own side of the same runs.

How it is computed: device-agnostic torch reductions over ``int64`` views of the rank buffer,
with no copy where runs are word-aligned (every real layout). A 2-D view ``X[r, c]`` of
words whose stream positions are ``p + r * cols + c`` contributes
``sum_c colsum[c] * (2c + 1) + sum_r rowsum[r] * 2 * (p + r * cols)``: two reductions, no
product the size of the data. Runs that are not word-aligned on this side (odd sizes) are
gathered into one padded copy first -- the same value, by definition.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["MASK", "StreamDigest", "total"]

#: Digests are unsigned 64-bit numbers.
MASK = (1 << 64) - 1
#: Columns of the 2-D views a long run is cut into (words): 4 KiB rows.
_COLS = 512
#: Weight tensors per (device, size): (2c + 1) for columns, r for rows.
_WEIGHTS: dict[tuple[str, int, str], torch.Tensor] = {}


def _weights(device: torch.device, n: int, kind: str) -> torch.Tensor:
    key = (str(device), n, kind)
    w = _WEIGHTS.get(key)
    if w is None:
        w = torch.arange(n, dtype=torch.int64, device=device)
        if kind == "col":
            w = w * 2 + 1
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        w = _WEIGHTS[key] = w
    return w


class StreamDigest:
    """The digest plan of one stream: its runs on this rank's side, ``offsets`` and ``lengths``
    in bytes (relative to a base added per request), in stream order. Built once per route
    (per KV block count), used per request by :meth:`of`."""

    __slots__ = ("offsets", "lengths", "nbytes", "aligned", "blocks", "max_rows", "max_cols")

    def __init__(self, offsets, lengths) -> None:
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        keep = lengths > 0
        self.offsets, self.lengths = offsets[keep], lengths[keep]
        self.nbytes = int(self.lengths.sum())
        self.aligned = bool(np.all(self.offsets % 8 == 0) and np.all(self.lengths % 8 == 0))
        #: (word offset, rows, row stride in words, cols, stream word position)
        self.blocks: list[tuple[int, int, int, int, int]] = []
        if self.aligned:
            self.blocks = _blocks(self.offsets // 8, self.lengths // 8)
        self.max_rows = max((b[1] for b in self.blocks), default=1)
        self.max_cols = max((b[3] for b in self.blocks), default=1)

    def of(self, buffer: torch.Tensor, base: int) -> torch.Tensor:
        """The digest of the stream in ``buffer`` (a 1-D ``uint8`` tensor on any device) at
        byte offset ``base``, as a 0-d ``int64`` tensor on the buffer's device (no host
        synchronization: sum several, then read them at once with :func:`total`)."""
        if self.aligned and base % 8 == 0 and buffer.storage_offset() % 8 == 0 \
                and buffer.numel() % 8 == 0:
            return _digest_blocks(buffer.view(torch.int64), self.blocks, base // 8,
                                  self.max_rows, self.max_cols)
        pieces = [buffer[base + o:base + o + n]
                  for o, n in zip(self.offsets.tolist(), self.lengths.tolist())]
        pad = -self.nbytes % 8
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=buffer.device))
        if not pieces:
            return torch.zeros((), dtype=torch.int64, device=buffer.device)
        words = torch.cat(pieces).view(torch.int64)
        n = words.numel()
        rows, cols = (n // _COLS, _COLS) if n >= _COLS else (1, n)
        blocks = [(0, rows, cols, cols, 0)]
        if rows * cols < n:
            blocks.append((rows * cols, 1, n - rows * cols, n - rows * cols, rows * cols))
        return _digest_blocks(words, blocks, 0, rows, _COLS)


def _blocks(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """Runs (in words) as 2-D blocks: consecutive runs of one length at one stride are one
    block (the strided pieces of a layer-major layout); a run longer than ``_COLS`` words is
    cut into rows of ``_COLS`` and a remainder."""
    out: list[tuple[int, int, int, int, int]] = []
    pos = 0
    i, n = 0, len(offsets)
    while i < n:
        length = int(lengths[i])
        if length > _COLS:
            rows = length // _COLS
            out.append((int(offsets[i]), rows, _COLS, _COLS, pos))
            rest = length - rows * _COLS
            if rest:
                out.append((int(offsets[i]) + rows * _COLS, 1, rest, rest, pos + rows * _COLS))
            pos += length
            i += 1
            continue
        j = i + 1
        stride = int(offsets[j] - offsets[i]) if j < n else length
        while j < n and lengths[j] == length and offsets[j] - offsets[j - 1] == stride \
                and stride > 0:
            j += 1
        rows = j - i
        out.append((int(offsets[i]), rows, stride if rows > 1 else length, length, pos))
        pos += rows * length
        i = j
    return out


def _digest_blocks(words: torch.Tensor, blocks, base: int, max_rows: int,
                   max_cols: int) -> torch.Tensor:
    col_w = _weights(words.device, max_cols, "col")
    row_w = _weights(words.device, max_rows, "row")
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for off, rows, stride, cols, pos in blocks:
        x = words.as_strided((rows, cols), (stride, 1), words.storage_offset() + base + off)
        acc += (x.sum(0) * col_w[:cols]).sum()
        acc += (x.sum(1) * (row_w[:rows] * (2 * cols) + 2 * pos)).sum()
    return acc


def total(digests: list[torch.Tensor]) -> int:
    """The sum of ``digests`` (0-d tensors from :meth:`StreamDigest.of`) mod 2**64: one read."""
    if not digests:
        return 0
    return int(torch.stack(digests).sum().item()) & MASK
