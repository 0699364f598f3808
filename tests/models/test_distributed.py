"""The TP group helpers: TP = 1 without torch.distributed, thread groups, argument checks; where
a group listens (only the address asked for) and how it fails (within its timeout, naming the
rank, the address and who is missing), with rank processes. (Models on real gloo groups across
processes run in test_runner.py.)"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from statebridge.errors import ConfigError, StartupError
from statebridge.models import Rendezvous, ThreadGroup, init_tp_group
from statebridge.net import free_port
from statebridge.testing.sockets import WILDCARDS, listening_sockets


def test_tp1_needs_no_torch_distributed():
    group = init_tp_group(1, 0, device="cpu")
    assert group.all_reduce is None and group.tp_size == 1
    assert not dist.is_initialized()
    group.close()
    group.close()  # idempotent


@pytest.mark.parametrize("args,kwargs,match", [
    ((0, 0), {}, "tp_size"),
    ((2, 2), {}, "tp_rank"),
    ((2, 0), {}, "init_method"),
    ((2, 0), {"init_method": "env://"}, "init_method"),
    ((2, 0), {"init_method": "tcpstore://127.0.0.1"}, "tcpstore://127.0.0.1"),
    ((2, 0), {"init_method": "tcpstore://:80"}, "init_method"),
    ((2, 0), {"init_method": "tcp://127.0.0.1:1", "backend": "mpi"}, "backend"),
    ((2, 0), {"init_method": "tcp://127.0.0.1:1", "backend": "nccl", "device": "cpu"}, "nccl"),
    ((1, 0), {"cpu_threads": 0}, "cpu_threads"),
    ((2, 0), {"init_method": "tcp://127.0.0.1:1", "collective_timeout_s": 0}, "collective"),
])
def test_bad_group_arguments(args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        init_tp_group(*args, **kwargs)


def reduce_in_threads(inits: list[str], tp_size: int) -> dict[tuple[int, int], torch.Tensor]:
    """One private gloo group per init method, its ranks as threads of this process; rank r of
    group g all-reduces ``10 * g + r``. The results by (group, rank)."""
    results: dict[tuple[int, int], torch.Tensor] = {}

    def rank(group: int, r: int) -> None:
        with init_tp_group(tp_size, r, inits[group], device="cpu", timeout_s=30.0) as tp:
            assert tp.backend == "gloo" and tp.process_group is not None
            results[(group, r)] = tp.all_reduce(torch.full((3,), 10.0 * group + r))

    threads = [threading.Thread(target=rank, args=(g, r))
               for g in range(len(inits)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_two_private_gloo_groups_in_one_process():
    """init_tp_group builds private groups (what the rank hosts need): two TP=2 groups, their
    ranks as threads of this process, reduce independently; torch's default group stays unset."""
    results = reduce_in_threads([f"tcp://127.0.0.1:{free_port()}" for _ in range(2)], 2)
    assert sorted(results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (group, _), total in results.items():
        assert torch.equal(total, torch.full((3,), 20.0 * group + 1))
    assert not dist.is_initialized()


def test_thread_group_sums_identically_on_every_rank():
    group = ThreadGroup(3)
    assert ThreadGroup(1).all_reduce(0) is None

    def body(rank: int) -> list[torch.Tensor]:
        reduce = group.all_reduce(rank)
        return [reduce(torch.full((4,), float(rank + step))) for step in range(3)]

    results = group.run(body)
    for step in range(3):
        want = torch.full((4,), float(0 + 1 + 2 + 3 * step))
        for rank in range(3):
            assert torch.equal(results[rank][step], want)


def test_thread_group_failure_does_not_hang():
    group = ThreadGroup(2, timeout_s=30.0)

    def body(rank: int) -> None:
        if rank == 1:
            raise RuntimeError("rank 1 broke")
        group.all_reduce(rank)(torch.zeros(2))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        group.run(body)
    assert time.monotonic() - start < 10
    assert threading.active_count() < 50
    # the group is usable again
    assert group.run(lambda r: group.all_reduce(r)(torch.ones(1)).item()) == [2.0, 2.0]


def test_groups_on_node_hosted_stores_reduce_independently():
    """What the nodes do: each hosts its ranks' store (a port the kernel assigned, so no other
    process can hold it) and every rank joins as a client. Two TP=3 groups, ranks as threads."""
    stores = [Rendezvous(), Rendezvous()]
    assert stores[0].port != stores[1].port and all(s.port > 0 for s in stores)
    assert stores[0].init_method == f"tcpstore://127.0.0.1:{stores[0].port}"
    results = reduce_in_threads([s.init_method for s in stores], 3)
    assert len(results) == 6
    for (group, _), total in results.items():
        assert torch.equal(total, torch.full((3,), 30.0 * group + 3))
    for s in stores:
        s.close()
        s.close()  # idempotent


def test_rendezvous_for_group():
    assert Rendezvous.for_group(1) == ("", None)
    assert Rendezvous.for_group(4, "tcp://127.0.0.1:5") == ("tcp://127.0.0.1:5", None)
    init, store = Rendezvous.for_group(2)
    with store:
        assert init == store.init_method and init.startswith("tcpstore://")


def test_rendezvous_that_nobody_hosts_is_a_startup_error_naming_it():
    """A rank whose store is gone fails in bounded time with the address, instead of blocking
    the process (a rank host) that starts it."""
    store = Rendezvous()
    init = store.init_method
    store.close()
    with pytest.raises(StartupError, match=f"rank 1 of 2: no rendezvous at {init}"):
        init_tp_group(2, 1, init, device="cpu", timeout_s=1.0)


# -- where a group listens, and how it fails: rank processes ---------------------------------------

def _rank_main(tp_size: int, tp_rank: int, init_method: str, timeout_s: float,
               results: "mp.Queue") -> None:
    """Join the group, all-reduce ``tp_rank + 1``, report ``(rank, "ok", (sum, listeners))``
    with this process's listening sockets while the group is up, or ``(rank, "error", (type,
    message, seconds in init_tp_group))``."""
    start = time.monotonic()
    try:
        group = init_tp_group(tp_size, tp_rank, init_method, device="cpu",
                              timeout_s=timeout_s, cpu_threads=1)
    except BaseException as e:  # noqa: BLE001 -- reported to the test
        results.put((tp_rank, "error", (type(e).__name__, str(e), time.monotonic() - start)))
        return
    try:
        total = group.all_reduce(torch.full((2,), float(tp_rank + 1)))
        listeners = listening_sockets(os.getpid())
        group.all_reduce(torch.zeros(1))    # nobody leaves before everyone has looked
        results.put((tp_rank, "ok", (total.tolist(), listeners)))
    except BaseException:  # noqa: BLE001
        results.put((tp_rank, "error", ("crash", traceback.format_exc(), 0.0)))
    finally:
        group.close()


def run_ranks(tp_size: int, ranks: list[int], init_method: str, timeout_s: float,
              wait_s: float = 120.0) -> dict[int, tuple[str, tuple]]:
    """Start rank processes ``ranks`` of a ``tp_size`` group at ``init_method``; their reports
    by rank. Children are always reaped."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(tp_size, r, init_method, timeout_s, results),
                         daemon=True) for r in ranks]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, tuple]] = {}
    deadline = time.monotonic() + wait_s
    try:
        while len(got) < len(ranks):
            try:
                rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(ranks) - set(got))} did not report "
                                     f"within {wait_s} s (exit codes "
                                     f"{[p.exitcode for p in procs]})") from None
            got[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return got


@contextlib.contextmanager
def _init_method(scheme: str, host: str = "127.0.0.1"):
    """A node-hosted store's ``tcpstore://`` on ``host`` (closed after), or a ``tcp://`` address
    on ``host`` for rank 0 to host."""
    if scheme == "tcp://":
        yield f"tcp://{host}:{free_port(host)}"
        return
    with Rendezvous(host) as store:
        yield store.init_method


def _refusing_address() -> tuple[socket.socket, str]:
    """A bound socket that does not listen (connections to it are refused; nothing else can
    take its port while it lives) and its ``127.0.0.1:PORT``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheme,rank", [("tcpstore://", 0), ("tcp://", 1)],
                         ids=["hosted", "rank0-hosts"])
