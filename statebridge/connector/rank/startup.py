"""What a rank reports while it starts: its phases, its weights' loading progress, and the
memory it holds once it is up.

Phases (:func:`phase`) are logged at INFO as they start and as they end, with their duration,
so a node's output tells a slow start from a hang: ``pools`` (the rank buffer: pages and KV
pool), ``UCX worker``, ``rendezvous of TP n`` (the TP group's ``torch.distributed`` store) and
``weights from DIR`` (with the bytes read).

Weights loading progress (:class:`WeightProgress`): on a terminal, rank 0 draws one ``tqdm``
bar of the bytes it has read (the ranks of a group read their shards at the same time, so one
bar stands for all and stays readable at any TP); elsewhere every rank logs one line per
``interval`` seconds while it loads. Either way each rank logs the total when done.

Memory (:func:`weight_memory`): what the weights cost the rank process, read from the process
itself -- the bytes of the distinct tensor storages the model holds outside the checkpoint's
file mappings (private memory: the shards it copied), and the resident pages of those
mappings (``/proc/self/smaps``). safetensors hands out whole tensors and row ranges as views
of its mapping of the file, and reading a shard leaves the pages it read resident: page cache,
but ``ps`` counts it in each process's RSS. :class:`~statebridge.models.checkpoint.Checkpoint`
copies what it reads out of the mapping, so a loaded rank normally maps nothing; the mapped
figure says so rather than assuming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)

__all__ = ["phase", "WeightProgress", "weight_memory", "tensor_bytes", "mapped_ranges",
           "mapped_bytes", "fmt_bytes", "release_free_heap"]


def fmt_bytes(nbytes: int) -> str:
    """``1.2 GiB``, ``260.0 MiB``, ``12.0 KiB``, ``512 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


class _Phase:
    """What the caller may add to a phase's closing line (``detail``)."""

    def __init__(self) -> None:
        self.detail = ""
        self.seconds = 0.0


@contextlib.contextmanager
def phase(who: str, what: str) -> Iterator[_Phase]:
    """Log ``who: what ...`` at INFO, run the body, then ``who: what done in N s (detail)``;
    a body that raises logs ``what failed after N s`` and raises on."""
    log.info("%s: %s ...", who, what)
    p = _Phase()
    start = time.perf_counter()
    try:
        yield p
    except BaseException:
        log.info("%s: %s failed after %.1f s", who, what, time.perf_counter() - start)
        raise
    p.seconds = time.perf_counter() - start
    log.info("%s: %s done in %.1f s%s", who, what, p.seconds,
             f" ({p.detail})" if p.detail else "")


class WeightProgress:
    """Counts the weight bytes a rank reads (``__call__(nbytes)``, from the loading thread) and
    shows them: a ``tqdm`` bar when ``bar`` (rank 0 on a terminal), else a log line every
    ``interval`` seconds. Use as a context manager around the loading."""

    def __init__(self, who: str, *, bar: bool | None = None, interval: float = 10.0,
                 tp_rank: int = 0) -> None:
        self.who = who
        self.nbytes = 0
        self.interval = interval
        if bar is None:
            bar = tp_rank == 0 and _stderr_is_terminal()
        self._bar: Any = None
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:          # (a runtime dependency; an odd install: log lines)
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(desc=f"{who}: weights", unit="B", unit_scale=True,
                                 unit_divisor=1024, file=sys.stderr, leave=False,
                                 mininterval=min(0.5, interval))
        self._start = time.perf_counter()
        self._next_log = self._start + interval
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.nbytes += nbytes
            if self._bar is not None:
                self._bar.update(nbytes)
                return
            now = time.perf_counter()
            if now >= self._next_log:
                self._next_log = now + self.interval
                elapsed = now - self._start
                log.info("%s: weights: %s read in %.0f s (%s/s)", self.who,
                         fmt_bytes(self.nbytes), elapsed, fmt_bytes(int(self.nbytes / elapsed)))

    def __enter__(self) -> "WeightProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def release_free_heap() -> bool:
    """Hand the heap that loading freed back to the system (glibc ``malloc_trim``): the
    temporaries of sharding and conversion otherwise stay in the process's RSS as free heap,
    half a GiB for a 1B-parameter model. False where the C library has no such call."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def tensor_bytes(root: Any, *, exclude: tuple[torch.Tensor, ...] = (),
                 exclude_ranges: tuple[tuple[int, int], ...] = ()) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through containers,
    ``torch.nn.Module``\\ s and statebridge objects, leaving out the storages of ``exclude``
    (the rank buffer: pages and KV pool are counted on their own) and those whose memory lies
    in one of the address ranges ``exclude_ranges`` (``[start, end)``: tensors safetensors
    hands out straight from its file mapping are counted as mapped, not private). A storage
    shared by several tensors (tied embeddings, views) counts once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in skip and storage.nbytes() and \
                    not any(a <= ptr < b for a, b in exclude_ranges):
                storages[ptr] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module) or \
                type(obj).__module__.startswith("statebridge."):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return sum(storages.values())


def weight_memory(root: Any, model_dir: str, *,
                  exclude: tuple[torch.Tensor, ...] = ()) -> tuple[int, int]:
    """(private, mapped) bytes of a model's weights in this process: the tensor storages
    reachable from ``root`` outside the checkpoint's file mappings (and outside ``exclude``),
    and the resident bytes of those mappings (:func:`mapped_bytes`)."""
    ranges = mapped_ranges(model_dir)
    return tensor_bytes(root, exclude=exclude, exclude_ranges=ranges), mapped_bytes(model_dir)


def _in_directory(line: str, root: str) -> bool:
    parts = line.split(None, 5)
    return len(parts) == 6 and parts[5].strip().startswith(root)


def mapped_ranges(directory: str, maps: str = "/proc/self/maps") -> tuple[tuple[int, int], ...]:
    """Address ranges ``[start, end)`` of the files under ``directory`` mapped into this
    process; () where ``maps`` cannot be read."""
    root = os.path.realpath(directory) + os.sep
    out = []
    try:
        with open(maps) as f:
            for line in f:
                if _in_directory(line, root):
                    start, _, end = line.split(None, 1)[0].partition("-")
                    out.append((int(start, 16), int(end, 16)))
    except OSError:
        return ()
    return tuple(out)


def mapped_bytes(directory: str, smaps: str = "/proc/self/smaps") -> int:
    """Resident bytes of the files under ``directory`` mapped into this process (its
    ``smaps``: the ``Rss`` of every mapping whose path lies in that directory; page cache,
    shared with every other process mapping the file); 0 where ``smaps`` cannot be read."""
    root = os.path.realpath(directory) + os.sep
    total = 0
    inside = False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if not head:
                    continue
                if not head.endswith(":"):        # a mapping's header: range perms ... path
                    inside = _in_directory(line, root)
                elif inside and head == "Rss:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
