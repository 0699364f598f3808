"""The connector's data plane without vLLM: two agents (a producer group and a consumer group)
on 127.0.0.1 over buffers laid out as vLLM lays its caches, checked byte for byte against the
paged plan's oracle (tests/state/test_paged.py), plus the failure paths: a producer that never
answers, an unknown request, a lease that ends, and the settings' errors."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from statebridge.errors import ConfigError
from statebridge.state.paged import PagedGeometry, PagedPlan
from statebridge.vllm.agent import Agent, Load
from statebridge.vllm.describe import Layers
from statebridge.vllm.settings import Settings

from tests.state.test_paged import BLOCK_SIZE, _case, _fill, _slots, _spec

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]
_PORTS = iter(range(6500, 6900, 9))


def _layers(spec, tp, rank, slots, bufs):
    geometry = PagedGeometry(spec, tp, "SD", BLOCK_SIZE, slots)
    state = tuple(g.layer_ids for g in spec.groups)
    groups = state + ((spec.kv.layer_ids,) if spec.kv else ())
    return Layers(spec, geometry, groups, tuple([True] * len(state) + [False] * (len(groups)
                                                                                   - len(state))),
                  ((0, bufs[rank]),))


def _group_blocks(spec, state_block, kv_table):
    out = [(state_block[g.layer_ids[0]],) for g in spec.groups]
    if spec.kv:
        out.append(tuple(kv_table[spec.kv.layer_ids[0]]))
    return tuple(out)


def _same_block_per_group(spec, table_state, table_kv):
    """vLLM gives all layers of a cache group one block id: make the oracle's tables so."""
    for g in spec.groups:
        for i in g.layer_ids:
            table_state[i] = table_state[g.layer_ids[0]]
    if spec.kv:
        for i in spec.kv.layer_ids:
            table_kv[i] = table_kv[spec.kv.layer_ids[0]]


