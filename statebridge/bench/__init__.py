"""Benchmarks of the statebridge connector (``statebridge bench``).

- :mod:`statebridge.bench.hetero_tp`: heterogeneous-TP transfer benchmark against the
  ``ucx_perftest`` line rate, NIXL on the same runs, and NIXL the vLLM way (per-layer ``LDS``).
- :mod:`statebridge.bench.ab`: the connector's A/B switches, which only the harness turns off.
- The timing probes the benchmark reads are instrumented ranks' ``RankProbe`` messages
  (:class:`~statebridge.testing.probes.Probes`; the switch is documented in
  :class:`~statebridge.connector.messages.RankProbe`).
"""

from __future__ import annotations

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())
