"""Which TCP addresses a process listens on, read from ``/proc`` (Linux), for tests that check
every listener binds only where it was asked to.

    for pid in [node.pid, *descendants(node.pid)]:
        for address, port in listening_sockets(pid):
            assert address == "127.0.0.1", (pid, address, port)

:func:`listening_sockets` matches the socket inodes among ``/proc/PID/fd`` with the ``LISTEN``
rows of ``/proc/PID/net/tcp`` and ``tcp6`` (the tables of that process's network namespace), so
it sees exactly the sockets the process holds, including ones a library opened (torch's store,
gloo, UCX) and ones it inherited. Addresses come back as :mod:`ipaddress` writes them
(``"0.0.0.0"`` and ``"::"`` are every address). :func:`descendants` lists a process's children,
grandchildren and so on (rank processes of a node, :func:`is_rank`).
"""

from __future__ import annotations

import ipaddress
import os
import sys
from typing import NamedTuple

__all__ = ["Listener", "listening_sockets", "descendants", "alive", "is_rank", "WILDCARDS"]

#: Addresses that mean "every address" (IPv4, IPv6, and IPv4 in IPv6).
WILDCARDS = frozenset({"0.0.0.0", "::", "::ffff:0.0.0.0"})

_LISTEN = "0A"     # TCP_LISTEN in /proc/net/tcp's "st" column


class Listener(NamedTuple):
    """One listening TCP socket: ``(address, port)``."""

    address: str
    port: int


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open. ProcessLookupError when it does not exist."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    inodes = set()
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except (FileNotFoundError, PermissionError):     # closed meanwhile
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _address(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s ``local_address`` host part: 32-bit words (one for IPv4, four
    for IPv6) printed in host byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def listening_sockets(pid: int) -> list[Listener]:
    """The TCP sockets (IPv4 and IPv6) process ``pid`` holds in the listening state, sorted.
    ProcessLookupError when there is no such process; PermissionError for another user's."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            if table == "tcp6":        # a kernel without IPv6
                continue
            raise ProcessLookupError(f"no process {pid}") from None
        for row in rows:
            fields = row.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(fields) < 10 or fields[3] != _LISTEN or int(fields[9]) not in inodes:
                continue
            address, port = fields[1].split(":")
            found.add(Listener(_address(address), int(port, 16)))
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def is_rank(pid: int) -> bool:
    """Whether process ``pid`` is a rank process (named by
    :func:`statebridge.connector.launch.rank_title`)."""
    from statebridge.connector.launch import RANK_TITLES

    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith(RANK_TITLES)
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), parents first. Processes
    that exit meanwhile are left out."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as f:
                    children = [int(c) for c in f.read().split()]
            except FileNotFoundError:
                continue
            for child in children:
                if child not in out:
                    out.append(child)
                    todo.append(child)
    return out
