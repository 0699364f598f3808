"""Process setup for the data plane: UCX environment variables and page-buffer memory.

Nothing here runs on import: a library must not edit ``os.environ`` when it is imported, so a
process entry point calls :func:`configure_ucx_env` before it builds its first
:class:`Transport` (UCX options can also go to the transport as ``ucx_options``).

Huge pages: torch CPU tensors are not backed by transparent huge pages, numpy arrays are
(``madvise`` from 4 MiB). Shared-memory transfers out of non-THP buffers are markedly slower
from 1 MiB up (``benchmarks/bench_transport.py``; docs/measurements.md, "Transport choices").
:func:`alloc_buffer` returns a THP-backed uint8 tensor for
``StateCache(..., buffer=alloc_buffer(n))``.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from statebridge.errors import ConfigError

__all__ = ["alloc_buffer", "configure_ucx_env"]


def configure_ucx_env(*, tls: str | None = None, proto_info: bool = False,
                      quiet_unused_env_warnings: bool = True,
                      environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``UCX_*`` variables for this process; call it from a process entry point before the
    first :class:`Transport` (never called on import). Returns what it set.

    - ``tls``: ``UCX_TLS`` (e.g. ``"sm,self"`` or ``"tcp,self"``); None leaves UCX's choice.
    - ``proto_info``: ``UCX_PROTO_INFO=y`` prints which transport each protocol uses.
    - ``quiet_unused_env_warnings``: ``UCX_WARN_UNUSED_ENV_VARS=n``; ucxx sets
      ``UCX_MEMTYPE_CACHE`` on import, which this libucx build does not know and warns about.
    """
    environ = os.environ if environ is None else environ
    changes: dict[str, str] = {}
    if tls is not None:
        changes["UCX_TLS"] = tls
    if proto_info:
        changes["UCX_PROTO_INFO"] = "y"
    if quiet_unused_env_warnings:
        changes["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    environ.update(changes)
    return changes


def alloc_buffer(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed 1-D uint8 CPU tensor of ``nbytes`` for a page buffer or staging.

    With ``huge_pages`` the memory comes from numpy, which asks the kernel for transparent huge
    pages (``madvise``) on allocations of 4 MiB and more; plain torch CPU tensors do not, and
    shared-memory transfers out of 4 KiB pages run at about half the speed.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    if huge_pages:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return torch.zeros(nbytes, dtype=torch.uint8)
