"""statebridge: move Mamba-family recurrent state between prefill and decode TP groups.

The stable public names are re-exported here:

- :class:`StateSpec` -- what a model's recurrent state is (from a Hugging Face config).
- :class:`Client` -- submit requests to a decode node.
- the error tree of :mod:`statebridge.errors`, rooted at :class:`StatebridgeError`.
- ``__version__``.

Everything else (the connector, the nodes, kernels, models) is reached through its module.
``import statebridge`` stays light: it imports :mod:`statebridge.errors` only, and
``StateSpec`` (torch) and ``Client`` (zmq) are imported on first use. Nothing here imports ucxx.

statebridge logs through ``logging.getLogger("statebridge.<module>")`` and never configures
logging: the package logger gets a :class:`logging.NullHandler`, and the application (the
``statebridge`` CLI, a benchmark script) adds the handlers.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from statebridge.errors import (
    AbortedError,
    AuthenticationError,
    CacheError,
    CacheFullError,
    ClosedError,
    ConfigError,
    DoubleFreeError,
    IncompatiblePeerError,
    LayoutError,
    PeerLostError,
    ProtocolError,
    ShapeError,
    StatebridgeError,
    TransferError,
    TransferTimeoutError,
    UnknownPageError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from statebridge.node.client import Client
    from statebridge.state.spec import StateSpec

logging.getLogger(__name__).addHandler(logging.NullHandler())

try:
    __version__ = version("statebridge")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

#: Public names imported on first access: name -> module.
_LAZY = {
    "StateSpec": "statebridge.state.spec",
    "Client": "statebridge.node.client",
}

__all__ = [
    "__version__",
    "StateSpec",
    "Client",
    "StatebridgeError",
    "ConfigError",
    "UnsupportedModelError",
    "LayoutError",
    "CacheError",
    "CacheFullError",
    "DoubleFreeError",
    "UnknownPageError",
    "ShapeError",
    "ProtocolError",
    "IncompatiblePeerError",
    "TransferError",
    "PeerLostError",
    "TransferTimeoutError",
    "AbortedError",
    "ClosedError",
    "AuthenticationError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
