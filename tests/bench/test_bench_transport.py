"""benchmarks/bench_transport.py: its ModeTransport moves exact bytes in every progress mode and
over send_multi (one transport talking to itself), and every cell of a tiny matrix runs in the
benchmark's two processes (no timing thresholds)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from statebridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAGE = 256 * 1024
PAGES = 4

pytestmark = [pytest.mark.ucx]


@pytest.fixture(scope="module")
def bench():
    # Imported by name from benchmarks/ (on sys.path while these tests run): the benchmark's
    # spawned processes import its worker function the same way.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("bench_transport")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("bench_transport", None)


def _loop(bench, mode: str):
    bench.tr.configure_ucx_env()
    t = bench.ModeTransport(bench.tr.alloc_buffer(PAGE * PAGES), progress_mode=mode,
                            name=f"loop-{mode}")
    t.connect("self", t.address)
    page = t.posting.page_np
    page[:] = np.random.default_rng(3).integers(0, 256, page.size, dtype=np.uint8)
    return t


def _wait(handles, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    for h in handles:
        h.wait(max(0.0, deadline - time.monotonic()))


# (src offset, dst offset, length) inside one page: eager, rendezvous and single-byte runs
RUNS = np.array([[0, 100_000, 64], [1000, 0, 70_000], [200_000, 250_000, 1],
                 [90_000, 180_000, 20_000]], dtype=np.int64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "polling", "background", "thread"])
def test_every_progress_mode_moves_the_same_bytes(bench, mode):
    t = _loop(bench, mode)
    try:
        buf = t.posting.page_np
        expected = buf.copy()
        src, dst = 0, 2 * PAGE
        runs = RUNS + np.array([src, dst, 0])
        _wait([t.post_recv("self", 5, 0, runs), t.post_send("self", 5, 0, runs)])
        for s, d, n in runs.tolist():
            expected[d:d + n] = expected[s:s + n]
        assert np.array_equal(buf, expected)

        # Staged: gather the runs into one message, scatter them into page 3.
        staged = np.stack([RUNS[:, 0] + PAGE, np.cumsum([0, *RUNS[:-1, 2]]), RUNS[:, 2]], axis=1)
        unpack = np.stack([staged[:, 1], RUNS[:, 1] + 3 * PAGE, RUNS[:, 2]], axis=1)
        nbytes = int(RUNS[:, 2].sum())
        recv = t.post_recv_staged("self", 6, 1, nbytes, unpack)
        _wait([recv, t.post_send_staged("self", 6, 1, staged)])
        for (s, _, n), (_, d, _) in zip(staged.tolist(), unpack.tolist()):
            expected[d:d + n] = expected[s:s + n]
        assert np.array_equal(buf, expected)
        stats = t.stats()
        assert stats["progress_mode"] == mode and stats["failures"] == {}
        assert stats["zero_copy_messages_sent"] == stats["zero_copy_messages_received"] \
            == len(RUNS)
        assert stats["staged_messages_sent"] == stats["staged_messages_received"] == 1
        assert stats["handles_outstanding"] == 0
    finally:
        t.close()
    t.close()                                             # idempotent


@pytest.mark.timeout(60)
def test_send_multi_lands_exactly(bench):
    t = _loop(bench, "blocking")
    try:
        buf = t.posting.page_np
        expected = buf.copy()
        runs = RUNS + np.array([PAGE, 2 * PAGE, 0])
        recv = t.post_recv_multi("self", 7, 0, runs)
        send = t.post_send_multi("self", 7, 0, runs)
        _wait([recv, send])
        for s, d, n in runs.tolist():
            expected[d:d + n] = expected[s:s + n]
        assert np.array_equal(buf, expected)
        assert (recv.kind, recv.messages, recv.nbytes) == ("multi", len(RUNS),
                                                           int(RUNS[:, 2].sum()))
        stats = t.stats()
        assert stats["multi_messages_sent"] == stats["multi_messages_received"] == len(RUNS)
        assert stats["bytes_received"] == int(RUNS[:, 2].sum())
    finally:
        t.close()


def test_unknown_progress_mode_is_rejected(bench):
    with pytest.raises(ConfigError, match="progress_mode 'spin'"):
        bench.ModeTransport(bench.tr.alloc_buffer(16), progress_mode="spin")


@pytest.mark.timeout(240)
def test_every_cell_of_a_tiny_matrix_runs(bench):
    a = bench.parse_args(["--sizes", "65536", "--rounds", "1", "--total-bytes", str(256 * 1024),
                          "--seq-messages", "4", "--no-perftest", "--timeout", "20"])
    todo = bench.cells(a)
    assert {c["progress_mode"] for c in todo} == set(bench.MODES)
    assert {c["variant"] for c in todo} == set(bench.VARIANTS) - {"no-thp"}
    assert any(not c["huge_pages"] for c in todo)          # the no-thp cell
    sender, receiver = bench._Proc("test-sender"), bench._Proc("test-receiver")
    try:
        for cell in todo:
            row = bench.run_cell(sender, receiver, a, **cell)
            assert row["rounds"] == 1 and row["gbps_median"] > 0, row
            assert row["messages"] == bench._messages(a, cell["variant"], 65536)
    finally:
        sender.stop()
        receiver.stop()
