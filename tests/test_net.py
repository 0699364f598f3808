"""statebridge.net: the one free_port."""

from __future__ import annotations

import socket

import pytest

from statebridge.net import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"], ids=["loopback", "any"])
def test_free_port_is_bindable(host):
    port = free_port(host)
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind((host, port))
