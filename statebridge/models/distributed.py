"""The TP group of a runner: a ``torch.distributed`` process group across processes, threads in
one process, or nothing at TP = 1.

Across processes (one per rank)::

    group = init_tp_group(tp_size, tp_rank, "tcp://127.0.0.1:29500")   # gloo on CPU, nccl on CUDA
    runner = ModelRunner(model_dir, tp_size, tp_rank, cache, all_reduce=group.all_reduce)
    ...
    group.close()

:func:`init_tp_group` is the one builder of such a group (the rank processes of
:mod:`statebridge.node` use it too). It builds a *private* process group (a ``TCPStore`` and a
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on it), never torch's default group, so several TP
groups can live in one process and nothing global is initialised.

Where the store lives: with ``tcp://HOST:PORT`` rank 0 hosts it on that port, which the caller
had to pick beforehand (another process may take a port between a "free port" probe and rank
0's bind, and then ranks of two groups meet in one store). The nodes instead host it
themselves with :class:`Rendezvous` (bound to a port the kernel assigns, so nothing can take
it) and hand the ranks ``tcpstore://HOST:PORT``: every rank connects as a client.

Where it listens: only on HOST. The store's listening socket is made here, bound to HOST, and
handed to torch (a ``TCPStore`` left to itself listens on every address, IPv4 and IPv6), and
the gloo group's pairs listen on a device bound to the same HOST (torch's default device binds
the address the machine's host name resolves to); with a wildcard HOST (``0.0.0.0``, ``::``)
the store listens on it as asked, and the ranks meet and pair over loopback. NCCL picks its
own interfaces: binding it (``NCCL_SOCKET_IFNAME``, ``NCCL_SOCKET_FAMILY``) is the launcher's
job.

Bounded: :func:`init_tp_group` either returns a group whose ranks have all met and summed one
value, or raises :class:`~statebridge.errors.StartupError` within ``timeout_s`` naming the rank,
the group size, the rendezvous address, and the ranks that never came.

At TP = 1, ``init_tp_group(1, 0)`` touches no ``torch.distributed`` and its ``all_reduce`` is
None. :class:`ThreadGroup` runs the ranks of a group as threads of one process (tests, a
single-process reference run): its all-reduce sums in rank order, so every rank gets the same
bits.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from statebridge.errors import ConfigError, StartupError

__all__ = ["TPGroup", "init_tp_group", "make_all_reduce", "ThreadGroup",
           "AllReduce", "Rendezvous"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
T = TypeVar("T")


def make_all_reduce(process_group: Any) -> AllReduce:
    """An :data:`AllReduce` summing over ``process_group`` (a c10d process group, e.g. the one
    :func:`init_tp_group` builds); it reduces its argument in place when contiguous."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        process_group.allreduce([tensor]).wait()
        return tensor

    return all_reduce


@dataclass
class TPGroup(contextlib.AbstractContextManager):
    """One rank's membership in a TP group. ``all_reduce`` and ``process_group`` are None at
    TP = 1."""

    tp_size: int
    tp_rank: int
    device: torch.device
    backend: str | None = None
    all_reduce: AllReduce | None = None
    process_group: Any = field(default=None, repr=False)

    def close(self) -> None:
        """Drop this object's hold on the process group (idempotent); the group is freed once
        no ``all_reduce`` handed out refers to it."""
        self.process_group = None
        self.all_reduce = None

    def __exit__(self, *exc: Any) -> None:  # __enter__ (the base's) gives the group itself
        self.close()


_HOSTED = "tcpstore://"
#: Store keys of :func:`init_tp_group` (apart from gloo's own, which start with ``/``).
_ARRIVED = "statebridge/tp/arrived/"


