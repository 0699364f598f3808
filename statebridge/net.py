"""Small network helpers shared by the nodes, the model runtime, tests and benchmarks."""

from __future__ import annotations

import functools
import os
import socket

__all__ = ["free_port", "host_id", "same_host"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (e.g. for a ``tcp://`` rendezvous of
    ``torch.distributed``). Another process may take it before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@functools.cache
def host_id() -> str:
    """What two processes share when they can read each other's memory: the kernel they run on
    (its boot id) and their pid namespace (``process_vm_readv`` names the other process by its
    pid). "" when either cannot be read: such a process is never taken for a neighbour."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{pid_ns}" if boot else ""


def same_host(other: str) -> bool:
    """Whether a peer that reported :func:`host_id` ``other`` runs beside this process (an
    unknown id, "", never does)."""
    return bool(other) and other == host_id()
