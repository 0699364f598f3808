"""What UCX says it has and chose (connector/data/ucxinfo.py), read from UCX itself, and the
warning a rank gives when device memory would travel through host memory; a transport over a
rank buffer in segments (a pool, then host control words)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from statebridge.connector.data import ucxinfo
from statebridge.errors import ConfigError, TransferError

# ucp_context_print_info / ucp_ep_print_info output of libucx-cu12 1.21 on a CPU machine.
CONTEXT = """#
# UCP context
#
#            md 0  :  component 0  self
#            md 1  :  component 1  tcp
#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 1  dev 2  flags -- tcp/lo
#      resource 3  :  md 2  dev 0  flags -- sysv/memory
#      resource 4  :  md 4  dev 0  flags -- cma/memory
#
"""
ENDPOINT = """#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] seg 4294967295 am
#                 lane[1]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] seg 4294967295 rma_bw#0
#                 lane[2]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] seg 4294967295 rma_bw#1
#
# | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send*(fast-completion) from host memory    |
# |                        8K..inf | (?) rendezvous zero-copy read from remote              | cma/memory  |
"""


def test_resources_and_lanes_are_parsed_from_ucx_output():
    assert ucxinfo.parse_resources(CONTEXT) == ["self/memory", "tcp/eth0", "tcp/lo",
                                                "sysv/memory", "cma/memory"]
    assert ucxinfo.parse_lanes(ENDPOINT) == ["sysv/memory", "cma/memory"]      # once each
    assert ucxinfo.parse_resources("nothing here") == ucxinfo.parse_lanes("") == []


GPU_TCP = ["self/memory", "tcp/eth0", "cuda_copy/cuda", "cuda_ipc/cuda", "cma/memory"]
GPU_RC = GPU_TCP + ["rc_mlx5/mlx5_0:1", "dc_mlx5/mlx5_0:1"]


@pytest.mark.parametrize("memory,resources,peermem,needle", [
    ("host", GPU_TCP, False, ""),                        # host pools: nothing to say
    ("cuda", [], False, ""),                             # UCX could not be asked: nothing said
    ("cuda", ["tcp/eth0", "cma/memory"], True, "no cuda_copy"),
    ("cuda", GPU_TCP, True, "no RDMA transport"),
    ("cuda", GPU_RC, False, "nvidia_peermem module is not loaded"),
    ("cuda", GPU_RC, True, ""),                          # GPUDirect RDMA
], ids=["host", "unknown", "no-cuda", "tcp-only", "rdma-no-peermem", "rdma"])
def test_device_path_says_when_device_memory_goes_through_the_host(memory, resources, peermem,
                                                                   needle):
    why = ucxinfo.device_path(memory, resources, peermem=peermem)
    assert (needle in why) if needle else why == ""
    if needle == "no RDMA transport":
        assert "tcp" in why and "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" in why


def test_the_libucp_already_mapped_is_the_one_asked():
    maps = ("7f00-7f10 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 2 /opt/ucx/lib/libucp.so.0.0.0\n")
    assert ucxinfo._loaded_libucp(maps) == "/opt/ucx/lib/libucp.so.0.0.0"
    assert ucxinfo._loaded_libucp("").endswith("libucx/lib/libucp.so")


def test_peermem_is_read_from_the_module_list():
    assert ucxinfo.peermem_loaded("nvidia_peermem 16384 0 - Live 0x0\nnvidia 1 2 - Live 0\n")
    assert not ucxinfo.peermem_loaded("nvidia 56811520 2 nvidia_uvm, Live 0x0\n")


@pytest.mark.ucx
def test_a_transport_reports_what_ucx_has_and_chose():
    """Real UCX: the context's transports, and the lanes of an endpoint to a peer on this host
    (shared memory), as UCX itself prints them; host memory warns about nothing."""
    from statebridge.connector.data.transport import Transport

    a = Transport(torch.zeros(1 << 16, dtype=torch.uint8), name="a")
    b = Transport(torch.zeros(1 << 16, dtype=torch.uint8), name="b")
    try:
        assert "self/memory" in a.resources and any(r.startswith("tcp/") for r in a.resources)
        assert a.memory == "host" and a.host_staging == ""
        a.connect("b", b.address)
        lanes = a.lanes("b")
        assert lanes and set(lanes) <= set(a.resources)
        assert a.stats()["lanes"] == {"b": ",".join(lanes)}
    finally:
        a.close()
        b.close()


@pytest.mark.ucx
def test_a_transport_over_segments_moves_bytes_into_each_of_them():
    """A rank buffer in two segments (the pool at 0, control words after a gap): runs land at
    their absolute offsets in either segment; a run across segments is refused."""
    from statebridge.connector.data.transport import Transport

    pool, ctl = torch.zeros(8192, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    data = torch.arange(16384).to(torch.uint8)
    src = Transport(data, name="src")
    dst = Transport([(0, pool), (12288, ctl)], name="dst")
    try:
        assert dst.memory == "host"
        src.connect("dst", dst.address)
        runs = np.array([[100, 64, 4000], [9000, 12288 + 8, 16]], dtype=np.int64)   # eager
        recv = dst.post_recv(None, 1, 0, runs)
        src.post_send("dst", 1, 0, runs)
        recv.wait(10)
        assert torch.equal(pool[64:4064], data[100:4100])
        assert torch.equal(ctl[8:24], data[9000:9016])
        assert int(pool.count_nonzero()) + int(ctl.count_nonzero()) <= 4016
        with pytest.raises(TransferError, match="not inside one segment"):
            dst.post_recv(None, 2, 0, np.array([[0, 8000, 500]], dtype=np.int64))
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("segments,needle", [
    ([(4, torch.zeros(8, dtype=torch.uint8))], "segments start at 0"),
    ([(0, torch.zeros(8, dtype=torch.uint8)), (4, torch.zeros(8, dtype=torch.uint8))],
     "the previous one ends at 8"),
    ([(0, torch.zeros(8, dtype=torch.int32))], "uint8"),
    ([], "non-empty"),
], ids=["first-not-at-0", "overlap", "dtype", "empty"])
def test_bad_segments_are_refused_naming_them(segments, needle):
    from statebridge.connector.data.transport import _segments

    with pytest.raises(ConfigError, match=needle):
        _segments(segments)