def test_a_rank_where_nothing_listens_fails_within_its_timeout_naming_rank_and_address(
        scheme, rank):
    sock, address = _refusing_address()
    with sock:
        status, (kind, message, seconds) = run_ranks(2, [rank], scheme + address, 1.5)[rank]
    assert (status, kind) == ("error", "StartupError"), message
    assert f"TP rank {rank} of 2: no rendezvous at {scheme}{address} within 1.5 s" in message
    assert seconds < 1.5 + 5.0        # bounded by timeout_s (plus slack for a loaded machine)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp_size,started,scheme", [
    (2, [0], "tcpstore://"),
    (2, [0], "tcp://"),
    (3, [0, 2], "tcpstore://"),
], ids=["2-hosted", "2-rank0-hosts", "3-middle-missing"])
def test_a_rank_that_never_comes_fails_the_others_within_the_timeout_naming_it(
        tp_size, started, scheme):
    """The ranks that did come fail at setup, not at their first real step: within their
    timeout, naming themselves, the group size, the address and the missing rank."""
    missing = sorted(set(range(tp_size)) - set(started))
    with _init_method(scheme) as init:
        got = run_ranks(tp_size, started, init, 1.5)
    for rank in started:
        status, (kind, message, seconds) = got[rank]
        assert (status, kind) == ("error", "StartupError"), message
        assert (f"TP rank {rank} of {tp_size}: rank {missing[0]} of {tp_size} never joined the "
                f"group at {init} within 1.5 s") in message
        assert seconds < 1.5 + 5.0


