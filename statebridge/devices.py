"""Which device a rank computes on and holds its pages and KV pool in: ``--device``.

One spelling for the nodes, the runner's tools and the benchmark::

    auto      CUDA when a GPU is visible, else the CPU
    cpu       the CPU (host memory)
    cuda      GPUs from the first visible one
    cuda:N    GPUs from visible GPU N

Rank ``r`` of a node on CUDA uses visible GPU ``(first + r) % visible``: at most one rank per
GPU while the group has no more ranks than there are GPUs, several ranks on one GPU beyond
that. The TP group's backend follows (:func:`tp_backend`): NCCL when every rank has a GPU of
its own, gloo when ranks share one (NCCL refuses two ranks on one device).

A node resolves the spelling in each rank process (:func:`rank_device`); :func:`memory_kind`
says what the node's ranks hold their memory in, for the handshake. ``visible`` is the number
of visible GPUs, ``torch.cuda.device_count()`` unless given (tests pass a count).

Imported by the connector (memory kinds) and the models (TP group): it depends on torch only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from statebridge.errors import ConfigError

__all__ = ["DeviceSpec", "visible_gpus", "rank_device", "memory_kind", "tp_backend",
           "DEVICE_HELP"]

DEVICE_HELP = ("where the ranks compute and hold pages and KV: auto (CUDA when a GPU is "
               "visible, else cpu), cpu, cuda, or cuda:N (rank r uses visible GPU N + r, "
               "wrapping around)")

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed ``--device`` value: ``kind`` auto | cpu | cuda, and ``first`` (the N of
    ``cuda:N``; None when not given)."""

    kind: str
    first: int | None = None

    @classmethod
    def parse(cls, text: "str | DeviceSpec") -> "DeviceSpec":
        """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; :class:`ConfigError` naming anything
        else."""
        if isinstance(text, DeviceSpec):
            return text
        match = _SPEC.match(text.strip().lower()) if isinstance(text, str) else None
        if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {text!r}")
        first = match.group(2)
        return cls(match.group(1), int(first) if first is not None else None)

    def __str__(self) -> str:
        return self.kind if self.first is None else f"{self.kind}:{self.first}"


def visible_gpus() -> int:
    """CUDA devices this process can see (0 without CUDA or a CUDA build of torch)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):       # a CPU build or a broken driver
        return 0


def _resolve(spec: "str | DeviceSpec", visible: int | None) -> tuple[DeviceSpec, int]:
    spec = DeviceSpec.parse(spec)
    count = visible_gpus() if visible is None else visible
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"visible GPU count must be a non-negative integer, got {count!r}")
    if spec.kind == "auto":
        spec = DeviceSpec("cuda" if count else "cpu")
    if spec.kind == "cuda":
        if count == 0:
            raise ConfigError(f"device {spec} asks for CUDA, but no GPU is visible "
                              f"(torch {torch.__version__}, CUDA build: "
                              f"{torch.version.cuda is not None}); use --device cpu or auto")
        if spec.first is not None and spec.first >= count:
            raise ConfigError(f"device {spec}: only {count} GPU(s) are visible "
                              f"(cuda:0 .. cuda:{count - 1})")
    return spec, count


def rank_device(spec: "str | DeviceSpec", tp_rank: int, *,
                visible: int | None = None) -> torch.device:
    """The device of rank ``tp_rank``: the CPU, or visible GPU ``(first + tp_rank) %
    visible``. :class:`ConfigError` when CUDA is asked for and not there."""
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ConfigError(f"tp_rank must be a non-negative integer, got {tp_rank!r}")
    spec, count = _resolve(spec, visible)
    if spec.kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", ((spec.first or 0) + tp_rank) % count)


def memory_kind(spec: "str | DeviceSpec", *, visible: int | None = None) -> str:
    """``"cuda"`` when ranks on ``spec`` hold their pages and KV in device memory, else
    ``"host"`` (what a node tells its peers at the handshake)."""
    return "cuda" if _resolve(spec, visible)[0].kind == "cuda" else "host"


def tp_backend(spec: "str | DeviceSpec", tp_size: int, *, visible: int | None = None) -> str:
    """The TP group's ``torch.distributed`` backend for ``tp_size`` ranks on ``spec``: NCCL
    when every rank has a GPU of its own (``tp_size <= visible``), gloo when ranks share a GPU
    or run on the CPU."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    spec, count = _resolve(spec, visible)
    return "nccl" if spec.kind == "cuda" and tp_size <= count else "gloo"
