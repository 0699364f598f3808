"""Heterogeneous-TP transfer benchmark: statebridge vs the line rate, NIXL, and vLLM's way.

For every (preset, prefill TP x decode TP, layout) cell, in one run on this machine:

- statebridge: a :class:`~statebridge.connector.prefill.PrefillServer` and a
  :class:`~statebridge.connector.decode.DecodeCoordinator`, every rank its own process
  (:class:`~statebridge.testing.hosts.RankHostPool`), move ``--requests`` requests with
  ``--concurrency`` in flight. Byte-exactness is checked first on a few requests (decode-rank
  checksums against the synthetic-state oracle), then the timed round runs with timing probes
  only: per-rank times, message and staging counts come from the ranks' ``RankProbe``
  messages (:class:`~statebridge.testing.probes.Probes`; the switch is documented in
  :class:`~statebridge.connector.messages.RankProbe`), never from the product's own messages.
  The prefill "model" (:class:`~statebridge.bench._model.PageOnceModel`) fills each page once,
  so the transfer, not the stand-in model, is measured.
- line rate: ``ucx_perftest -t tag_bw`` over the same UCX transport at the plan's mean message
  size (:mod:`statebridge.bench._perftest`).
- NIXL (UCX backend): READ of exactly the cell's runs between page buffers of separate
  processes, one descriptor per run; and vLLM's way: the same state laid out ``LDS`` (one
  descriptor per layer per piece). See :mod:`statebridge.bench._nixl`.
- copy limit: the fastest copy of the cell's bytes this machine does, the best of several
  candidates (the shared-map read and ``process_vm_readv``, one copier per core or per decode
  rank, cold and warm sources), counted by the copy's CPU so that other work on the machine
  does not lower it; the report names the candidate (its yardstick) and lists any figure above
  it, which would show the limit is wrong. See :mod:`statebridge.bench._copylimit`.

Wire into a CLI with :func:`add_parser` and :func:`main`.

One concern per module: :mod:`~statebridge.bench.hetero_tp.cli` (the command line, the presets,
the run over every cell), :mod:`~statebridge.bench.hetero_tp.cells` (running one cell),
:mod:`~statebridge.bench.hetero_tp.procstats` (per-process figures from ``/proc``),
:mod:`~statebridge.bench.hetero_tp.report` (JSON, CSV, plot, table).
"""

from statebridge.bench.hetero_tp.cells import (
    BURST_GAP_FACTOR,
    MODEL,
    TRANSPORTS,
    _statebridge_cell,
    completions_per_burst,
    prompt_tokens,
)
from statebridge.bench.hetero_tp.cli import (
    DEFAULT_TP,
    LAYOUTS,
    PRESETS,
    add_parser,
    cell_memory,
    configure_parser,
    main,
    parse_pairs,
    plan_cells,
    preset_spec,
    run,
)
from statebridge.bench.hetero_tp.procstats import _peak_rss_mib, _PeakRss
from statebridge.bench.hetero_tp.report import (
    CELL_FIELDS,
    CSV_FIELDS,
    format_table,
    limit_warnings,
    write_csv,
    write_json,
    write_plot,
)

__all__ = ["PRESETS", "TRANSPORTS", "add_parser", "main", "run", "preset_spec"]
