"""A rank's compute thread hands results to its loop in batches, but never holds a result
while slow work runs: a cheap prefill queued just before a slow decode step is answered at
once, not after the step."""

from __future__ import annotations

import threading
import time

import pytest

from statebridge.config import ConnectorConfig
from statebridge.connector import messages as m
from statebridge.node import messages as nm
from statebridge.connector.rank import RankSetup, RankWorker

from ._helpers import SPECS, wait_until

pytestmark = [pytest.mark.ucx]


@pytest.fixture
def worker():
    setup = RankSetup(role="decode", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                      spec_json=SPECS["mamba2-g1"].to_json(), layout="DLS", num_pages=4,
                      node_id="decode-compute", config=ConnectorConfig(),
                      model="tests.connector._helpers:SlowStepModel")
    w = RankWorker(setup)
    sent: list[tuple[float, m.Message]] = []
    lock = threading.Lock()

    def record(msg):
        with lock:
            sent.append((time.monotonic(), msg))
    w._send = record                                    # what would go to the coordinator
    w.sent = sent
    thread = threading.Thread(target=w.loop.run, daemon=True)
    thread.start()
    yield w
    w.loop.request_stop()
    w.loop.wake()
    thread.join(5)
    w.close()


def _step(n: int) -> nm.RankStep:
    return nm.RankStep(step=n, request_ids=("a",), pages=(0,), tokens=(1,), positions=(3,),
                      temperatures=(0.0,), top_ps=(1.0,), seeds=(0,))


def test_cheap_result_is_not_held_behind_a_slow_step(worker):
    started = time.monotonic()
    # Both queued in one loop call: the prefill is computed first (cheap), then the 0.3 s step.
    worker.loop.call_soon(lambda: (
        worker._on_local_prefill(m.RankLocalPrefill(request_id="p1", generation=5,
                                                    prompt=m.pack_tokens((1, 2, 3)), page=1)),
        worker.compute.submit_model(_step(1))))
    wait_until(lambda: len(worker.sent) >= 2, 10.0, "prefill done and step result")
    (t_done, done), (t_step, step) = worker.sent[:2]
    assert isinstance(done, m.RankDone) and (done.request_id, done.kind) == ("p1", "")
    assert isinstance(step, nm.RankStepResult) and step.tokens == (7,)
    assert t_done - started < 0.2, f"prefill answered after {t_done - started:.3f} s"
    assert t_step - started >= 0.3


def test_backlog_of_cheap_prefills_all_answered(worker):
    worker.loop.call_soon(lambda: [
        worker._on_local_prefill(m.RankLocalPrefill(request_id=f"p{i}", generation=10 + i,
                                                    prompt=m.pack_tokens((1,)), page=i % 4))
        for i in range(40)])
    wait_until(lambda: len(worker.sent) >= 40, 10.0, "40 prefills answered")
    done = [msg for _, msg in worker.sent]
    assert [d.request_id for d in done] == [f"p{i}" for i in range(40)]
    assert all(d.kind == "" for d in done)


def test_the_compute_bookkeeping_belongs_to_the_loop_thread(worker):
    """Which requests are queued or computing is the loop thread's: once the loop used it,
    another thread that asks or changes it gets a typed error (the compute thread asks only a
    lock-guarded set whether a request was cancelled)."""
    from statebridge.connector.ledger import RequestKey
    from statebridge.errors import StatebridgeError

    worker.loop.call_soon(lambda: worker._on_local_prefill(m.RankLocalPrefill(
        request_id="p1", generation=3, prompt=m.pack_tokens((1,)), page=0)))
    wait_until(lambda: len(worker.sent) >= 1, 10.0, "prefill answered")
    key = RequestKey("", "p1", 3)
    for use in (lambda: key in worker.compute, lambda: worker.compute.finish(key),
                lambda: worker.compute.cancel(key, "aborted", "test"),
                lambda: worker.compute.submit(m.RankLocalPrefill(
                    request_id="p2", generation=4, prompt=m.pack_tokens((1,)), page=1))):
        with pytest.raises(StatebridgeError, match="not the loop's"):
            use()
    assert len(worker.compute) == 0
    assert worker.loop.call(lambda: key in worker.compute) is False
