"""Small network helpers shared by the nodes, the model runtime, tests and benchmarks."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (e.g. for a ``tcp://`` rendezvous of
    ``torch.distributed``). Another process may take it before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
