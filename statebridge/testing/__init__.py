"""statebridge.testing: stand-ins for tests and benchmarks, not for serving.

- :mod:`~statebridge.testing.synthetic`: deterministic synthetic state (what a stand-in prefill
  rank "computes" and what every decode rank must then hold).
- :mod:`~statebridge.testing.models`: :class:`~statebridge.testing.models.SyntheticModel`, the
  rank "model" that writes that state.
- :mod:`~statebridge.testing.hosts`: :class:`~statebridge.testing.hosts.RankHostPool`, long-lived
  rank host processes that start many TP groups cheaply.
- :func:`stable_seed`: an RNG seed from a test case's parameters, the same in every process.

Nothing in the serving path imports this package.
"""

from __future__ import annotations

import zlib

__all__ = ["stable_seed"]


def stable_seed(*parts: object) -> int:
    """An RNG seed in ``[0, 2**32)`` from ``parts``, the same in every process and on every run.

    ``hash()`` of strings is salted per process (``PYTHONHASHSEED``), so a seed derived from it
    changes between runs and between a test and the processes it starts. This is the CRC-32 of
    ``repr(parts)``: give strings, ints and bools (whose ``repr`` is stable), e.g.
    ``stable_seed("mamba2-g1", 2, 4, "DLS")``.
    """
    return zlib.crc32(repr(parts).encode())
