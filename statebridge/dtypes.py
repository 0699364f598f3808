"""The dtype names statebridge accepts in ``config.json``, in state specs and on the wire.

One table for the config reader (:mod:`statebridge.hf_config`), the state spec
(:mod:`statebridge.state.spec`) and the model runtime, in its own module so that those can all
import it without importing each other.
"""

from __future__ import annotations

import torch

from statebridge.errors import ConfigError

__all__ = ["DTYPES", "dtype_from_name"]

#: dtype names accepted in configs and on the wire -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


def dtype_from_name(name: str | torch.dtype) -> str:
    """Canonical dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``) of ``name``."""
    if isinstance(name, torch.dtype):
        for key, value in DTYPES.items():
            if value == name:
                return key
        raise ConfigError(f"unsupported state dtype {name!r}; expected one of {sorted(DTYPES)}")
    key = str(name).removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ConfigError(f"unsupported state dtype {name!r}; expected one of {sorted(DTYPES)}")
    return key
