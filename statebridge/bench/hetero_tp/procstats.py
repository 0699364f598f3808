"""Per-process figures from ``/proc`` over a round: CPU seconds, wake-ups (voluntary context
switches), peak RSS."""

from __future__ import annotations

import os

from statebridge.bench._nixl import _cpu_seconds


def _cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(_cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


def _sleeps(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid``: each is a thread going to sleep,
    i.e. one wake-up to come (zmq's I/O threads, UCX's, compute threads included)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except OSError:                           # the thread ended meanwhile
            pass
    return total


def _sleeps_snapshot(groups: dict[str, list[int]]) -> dict[str, int]:
    return {name: sum(_sleeps(pid) for pid in pids) for name, pids in groups.items()}


def _reset_peak_rss(pid: int) -> bool:
    """Reset process ``pid``'s peak RSS (VmHWM) to its current RSS (``/proc/PID/clear_refs``
    ``5``, Linux >= 4.0); False where that is refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib(pid: int) -> float | None:
    """Peak resident set size (VmHWM) of process ``pid`` in MiB, or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024        # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


class _PeakRss:
    """Peak RSS per process over one cell, by process class. The rank hosts and NIXL workers
    live across cells, so their peaks are reset when the cell starts; where the kernel refuses
    the reset the figure is the peak since the process started (``scope`` says which)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        resets = [_reset_peak_rss(pid) for pids in groups.values() for pid in pids]
        self.scope = "cell" if all(resets) else "process"

    def read(self) -> dict[str, list[float | None]]:
        return {name: [_peak_rss_mib(pid) for pid in pids] for name, pids in self.groups.items()}
