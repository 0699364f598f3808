"""Prefill steps on a rank's compute thread: what a step holds (:class:`PrefillBatcher`), that a
request's result leaves as soon as the step with its last token ends, and that the ranks of a
group run the same steps whatever order their messages arrived in, cancels included."""

from __future__ import annotations

import threading
import time

import pytest

from statebridge.connector import messages as m
from statebridge.connector.rank.compute import (
    MAX_STEP_REQUESTS,
    ComputeThread,
    PrefillBatcher,
    PrefillJob,
    key_of,
)
from statebridge.connector.stats import Counters
from statebridge.errors import ConfigError


def _job(name: str, n: int) -> PrefillJob:
    return PrefillJob(msg=name, key=name, page=0, tokens=tuple(range(n)))


def _run(batcher: PrefillBatcher) -> list[list[tuple[str, int, int]]]:
    """Every step until the batcher is empty, as (job, start, end)."""
    steps = []
    while batcher:
        plan = batcher.plan()
        assert plan, "a batcher with jobs plans a step"
        steps.append([(job.msg, start, end) for job, start, end in plan])
        batcher.ran(plan)
    return steps


def test_a_step_fills_the_budget_in_arrival_order_and_cuts_the_last():
    b = PrefillBatcher(10, chunked=True)
    for name, n in (("a", 4), ("b", 5), ("c", 6), ("d", 0), ("e", 3)):
        b.add(_job(name, n))
    assert _run(b) == [
        [("a", 0, 4), ("b", 0, 5), ("c", 0, 1)],
        [("c", 1, 6), ("d", 0, 0), ("e", 0, 3)],
    ]


def test_whole_prompts_only_when_the_model_takes_no_chunks():
    b = PrefillBatcher(10, chunked=False)
    for name, n in (("a", 4), ("b", 7), ("c", 25), ("d", 2)):
        b.add(_job(name, n))
    # b waits for the next step (order kept); c, over the budget, runs alone
    assert _run(b) == [[("a", 0, 4)], [("b", 0, 7)], [("c", 0, 25)], [("d", 0, 2)]]


def test_batching_off_runs_one_whole_prompt_per_step():
    b = PrefillBatcher(None, chunked=True)
    for name, n in (("a", 4), ("b", 30), ("c", 1)):
        b.add(_job(name, n))
    assert _run(b) == [[("a", 0, 4)], [("b", 0, 30)], [("c", 0, 1)]]


def test_a_long_prompt_does_not_hold_back_short_ones_beyond_one_step():
    """A prompt of four budgets first, three short ones behind it: the long one takes the
    first step, then at most half of each step while others wait; the short ones finish in
    the second step, and the long one still advances every step."""
    b = PrefillBatcher(16, chunked=True)
    b.add(_job("long", 64))
    for name in ("s1", "s2", "s3"):
        b.add(_job(name, 2))
    steps = _run(b)
    assert steps[0] == [("long", 0, 16)]
    # half the step for the long one, the short ones, then what they left to the long one
    assert steps[1] == [("long", 16, 26), ("s1", 0, 2), ("s2", 0, 2), ("s3", 0, 2)]
    assert steps[2:] == [[("long", 26, 42)], [("long", 42, 58)], [("long", 58, 64)]]
    # arrivals during the long prompt's chunks get at least half of the next step
    b.add(_job("long2", 40))
    b.ran(b.plan())                                   # long2 takes a whole step alone
    b.add(_job("late", 9))
    assert b.plan() == [(b.jobs[0], 16, 24), (b.jobs[1], 0, 8)]


def test_a_step_holds_at_most_max_step_requests():
    b = PrefillBatcher(10 * MAX_STEP_REQUESTS, chunked=True)
    for i in range(MAX_STEP_REQUESTS + 5):
        b.add(_job(f"r{i}", 1))
    assert len(b.plan()) == MAX_STEP_REQUESTS


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_a_bad_budget_is_refused(budget):
    with pytest.raises(ConfigError, match=repr(budget)):
        PrefillBatcher(budget, chunked=True)


# -- the compute thread ----------------------------------------------------------------------

class _Loop:
    """Runs what the compute thread hands over at once, on the compute thread."""

    def call_soon(self, fn, *args):
        fn(*args)


