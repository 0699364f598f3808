"""Field readers of ``config.json``: each reads one key (or its aliases), applies the default
when it is absent or null, and names the key and the value it refuses; the special floats of
transformers' JSON; and the raw file itself."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from statebridge.dtypes import DTYPES, dtype_from_name
from statebridge.errors import ConfigError, UnsupportedModelError

#: The weights' dtype when the config names none.
DEFAULT_DTYPE = "float32"

_FLOAT_TAG = "__float__"
_FLOAT_VALUES = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_special_floats(obj: Any) -> Any:
    """Replace ``{"__float__": "Infinity"}`` objects (transformers 5's JSON form) by floats."""
    if isinstance(obj, dict):
        if set(obj) == {_FLOAT_TAG} and obj[_FLOAT_TAG] in _FLOAT_VALUES:
            return _FLOAT_VALUES[obj[_FLOAT_TAG]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [decode_special_floats(v) for v in obj]
    return obj


def encode_special_floats(obj: Any) -> Any:
    """Inverse of :func:`decode_special_floats` (what transformers 5 writes to config.json)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        tag = "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"
        return {_FLOAT_TAG: tag}
    if isinstance(obj, dict):
        return {k: encode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_special_floats(v) for v in obj]
    return obj


# -- field readers: each names the key and the value it refuses --------------------------------

_ABSENT = object()


def _lookup(config: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    """The first of ``keys`` whose value is not null, and that value (``_ABSENT`` if none)."""
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return keys[0], _ABSENT


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(config: Mapping[str, Any], *keys: str, default: int) -> int:
    key, value = _lookup(config, keys)
    if value is _ABSENT:
        return default
    if not _is_number(value) or not math.isfinite(value) or value != int(value) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return int(value)


def _positive(config: Mapping[str, Any], *keys: str, default: float) -> float:
    """A positive finite number, kept as given (``expand`` may be an int or a float)."""
    key, value = _lookup(config, keys)
    if value is _ABSENT:
        return default
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive number, got {value!r}")
    return value


def _count(config: Mapping[str, Any], key: str, *, default: int) -> int:
    """A non-negative integer (a count that may be 0)."""
    _, value = _lookup(config, (key,))
    if value is _ABSENT:
        return default
    if not _is_number(value) or not math.isfinite(value) or value != int(value) or value < 0:
        raise ConfigError(f"config field {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _typed(config: Mapping[str, Any], kind: type, what: str, *keys: str, default: Any) -> Any:
    """A value of exactly ``kind`` (``bool`` or ``str``); ``what`` says which in errors."""
    key, value = _lookup(config, keys)
    if value is _ABSENT:
        return default
    if not isinstance(value, kind):
        raise ConfigError(f"config field {key!r} must be {what}, got {value!r}")
    return value


def _bool(config: Mapping[str, Any], *keys: str, default: bool) -> bool:
    return _typed(config, bool, "true or false", *keys, default=default)


def _time_step_limit(config: Mapping[str, Any], *,
                     default: tuple[float, float]) -> tuple[float, float]:
    limit = config.get("time_step_limit")
    if limit is None:
        limit = default
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or not all(
            _is_number(v) for v in limit):
        raise ConfigError(f"config field 'time_step_limit' must be [min, max], got {limit!r}")
    return float(limit[0]), float(limit[1])


def _layer_type_list(config: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ConfigError(f"config field {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _dtype(config: Mapping[str, Any]) -> str:
    """``dtype``, else the legacy ``torch_dtype``, else float32 (see the module docstring)."""
    key, value = _lookup(config, ("dtype", "torch_dtype"))
    if value is _ABSENT:
        return DEFAULT_DTYPE
    if not isinstance(value, str):
        raise ConfigError(f"config field {key!r} must be a dtype name, got {value!r}")
    try:
        return dtype_from_name(value)
    except ConfigError:
        raise ConfigError(f"config field {key!r} is {value!r}; expected one of "
                          f"{sorted(DTYPES)}") from None


def _int_list(config: Mapping[str, Any], key: str) -> list[int] | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"config field {key!r} must be a list of integers, got {value!r}")
    return list(value)


def _rope_theta(config: Mapping[str, Any], *, default: float) -> float:
    """``rope_parameters.rope_theta`` (transformers 5), else the legacy top-level ``rope_theta``,
    else the model's default; only the ``"default"`` rope type is served."""
    params = config.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"config field 'rope_parameters.rope_type' is {rope_type!r}; "
                                    f"only 'default' rotary embeddings are served")
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise UnsupportedModelError(f"config field 'partial_rotary_factor' is {factor!r}; only "
                                    f"1.0 (rotary over the whole head) is served")
    theta = params.get("rope_theta", config.get("rope_theta", default))
    if not _is_number(theta) or not theta > 0:
        raise ConfigError(f"config field 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint directory, or a JSON file given directly."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {path!r}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {path!r} is not a JSON object")
    return config
