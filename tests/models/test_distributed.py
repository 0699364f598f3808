"""The TP group helpers: TP = 1 without torch.distributed, thread groups, argument checks.
(Real gloo groups across processes run in test_runner.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from statebridge.errors import ConfigError, StartupError
from statebridge.models import Rendezvous, ThreadGroup, init_tp_group
from statebridge.net import free_port


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
