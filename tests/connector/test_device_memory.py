"""Rank pools in device memory (connector/rank/memory.py's CUDA kind, connector/data/device.py)
run on the CPU through the emulation backend (statebridge/testing/device.py): the export
record, a pool exported by one process and opened by another, the one-launch gather polled
to completion, the shared-map rule between memory kinds, and prefill -> decode groups whose
decode ranks gather every pair of a request out of the prefill ranks' pools, byte for byte."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from statebridge.connector.data import device as dev
from statebridge.connector.data import shared
from statebridge.connector.rank.memory import CudaDevice, HostAnonymous, RankMemory
from statebridge.errors import ConfigError, TransferError
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan
from statebridge.testing import device as emu
from statebridge.testing.hosts import RankHostPool

from ._helpers import SPECS, log_to_stderr

RECORD = dev.ExportRecord(device=1, pid=4242, pointer=0x7F0000000000, nbytes=123456,
                          uuid=bytes(range(16)), handle=bytes(range(64)))


@pytest.fixture
def emulated():
    old = emu.install(polls=3, kernel=True)        # the Triton kernel, interpreted
    try:
        yield dev.backend()
    finally:
        emu.restore(old)


def test_export_record_round_trips_in_its_fixed_size():
    data = RECORD.encode()
    assert len(data) == 8 + 4 + 4 + 8 + 8 + 8 + 16 + 64 <= dev.EXPORT_BYTES
    assert dev.ExportRecord.decode(data + b"\0" * 100) == RECORD


@pytest.mark.parametrize("data,needle", [
    (b"\0" * 200, "no device export record"),          # a rank that exported nothing
    (b"SBCUDA\x00\x01" + b"\0" * 10, "bytes, need"),
    (RECORD.encode()[:8] + (7).to_bytes(4, "little") + RECORD.encode()[12:], "version 7"),
], ids=["zeros", "short", "version"])
def test_a_bad_export_record_is_a_transfer_error_naming_what(data, needle):
    with pytest.raises(TransferError, match=needle):
        dev.ExportRecord.decode(data, " of pid 1")


def test_an_export_record_with_a_wrong_handle_size_is_refused():
    with pytest.raises(Exception, match="handle of 3 bytes"):
        dev.ExportRecord(device=0, pid=1, pointer=1, nbytes=1, uuid=bytes(16),
                         handle=b"abc").encode()


def test_the_real_backend_takes_only_cuda_devices_as_device_memory():
    assert dev.CudaBackend().device_memory(torch.device("cuda", 0))
    assert not dev.CudaBackend().device_memory(torch.device("cpu"))
    assert dev.memory_of("cpu") == "host"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_without_a_driver_the_real_backend_refuses_naming_the_cuda_error():
    with pytest.raises(ConfigError, match=r"cudaSetDevice\(0\) failed: cudaError"):
        dev.CudaBackend().allocate(64, torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="needs a CUDA device, got cpu"):
        dev.DevicePool(64, "cpu")


GEOMETRY = PageGeometry(SPECS["mamba2-g1"], 1, "DLS")


def _prefill_child(conn, device: str) -> None:
    """A prefill rank's memory in device memory (emulated on "cpu"), pages filled with a
    pattern; it sends its pid and map descriptor and waits to be told to exit."""
    if device == "cpu":
        emu.install()
    memory = RankMemory(GEOMETRY, 4, mappable=True, label="test-prefill", device=device)
    memory.pages.copy_(torch.arange(memory.pages.numel(), device=device).to(torch.uint8))
    if device != "cpu":
        torch.cuda.synchronize()
    conn.send((os.getpid(), memory.peer_fd, memory.ctl_base))
    conn.recv()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU and none is visible; run `pytest -m cuda` "
                                 "on a GPU machine")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, CUDA])], ids=["emulated", "cuda"])
def test_a_pool_exported_by_one_process_is_gathered_by_another_in_one_launch(device):
    """Emulated: the launch is counted and the event fires on its third poll. CUDA: a real
    cudaMalloc pool, its IPC handle opened in this process, the gather on the rank's stream."""
    old = emu.install(polls=3, kernel=True) if device == "cpu" else dev.backend()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_child, args=(child, device), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the prefill process did not start"
        pid, fd, src_ctl = parent.recv()
        decode = RankMemory(GEOMETRY, 4, label="test-decode", device=device)
        assert isinstance(decode.kind, CudaDevice) and decode.memory == "cuda"
        src = shared.PeerMap(pid, fd)
        pool = decode.open_peer(src)
        assert pool.record.pid == pid and pool.record.nbytes == src_ctl
        page = GEOMETRY.page_size
        runs = np.array([[0, 0, 64], [page + 8, 200, 40], [2 * page - 24, 3 * page - 24, 24]],
                        dtype=np.int64)
        template = decode.prepare_gather([runs])
        backend = dev.backend()
        launches = getattr(backend, "counts", {}).get("launch", 0)
        event = decode.gather_from(pool, template, [(page, page)])
        if device == "cpu":
            assert backend.counts["launch"] == launches + 1        # ONE launch for every run
            assert not decode.gather_done(event) and not decode.gather_done(event)
            assert decode.gather_done(event)
        else:
            deadline = time.monotonic() + 30
            while not decode.gather_done(event):
                assert time.monotonic() < deadline, "the gather's event never fired"
        expect = np.zeros(decode.pages.numel(), dtype=np.uint8)
        pattern = (np.arange(4 * page) % 256).astype(np.uint8)      # the pages
        for a, b, n in runs.tolist():
            expect[page + b:page + b + n] = pattern[page + a:page + a + n]
        assert np.array_equal(decode.pages.cpu().numpy(), expect)
    finally:
        parent.send(None)
        proc.join(30)
        emu.restore(old)


