"""Run templates: the runs of a rank pair checked once and posted at many page offsets.

One transport talks to itself (a loopback endpoint over its own worker address), so the test
stays in one process; the expected bytes come from plain numpy slicing of the fill pattern.
"""

from __future__ import annotations

import numpy as np
import pytest

from statebridge.errors import ConfigError

PAGE = 4096
PAGES = 6


@pytest.fixture()
def loop_transport():
    from statebridge.connector.data import Transport, alloc_buffer, configure_ucx_env

    configure_ucx_env()
    t = Transport(alloc_buffer(PAGE * PAGES), name="loop")
    t.connect("self", t.address)
    yield t
    t.close()


def _drive(t, handles, seconds=10.0):
    import time

    deadline = time.monotonic() + seconds
    while not all(h.finished() for h in handles):
        assert time.monotonic() < deadline, f"not done: {handles}"
        t.progress(0.01)
    for h in handles:
        h.wait(0)


def test_template_posts_land_at_each_page_offset(loop_transport):
    t = loop_transport
    buf = t.posting.page_np                         # the transport's page buffer, as numpy
    rng = np.random.default_rng(7)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    before = buf.copy()
    # Three runs of a pair: (src offset, dst offset, length) within one page; one eager-sized,
    # one rendezvous-sized, one of a single byte.
    runs = np.array([[0, 2048, 1000], [1000, 0, 2000], [3000, 3500, 1]], dtype=np.int64)
    send_t, recv_t = t.template(runs, "send"), t.template(runs, "recv")
    assert (send_t.nbytes, len(send_t), send_t.extent) == (3001, 3, 3001)
    assert recv_t.extent == 3501

    expected = before.copy()
    generation = 40
    # Pages 0 -> 3, 1 -> 4, 2 -> 5, then other pairings: the cached buffer views must follow
    # the page offset and the length (page 3's first byte starts a 2000-byte receive run, then
    # a 1000-byte send run).
    for src_page, dst_page in ((0, 3), (1, 4), (2, 5), (0, 4), (2, 3), (3, 0)):
        generation += 1
        src, dst = src_page * PAGE, dst_page * PAGE
        recv = t.post_runs("recv", "self", generation, 2, dst, recv_t)
        send = t.post_runs("send", "self", generation, 2, src, send_t)
        _drive(t, [recv, send])
        for s, d, n in runs.tolist():
            expected[dst + d:dst + d + n] = expected[src + s:src + s + n]
        assert np.array_equal(buf, expected), (src_page, dst_page)
        assert (recv.nbytes, recv.messages, recv.kind) == (3001, 3, "zero_copy")


def test_template_errors_name_the_offending_values(loop_transport):
    t = loop_transport
    runs = np.array([[0, 0, 64], [100, 4000, 96]], dtype=np.int64)
    recv_t = t.template(runs, "recv")
    last_page = (PAGES - 1) * PAGE
    t.post_runs("recv", "self", 1, 0, last_page, recv_t).cancel()      # fits: ends at the end
    # 8 bytes further, run 0 still fits but run 1 ends 8 bytes past the buffer.
    with pytest.raises(ConfigError, match=rf"receive run 1 \[100, {last_page + 8 + 4000}, 96\] "
                                          rf"lies outside the page buffer \({PAGES * PAGE} bytes\)"):
        t.post_runs("recv", "self", 1, 0, last_page + 8, recv_t)
    with pytest.raises(ConfigError, match=r"run 0 \[-8, 0, 64\]"):
        t.template(np.array([[-8, 0, 64]]), "send")
    with pytest.raises(ConfigError, match=r"run 1 \[0, 5, -1\] has a negative"):
        t.template(np.array([[0, 0, 1], [0, 5, -1]]), "recv")
    with pytest.raises(ConfigError, match="direction must be 'send' or 'recv', got 'put'"):
        t.template(runs, "put")
    with pytest.raises(ConfigError, match="generation"):
        t.post_runs("recv", "self", 2**32, 0, 0, recv_t)
    with pytest.raises(ConfigError, match="src_rank"):
        t.post_runs("recv", "self", 1, 256, 0, recv_t)
    with pytest.raises(ConfigError, match="base must be an int, got '0'"):
        t.post_runs("recv", "self", 1, 0, "0", recv_t)
    with pytest.raises(ConfigError, match="unknown peer 'nobody'"):
        t.post_runs("send", "nobody", 1, 0, 0, t.template(runs, "send"))
