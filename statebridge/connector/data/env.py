"""Process setup for the data plane: UCX environment variables, the network devices a rank's
UCX worker may use, and page-buffer memory.

Nothing here runs on import: a library must not edit ``os.environ`` when it is imported, so a
process entry point calls :func:`configure_ucx_env` before it builds its first
:class:`Transport` (UCX options can also go to the transport as ``ucx_options``).

Where UCX listens: a UCX worker's TCP transport opens a listening socket on every network
interface it may use (by default all of them, the machine's external addresses included), even
when its peers reach it by worker address over shared memory. A node binds everything to the
address the user gave (``--host``), so its ranks' workers get ``NET_DEVICES`` = the interface
holding that address (:func:`ucx_net_devices`; loopback: ``lo``) and ``TCP_AF_PRIO`` = its
address family (:func:`ucx_options`). Shared memory (``sysv``, ``posix``, ``cma``) and ``self``
are not network devices: a restriction leaves them as they are. An operator's own
``UCX_NET_DEVICES`` wins.

Huge pages: torch CPU tensors are not backed by transparent huge pages, numpy arrays are
(``madvise`` from 4 MiB). Shared-memory transfers out of non-THP buffers are markedly slower
from 1 MiB up (``benchmarks/bench_transport.py``; docs/measurements.md, "Transport choices").
:func:`alloc_buffer` returns a THP-backed uint8 tensor for
``StateCache(..., buffer=alloc_buffer(n))``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

import numpy as np
import torch

from statebridge.errors import ConfigError

__all__ = ["alloc_buffer", "configure_ucx_env", "interface_addresses", "ucx_net_devices",
           "ucx_options"]

_WILDCARDS = ("0.0.0.0", "::", "[::]", "*", "")


def configure_ucx_env(*, tls: str | None = None, proto_info: bool = False,
                      quiet_unused_env_warnings: bool = True,
                      environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``UCX_*`` variables for this process; call it from a process entry point before the
    first :class:`Transport` (never called on import). Returns what it set.

    - ``tls``: ``UCX_TLS`` (e.g. ``"sm,self"`` or ``"tcp,self"``); None leaves UCX's choice.
    - ``proto_info``: ``UCX_PROTO_INFO=y`` prints which transport each protocol uses.
    - ``quiet_unused_env_warnings``: ``UCX_WARN_UNUSED_ENV_VARS=n``; ucxx sets
      ``UCX_MEMTYPE_CACHE`` on import, which this libucx build does not know and warns about.
    """
    environ = os.environ if environ is None else environ
    changes: dict[str, str] = {}
    if tls is not None:
        changes["UCX_TLS"] = tls
    if proto_info:
        changes["UCX_PROTO_INFO"] = "y"
    if quiet_unused_env_warnings:
        changes["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    environ.update(changes)
    return changes


def alloc_buffer(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed 1-D uint8 CPU tensor of ``nbytes`` for a page buffer or staging.

    With ``huge_pages`` the memory comes from numpy, which asks the kernel for transparent huge
    pages (``madvise``) on allocations of 4 MiB and more; plain torch CPU tensors do not, and
    shared-memory transfers out of 4 KiB pages run at about half the speed.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    if huge_pages:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return torch.zeros(nbytes, dtype=torch.uint8)


# -- which interface holds an address (rtnetlink, Linux) ------------------------------------------

_RTM_NEWADDR, _RTM_GETADDR, _NLMSG_DONE, _NLMSG_ERROR = 20, 22, 3, 2
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_NLMSGHDR = struct.Struct("=IHHII")
_IFADDRMSG = struct.Struct("=BBBBI")
_RTATTR = struct.Struct("=HH")


def interface_addresses() -> list[tuple[str, "ipaddress.IPv4Interface | ipaddress.IPv6Interface"]]:
    """Every address of every network interface of this machine (its network namespace) as
    ``(interface name, address/prefix)``, read from the kernel over rtnetlink (secondary
    addresses included). ConfigError where the kernel cannot be asked."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)   # NETLINK_ROUTE
    except (OSError, AttributeError) as e:
        raise ConfigError(f"cannot list this machine's interface addresses: {e}") from None
    out = []
    with sock:
        sock.bind((0, 0))
        request = _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(request), _RTM_GETADDR,
                                 _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + request)
        while True:
            data = sock.recv(1 << 16)
            pos = 0
            while pos + _NLMSGHDR.size <= len(data):
                length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, pos)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    raise ConfigError("cannot list this machine's interface addresses: "
                                      "rtnetlink answered an error")
                if kind == _RTM_NEWADDR:
                    out.extend(_addresses(data[pos + _NLMSGHDR.size:pos + length]))
                if length < _NLMSGHDR.size:
                    return out
                pos += (length + 3) & ~3


def _addresses(body: bytes) -> list:
    family, prefix, _, _, index = _IFADDRMSG.unpack_from(body)
    if family not in (socket.AF_INET, socket.AF_INET6):
        return []
    attrs: dict[int, bytes] = {}
    pos = _IFADDRMSG.size
    while pos + _RTATTR.size <= len(body):
        length, kind = _RTATTR.unpack_from(body, pos)
        if length < _RTATTR.size:
            break
        attrs[kind] = body[pos + _RTATTR.size:pos + length]
        pos += (length + 3) & ~3
    # IPv4: IFA_LOCAL is this side's address (IFA_ADDRESS the peer's on point-to-point links).
    raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS)
    if raw is None:
        return []
    try:
        name = socket.if_indextoname(index)
    except OSError:
        return []
    return [(name, ipaddress.ip_interface((ipaddress.ip_address(raw), prefix)))]


def ucx_net_devices(host: str) -> str:
    """The network interface that holds ``host`` (an address or a name), for
    ``UCX_NET_DEVICES``: a node's ranks then listen (UCX over TCP) where the node was asked
    to listen. "" for a wildcard host (``0.0.0.0``, ``::``: every interface, as asked).
    A loopback address that no interface lists exactly (``127.0.0.2``) is the loopback
    interface's. ConfigError when no interface of this machine holds it."""
    if host in _WILDCARDS:
        return ""
    ips = _resolve(host)
    found = interface_addresses()
    for ip in ips:
        for name, iface in found:
            if iface.ip == ip:
                return name
    for ip in ips:
        if ip.is_loopback:
            for name, iface in found:
                if iface.ip.is_loopback and ip in iface.network:
                    return name
    raise ConfigError(
        f"bind host {host!r} ({', '.join(map(str, ips))}) is no address of an interface of "
        f"this machine ({', '.join(sorted({f'{n} {i.ip}' for n, i in found}))}); bind one of "
        f"those, or name UCX's devices yourself with UCX_NET_DEVICES")


def _resolve(host: str) -> list:
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return [ipaddress.ip_address(text)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve bind host {host!r}: {e}") from None
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))


def ucx_options(net_devices: str, host: str = "",
                environ: "dict[str, str] | None" = None) -> dict[str, str]:
    """The UCX options (for :class:`Transport`'s ``ucx_options``) that keep a worker's TCP
    listeners on ``net_devices`` (:func:`ucx_net_devices`) and on the address family of
    ``host``: {} when ``net_devices`` is "" or the operator set ``UCX_NET_DEVICES``."""
    environ = os.environ if environ is None else environ
    if not net_devices or "UCX_NET_DEVICES" in environ:
        return {}
    options = {"NET_DEVICES": net_devices}
    if host and "UCX_TCP_AF_PRIO" not in environ:
        ips = _resolve(host) if host not in _WILDCARDS else []
        if ips:
            options["TCP_AF_PRIO"] = "inet6" if ips[0].version == 6 else "inet"
    return options
