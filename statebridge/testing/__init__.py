"""statebridge.testing: stand-ins for tests and benchmarks, not for serving.

- :mod:`~statebridge.testing.synthetic`: deterministic synthetic state (what a stand-in prefill
  rank "computes" and what every decode rank must then hold).
- :mod:`~statebridge.testing.models`: :class:`~statebridge.testing.models.SyntheticModel`, the
  rank "model" that writes that state.
- :mod:`~statebridge.testing.hosts`: :class:`~statebridge.testing.hosts.RankHostPool`, long-lived
  rank host processes that start many TP groups cheaply.

Nothing in the serving path imports this package.
"""