def _wait(agents, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    got = [set(), set(), set()]
    while time.monotonic() < deadline:
        for a in agents:
            for k, s in enumerate(a.take_finished()):
                got[k] |= s
        if pred(got):
            return got
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("name,src_tp,dst_tp,computed", [
    ("lfm2-hybrid", 1, 2, 0), ("granite-hybrid", 2, 1, 0), ("mamba2-g1", 2, 2, 0),
    # the decode instance's prefix cache holds the first blocks: they are never written
    ("lfm2-hybrid", 1, 2, BLOCK_SIZE), ("granite-hybrid", 2, 1, 2 * BLOCK_SIZE)])
def test_a_load_moves_exactly_each_decode_ranks_bytes_and_the_producer_then_frees(
        name, src_tp, dst_tp, computed):
    spec = _spec(name)
    state, kv_values, sides = _case(spec, src_tp, dst_tp, "SD", tokens=9)
    (s_slots, s_state, s_kv), (d_slots, d_state, d_kv) = sides["src"], sides["dst"]
    for st, kv in ((s_state, s_kv), (d_state, d_kv)):
        _same_block_per_group(spec, st, kv)
    src = [torch.from_numpy(_fill(spec, src_tp, r, "SD", s_slots, state, kv_values, s_state, s_kv,
                                  background=r)[0]) for r in range(src_tp)]
    want = [_fill(spec, dst_tp, r, "SD", d_slots, state, kv_values, d_state, d_kv,
                  background=100 + r) for r in range(dst_tp)]
    if computed:
        # those bytes keep what the decode rank had (its background), state aside
        held = {i: t[:computed // BLOCK_SIZE] for i, t in d_kv.items()}
        for r, (w, mask) in enumerate(want):
            bg, in_held = _fill(spec, dst_tp, r, "SD", d_slots, state, kv_values, d_state, held,
                                background=100 + r)
            _, state_only = _fill(spec, dst_tp, r, "SD", d_slots, state, kv_values, d_state,
                                  {i: [] for i in d_kv}, background=100 + r)
            keep = in_held & ~state_only
            assert keep.any()
            w[keep] = ((np.arange(w.size) * 7 + 100 + r) % 251).astype(np.uint8)[keep]
    dst = [torch.from_numpy(((np.arange(w.size) * 7 + 100 + r) % 251).astype(np.uint8))
           for r, (w, _) in enumerate(want)]
    port = next(_PORTS)
    settings = Settings(port=port, transfer_timeout_s=15)
    producers = [Agent(_layers(spec, src_tp, r, s_slots, src), tp_rank=r, tp_size=src_tp,
                       engine_id="P", producer=True, consumer=False, settings=settings)
                 for r in range(src_tp)]
    consumers = [Agent(_layers(spec, dst_tp, r, d_slots, dst), tp_rank=r, tp_size=dst_tp,
                       engine_id="D", producer=False, consumer=True, settings=settings)
                 for r in range(dst_tp)]
    try:
        for a in producers:
            a.hold("req-p")
        for a in consumers:
            a.load(Load(request_id="req-d", remote_request_id="req-p", engine_id="P",
                        host="127.0.0.1", port=port, remote_tp=src_tp,
                        remote_blocks=_group_blocks(spec, s_state, s_kv),
                        local_blocks=_group_blocks(spec, d_state, d_kv), tokens=9,
                        computed_tokens=computed))
        for a in consumers:                   # vLLM waits for every rank's report
            got = _wait([a], lambda g: bool(g[1]))
            assert got[1] == {"req-d"} and not got[2]
        for r, (w, mask) in enumerate(want):
            assert np.array_equal(dst[r].numpy(), w), f"decode rank {r}"
        # every producer rank reports the request once every consumer rank read it
        sent = _wait(producers, lambda g: "req-p" in g[0])
        assert sent[0] == {"req-p"}
        # one pull with runs per rank pair the plan moves bytes between (the others release)
        pairs = PagedPlan(producers[0].layers.geometry, consumers[0].layers.geometry).pairs
        assert sum(a.counters["pulls_served"] for a in producers) == len(pairs)
    finally:
        for a in producers + consumers:
            a.close()


def _lone_agent(engine_id: str, *, producer: bool, settings: Settings) -> Agent:
    """One TP-1 agent over a zeroed LFM2-hybrid buffer (nothing to compare: failure paths)."""
    spec = _spec("lfm2-hybrid")
    slots = _slots(spec, 1, 1)
    buf = torch.zeros(max(s.base + s.block_stride * s.num_blocks for s in slots.values()) + 16,
                      dtype=torch.uint8)
    return Agent(_layers(spec, 1, 0, slots, [buf]), tp_rank=0, tp_size=1, engine_id=engine_id,
                 producer=producer, consumer=not producer, settings=settings)


def _unanswered_load(engine_id: str) -> Load:
    """A load of request "r" from a producer nobody runs (port 1)."""
    return Load(request_id="r", remote_request_id="x", engine_id=engine_id, host="127.0.0.1",
                port=1, remote_tp=1, remote_blocks=((0,), (0,)), local_blocks=((0,), (0,)),
                tokens=3)


def test_a_producer_that_never_answers_fails_the_load_within_the_handshake_bound():
    agent = _lone_agent("D", producer=False, settings=Settings(port=next(_PORTS), handshake_timeout_s=1.0))
    try:
        t = time.monotonic()
        agent.load(_unanswered_load("P"))
        got = _wait([agent], lambda g: "r" in g[2], timeout=10)
        assert got[2] == {"r"} and got[1] == {"r"}       # failed loads are finished too
        assert time.monotonic() - t < 5
    finally:
        agent.close()


def test_a_held_request_nobody_pulls_is_freed_when_its_lease_ends():
    agent = _lone_agent("P", producer=True, settings=Settings(port=next(_PORTS)))
    try:
        agent.hold("r", lease_s=0.5)
        t = time.monotonic()
        got = _wait([agent], lambda g: "r" in g[0], timeout=10)
        assert got[0] == {"r"} and 0.4 < time.monotonic() - t < 5
        assert agent.counters["leases_expired"] == 1
    finally:
        agent.close()


def test_an_idle_steps_wait_sleeps_until_a_transfer_ends_and_not_when_none_is_open():
    # vLLM steps without pause while a transfer is open; the connector sleeps those steps in
    # wait_for_transfers, which must end with the transfer (here: a failed handshake, ~1 s)
    agent = _lone_agent("D", producer=False, settings=Settings(port=next(_PORTS),
                                                               handshake_timeout_s=1.0))
    try:
        t = time.monotonic()
        agent.wait_for_transfers(20.0)                  # nothing open: no wait
        assert time.monotonic() - t < 5
        agent.load(_unanswered_load("P"))
        t = time.monotonic()
        agent.wait_for_transfers(0.2)                   # open, nothing ended: it sleeps
        assert time.monotonic() - t >= 0.2
        agent.wait_for_transfers(20.0)                  # returns when the load fails
        assert time.monotonic() - t < 10
        sending, recving, failed = agent.take_finished()
        assert failed == {"r"} and recving == {"r"}
        t = time.monotonic()
        agent.wait_for_transfers(20.0)                  # reported: nothing open again
        assert time.monotonic() - t < 5
    finally:
        agent.close()


def test_a_data_plane_thread_that_dies_releases_its_holds_and_fails_later_loads_at_once():
    agent = _lone_agent("P", producer=True, settings=Settings(port=next(_PORTS)))
    try:
        agent.hold("held-before")
        assert _wait([agent], lambda g: True, timeout=0.5) == [set(), set(), set()]

        def boom():
            raise RuntimeError("injected")
        agent._step = boom                # the thread's next turn raises
        agent._wake()
        agent._thread.join(timeout=10)
        assert not agent._thread.is_alive()
        # nothing can read the held blocks any more: vLLM may free them
        assert agent.take_finished()[0] == {"held-before"}
        # a load after the death fails at once (no wait for a thread that is gone) ...
        agent.load(_unanswered_load("Q"))
        agent.hold("held-after")
        sending, recving, failed = agent.take_finished()
        assert failed == {"r"} and recving == {"r"} and sending == {"held-after"}
    finally:
        agent.close()


@pytest.mark.parametrize("extra,match", [
    ({"side_chanel_port": 1}, "unknown key 'side_chanel_port'"),
    ({"side_channel_port": "7000"}, "side_channel_port must be a port"),
    ({"lease_s": 0}, "lease_s must be a positive number of seconds, got 0"),
    ({"verify_transfers": "yes"}, "verify_transfers must be true or false, got 'yes'"),
])
def test_settings_name_the_offending_value(extra, match):
    with pytest.raises(ConfigError, match=match):
        Settings.from_extra(extra)
    assert Settings.from_extra({"side_channel_port": 7000, "lease_s": 5}).port == 7000


def test_import_statebridge_and_the_agent_never_import_vllm():
    import subprocess
    import sys

    code = ("import sys, statebridge, statebridge.vllm.agent, statebridge.vllm.wire; "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux CPU affinity and two CPUs")
def test_a_worker_pinned_to_one_cpu_starts_an_agent_whose_threads_run_on_every_cpu():
    # vLLM's CPU worker pins itself to its OMP cores before it registers the caches; the
    # agent's threads (its own, zmq's I/O thread, UCX's async thread) must not inherit that.
    every = set(range(os.cpu_count()))
    out: dict = {}

    def worker():
        os.sched_setaffinity(0, {0})
        before = {t.native_id for t in threading.enumerate()}
        before |= set(int(t) for t in os.listdir("/proc/self/task"))
        agent = _lone_agent("P", producer=True, settings=Settings(port=next(_PORTS)))
        try:
            new = set(int(t) for t in os.listdir("/proc/self/task")) - before
            out["new"] = {t: os.sched_getaffinity(t) for t in new}
            out["agent"] = os.sched_getaffinity(agent._thread.native_id)
            out["caller"] = os.sched_getaffinity(0)
        finally:
            agent.close()

    t = threading.Thread(target=worker)
    t.start()
    t.join(30)
    assert out["caller"] == {0}                       # the worker keeps its pin
    assert out["agent"] == every
    assert len(out["new"]) >= 3 and all(m == every for m in out["new"].values()), out["new"]


def test_the_agent_thread_carries_its_name_where_top_and_py_spy_show_threads():
    agent = _lone_agent("P", producer=True, settings=Settings(port=next(_PORTS)))
    try:
        comm = Path(f"/proc/self/task/{agent._thread.native_id}/comm")
        for _ in range(100):                      # the thread names itself when it starts
            if comm.read_text().strip() == "sb-vllm-0":
                break
            time.sleep(0.02)
        assert comm.read_text().strip() == "sb-vllm-0"
        assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() \
            != "sb-vllm-0"
    finally:
        agent.close()


class _DeafPoller(zmq.Poller):
    """A poller that never reports a zmq socket ready (a wakeup lost on the way)."""

    def poll(self, timeout=None):
        return [(s, e) for s, e in super().poll(timeout) if isinstance(s, int)]


def test_messages_whose_wakeup_is_lost_are_still_read_within_a_turn(monkeypatch):
    # Every turn reads every socket, so a message poll() never reports is still read (with
    # the old poll-only reads the handshake below failed its 3 s bound).
    monkeypatch.setattr(zmq, "Poller", _DeafPoller)
    port = next(_PORTS)
    producer = _lone_agent("P", producer=True, settings=Settings(port=port))
    consumer = _lone_agent("D", producer=False, settings=Settings(port=next(_PORTS),
                                                                  handshake_timeout_s=3.0))
    try:
        producer.hold("x")
        consumer.load(Load(request_id="r", remote_request_id="x", engine_id="P",
                           host="127.0.0.1", port=port, remote_tp=1,
                           remote_blocks=((0,), (0,)), local_blocks=((0,), (0,)), tokens=3))
        got = _wait([consumer], lambda g: "r" in g[1], timeout=20)
        assert got[1] == {"r"} and not got[2], got       # loaded, not failed
        assert "x" in _wait([producer], lambda g: "x" in g[0], timeout=20)[0]
    finally:
        consumer.close()
        producer.close()
