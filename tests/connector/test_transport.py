"""The UCX data plane, for real: separate rank processes on 127.0.0.1, real transfer plans.

Every process is an agent (``_transport_agent.py``) that owns one Transport; worker addresses
travel over multiprocessing pipes (the zmq control plane is tested elsewhere). Expected bytes
come from an independent oracle: the agents' deterministic fill patterns, copied run by run in
plain numpy, compared by SHA-256 over each whole page buffer (so bytes outside the runs are
checked to be untouched too).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from statebridge.errors import ConfigError
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec

from ._transport_agent import AgentError, pattern, sha256, start_agents

# Mamba2 with a bf16 conv state and an fp32 SSM state; n_groups 4 (B/C split at TP 2 and 4).
# Runs range from 192 B (eager) to 64 KiB (rendezvous); LSD -> DLS pairs are staged.
SPEC = StateSpec.from_config(
    {"model_type": "mamba2", "hidden_size": 256, "expand": 2, "head_dim": 16, "state_size": 32,
     "n_groups": 4, "conv_kernel": 4, "num_hidden_layers": 4, "torch_dtype": "bfloat16"},
    ssm_dtype="float32")
NUM_PAGES = 3
SRC_PAGE, DST_PAGE = 2, 1          # non-zero page offsets on both sides


# -- oracle ---------------------------------------------------------------------------------------

def oracle_copy(src: np.ndarray, dst: np.ndarray, runs: np.ndarray) -> None:
    for s, d, n in runs.tolist():
        dst[d:d + n] = src[s:s + n]


class Cluster:
    """Some source and destination ranks of ``plan``, one agent each, connected pairwise.

    The parent mirrors every rank's buffer (fill patterns + oracle copies) to know what each
    destination must hold.
    """

    def __init__(self, plan: TransferPlan, src: dict, dst: dict, **transport_kwargs) -> None:
        self.plan, self.src, self.dst = plan, src, dst
        self.mirror: dict[tuple[str, int], np.ndarray] = {}
        addresses = {}
        for side, ranks, page_size in (("src", src, plan.src.page_size),
                                       ("dst", dst, plan.dst.page_size)):
            for rank, agent in ranks.items():
                nbytes = NUM_PAGES * page_size
                addresses[(side, rank)] = agent.call("open", nbytes, **transport_kwargs)
                seed = (1000 if side == "src" else 2000) + rank
                agent.call("fill", 0, nbytes, seed)
                self.mirror[(side, rank)] = pattern(seed, nbytes)
        for pair in self.pairs():
            self.src[pair.src_rank].call("connect", f"dst/{pair.dst_rank}",
                                         addresses[("dst", pair.dst_rank)])
            self.dst[pair.dst_rank].call("connect", f"src/{pair.src_rank}",
                                         addresses[("src", pair.src_rank)])

    def pairs(self):
        return [p for p in self.plan if p.src_rank in self.src and p.dst_rank in self.dst]

    def bases(self, src_page: int, dst_page: int) -> tuple[int, int]:
        return src_page * self.plan.src.page_size, dst_page * self.plan.dst.page_size

    def post_recvs(self, generation: int, src_page: int, dst_page: int) -> list:
        src_base, dst_base = self.bases(src_page, dst_page)
        out = []
        for pair in self.pairs():
            agent = self.dst[pair.dst_rank]
            peer = f"src/{pair.src_rank}"
            if pair.staged:
                unpack = pair.unpack + np.array([0, dst_base, 0], dtype=np.int64)
                hid = agent.call("post", "post_recv_staged", peer, generation, pair.src_rank,
                                 int(pair.pack[:, 2].sum()), unpack)
            else:
                hid = agent.call("post", "post_recv", peer, generation, pair.src_rank,
                                 pair.runs_at(src_base, dst_base))
            out.append((agent, hid))
        return out

    def post_sends(self, generation: int, src_page: int, dst_page: int) -> list:
        src_base, dst_base = self.bases(src_page, dst_page)
        out = []
        for pair in self.pairs():
            agent = self.src[pair.src_rank]
            peer = f"dst/{pair.dst_rank}"
            if pair.staged:
                pack = pair.pack + np.array([src_base, 0, 0], dtype=np.int64)
                hid = agent.call("post", "post_send_staged", peer, generation, pair.src_rank,
                                 pack)
            else:
                hid = agent.call("post", "post_send", peer, generation, pair.src_rank,
                                 pair.runs_at(src_base, dst_base))
            out.append((agent, hid))
        return out

    def expect(self, src_page: int, dst_page: int) -> None:
        """Record in the mirror that a request moved ``src_page`` into ``dst_page``."""
        src_base, dst_base = self.bases(src_page, dst_page)
        for pair in self.pairs():
            oracle_copy(self.mirror[("src", pair.src_rank)],
                        self.mirror[("dst", pair.dst_rank)], pair.runs_at(src_base, dst_base))

    def assert_destinations(self) -> None:
        for rank, agent in self.dst.items():
            expected = self.mirror[("dst", rank)]
            got = agent.call("digest", 0, expected.size)
            assert got == sha256(expected), f"destination rank {rank} holds wrong bytes"

    def all_agents(self):
        return list({id(a): a for a in [*self.src.values(), *self.dst.values()]}.values())


def wait_ok(handles, timeout: float = 10.0) -> list[dict]:
    results = [agent.call("wait", hid, timeout, timeout=timeout + 10) for agent, hid in handles]
    failed = [r for r in results if not r["ok"]]
    assert not failed, f"transfers failed: {failed}"
    return results


@pytest.fixture(scope="module")
def agents():
    started = start_agents("a", "b", "c")
    yield started
    for agent in started:
        agent.stop()


# -- tags (no UCX) ----------------------------------------------------------------------------

def test_make_tag_bit_layout():
    from statebridge.connector.data import make_tag, split_tag

    assert make_tag(0, 0, 0) == 0
    assert make_tag(1, 0, 0) == 1 << 32
    assert make_tag(0, 1, 0) == 1 << 24
    assert make_tag(0, 0, 1) == 1
    top = make_tag(2**32 - 1, 255, 2**24 - 1)
    assert top == 2**64 - 1
    for fields in [(7, 3, 12345), (2**32 - 1, 0, 0), (0, 255, 0), (123456789, 17, 2**24 - 2)]:
        assert split_tag(make_tag(*fields)) == fields
    # A new generation never collides with any tag of the previous one.
    old = {make_tag(41, s, i) for s in range(4) for i in range(64)}
    new = {make_tag(42, s, i) for s in range(4) for i in range(64)}
    assert not old & new


def test_a_generation_match_takes_every_tag_of_it_and_no_other():
    """The (tag, mask) a drain of one generation (and source rank) probes with."""
    from statebridge.connector.data import make_tag
    from statebridge.connector.data.tags import tag_match

    def matches(tag, match):
        return tag & match[1] == match[0]

    gen = tag_match(42)
    rank = tag_match(42, 3)
    for s in (0, 3, 255):
        for i in (0, 1, 2**24 - 1):
            assert matches(make_tag(42, s, i), gen)
            assert matches(make_tag(42, s, i), rank) == (s == 3)
            assert not matches(make_tag(41, s, i), gen) and not matches(make_tag(43, s, i), gen)
    with pytest.raises(ConfigError, match="generation .* got 4294967296"):
        tag_match(2**32)
    with pytest.raises(ConfigError, match="src_rank .* got 256"):
        tag_match(1, 256)


@pytest.mark.parametrize("fields,message", [
    pytest.param((2**32, 0, 0), "generation .* got 4294967296", id="generation-too-big"),
    pytest.param((-1, 0, 0), "generation .* got -1", id="generation-negative"),
    pytest.param((0, 256, 0), "src_rank .* got 256", id="src-rank-too-big"),
    pytest.param((0, 0, 2**24), "index .* got 16777216", id="index-too-big"),
    pytest.param((0, 0, -3), "index .* got -3", id="index-negative"),
    pytest.param((True, 0, 0), "generation .* got True", id="bool-generation"),
    pytest.param((1.0, 0, 0), "generation .* got 1.0", id="float-generation"),
])
def test_make_tag_rejects_out_of_range(fields, message):
    from statebridge.connector.data import make_tag

    with pytest.raises(ConfigError, match=message):
        make_tag(*fields)


# -- in-process API checks (one Transport, no peer process) -------------------------------------

@pytest.mark.ucx
def test_api_rejects_bad_input_and_closes_cleanly():
    import torch

    from statebridge.connector.data import Transport, alloc_buffer, configure_ucx_env
    from statebridge.errors import ClosedError, PeerLostError

    configure_ucx_env()
    with pytest.raises(ConfigError, match="uint8"):
        Transport(torch.zeros(16, dtype=torch.float32))

    t = Transport(alloc_buffer(4096), name="solo")
    try:
        runs = np.array([[0, 0, 64]], dtype=np.int64)
        with pytest.raises(ConfigError, match="unknown peer 'nobody'"):
            t.post_send("nobody", 1, 0, runs)
        with pytest.raises(ConfigError, match=r"run 0 \[4090, 0, 64\] lies outside"):
            t.post_send("nobody", 1, 0, np.array([[4090, 0, 64]]))
        with pytest.raises(ConfigError, match=r"\[R, 3\]"):
            t.post_recv(None, 1, 0, np.zeros((2, 2), dtype=np.int64))
        with pytest.raises(ConfigError, match="generation"):
            t.post_recv(None, 2**32, 0, runs)

        t.connect("self", t.address)
        t.connect("self", t.address)                      # idempotent
        with pytest.raises(ConfigError, match="another address"):
            t.connect("self", b"\x01" + t.address[1:])
        assert t.fail_peer("self", "heartbeats stopped") == 0
        with pytest.raises(PeerLostError, match="heartbeats stopped") as info:
            t.post_send("self", 1, 0, runs)
        assert info.value.peer == "self"
        t.connect("self", t.address)                      # a lost peer may come back

        pending = t.post_recv(None, 5, 0, runs)
        assert not pending.done()
    finally:
        t.close()
    t.close()                                             # idempotent
    assert pending.done()
    with pytest.raises(ClosedError):
        pending.wait(1)
    with pytest.raises(ClosedError):
        t.post_recv(None, 6, 0, runs)
    assert t.stats()["failures"] == {"closed": 1}


# -- data movement between processes ----------------------------------------------------------

ZERO_COPY_CASES = [
    pytest.param(2, 4, "DLS", "DLS", (0,), (0, 1), id="2x4-DLS"),
    pytest.param(2, 4, "LDS", "LDS", (0,), (0, 1), id="2x4-LDS"),
    pytest.param(4, 2, "LDS", "LDS", (0, 1), (0,), id="4x2-LDS"),
]


@pytest.mark.ucx
@pytest.mark.timeout(90)
@pytest.mark.parametrize("src_tp,dst_tp,src_layout,dst_layout,src_ranks,dst_ranks",
                         ZERO_COPY_CASES)
def test_zero_copy_pairs_land_exactly(agents, src_tp, dst_tp, src_layout, dst_layout,
                                      src_ranks, dst_ranks):
    plan = TransferPlan.build(SPEC, src_tp, src_layout, dst_tp, dst_layout)
    pool = iter(agents)
    cluster = Cluster(plan, {r: next(pool) for r in src_ranks}, {r: next(pool) for r in dst_ranks})
    assert cluster.pairs() and not any(p.staged for p in cluster.pairs())

    recvs = cluster.post_recvs(7, SRC_PAGE, DST_PAGE)
    sends = cluster.post_sends(7, SRC_PAGE, DST_PAGE)
    wait_ok(recvs + sends)
    cluster.expect(SRC_PAGE, DST_PAGE)
    cluster.assert_destinations()

    runs = sum(len(p.runs) for p in cluster.pairs())
    nbytes = sum(p.nbytes for p in cluster.pairs())
    stats = [a.call("stats") for a in cluster.all_agents()]
    assert sum(s["zero_copy_messages_sent"] for s in stats) == runs
    assert sum(s["zero_copy_messages_received"] for s in stats) == runs
    assert sum(s["bytes_received"] for s in stats) == nbytes
    for s in stats:                                     # zero-copy is real: nothing staged
        assert s["staging_buffers_used"] == 0 and s["staging_bytes"] == 0
        assert s["staging_buffers_allocated"] == 0
        assert s["handles_outstanding"] == 0 and s["failures"] == {}


@pytest.mark.ucx
@pytest.mark.timeout(90)
def test_staged_pairs_pack_send_once_and_scatter(agents):
    plan = TransferPlan.build(SPEC, 2, "LSD", 4, "DLS")
    a, b, c = agents
    cluster = Cluster(plan, {0: a}, {0: b, 1: c})
    pairs = cluster.pairs()
    assert all(p.staged for p in pairs) and min(len(p.unpack) for p in pairs) > 1000

    recvs = cluster.post_recvs(9, SRC_PAGE, DST_PAGE)
    sends = cluster.post_sends(9, SRC_PAGE, DST_PAGE)
    wait_ok(recvs + sends)
    cluster.expect(SRC_PAGE, DST_PAGE)                  # the zero-copy runs: same bytes
    cluster.assert_destinations()

    src_stats = a.call("stats")
    assert src_stats["staged_messages_sent"] == len(pairs) == src_stats["messages_sent"]
    assert src_stats["staging_buffers_used"] == len(pairs)
    assert src_stats["staging_bytes"] == sum(p.staging_bytes for p in pairs)
    assert src_stats["zero_copy_messages_sent"] == 0
    for agent, pair in zip((b, c), pairs):
        s = agent.call("stats")
        assert s["staged_messages_received"] == 1 == s["messages_received"]
        assert s["staging_bytes"] == pair.staging_bytes
        assert s["zero_copy_messages_received"] == 0

    # The pool reuses its buffers: a second request allocates nothing new.
    before = src_stats["staging_buffers_allocated"]
    wait_ok(cluster.post_recvs(10, 0, 2) + cluster.post_sends(10, 0, 2))
    cluster.expect(0, 2)
    cluster.assert_destinations()
    assert a.call("stats")["staging_buffers_allocated"] == before


@pytest.mark.ucx
@pytest.mark.timeout(90)
def test_concurrent_requests_with_different_generations(agents):
    plan = TransferPlan.build(SPEC, 4, "DLS", 2, "DLS")
    a, b, c = agents
    cluster = Cluster(plan, {0: a, 1: b}, {0: c})
    # Three requests in flight at once: src page i -> dst page 2 - i, generations 100..102;
    # receives posted newest first, sends oldest first.
    requests = [(100 + i, i, NUM_PAGES - 1 - i) for i in range(NUM_PAGES)]
    recvs = [h for g, s, d in reversed(requests) for h in cluster.post_recvs(g, s, d)]
    sends = [h for g, s, d in requests for h in cluster.post_sends(g, s, d)]
    assert len(recvs) == len(sends) == 2 * len(requests)
    wait_ok(sends + recvs)
    for _, s, d in requests:
        cluster.expect(s, d)
    cluster.assert_destinations()
    assert c.call("stats")["handles_completed"] == len(recvs)


@pytest.mark.ucx
@pytest.mark.timeout(90)
def test_stale_generation_never_completes_a_new_receive(agents):
    plan = TransferPlan.build(SPEC, 2, "LDS", 4, "LDS")
    a, b, _ = agents
    cluster = Cluster(plan, {0: a}, {0: b})
    (pair,) = cluster.pairs()

    # An earlier attempt (generation 20) sends after its receiver gave up; the same request
    # retried as generation 21 reuses the same page and the same run indices.
    stale = cluster.post_sends(20, SRC_PAGE, DST_PAGE)
    fresh = cluster.post_recvs(21, SRC_PAGE, DST_PAGE)
    b.call("progress", 0.3)
    a.call("progress", 0.1)
    assert not b.call("done", fresh[0][1]), "a stale message completed a newer receive"
    cluster.assert_destinations()                       # and wrote nothing into the page

    # The retry's own data (different bytes) completes it.
    a.call("fill", SRC_PAGE * plan.src.page_size, plan.src.page_size, 77)
    cluster.mirror[("src", 0)][SRC_PAGE * plan.src.page_size:(SRC_PAGE + 1)
                               * plan.src.page_size] = pattern(77, plan.src.page_size)
    wait_ok(fresh + cluster.post_sends(21, SRC_PAGE, DST_PAGE))
    cluster.expect(SRC_PAGE, DST_PAGE)
    cluster.assert_destinations()

    # The stale messages still sit unmatched at the receiver; draining them releases the
    # stale sends (rendezvous ones wait for the receiver) and leaves the page untouched.
    assert b.call("discard_unexpected", 20) == len(pair.runs)
    wait_ok(stale)
    cluster.assert_destinations()
    assert b.call("discard_unexpected", 20) == 0


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_wait_timeout_then_cancel_cleanly(agents):
    plan = TransferPlan.build(SPEC, 2, "DLS", 4, "DLS")
    a, b, _ = agents
    cluster = Cluster(plan, {0: a}, {0: b})
    (pair,) = cluster.pairs()
    ((_, hid),) = cluster.post_recvs(30, SRC_PAGE, DST_PAGE)

    out = b.call("wait", hid, 0.25)
    assert out["error"] == "TransferTimeoutError" and out["kind"] == "timeout"
    assert 0.25 <= out["waited"] < 2.0 and not out["done"]
    b.call("cancel", hid)
    out = b.call("wait", hid, 1.0)
    assert out["error"] == "AbortedError" and out["done"] and out["waited"] < 0.5
    b.call("cancel", hid)                               # idempotent

    # Cancelled receives no longer match: a late sender's messages stay unexpected and the
    # page keeps its bytes.
    late = cluster.post_sends(30, SRC_PAGE, DST_PAGE)
    b.call("progress", 0.2)
    cluster.assert_destinations()
    assert b.call("discard_unexpected", 30, 0) == len(pair.runs)
    wait_ok(late)
    stats = b.call("stats")
    assert stats["failures"] == {"timeout": 1, "aborted": 1}
    assert stats["handles_outstanding"] == 0 and stats["stale_messages_discarded"] == len(pair.runs)


# -- a peer dies ----------------------------------------------------------------------------------

def _start_victim(name: str):
    (victim,) = start_agents(name)
    return victim


def _kill_mid_transfer(agents, error_handling: bool):
    """``victim`` is source rank 0 for agent a (it sends half its runs, then dies) and
    destination rank 0 for agent b (it never posts its receives). Returns the survivors' wait
    results and the kill time."""
    a, b, _ = agents
    victim = _start_victim("victim")
    try:
        into_a = TransferPlan.build(SPEC, 2, "LDS", 4, "LDS")       # victim -> a
        from_b = TransferPlan.build(SPEC, 2, "DLS", 4, "DLS")       # b -> victim
        kw = {"error_handling": error_handling}
        victim_addr = victim.call("open", NUM_PAGES * into_a.src.page_size, **kw)
        a_addr = a.call("open", NUM_PAGES * into_a.dst.page_size, **kw)
        b_addr = b.call("open", NUM_PAGES * from_b.src.page_size, **kw)
        victim.call("connect", "a", a_addr)
        victim.call("connect", "b", b_addr)
        a.call("connect", "victim", victim_addr)
        b.call("connect", "victim", victim_addr)

        pair = into_a.pair(0, 0)
        runs = pair.runs_at(SRC_PAGE * into_a.src.page_size, DST_PAGE * into_a.dst.page_size)
        recv = a.call("post", "post_recv", "victim", 50, 0, runs)
        half = victim.call("post", "post_send", "a", 50, 0, runs[: len(runs) // 2])
        a.call("progress", 0.2)                     # a pulls the rendezvous runs
        assert victim.call("wait", half, 5)["ok"]
        assert not a.call("done", recv)                             # half of it arrived

        out_pair = from_b.pair(0, 0)
        send = b.call("post", "post_send", "victim", 51, 0, out_pair.runs_at(0, 0))
        b.call("progress", 0.1)
        assert not b.call("done", send)                 # its 64 KiB run waits for the receiver

        t_kill = victim.kill()
        return (a, recv), (b, send), t_kill
    finally:
        victim.stop()


@pytest.mark.ucx
@pytest.mark.timeout(90)
def test_killed_peer_fails_outstanding_handles_after_fail_peer(agents):
    (a, recv), (b, send), t_kill = _kill_mid_transfer(agents, error_handling=False)
    # Without UCX error handling nothing notices the death by itself ...
    assert a.call("wait", recv, 0.3)["error"] == "TransferTimeoutError"
    assert b.call("wait", send, 0.3)["error"] == "TransferTimeoutError"
    # ... until the control plane says so.
    for agent, hid in ((a, recv), (b, send)):
        assert agent.call("fail_peer", "victim", "heartbeats stopped") == 1
        out = agent.call("wait", hid, 5)
        assert out["error"] == "PeerLostError" and out["peer"] == "victim"
        assert "heartbeats stopped" in out["message"] and out["waited"] < 1.0
        stats = agent.call("stats")
        assert stats["failures"].get("peer_lost") == 1 and stats["handles_outstanding"] == 0
    with pytest.raises(AgentError, match="PeerLostError"):
        a.call("post", "post_recv", "victim", 52, 0, np.array([[0, 0, 8]]))


@pytest.mark.ucx
@pytest.mark.timeout(90)
def test_killed_peer_detected_by_ucx_error_handling(agents, record_property):
    (a, recv), (b, send), t_kill = _kill_mid_transfer(agents, error_handling=True)
    detections = {}
    for role, (agent, hid) in (("receiver", (a, recv)), ("sender", (b, send))):
        out = agent.call("wait", hid, 5)                # no fail_peer: UCX reports the death
        assert out["error"] == "PeerLostError" and out["peer"] == "victim", out
        detections[role] = out["at"] - t_kill
        assert detections[role] < 3.0, f"{role} took {detections[role]:.3f} s to notice"
        stats = agent.call("stats")
        assert stats["ucx_peer_errors"] == 1 and stats["failures"].get("peer_lost") == 1
    record_property("ucx_peer_loss_detection_s", detections)
    print(f"UCX error handling noticed the SIGKILL after "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in detections.items()))


@pytest.mark.ucx
@pytest.mark.timeout(90)
@pytest.mark.parametrize("src_layout,dst_layout,loopback", [
    ("DLS", "DLS", False), ("LSD", "DLS", False), ("DLS", "DLS", True)],
    ids=["zero-copy", "staged", "zero-copy-loopback-only"])
def test_receiver_reads_while_the_sender_is_stopped(agents, src_layout, dst_layout, loopback):
    """Over shared memory a rendezvous message (8 KiB and more) is read by the receiver out of
    the sender's memory: the receive completes while the sender does not run at all, and the
    send completes at the sender's next progress. This is what lets a prefill rank sleep
    through its sends (``Transport.sends_complete_unattended``).

    ``loopback``: the workers' network devices restricted to the loopback interface, as a
    node bound to 127.0.0.1 does (``ucx_options``): shared memory and cma are no network
    devices, so this still holds -- and both workers listen on 127.0.0.1 only.

    Once the endpoints are wired up: the very first transfer after connecting once (of ~10
    runs) did not complete with its sender stopped (UCX finishing the endpoints' wire-up
    needs both sides), so a first round runs with both sides awake."""
    import os
    import signal

    from statebridge.connector.data.env import ucx_net_devices, ucx_options
    from statebridge.testing.sockets import listening_sockets

    plan = TransferPlan.build(SPEC, 2, src_layout, 2, dst_layout)
    a, b, _ = agents
    options = ucx_options(ucx_net_devices("127.0.0.1"), "127.0.0.1", environ={}) \
        if loopback else {}
    # The agents serve every case of the module: what earlier cases' workers opened stays.
    before = {agent.pid: set(listening_sockets(agent.pid)) for agent in (a, b)}
    cluster = Cluster(plan, {0: a}, {0: b}, ucx_options=options)
    if loopback:
        assert options == {"NET_DEVICES": "lo", "TCP_AF_PRIO": "inet"}
        for agent in (a, b):
            found = set(listening_sockets(agent.pid)) - before[agent.pid]
            assert found and all(x.address == "127.0.0.1" for x in found), found
    (pair,) = cluster.pairs()
    largest = int(pair.pack[:, 2].sum()) if pair.staged else int(pair.runs[:, 2].max())
    assert largest >= 8192
    wait_ok(cluster.post_recvs(8, SRC_PAGE, DST_PAGE) + cluster.post_sends(8, SRC_PAGE, DST_PAGE))
    recvs = cluster.post_recvs(9, SRC_PAGE, DST_PAGE)
    sends = cluster.post_sends(9, SRC_PAGE, DST_PAGE)
    a.call("progress", 0.0)                # as a rank loop: one progress after posting
    os.kill(a.pid, signal.SIGSTOP)
    try:
        for agent, hid in recvs:
            result = agent.call("wait", hid, 10.0, timeout=20)
            assert result["ok"], result
    finally:
        os.kill(a.pid, signal.SIGCONT)
    cluster.expect(SRC_PAGE, DST_PAGE)
    cluster.assert_destinations()
    wait_ok(sends)


@pytest.mark.ucx
@pytest.mark.parametrize("same_host,error_handling,tls,expected", [
    (True, False, None, True),
    (False, False, None, False),
    (True, True, None, False),
    (True, False, "tcp,self", False),
    (True, False, "sm,self", True),
    (True, False, "cma,tcp,self", True),
    (True, False, "^cma", False),
    (True, False, "^tcp", True),
])
def test_sends_complete_unattended_only_where_the_receiver_reads(same_host, error_handling, tls,
                                                               expected):
    from statebridge.connector.data import Transport, alloc_buffer, configure_ucx_env

    configure_ucx_env()
    options = {"TLS": tls} if tls else None
    t = Transport(alloc_buffer(4096), error_handling=error_handling, ucx_options=options)
    try:
        assert t.sends_complete_unattended(same_host) is expected
    finally:
        t.close()


# -- where a worker listens ----------------------------------------------------------------------

def test_ucx_net_devices_is_the_interface_holding_the_bind_address():
    from statebridge.connector.data.env import interface_addresses, ucx_net_devices
    from statebridge.errors import ConfigError

    found = interface_addresses()
    loopback = {name for name, iface in found if iface.ip.is_loopback}
    assert ucx_net_devices("127.0.0.1") in loopback
    assert ucx_net_devices("localhost") in loopback
    assert ucx_net_devices("127.0.0.7") in loopback          # in 127/8: loopback's too
    for name, iface in found:                                  # every address of this machine
        if not iface.ip.is_link_local:
            assert ucx_net_devices(str(iface.ip)) == name, (name, iface)
    assert ucx_net_devices("0.0.0.0") == ucx_net_devices("::") == ""    # every interface
    with pytest.raises(ConfigError, match="198.51.100.7.*no address of an interface"):
        ucx_net_devices("198.51.100.7")                        # TEST-NET-2: nobody's


def test_ucx_options_leave_an_operators_choice_alone():
    from statebridge.connector.data.env import ucx_options

    assert ucx_options("lo", "127.0.0.1", environ={}) == {"NET_DEVICES": "lo",
                                                          "TCP_AF_PRIO": "inet"}
    assert ucx_options("lo", "::1", environ={})["TCP_AF_PRIO"] == "inet6"
    assert ucx_options("lo", "127.0.0.1", environ={"UCX_NET_DEVICES": "eth0"}) == {}
    assert ucx_options("", "0.0.0.0", environ={}) == {}


@pytest.mark.ucx
@pytest.mark.parametrize("restricted", [False, True], ids=["default", "loopback-only"])
def test_a_worker_listens_only_on_its_network_devices(restricted):
    """UCX's TCP transport listens on every interface it may use -- all of them by default;
    restricted to the bind address's interface, on that address only."""
    from statebridge.connector.data import Transport, alloc_buffer, configure_ucx_env
    from statebridge.connector.data.env import interface_addresses, ucx_options
    from statebridge.testing.sockets import listening_sockets

    configure_ucx_env()
    before = set(listening_sockets(os.getpid()))
    options = ucx_options("lo", "127.0.0.1", environ={}) if restricted else None
    t = Transport(alloc_buffer(4096), ucx_options=options)
    try:
        opened = set(listening_sockets(os.getpid())) - before
    finally:
        t.close()
    assert opened
    if restricted:
        assert {x.address for x in opened} == {"127.0.0.1"}, opened
    elif any(not iface.ip.is_loopback and iface.ip.version == 4
             for _, iface in interface_addresses()):
        assert {x.address for x in opened} - {"127.0.0.1"}, opened    # the default: more