def _new_listeners(before: list) -> list:
    return sorted(set(listening_sockets(os.getpid())) - set(before))


@pytest.mark.parametrize("host,want,connect", [
    ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("::1", "::1", "[::1]"),
    ("localhost", ("127.0.0.1", "::1"), None),
    ("0.0.0.0", "0.0.0.0", "127.0.0.1"),
    ("::", "::", "[::1]"),
], ids=["ipv4", "ipv6", "name", "any-ipv4", "any-ipv6"])
def test_a_rendezvous_listens_only_on_its_host(host, want, connect):
    """On the address asked for and nothing else (a TCPStore left to itself listens on ``::``,
    IPv4 and IPv6, whatever it was asked). A wildcard is listened on as asked, and the ranks
    are sent to loopback; either way a group forms on it."""
    before = listening_sockets(os.getpid())
    with Rendezvous(host) as store:
        listeners = _new_listeners(before)
        assert [port for _, port in listeners] == [store.port]
        (address, _), = listeners
        assert address in (want if isinstance(want, tuple) else (want,))
        assert store.address == address
        if connect is None:                   # a name: the address it resolved to
            connect = f"[{address}]" if ":" in address else address
        assert store.init_method == f"tcpstore://{connect}:{store.port}"
        results = reduce_in_threads([store.init_method], 2)
        assert [results[(0, r)].tolist() for r in range(2)] == [[1.0, 1.0, 1.0]] * 2
    assert store.port not in {port for _, port in listening_sockets(os.getpid())}   # closed


def test_a_rendezvous_host_that_does_not_resolve_or_bind_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        Rendezvous("no-such-host.invalid")
    with pytest.raises(StartupError, match=r"192\.0\.2\.1"):      # not an address of this host
        Rendezvous("192.0.2.1")
    assert Rendezvous.for_group(2, host="::1")[1].init_method.startswith("tcpstore://[::1]:")


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheme,host", [
    ("tcpstore://", "127.0.0.1"),
    ("tcpstore://", "127.0.0.2"),
    ("tcp://", "127.0.0.2"),
], ids=["hosted", "hosted-127.0.0.2", "rank0-hosts-127.0.0.2"])
def test_a_gloo_groups_ranks_listen_only_on_the_rendezvous_host(scheme, host):
    """Every listening socket of both rank processes (gloo's pairs, and rank 0's store when it
    hosts one) is on the rendezvous host while the group is up; the group sums across them.
    127.0.0.2 is loopback too, but not where a default gloo device (the address the machine's
    name resolves to) would listen."""
    with _init_method(scheme, host) as init:
        got = run_ranks(2, [0, 1], init, 30.0)
    for rank in (0, 1):
        status, payload = got[rank]
        assert status == "ok", payload
        total, listeners = payload
        assert total == [3.0, 3.0]
        assert listeners, f"rank {rank} listens nowhere (gloo's pairs listen)"
        assert {address for address, _ in listeners} == {host}, listeners
    if scheme == "tcp://":
        assert (host, int(init.rpartition(":")[2])) in got[0][1][1]
