"""statebridge.devices: ``--device`` spellings, the GPU of each rank, the TP backend -- with the
visible GPU count faked, so every rule runs on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from statebridge.devices import DeviceSpec, memory_kind, rank_device, tp_backend, visible_gpus
from statebridge.errors import ConfigError


@pytest.mark.parametrize("text, kind, first", [
    ("auto", "auto", None), ("cpu", "cpu", None), ("cuda", "cuda", None),
    ("cuda:0", "cuda", 0), ("cuda:3", "cuda", 3), (" CUDA:2 ", "cuda", 2),
])
def test_parse(text, kind, first):
    spec = DeviceSpec.parse(text)
    assert (spec.kind, spec.first) == (kind, first)
    assert DeviceSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cpu:0", "auto:1", "", "cuda:x", 3,
                                  None])
def test_parse_refuses_other_spellings(text):
    with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
        DeviceSpec.parse(text)


@pytest.mark.parametrize("spec, visible, want", [
    # auto: CUDA when a GPU is visible, rank r on GPU r % count
    ("auto", 0, ["cpu"] * 4),
    ("auto", 1, ["cuda:0"] * 4),
    ("auto", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("auto", 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
    # cuda:N: the first GPU is N, wrapping around the visible ones
    ("cuda:2", 4, ["cuda:2", "cuda:3", "cuda:0", "cuda:1"]),
    ("cuda:1", 3, ["cuda:1", "cuda:2", "cuda:0", "cuda:1"]),
    ("cuda", 8, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("cpu", 8, ["cpu"] * 4),
], ids=lambda v: str(v))
def test_rank_devices(spec, visible, want):
    got = [str(rank_device(spec, r, visible=visible)) for r in range(4)]
    assert got == want


def test_cuda_without_a_gpu_or_past_the_last_one_is_a_config_error():
    with pytest.raises(ConfigError, match="no GPU is visible"):
        rank_device("cuda", 0, visible=0)
    with pytest.raises(ConfigError, match=r"cuda:4: only 4 GPU\(s\)"):
        rank_device("cuda:4", 0, visible=4)
    with pytest.raises(ConfigError, match="tp_rank"):
        rank_device("cpu", -1, visible=0)


@pytest.mark.parametrize("spec, visible, tp_size, backend, kind", [
    ("auto", 0, 4, "gloo", "host"),        # CPU
    ("cpu", 8, 2, "gloo", "host"),
    ("auto", 4, 4, "nccl", "cuda"),        # one GPU per rank
    ("cuda:1", 4, 2, "nccl", "cuda"),
    ("auto", 1, 2, "gloo", "cuda"),        # two ranks share the one GPU
    ("cuda", 2, 4, "gloo", "cuda"),
    ("auto", 1, 1, "nccl", "cuda"),        # TP 1: no group is built, the rule still answers
])
def test_backend_and_memory_kind(spec, visible, tp_size, backend, kind):
    assert tp_backend(spec, tp_size, visible=visible) == backend
    assert memory_kind(spec, visible=visible) == kind


def test_visible_gpus_is_torchs_count():
    assert visible_gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    # On this machine auto resolves to what torch sees.
    assert rank_device("auto", 0).type == ("cuda" if visible_gpus() else "cpu")
