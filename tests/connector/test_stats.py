"""The one counter system: exact totals from many threads, declared names, reads while adding."""

from __future__ import annotations

import threading

from statebridge.connector.stats import Counters, ops


def test_totals_of_many_threads_are_exact():
    counters = Counters()
    threads, per_thread = 8, 20_000
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        for _ in range(per_thread):
            counters.add("messages")
            counters.add("bytes", 3)
        counters.add(f"thread_{i}")
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    snap = counters.snapshot()
    assert snap["messages"] == threads * per_thread == counters.get("messages")
    assert snap["bytes"] == 3 * threads * per_thread
    assert all(snap[f"thread_{i}"] == 1 for i in range(threads))


def test_declared_names_read_zero_and_unknown_names_are_absent():
    counters = Counters(("sent", "received"))
    assert counters.snapshot() == {"sent": 0, "received": 0}
    assert counters.get("never") == 0
    counters.add("sent", 2)
    counters.add("seconds", 0.25)
    assert counters.snapshot() == {"sent": 2, "received": 0, "seconds": 0.25}


def test_a_shard_adds_for_its_thread_only():
    counters = Counters()
    counters.shard()["a"] += 5
    other = threading.Thread(target=lambda: counters.shard().update(a=7))
    other.start()
    other.join()
    assert counters.get("a") == 12


def test_reading_while_another_thread_adds_new_names():
    counters = Counters()
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            counters.add(f"name_{i % 5000}")
            i += 1
    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(2000):                  # never "dictionary changed size"
            snap = counters.snapshot()
            assert all(v >= 1 for v in snap.values())
    finally:
        stop.set()
        t.join()


def test_the_process_operation_counts_declare_their_names():
    assert set(ops.snapshot()) >= {"control_sent", "control_received", "probes_sent",
                                   "ucx_ops", "unattended_sleeps", "shared_map_reads",
                                   "transfer_digests"}
