"""Mixer implementations by stable name, so a deployment can swap one without touching callers.

A registered implementation is a class (or any callable) built from ONE rank's local weights with
the keyword arguments of :class:`~statebridge.kernels.layers.ShortConvMixer` (``"short_conv"``)
or :class:`~statebridge.kernels.layers.Mamba2Mixer` (``"mamba2"``), and their ``prefill`` /
``decode`` methods. :mod:`statebridge.models.tp` cuts those weights from a checkpoint::

    impl = registry.get("mamba2")
    mixer = models.tp.mamba2_from_hf(config, weights, tp_size=4, tp_rank=r, all_reduce=ar,
                                     cls=impl)
"""

from __future__ import annotations

from statebridge.errors import ConfigError
from statebridge.kernels.layers import Mamba2Mixer, ShortConvMixer

__all__ = ["register", "get", "names"]

_IMPLEMENTATIONS: dict[str, object] = {}


def register(name: str, impl: object, *, replace: bool = False) -> None:
    """Register ``impl`` under ``name``; re-registering a name needs ``replace=True``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a mixer name must be a non-empty string, got {name!r}")
    if name in _IMPLEMENTATIONS and not replace:
        raise ConfigError(f"mixer {name!r} is already registered ({_IMPLEMENTATIONS[name]!r}); pass replace=True")
    _IMPLEMENTATIONS[name] = impl


def get(name: str) -> object:
    """The implementation registered under ``name``; :class:`ConfigError` naming it if none."""
    try:
        return _IMPLEMENTATIONS[name]
    except KeyError:
        raise ConfigError(f"no mixer registered under {name!r}; registered: {sorted(_IMPLEMENTATIONS)}") from None


def names() -> tuple[str, ...]:
    """Registered names, sorted."""
    return tuple(sorted(_IMPLEMENTATIONS))


register("short_conv", ShortConvMixer)
register("mamba2", Mamba2Mixer)
