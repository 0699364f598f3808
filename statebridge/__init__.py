"""statebridge: move Mamba-family recurrent state between prefill and decode TP groups.

The stable public names are re-exported here:

- :class:`StateSpec` -- what a model's recurrent state is (from a Hugging Face config).
- :class:`Client` -- submit requests to a decode node.
- :class:`Layout` (a page layout), :class:`TransferPlan` (what moves between two TP groups).
- :class:`PrefillServer`, :class:`DecodeCoordinator` -- the two sides of the connector.
- :class:`ConnectorConfig`, :class:`NodeConfig` -- the settings of the connector and a node.
- the extension points: :class:`RankModel` (what a rank runs: prefill, messages of its own,
  a check of the checkpoint before ranks start), :class:`RankSetup` (what it is given),
  :data:`Launcher` (how rank processes start).
- the error tree of :mod:`statebridge.errors`, rooted at :class:`StatebridgeError`.
- ``__version__``.

Everything else (the connector, the nodes, kernels, models) is reached through its module.
``import statebridge`` stays light: it imports :mod:`statebridge.errors` only; the other names
(torch, zmq behind them) are imported on first use. Nothing here imports ucxx.

statebridge logs through ``logging.getLogger("statebridge.<module>")`` and never configures
logging: the package logger gets a :class:`logging.NullHandler`, and the application (the
``statebridge`` CLI, a benchmark script) adds the handlers.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from statebridge import errors as _errors
from statebridge.errors import *  # noqa: F401,F403 -- the error tree is public as a whole

if TYPE_CHECKING:
    from statebridge.config import ConnectorConfig, NodeConfig
    from statebridge.connector.decode import DecodeCoordinator
    from statebridge.connector.group import Launcher
    from statebridge.connector.prefill import PrefillServer
    from statebridge.connector.rank import RankModel, RankSetup
    from statebridge.node.client import Client
    from statebridge.state.layout import Layout
    from statebridge.state.plan import TransferPlan
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
    "ConnectorConfig": "statebridge.config",
    "NodeConfig": "statebridge.config",
    "RankModel": "statebridge.connector.rank",
    "RankSetup": "statebridge.connector.rank",
    "Launcher": "statebridge.connector.group",
    "Layout": "statebridge.state.layout",
    "TransferPlan": "statebridge.state.plan",
    "PrefillServer": "statebridge.connector.prefill",
    "DecodeCoordinator": "statebridge.connector.decode",
}

__all__ = ["__version__", *_LAZY, *_errors.__all__]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
