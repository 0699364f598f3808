"""A/B switches: fast paths of the connector that the benchmark harness can turn off, to
compare each with the path it replaced. This is the one place they are documented.

They are fields of :class:`~statebridge.config.ConnectorConfig` (the connector reads them;
:data:`statebridge.config.AB_SWITCHES` names them) but they are not settings: on by default,
no node CLI flag, no ``STATEBRIDGE_*`` variable (``ConnectorConfig.from_env`` refuses one),
and nothing a deployment should turn off. ``statebridge bench --off NAME`` runs a benchmark
with one off; tests that prove the other path still works flip them with
:func:`with_switches`.

- ``local_ranks``: rank processes reach their coordinator over the local channel
  (:mod:`statebridge.connector.local`: a Unix socket in the abstract namespace that both loop
  threads serve themselves, admitting only processes of the node's own user). Off: the ranks
  dial the coordinator's zmq ROUTER over TCP loopback (CurveZMQ under ``keys_dir``), whose
  I/O threads add wake-ups to every message between a coordinator and its ranks.
- ``shared_map``: on one host a decode rank copies its runs out of a read-only mapping of the
  prefill rank's buffer (:mod:`statebridge.connector.data.shared`; which pairs is
  ``shared_map_min_bytes``, a setting). Off, on either group: UCX carries every byte between
  ranks of one host (the cma rendezvous), as it does between hosts.

- ``batched_prefill``: a prefill rank runs queued prompts together, up to
  ``max_prefill_tokens`` per step and in chunks beyond it (:mod:`statebridge.connector.rank.compute`).
  Off: one whole prompt per step, in arrival order, as before batching.

Results of the comparisons: docs/measurements.md ("The ranks' local channel", "Reading state
out of a shared map", "Written KV sources, and attention KV through the shared map").
"""

from __future__ import annotations

from typing import Iterable

from statebridge.config import AB_SWITCHES, ConnectorConfig
from statebridge.errors import ConfigError

__all__ = ["SWITCHES", "with_switches", "switched_off"]

#: The switches, each with what turning it off compares (the module docstring says more).
SWITCHES = {
    "local_ranks": "ranks reach their coordinator over zmq on TCP loopback instead of the "
                   "local channel",
    "shared_map": "UCX carries every byte between ranks of one host instead of shared-map "
                  "reads",
    "batched_prefill": "a prefill rank runs one whole prompt per step instead of batching "
                       "queued prompts up to max_prefill_tokens",
}
assert set(SWITCHES) == set(AB_SWITCHES), "statebridge.config.AB_SWITCHES and SWITCHES differ"


def with_switches(config: ConnectorConfig, **switches: bool) -> ConnectorConfig:
    """``config`` with A/B switches set (``with_switches(c, shared_map=False)``);
    ConfigError naming an unknown switch or a value that is not a bool."""
    for name, value in switches.items():
        if name not in SWITCHES:
            raise ConfigError(f"unknown A/B switch {name!r}; the switches: {sorted(SWITCHES)}")
        if not isinstance(value, bool):
            raise ConfigError(f"A/B switch {name} must be True or False, got {value!r}")
    return config.replace(**switches)


def switched_off(config: ConnectorConfig, names: Iterable[str]) -> ConnectorConfig:
    """``config`` with the switches ``names`` off (``statebridge bench --off NAME``)."""
    return with_switches(config, **{name: False for name in names})
