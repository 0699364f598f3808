"""The front doors' settings: the flags reach HttpConfig and NodeConfig, bad values are refused,
and when the zmq front door listens."""

from __future__ import annotations

import pytest

from statebridge.cli import NODE_FRONT_DOORS, _http_config, _node_config, build_parser
from statebridge.config import ConnectorConfig, HttpConfig, NodeConfig
from statebridge.errors import ConfigError
from statebridge.node.decode_node import _front_door

BASE = ["decode", "--model", "m", "--tp", "1", "--port", "1", "--prefill", "127.0.0.1:2"]


def test_the_flags_reach_the_configs():
    args = build_parser().parse_args(BASE + ["--http-port", "0", "--max-body-bytes", "1MiB",
                                             "--front-door", "off"])
    assert _http_config(args).max_body_bytes == 1 << 20
    assert _node_config(args).front_door == "off"
    args = build_parser().parse_args(BASE + ["--http-port", "0"])
    assert _http_config(args).max_body_bytes == HttpConfig().max_body_bytes == 1 << 20
    assert _node_config(args).front_door == "auto"
    assert NODE_FRONT_DOORS == NodeConfig.FRONT_DOORS
    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + ["--front-door", "sometimes"])


@pytest.mark.parametrize("bad", [dict(max_body_bytes=100), dict(max_body_bytes=True),
                                 dict(header_timeout=0), dict(body_timeout=-1),
                                 dict(body_timeout=float("inf")), dict(header_timeout="5")])
def test_http_limits_refuse_bad_values(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        HttpConfig(**bad)


def test_node_front_door_refuses_bad_values():
    with pytest.raises(ConfigError, match="front_door"):
        NodeConfig(front_door="maybe")




class _Keyed:
    keys_dir = "/some/keys"
    bind_host = "127.0.0.1"


@pytest.mark.parametrize("setting,http,config,listens", [
    ("auto", None, ConnectorConfig(), True),                                # no HTTP
    ("auto", HttpConfig(port=0), ConnectorConfig(), True),                  # HTTP without key
    ("auto", HttpConfig(port=0, api_key="k"), ConnectorConfig(), False),    # the side door
    ("auto", HttpConfig(port=0, api_key="k"), _Keyed(), True),              # CURVE guards it
    ("auto", HttpConfig(port=None, api_key="k"), ConnectorConfig(), True),  # HTTP not served
    ("on", HttpConfig(port=0, api_key="k"), ConnectorConfig(), True),
    ("off", None, ConnectorConfig(), False),
], ids=["no-http", "open-http", "key-no-curve", "key-and-curve", "no-http-port", "on", "off"])
def test_when_the_zmq_front_door_listens(setting, http, config, listens):
    door, why = _front_door(setting, http, config)
    assert door is listens
    assert bool(why) is not listens
