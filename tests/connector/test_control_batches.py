"""Row batches on the wire: what an event loop queues to one peer in one iteration."""

from __future__ import annotations

import time

import pytest
import zmq

from statebridge.connector import control as c
from statebridge.connector import frames as wire
from statebridge.connector import messages as m


def _done(i: int) -> m.RankDone:
    return m.RankDone(tp_rank=i % 4, peer_node="prefill-x", request_id=f"r{i}", generation=i,
                      kind="", message="", nbytes=i)


def _prefill(i: int, tokens: int) -> m.RankPrefill:
    return m.RankPrefill(request_id=f"p{i}", generation=i,
                         prompt=m.pack_tokens(range(i, i + tokens)), src_page=i % 8,
                         peer_node="decode-x", src_blocks=(i,), dst_blocks=(i + 1,),
                         kv_tokens=tokens)


@pytest.fixture
def pair():
    """(a ROUTER, a DEALER connected to it, the dealer's identity at the router)."""
    ctx = zmq.Context.instance()
    router, port = c.bind_router(ctx, "127.0.0.1")
    dealer = c.connect_dealer(ctx, f"127.0.0.1:{port}")
    c.send_dealer(dealer, m.Heartbeat(node_id="hello", seq=0))
    assert router.poll(10_000)
    identity, _ = c.recv_router(router, 1 << 20)
    yield router, dealer, identity
    dealer.close(0)
    router.close(0)


def _send_from_loop(messages_for, sock, identity) -> None:
    """Queue ``messages_for()`` on an event loop thread in ONE iteration, then flush."""
    loop = c.EventLoop("batches")
    loop.start()
    try:
        loop.call(lambda: [c.send_router(sock, identity, x) for x in messages_for()])
    finally:
        loop.stop()


def _frames(dealer: zmq.Socket, want: int, timeout: float = 10.0) -> list[bytes]:
    frames: list[bytes] = []
    deadline = time.monotonic() + timeout
    while sum(len(m.decode_frame(f)) for f in frames) < want:
        assert dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))), \
            f"only {len(frames)} frames arrived"
        frames.extend(dealer.recv_multipart())
    return frames


def test_queued_batch_messages_leave_as_row_batches_in_order(pair):
    router, dealer, identity = pair
    sent = [_done(i) for i in range(50)] + [m.Heartbeat(node_id="mid", seq=1)] + \
        [_done(i) for i in range(50, 80)] + [m.RankCancel(peer_node="p", request_id="r1",
                                                           generation=1, kind="aborted",
                                                           reason="x", lost_node="")]
    _send_from_loop(lambda: sent, router, identity)
    frames = _frames(dealer, len(sent))
    # four frames: 50 RankDone rows, the Heartbeat on its own, 30 rows, the RankCancel
    assert [len(m.decode_frame(f)) for f in frames] == [50, 1, 30, 1]
    assert [x for f in frames for x in m.decode_frame(f)] == sent


def test_the_reader_hands_out_every_row_of_a_batch(pair):
    router, dealer, identity = pair
    sent = [_done(i) for i in range(20)]
    loop = c.EventLoop("batches-out")
    loop.start()
    try:
        loop.call(lambda: [c.send_dealer(dealer, x) for x in sent])
    finally:
        loop.stop()
    got = []
    deadline = time.monotonic() + 10
    while len(got) < len(sent) and time.monotonic() < deadline:
        router.poll(100)
        while (item := c.recv_router(router, 1 << 20)) is not None:
            got.append(item)
    assert [msg for _, msg in got] == sent
    assert {ident for ident, _ in got} == {identity}


def test_large_batches_are_split_below_the_frame_budget(pair):
    router, dealer, identity = pair
    sent = [_prefill(i, 2000) for i in range(40)]           # ~8 KB of prompt each
    _send_from_loop(lambda: sent, router, identity)
    frames = _frames(dealer, len(sent))
    assert len(frames) > 1
    assert all(len(f) <= wire.BATCH_FRAME_BYTES for f in frames)
    assert [x for f in frames for x in m.decode_frame(f)] == sent


def test_a_row_bigger_than_the_budget_still_goes_alone(pair):
    router, dealer, identity = pair
    sent = [_prefill(0, 100), _prefill(1, 20_000), _prefill(2, 100)]   # 80 KB prompt
    _send_from_loop(lambda: sent, router, identity)
    frames = _frames(dealer, len(sent))
    assert [x for f in frames for x in m.decode_frame(f)] == sent
    assert max(len(f) for f in frames) > wire.BATCH_FRAME_BYTES
    assert sorted(len(m.decode_frame(f)) for f in frames)[-1] <= 2


def test_a_row_msgpack_cannot_pack_is_dropped_and_the_others_leave(pair, caplog):
    router, dealer, identity = pair
    bad = m.RankDone(tp_rank=0, peer_node="p", request_id="bad", generation=1, kind="",
                     message="", nbytes=1 << 70)
    sent = [_done(1), bad, _done(2)]
    _send_from_loop(lambda: sent, router, identity)
    frames = _frames(dealer, 2)
    assert [x for f in frames for x in m.decode_frame(f)] == [_done(1), _done(2)]
    assert "dropped a RankDone that cannot be encoded" in caplog.text