def test_device_memory_keeps_control_words_in_host_memory(emulated):
    memory = RankMemory(GEOMETRY, 3, label="test")
    segments = memory.registered
    assert [start for start, _ in segments] == [0, memory.ctl_base]
    assert segments[0][1].numel() == memory.ctl_base
    assert segments[1][1].numel() == memory.nbytes - memory.ctl_base
    with pytest.raises(TransferError, match="gather instead"):
        memory.copy_from(None, [])


def test_a_host_rank_cannot_open_a_device_pool():
    memory = RankMemory(GEOMETRY, 2, label="test")
    assert isinstance(memory.kind, HostAnonymous) and memory.memory == "host"
    with pytest.raises(TransferError, match="host memory"):
        memory.open_peer(None)


def test_a_peer_without_an_export_record_is_named(emulated):
    plain = shared.SharedBuffer(1 << 16)
    decode = RankMemory(GEOMETRY, 2, label="test")
    with pytest.raises(TransferError, match=f"no device export record of pid {os.getpid()}"):
        decode.open_peer(shared.PeerMap(os.getpid(), plain.fd))


def _side(role, memory, has_kv=False, page_size=4096):
    return shared.MapSide(role=role, takes_part=True, tp_size=2, page_size=page_size,
                          has_kv=has_kv, host_id="h", min_bytes=1 << 20 if role == "prefill"
                          else 0, memory=memory)


@pytest.mark.parametrize("prefill,decode,expected", [
    ("cuda", "cuda", 0),            # every pair, however small: one launch gathers them all
    ("host", "host", None),         # a small page under min_bytes: none (unchanged)
    ("cuda", "host", None),         # mixed kinds go over UCX
    ("host", "cuda", None),
])
def test_the_shared_map_rule_between_memory_kinds(prefill, decode, expected):
    assert shared.map_threshold(_side("prefill", prefill), _side("decode", decode)) == expected


# -- groups: prefill ranks export, decode ranks gather -----------------------------------------

def _host_init() -> None:
    log_to_stderr()
    emu.install()


def _started(pool: RankHostPool) -> RankHostPool:
    """``pool`` once every host answers (imports take long on a loaded machine; a host that
    never starts still fails the test, after 120 s)."""
    for attempt in range(4):
        try:
            pool.ops()
            return pool
        except ConfigError:
            if attempt == 3:
                raise
    return pool


@pytest.fixture(scope="module")
def pools():
    with RankHostPool(2, initializer=_host_init) as prefill_hosts, \
            RankHostPool(4, initializer=_host_init) as decode_hosts:
        yield _started(prefill_hosts), _started(decode_hosts)


def _gathers(hosts, ranks: int) -> tuple[int, int]:
    ops = hosts.ops(ranks)
    return (sum(c.get("device_gathers", 0) for c in ops),
            sum(c.get("shared_map_reads", 0) for c in ops))


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", [
    ("mamba2-g1", 2, 4, "DLS", "DLS"),
    ("mamba2-g1", 2, 4, "LSD", "DLS"),           # staged pairs are gathered too
    ("shortconv", 1, 2, "DLS", "DLS"),           # recurrent + KV runs in one launch
], ids=["2x4", "2x4-staged", "shortconv-kv-1x2"])
def test_decode_ranks_gather_out_of_prefill_pools_byte_exact(emulated, pools, spec_name, src_tp,
                                                             dst_tp, src_layout, dst_layout):
    from .test_connector import REQUESTS, SHM, transfer_round

    plan = TransferPlan.build(SPECS[spec_name], src_tp, src_layout, dst_tp, dst_layout)
    _, decode_hosts = pools
    gathers, reads = _gathers(decode_hosts, dst_tp)
    config = SHM.replace(peer_timeout=10.0)
    results, prefill_stats, decode_stats = transfer_round(
        pools, spec_name, src_tp, dst_tp, src_layout, dst_layout, config=config, rounds=2)
    assert decode_stats["transfers_ok"] == 2 * REQUESTS
    assert decode_stats["memory"] == prefill_stats["memory"] == "cuda"
    # One gather per (request, prefill peer rank) on each decode rank, whatever the pairs'
    # count or kind; nothing went through the host copy.
    peers = sum(len({s for (s, d) in plan.pairs if d == r}) for r in range(dst_tp))
    after = _gathers(decode_hosts, dst_tp)
    assert after[0] - gathers == 2 * REQUESTS * peers
    assert after[1] == reads
    assert max(decode_stats["rank_staging_bytes"]) == 0

