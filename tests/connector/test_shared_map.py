"""Shared-map reads (statebridge/connector/data/shared/ and its C copy, _copy.c):
the copy against numpy, its bounds checks, and a mapping of another process's memfd."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from statebridge.config import ConnectorConfig
from statebridge.connector.data import shared
from statebridge.connector.data.tags import (
    MAX_INDEX,
    MAX_RUNS,
    READY_INDEX,
    STAGED_INDEX,
)
from statebridge.errors import ConfigError, TransferError


def test_the_compiled_copy_is_built():
    """`pip install -e .` builds the C copy, statebridge.connector.data.shared._copy (CI
    installs exactly so)."""
    assert shared.available()


def _own_map(buf: shared.SharedBuffer) -> shared.PeerMap:
    import os

    return shared.PeerMap(os.getpid(), buf.fd)


@pytest.mark.parametrize("streaming", [True, False])
def test_copy_runs_matches_numpy(streaming):
    """Rows of every size (below and above the streaming threshold, unaligned ends, one that
    ends at the source's last byte, where the streaming copy's prefetch stops) land exactly
    where numpy puts them; bytes outside the rows stay as they were."""
    from statebridge.connector.data.shared import _copy

    rng = np.random.default_rng(3)
    src = shared.SharedBuffer(4 << 20)
    src.tensor.numpy()[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    peer = _own_map(src)
    dst = np.full(4 << 20, 0xAB, dtype=np.uint8)
    expect = dst.copy()
    runs = np.array([[0, 7, 1], [100, 3 << 20, 200_001], [1 << 20, 1, 65_536 + 33],
                     [2 << 20, (2 << 20) + 5, 1_000_000], [17, 999_000, 0],
                     [(4 << 20) - 300_001, 1_100_000, 300_001]],     # ends at the source's end
                    dtype=np.int64)
    for s, d, n in runs:
        expect[d:d + n] = src.tensor.numpy()[s:s + n]
    old = _copy.set_streaming(streaming)
    try:
        assert shared.copy_runs(dst, peer, runs) == int(runs[:, 2].sum())
    finally:
        _copy.set_streaming(old)
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("row", [[0, 0, 5 << 20], [(4 << 20) - 3, 0, 4], [0, (1 << 20) - 1, 2],
                                 [-1, 0, 1], [0, -8, 1], [0, 0, -1]])
def test_a_run_outside_either_buffer_is_refused_and_nothing_is_copied(row):
    src = shared.SharedBuffer(4 << 20)
    src.tensor.numpy()[:] = 1
    dst = np.zeros(1 << 20, dtype=np.uint8)
    runs = np.array([[0, 0, 64], row], dtype=np.int64)
    with pytest.raises(TransferError,
                       match=r"run 1 of group 0 \(src -?\d+ \+ 0, dst -?\d+ \+ 0, -?\d+ bytes\)"):
        shared.copy_runs(dst, _own_map(src), runs)
    assert not dst.any()                      # the good first row was not copied either


@pytest.mark.parametrize("streaming", [True, False])
def test_copy_groups_shift_each_group_by_its_bases(streaming):
    """Each (runs, src_add, dst_add) group lands where numpy puts its rows shifted by the two
    bases (the cached tables of a rank pair plus one request's page and block bases)."""
    from statebridge.connector.data.shared import _copy

    rng = np.random.default_rng(5)
    src = shared.SharedBuffer(4 << 20)
    src.tensor.numpy()[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    dst = np.full(4 << 20, 0x11, dtype=np.uint8)
    expect = dst.copy()
    a = np.array([[0, 0, 70_000], [80_000, 100_000, 13]], dtype=np.int64)
    b = np.array([[5, 9, 1_000]], dtype=np.int64)
    groups = [(a, 1 << 20, 3), (b, 77, (2 << 20) + 1), (a, 0, 3 << 20)]
    for runs, sa, da in groups:
        for s, d, n in runs:
            expect[da + d:da + d + n] = src.tensor.numpy()[sa + s:sa + s + n]
    old = _copy.set_streaming(streaming)
    try:
        got = shared.copy_groups(dst, _own_map(src), groups)
    finally:
        _copy.set_streaming(old)
    assert got == 2 * int(a[:, 2].sum()) + int(b[:, 2].sum())
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("groups, match", [
    ([(np.array([[0, 0, 8]]), 0, 0), (np.array([[0, 0, 8]]), 0, (1 << 20) - 4)],
     r"run 0 of group 1 \(src 0 \+ 0, dst 0 \+ 1048572, 8 bytes\)"),
    ([(np.array([[0, 0, 8]]), (1 << 63) - 1, 0)], r"run 0 of group 0 \(src 0 \+ 9223372036854775807"),
    ([(np.array([[-9, 0, 8]]), 8, 0)], r"run 0 of group 0 \(src -9 \+ 8"),
])
def test_copy_groups_check_every_shifted_row_before_copying(groups, match):
    """A shifted row outside either span (an overflowing base too) is refused naming its group
    and row, and no group is copied."""
    src = shared.SharedBuffer(4 << 20)
    src.tensor.numpy()[:] = 1
    dst = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(TransferError, match=match):
        shared.copy_groups(dst, _own_map(src), groups)
    assert not dst.any()


def test_copy_groups_refuse_malformed_groups():
    from statebridge.connector.data.shared import _copy

    src = shared.SharedBuffer(1 << 20)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    peer = _own_map(src)
    ok = np.zeros((1, 3), dtype=np.int64)
    with pytest.raises(TransferError, match="65 groups, at most 64"):
        shared.copy_groups(dst, peer, [(ok, 0, 0)] * 65)
    with pytest.raises(TransferError, match="not rows of 3 int64"):
        shared.copy_groups(dst, peer, [(ok, 0, 0), (np.zeros(4, dtype=np.int64), 0, 0)])
    with pytest.raises(TypeError, match=r"a group is \(runs, src_add, dst_add\)"):
        _copy.copy_groups(dst.ctypes.data, dst.nbytes, peer.address, peer.nbytes, [(ok, 0)])


def _serve(conn) -> None:
    import os

    buf = shared.SharedBuffer(1 << 20, "test-peer")
    buf.tensor.numpy()[:] = np.arange(1 << 20, dtype=np.int64).astype(np.uint8)
    conn.send((os.getpid(), buf.fd))
    conn.recv()                               # keep the buffer until the reader is done


def test_a_peer_process_buffer_is_read_through_its_memfd():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(there,))
    proc.start()
    try:
        pid, fd = here.recv()
        peer = shared.PeerMap(pid, fd)
        assert peer.nbytes == 1 << 20
        dst = np.zeros(4096, dtype=np.uint8)
        shared.copy_runs(dst, peer, np.array([[1000, 0, 4096]], dtype=np.int64))
        assert np.array_equal(dst, (np.arange(1000, 5096) % 256).astype(np.uint8))
        # The map is read-only: nothing here can write into the peer's memory.
        with pytest.raises((TypeError, ValueError)):
            np.frombuffer(peer._map, dtype=np.uint8)[0] = 1
    finally:
        here.send("done")
        proc.join(10)


def test_a_buffer_that_cannot_be_opened_is_a_transfer_error_naming_it():
    with pytest.raises(TransferError, match=r"/proc/\d+/fd/987654"):
        shared.PeerMap(1, 987654)


def test_notice_tags_never_meet_run_or_staged_tags():
    assert len({READY_INDEX, STAGED_INDEX}) == 2
    assert max(READY_INDEX, STAGED_INDEX) <= MAX_INDEX
    assert MAX_RUNS <= min(READY_INDEX, STAGED_INDEX)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4M"])
def test_shared_map_min_bytes_is_checked(value):
    with pytest.raises(ConfigError, match="shared_map_min_bytes"):
        ConnectorConfig(shared_map_min_bytes=value)


def test_the_shared_map_threshold_comes_from_the_environment_and_the_switch_does_not():
    c = ConnectorConfig.from_env({"STATEBRIDGE_SHARED_MAP_MIN_BYTES": "65536"})
    assert c.shared_map is True and c.shared_map_min_bytes == 65536
    # shared_map is an A/B switch of the benchmark harness (statebridge/bench/ab.py)
    with pytest.raises(ConfigError, match="STATEBRIDGE_SHARED_MAP='0': shared_map is not a "
                                          "setting but an A/B switch"):
        ConnectorConfig.from_env({"STATEBRIDGE_SHARED_MAP": "0"})


def test_an_answer_swaps_only_the_pending_mark_of_its_own_request():
    """A reader's "done" is a compare-and-swap of one control word of the prefill buffer: it
    lands only over the mark of the request it read; a late answer of an earlier request that
    used the same slot writes nothing. Bytes around the word are untouched."""
    import mmap

    from statebridge.connector.data.shared import PENDING

    src = shared.SharedBuffer(3 * mmap.PAGESIZE)
    words = src.tensor.numpy().view(np.int64)
    peer = _own_map(src)
    w = (2 * mmap.PAGESIZE + 40) // 8                      # a word in the buffer's last page
    words[w] = PENDING | 7                                 # request of serial 7 waits
    assert not peer.answer(w * 8, PENDING | 6, 6)          # serial 6: gone, writes nothing
    assert words[w] == PENDING | 7
    assert peer.answer(w * 8, PENDING | 7, 7)
    assert words[w] == 7
    assert not peer.answer(w * 8, PENDING | 7, 7)          # answered once
    words[w - 1] = PENDING | 9                             # a word of a lower page: mapped on
    assert not peer.answer((w - 1) * 8 - mmap.PAGESIZE, PENDING | 9, 9)
    assert peer.answer((w - 1) * 8, PENDING | 9, 9) and words[w - 1] == 9
    assert np.count_nonzero(words) == 2


@pytest.mark.parametrize("offset", [-8, 4, 3 * 4096 - 4, 3 * 4096, 1 << 40])
def test_an_answer_outside_the_buffer_or_unaligned_is_refused(offset):
    src = shared.SharedBuffer(3 * 4096)
    with pytest.raises(TransferError, match=f"answer word at offset {offset} is not an aligned"):
        _own_map(src).answer(offset, 1, 2)
    assert not src.tensor.numpy().any()
