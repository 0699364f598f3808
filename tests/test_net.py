"""statebridge.net: the one free_port, and which processes share a host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from statebridge.net import free_port, host_id, same_host


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"], ids=["loopback", "any"])
def test_free_port_is_bindable(host):
    port = free_port(host)
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind((host, port))


def test_host_id_is_the_kernel_and_pid_namespace_shared_by_processes_here():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert host_id() == f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    child = subprocess.run([sys.executable, "-c",
                            "from statebridge.net import host_id; print(host_id())"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert child.stdout.strip() == host_id()
    assert same_host(host_id())


@pytest.mark.parametrize("other", ["", "another-boot-id/pid:[4026531836]"])
def test_an_unknown_or_other_host_is_never_this_one(other):
    assert not same_host(other)