class _Group:
    """The agreement of a TP group's ranks (what an all-reduce with MAX does)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=20)
        self.values: list = [None] * size

    def agree(self, rank: int, values: list[int]) -> list[int]:
        self.values[rank] = list(values)
        self.barrier.wait()
        out = [max(col) for col in zip(*self.values)]
        self.barrier.wait()
        return out


class _Model:
    """A stand-in rank model that records its steps (and every event, in order, in
    ``events``); its Heartbeat handler waits for ``gate`` (to queue work behind it)."""

    chunked_prefill = True
    kv = None

    def __init__(self, events: list, rank: int = 0, group: _Group | None = None,
                 step_s: float = 0.0) -> None:
        self.events, self.rank, self.group, self.step_s = events, rank, group, step_s
        self.gate = threading.Event()
        self.steps: list[list[tuple[str, int, int]]] = []

    def handlers(self):
        return {m.Heartbeat: lambda msg: self.gate.wait(20) and None}

    def prefill_chunks(self, chunks):
        step = [(c.request_id, c.start, c.start + len(c.tokens)) for c in chunks]
        self.steps.append(step)
        self.events.append(("step", self.rank, tuple(s[0] for s in step)))
        time.sleep(self.step_s)
        return [None] * len(chunks)

    def agree_max(self, values):
        return list(values) if self.group is None else self.group.agree(self.rank, values)

    def close(self):
        pass


def _prefill(name: str, n: int) -> m.RankLocalPrefill:
    return m.RankLocalPrefill(request_id=name, generation=1, prompt=m.pack_tokens(range(n)),
                              page=0)


def _thread(model: _Model, events: list, budget: int) -> ComputeThread:
    def computed(msg, error, final_at, started_at):
        events.append(("done", model.rank, msg.request_id, error))

    return ComputeThread(f"rank{model.rank}", model, _Loop(), Counters(),
                         on_computed=computed, on_reply=lambda reply: None,
                         max_prefill_tokens=budget)


def _wait(pred, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_each_request_is_handed_back_when_its_own_last_step_ends():
    events: list = []
    model = _Model(events, step_s=0.05)
    compute = _thread(model, events, budget=8)
    try:
        compute.submit_model(m.Heartbeat(node_id="t", seq=0))          # holds the thread while we queue
        for name, n in (("a", 3), ("b", 20), ("c", 2)):
            compute.submit(_prefill(name, n))
        model.gate.set()
        _wait(lambda: sum(e[0] == "done" for e in events) == 3, "three results")
    finally:
        compute.close()
    assert model.steps == [[("a", 0, 3), ("b", 0, 5)], [("b", 5, 11), ("c", 0, 2)],
                           [("b", 11, 19)], [("b", 19, 20)]]
    order = [e[2] for e in events]
    # a leaves after step 1, before step 2 runs; c after step 2; b after the last
    assert order == [("a", "b"), "a", ("b", "c"), "c", ("b",), ("b",), "b"]
    assert all(e[3] is None for e in events if e[0] == "done")


def test_ranks_run_the_same_steps_whatever_order_messages_arrive_in():
    """Rank 0 gets every prefill at once, rank 1 one at a time while it computes; a cancel
    reaches rank 1 only. Both run the same steps (the collectives line up) and both skip the
    cancelled request."""
    group = _Group(2)
    events: list = []
    models = [_Model(events, rank=r, group=group, step_s=0.02) for r in (0, 1)]
    threads = [_thread(model, events, budget=6) for model in models]
    prompts = [(f"p{i}", n) for i, n in enumerate((2, 9, 1, 4, 0, 7, 3, 5))]
    try:
        threads[0].submit_model(m.Heartbeat(node_id="t", seq=0))
        for name, n in prompts:
            threads[0].submit(_prefill(name, n))
        models[0].gate.set()
        models[1].gate.set()
        for i, (name, n) in enumerate(prompts):
            threads[1].submit(_prefill(name, n))
            if name == "p6":
                threads[1].cancel(key_of(_prefill("p6", 3)), "aborted", "test cancel")
            time.sleep(0.013 * (i % 3))
        _wait(lambda: sum(e[0] == "done" for e in events) == 2 * len(prompts), "every result")
    finally:
        for t in threads:
            t.close()
    assert models[0].steps == models[1].steps
    ran = {name for step in models[0].steps for name, _, _ in step}
    assert "p6" not in ran and ran == {name for name, _ in prompts} - {"p6"}
    for rank in (0, 1):
        done = {e[2]: e[3] for e in events if e[0] == "done" and e[1] == rank}
        assert done.pop("p6") is not None, f"rank {rank} answered p6 as computed"
        assert set(done.values()) == {None}


class _FlakyModel(_Model):
    """Its first agreement and its first step raise."""

    def __init__(self, events: list) -> None:
        super().__init__(events)
        self.agreements = self.failed_steps = 0

    def agree_max(self, values):
        self.agreements += 1
        if self.agreements == 1:
            raise RuntimeError("gloo: connection closed")
        return list(values)

    def prefill_chunks(self, chunks):
        if not self.failed_steps:
            self.failed_steps = 1
            self.events.append(("step", 0, tuple(c.request_id for c in chunks)))
            raise RuntimeError("device lost")
        return super().prefill_chunks(chunks)


def test_a_failed_agreement_or_step_fails_its_requests_and_the_thread_serves_on():
    events: list = []
    model = _FlakyModel(events)
    compute = _thread(model, events, budget=8)
    try:
        compute.submit_model(m.Heartbeat(node_id="t", seq=0))
        compute.submit(_prefill("a", 3))
        compute.submit(_prefill("b", 2))
        model.gate.set()
        _wait(lambda: sum(e[0] == "done" for e in events) == 2, "a and b answered")
        compute.submit(_prefill("c", 12))                 # two steps; the first one raises
        _wait(lambda: sum(e[0] == "done" for e in events) == 3, "c answered")
        compute.submit(_prefill("d", 4))
        _wait(lambda: sum(e[0] == "done" for e in events) == 4, "d answered")
    finally:
        compute.close()
    done = {e[2]: e[3] for e in events if e[0] == "done"}
    assert "could not agree" in done["a"] and "gloo: connection closed" in done["b"]
    assert done["c"] == "prefill failed: RuntimeError: device lost"
    assert done["d"] is None and model.steps == [[("d", 0, 4)]]
