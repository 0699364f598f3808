"""Small network helpers shared by nodes, tests and benchmarks."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (e.g. for a torch.distributed rendezvous).
    Another process may take it before it is bound: use it at once."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