def _parse_tcp(init_method: Any) -> tuple[str, int, bool]:
    """``(host, port, hosted)``: ``hosted`` when a :class:`Rendezvous` already serves the store.
    An IPv6 host may be written in brackets (``tcpstore://[::1]:PORT``)."""
    if isinstance(init_method, str):
        for scheme, hosted in (("tcp://", False), (_HOSTED, True)):
            if init_method.startswith(scheme):
                host, _, port = init_method.removeprefix(scheme).rpartition(":")
                if host.startswith("[") and host.endswith("]"):
                    host = host[1:-1]
                if host and port.isdigit() and 0 < int(port) < 65536:
                    return host, int(port), hosted
    raise ConfigError("init_method must be 'tcp://HOST:PORT' or 'tcpstore://HOST:PORT', "
                      f"got {init_method!r}")


def _host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reachable(address: str) -> str:
    """Where a process on this machine reaches a socket bound to numeric ``address``: itself, or
    loopback for a wildcard (``0.0.0.0``, ``::``), which is no address to connect to or to bind
    gloo's pairs on."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.is_unspecified:
        return "::1" if ip.version == 6 else "127.0.0.1"
    return address


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host`` (a name, an IPv4 or an IPv6 address) and ``port`` (0:
    one the kernel assigns, so nothing can take it between choosing and binding)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"rendezvous host {host!r} does not resolve ({e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen for a rendezvous on {_host_port(host, port)}: "
                           f"{e.strerror or e}") from None
    return sock


def _host_store(host: str, port: int, timeout_s: float) -> tuple[Any, str, int]:
    """``(store, address, port)``: a ``TCPStore`` server listening only on ``host`` (at the
    numeric ``address`` it resolved to) and ``port`` (0: kernel-assigned)."""
    import torch.distributed as dist

    sock = _listen(host, port)
    try:
        address, port = sock.getsockname()[:2]
        # torch owns (and closes, with the store) the descriptor it is given: it gets its own
        # duplicate of the listening socket, this one is closed below, and neither closes the
        # other's descriptor.
        fd = os.dup(sock.fileno())
        try:
            store = dist.TCPStore(address, port, None, True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s),
                                  master_listen_fd=fd)
        except (RuntimeError, OSError) as e:
            _close_if_ours(fd, sock)
            raise StartupError(f"cannot host a rendezvous store on {_host_port(address, port)}: "
                               f"{_first_line(e)}") from e
        except BaseException:
            _close_if_ours(fd, sock)
            raise
    finally:
        sock.close()
    return store, address, port


def _close_if_ours(fd: int, sock: socket.socket) -> None:
    """Close ``fd`` (the duplicate of ``sock`` handed to a store that failed) unless torch
    closed it already and the number now names something else."""
    try:
        if os.fstat(fd).st_ino == os.fstat(sock.fileno()).st_ino:
            os.close(fd)
    except OSError:
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class Rendezvous:
    """A ``TCPStore`` that a node hosts for its rank processes' TP group.

    It listens on ``host`` only (an IPv4 or IPv6 address or a name; loopback by default) at a
    port the kernel assigns (no race with other processes); :attr:`address` is the numeric
    address ``host`` resolved to. :attr:`init_method` (``tcpstore://ADDRESS:PORT``) is what the
    ranks pass to :func:`init_tp_group`, where every rank connects as a client and builds its
    gloo group on a device bound to that same address; for a wildcard host (``0.0.0.0``,
    ``::``) it names loopback instead (the ranks run on this machine, and their group needs no
    other address). One store serves one group: a restarted group gets a new one. Keep the object until the ranks are gone; :meth:`close` (idempotent)
    stops the store.
    """

    def __init__(self, host: str = "127.0.0.1", *, timeout_s: float = 60.0) -> None:
        if not isinstance(host, str) or not host:
            raise ConfigError(f"rendezvous host must be a host name or address, got {host!r}")
        self.host = host
        self._store, self.address, self.port = _host_store(host, 0, timeout_s)
        self.init_method = f"{_HOSTED}{_host_port(_reachable(self.address), self.port)}"

    @classmethod
    def for_group(cls, tp_size: int, dist_init: str = "", *,
                  host: str = "127.0.0.1") -> tuple[str, "Rendezvous | None"]:
        """What a node hands its ranks: ``(init_method, store)``. A given ``dist_init`` is used
        as is (no store); TP 1 needs none (``""``); else a new :class:`Rendezvous` listening on
        ``host`` (the node's bind address)."""
        if dist_init or tp_size == 1:
            return dist_init, None
        store = cls(host)
        return store.init_method, store

    def close(self) -> None:
        self._store = None

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def init_tp_group(tp_size: int, tp_rank: int, init_method: str | None = None, *,
                  backend: str | None = None, device: torch.device | str | None = None,
                  timeout_s: float = 60.0, collective_timeout_s: float | None = None,
                  cpu_threads: int | None = None) -> TPGroup:
    """Join a TP group of ``tp_size`` processes as rank ``tp_rank``.

    Args:
        init_method: ``"tcp://HOST:PORT"`` where rank 0 hosts the store (listening on HOST
            only), or ``"tcpstore://HOST:PORT"`` where a :class:`Rendezvous` hosts it
            (explicit; never read from the environment). Not needed at TP = 1. A gloo group's
            ranks listen for each other on HOST too.
        backend: default ``"nccl"`` for a CUDA device, else ``"gloo"``. NCCL chooses its own
            interfaces; bind it with ``NCCL_SOCKET_IFNAME`` in the ranks' environment.
        device: default ``cuda:<tp_rank % device count>`` when CUDA is available, else CPU.
        timeout_s: bound on joining, all steps together: reaching the store, every rank
            arriving there, and (gloo) the ranks connecting and summing one value. Past it,
            :class:`~statebridge.errors.StartupError` naming this rank, ``tp_size``,
            ``init_method`` and the ranks that never arrived. Also the bound on every
            collective unless ``collective_timeout_s`` is given.
        collective_timeout_s: bound on every collective after joining (default: ``timeout_s``).
        cpu_threads: when set, ``torch.set_num_threads(cpu_threads)`` for this process (several
            CPU ranks on one machine should share its cores, e.g. ``cores // tp_size``: intra-op
            threads that wait for a busy core make small matmuls orders of magnitude slower).

    At ``tp_size == 1`` without ``init_method`` nothing is initialised and ``all_reduce`` is
    None. The group is private (see the module docstring): ``torch.distributed``'s default
    group stays uninitialised.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    if device is None:
        device = (torch.device(f"cuda:{tp_rank % torch.cuda.device_count()}")
                  if torch.cuda.is_available() else torch.device("cpu"))
    device = torch.device(device)
    if cpu_threads is not None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be a positive integer, got {cpu_threads!r}")
        torch.set_num_threads(cpu_threads)
    if tp_size == 1 and init_method is None:
        return TPGroup(1, 0, device)
    host, port, hosted = _parse_tcp(init_method)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"backend 'nccl' needs a CUDA device, got {device}")
    for name, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    collective_timeout = datetime.timedelta(
        seconds=timeout_s if collective_timeout_s is None else collective_timeout_s)
    deadline = time.monotonic() + timeout_s
    where = f"TP rank {tp_rank} of {tp_size}"

    def left() -> datetime.timedelta:       # what remains of timeout_s (at least 1 ms)
        return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))

    if not hosted and tp_rank == 0:           # rank 0 hosts the store, listening on host only
        try:
            store = _host_store(host, port, timeout_s)[0]
        except (StartupError, ConfigError) as e:
            raise type(e)(f"{where}: {e}") from e
    else:                                     # every other rank (all ranks if hosted) a client
        try:
            # torch's own connect retries with a back-off that can outlast its timeout by
            # tens of seconds: it only starts once something listens there.
            _wait_listening(_reachable(host), port, deadline)
            store = dist.TCPStore(_reachable(host), port, None, False, timeout=left())
        except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError
            raise StartupError(f"{where}: no rendezvous at {init_method} within {timeout_s:g} s "
                               f"({_first_line(e)})") from e
    _meet(store, tp_rank, tp_size, left, f"{where}: ", init_method, timeout_s)
    try:
        if backend == "nccl":
            # NCCL connects at its first collective, on interfaces of its own choosing.
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = collective_timeout
            process_group = dist.ProcessGroupNCCL(store, tp_rank, tp_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(
                hostname=_reachable(host), lazy_init=False)]
            options._timeout = left()         # bounds connecting the pairs, here
            process_group = dist.ProcessGroupGloo(store, tp_rank, tp_size, options)
            check = torch.ones(1)             # every rank is connected and answers
            reduce_options = dist.AllreduceOptions()
            reduce_options.timeout = left()
            process_group.allreduce([check], reduce_options).wait()
            if check.item() != tp_size:
                raise StartupError(f"{where}: the group at {init_method} summed {check.item():g} "
                                   f"ones, not {tp_size} (ranks of another group in its store?)")
            process_group.set_timeout(collective_timeout)
        # Later users of the store (NCCL's first collective exchanges its id there) get the
        # store's whole bound again, not what setup left of it.
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise StartupError(f"{where}: the group at {init_method} did not form within "
                           f"{timeout_s:g} s ({_first_line(e)})") from e
    return TPGroup(tp_size, tp_rank, device, backend, make_all_reduce(process_group),
                   process_group)


def _wait_listening(host: str, port: int, deadline: float) -> None:
    """Return once a TCP connection to ``host:port`` succeeds; the last OSError once
    ``deadline`` (``time.monotonic()``) has passed."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, 1.0), 1e-3)):
                return
        except OSError:
            if time.monotonic() + 0.05 >= deadline:
                raise
        time.sleep(0.05)


def _meet(store: Any, tp_rank: int, tp_size: int, left: Callable[[], datetime.timedelta],
          where: str, init_method: str, timeout_s: float) -> None:
    """Mark ``tp_rank`` arrived in ``store`` and wait (``left()``) until every rank has; a
    StartupError names the ranks that never came."""
    keys = [f"{_ARRIVED}{r}" for r in range(tp_size)]
    try:
        store.set_timeout(left())
        store.set(keys[tp_rank], "1")
        store.wait(keys, left())
        return
    except (RuntimeError, OSError) as e:
        cause = e
    try:
        store.set_timeout(datetime.timedelta(seconds=1))
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    except (RuntimeError, OSError):
        raise StartupError(f"{where}lost the rendezvous at {init_method} while waiting for the "
                           f"other ranks ({_first_line(cause)})") from cause
    if not missing:       # everyone came, just after the wait gave up
        return
    names = ", ".join(str(r) for r in missing)
    raise StartupError(f"{where}rank{'s' if len(missing) > 1 else ''} {names} of {tp_size} never "
                       f"joined the group at {init_method} within {timeout_s:g} s") from cause


class ThreadGroup:
    """A TP group whose ranks are threads of this process.

    ``all_reduce(rank)`` gives rank ``rank``'s :data:`AllReduce`: every rank deposits its
    tensor, all sum them in rank order (identical bits on every rank), then continue. A rank
    that fails breaks the barrier, so the others raise instead of waiting out ``timeout_s``.
    """

    def __init__(self, tp_size: int, *, timeout_s: float = 60.0) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(tp_size, timeout=timeout_s)
        self._slots: list[torch.Tensor | None] = [None] * tp_size

    def all_reduce(self, rank: int) -> AllReduce | None:
        """Rank ``rank``'s all-reduce (None at TP = 1, like :func:`init_tp_group`)."""
        if not 0 <= rank < self.tp_size:
            raise ConfigError(f"rank must be in [0, {self.tp_size}), got {rank!r}")
        if self.tp_size == 1:
            return None

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = tensor
            self._barrier.wait()
            total = self._slots[0].clone()
            for other in self._slots[1:]:
                total += other
            self._barrier.wait()  # nobody overwrites a slot before everyone has summed
            return total

        return all_reduce

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(rank)`` on one thread per rank; the results in rank order. The first
        exception (by rank) is re-raised after every thread has finished."""
        results: list[Any] = [None] * self.tp_size
        errors: list[BaseException | None] = [None] * self.tp_size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
                errors[rank] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}", daemon=True)
                   for r in range(self.tp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._barrier.broken:
            self._barrier.reset()
        # Prefer the root cause over the BrokenBarrierError it caused in the other ranks.
        first = next((e for e in errors if e is not None
                      and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results
