"""``kv_connector_extra_config`` of :class:`~statebridge.vllm.StatebridgeConnector`, checked
(docs/vllm.md has the table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statebridge.errors import ConfigError

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` of the connector (see the README's table)."""

    host: str = "127.0.0.1"
    port: int = 5710
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    verify_transfers: bool = False

    KEYS = {"side_channel_host": "host", "side_channel_port": "port", "lease_s": "lease_s",
            "transfer_timeout_s": "transfer_timeout_s",
            "handshake_timeout_s": "handshake_timeout_s",
            "verify_transfers": "verify_transfers"}

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "Settings":
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if key not in cls.KEYS:
                raise ConfigError(f"kv_connector_extra_config: unknown key {key!r}; expected "
                                  f"one of {sorted(cls.KEYS)}")
            values[cls.KEYS[key]] = value
        out = cls(**values)
        if not isinstance(out.host, str) or not out.host:
            raise ConfigError(f"side_channel_host must be a host name, got {out.host!r}")
        if isinstance(out.port, bool) or not isinstance(out.port, int) \
                or not 0 < out.port < 65536 - 64:
            raise ConfigError(f"side_channel_port must be a port below 65472, got {out.port!r}")
        for name in ("lease_s", "transfer_timeout_s", "handshake_timeout_s"):
            value = getattr(out, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(out.verify_transfers, bool):
            raise ConfigError(f"verify_transfers must be true or false, got "
                              f"{out.verify_transfers!r}")
        return out
