"""listening_sockets / descendants: what a process listens on, read from /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from statebridge.testing.sockets import WILDCARDS, Listener, descendants, listening_sockets


def _listen(family: int, address: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen()
    return sock


def test_lists_this_processes_listeners_with_their_addresses_and_only_those():
    before = set(listening_sockets(os.getpid()))
    socks = [_listen(socket.AF_INET, "127.0.0.1"), _listen(socket.AF_INET, "0.0.0.0"),
             _listen(socket.AF_INET6, "::1"), _listen(socket.AF_INET6, "::")]
    bound_only = socket.socket()          # bound, not listening: not a listener
    bound_only.bind(("127.0.0.1", 0))
    peer = _listen(socket.AF_INET, "127.0.0.1")
    client = socket.create_connection(peer.getsockname())     # connected: not a listener
    try:
        want = {Listener(address, s.getsockname()[1])
                for address, s in zip(("127.0.0.1", "0.0.0.0", "::1", "::"), socks)}
        want.add(Listener("127.0.0.1", peer.getsockname()[1]))
        got = listening_sockets(os.getpid())
        assert got == sorted(got)
        assert set(got) - before == want
        assert {"0.0.0.0", "::"} <= WILDCARDS and "127.0.0.1" not in WILDCARDS
    finally:
        for s in [*socks, bound_only, peer, client]:
            s.close()
    assert set(listening_sockets(os.getpid())) == before


def test_another_processes_listeners_and_the_tree_below_a_process():
    """A child's listener is the child's, not its parent's; descendants finds grandchildren."""
    code = ("import socket, subprocess, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(s.getsockname()[1], g.pid, flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        port, grandchild = (int(x) for x in child.stdout.readline().split())
        assert listening_sockets(child.pid) == [Listener("127.0.0.1", port)]
        assert Listener("127.0.0.1", port) not in listening_sockets(os.getpid())
        assert listening_sockets(grandchild) == []
        tree = descendants(os.getpid())
        assert tree.index(child.pid) < tree.index(grandchild)
        assert descendants(child.pid) == [grandchild]
    finally:
        if grandchild is not None:
            os.kill(grandchild, 9)
        child.kill()
        child.wait()
        child.stdout.close()
    deadline = time.monotonic() + 10
    while child.pid in descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.pid not in descendants(os.getpid())


def test_a_process_that_does_not_exist():
    with subprocess.Popen([sys.executable, "-c", "pass"]) as gone:
        gone.wait()
    with pytest.raises(ProcessLookupError, match=str(gone.pid)):
        listening_sockets(gone.pid)
    assert descendants(gone.pid) == []
