"""Benchmarks of the statebridge connector (``statebridge bench``).

- :mod:`statebridge.bench.hetero_tp`: heterogeneous-TP transfer benchmark against the
  ``ucx_perftest`` line rate, NIXL on the same runs, and NIXL the vLLM way (per-layer ``LDS``).
"""

from __future__ import annotations

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())
