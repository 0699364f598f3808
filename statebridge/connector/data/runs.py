"""Byte runs: the ``[R, 3]`` rows of a transfer plan, checked before anything is posted.

A run is ``(src offset, dst offset, length)`` in bytes (``state/plan.py``). A rank turns each
pair's runs into a :class:`RunTemplate` once, with offsets relative to a page, and posts it at
every request's page offset. Staged pairs are gathered into / scattered out of a staging buffer
on the host by :func:`copy_runs` (the one implementation is
:func:`statebridge.kernels.pack.copy_runs_host`).
"""

from __future__ import annotations

import numpy as np
import torch

from statebridge.connector.data.tags import MAX_RUNS
from statebridge.errors import ConfigError

__all__ = ["RunTemplate", "as_runs", "check_span", "copy_runs"]


def as_runs(runs: object, what: str) -> np.ndarray:
    """``runs`` as a C-contiguous int64 ``[R, 3]`` array; :class:`ConfigError` otherwise."""
    if type(runs) is np.ndarray and runs.dtype == np.int64 and runs.ndim == 2 \
            and runs.shape[1] == 3 and runs.flags.c_contiguous:
        return runs                          # what PairPlan.runs_at() returns
    if isinstance(runs, torch.Tensor):
        runs = runs.detach().cpu().numpy()
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 3 \
            or not np.issubdtype(runs.dtype, np.integer):
        raise ConfigError(f"{what} must be an integer array [R, 3], got "
                          f"{getattr(runs, 'shape', type(runs).__name__)} "
                          f"{getattr(runs, 'dtype', '')}")
    return np.ascontiguousarray(runs, dtype=np.int64)


def check_span(runs: np.ndarray, col: int, size: int, what: str, side: str) -> None:
    """Every ``runs[:, col] .. + len`` must lie inside ``[0, size)``."""
    if len(runs) == 0:
        return
    off, length = runs[:, col], runs[:, 2]
    end = off + length
    if off.min() >= 0 and length.min() >= 0 and end.max() <= size:
        return
    bad = np.flatnonzero((off < 0) | (length < 0) | (end > size))
    if bad.size:
        i = int(bad[0])
        raise ConfigError(f"{what} run {i} {runs[i].tolist()} lies outside the {side} "
                          f"({size} bytes)")


def copy_runs(frm: np.ndarray, runs: np.ndarray, to: np.ndarray) -> None:
    """``to[b:b+n] = frm[a:a+n]`` for every checked run ``(a, b, n)`` (host numpy buffers)."""
    # Imported on first use: statebridge.kernels imports triton, which a transport that never
    # stages does not need.
    from statebridge.kernels.pack import copy_runs_host

    copy_runs_host(frm, runs, to)


class RunTemplate:
    """The zero-copy runs of one rank pair with offsets relative to a page, checked once.

    A rank posts the same runs for every request; only the page moves. Build the template once
    per peer (:meth:`Transport.template`) and post it at a page's byte offset with
    :meth:`Transport.post_runs`: per post only the page's bounds are checked. ``col`` says which
    offsets the template keeps: 0 the source's (a send), 1 the destination's (a receive).
    """

    __slots__ = ("runs", "col", "offsets", "lengths", "nbytes", "extent")

    def __init__(self, runs: object, col: int, what: str = "runs") -> None:
        runs = as_runs(runs, what)
        if len(runs) > MAX_RUNS:
            raise ConfigError(f"{len(runs)} runs exceed the {MAX_RUNS} a tag index can number")
        offsets, lengths = runs[:, col], runs[:, 2]
        if len(runs) and (offsets.min() < 0 or lengths.min() < 0):
            i = int(np.flatnonzero((offsets < 0) | (lengths < 0))[0])
            raise ConfigError(f"{what} run {i} {runs[i].tolist()} has a negative offset or "
                              f"length")
        self.runs = runs
        self.col = col
        self.offsets: list[int] = offsets.tolist()
        self.lengths: list[int] = lengths.tolist()
        self.nbytes = int(lengths.sum())
        self.extent = int((offsets + lengths).max()) if len(runs) else 0

    def __len__(self) -> int:
        return len(self.offsets)

    def outside(self, base: int, size: int, what: str, side: str) -> str:
        """The error message for posting at ``base`` in a ``size``-byte buffer."""
        for i, (off, n) in enumerate(zip(self.offsets, self.lengths)):
            if not 0 <= base + off <= base + off + n <= size:
                row = self.runs[i].tolist()
                row[self.col] += base
                return f"{what} run {i} {row} lies outside the {side} ({size} bytes)"
        return f"{what} runs at offset {base} lie outside the {side} ({size} bytes)"
