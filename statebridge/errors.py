"""The one exception tree of statebridge.

Every public function raises a subclass of :class:`StatebridgeError` with the offending value in
the message. The tree says who caused the error:

- :class:`ConfigError` -- the caller's configuration (model config, TP size, layout) is wrong.
- :class:`CacheError` -- misuse or exhaustion of a :class:`~statebridge.state.cache.StateCache`.
"""

from __future__ import annotations

__all__ = [
    "StatebridgeError",
    "ConfigError",
    "UnsupportedModelError",
    "LayoutError",
    "CacheError",
    "CacheFullError",
    "DoubleFreeError",
    "UnknownPageError",
    "ShapeError",
]


class StatebridgeError(Exception):
    """Base class of every error statebridge raises on purpose."""


class ConfigError(StatebridgeError, ValueError):
    """A configuration value is invalid: the message names the value and why."""


class UnsupportedModelError(ConfigError):
    """The model config describes an architecture or layer type statebridge cannot serve."""


class LayoutError(ConfigError):
    """An unknown or malformed page layout name."""


class CacheError(StatebridgeError):
    """Misuse or exhaustion of a state cache."""


class CacheFullError(CacheError):
    """Every page of the cache is in use (back-pressure, not a crash)."""


class DoubleFreeError(CacheError):
    """A page was freed that is not allocated."""


class UnknownPageError(CacheError):
    """A page id outside the cache."""


class ShapeError(StatebridgeError, ValueError):
    """A tensor handed to a kernel or layer has the wrong shape, dtype or strides."""
