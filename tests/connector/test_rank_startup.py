"""What a rank reports while it starts (connector/rank/startup.py): its phases, its weights'
loading progress, and what its weights cost its process."""

from __future__ import annotations

import io
import logging
import mmap

import pytest
import torch

from statebridge.connector.rank.startup import (
    WeightProgress,
    fmt_bytes,
    mapped_bytes,
    mapped_ranges,
    phase,
    release_free_heap,
    tensor_bytes,
)


def test_a_phase_logs_its_start_and_its_end_with_duration_and_detail(caplog):
    caplog.set_level(logging.INFO, logger="statebridge.connector.rank.startup")
    with phase("decode rank 1", "pools") as p:
        p.detail = "1.0 MiB"
    with pytest.raises(ValueError), phase("decode rank 1", "weights"):
        raise ValueError("broken")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "decode rank 1: pools ..."
    assert lines[1].startswith("decode rank 1: pools done in ") and \
        lines[1].endswith(" s (1.0 MiB)")
    assert lines[2] == "decode rank 1: weights ..."
    assert lines[3].startswith("decode rank 1: weights failed after ")


def test_loading_progress_is_a_line_per_interval_without_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="statebridge.connector.rank.startup")
    with WeightProgress("prefill rank 0", bar=False, interval=0.0) as progress:
        progress(3 << 20)
        progress(1 << 20)
    assert progress.nbytes == 4 << 20
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[1].startswith("prefill rank 0: weights: 4.0 MiB read in ")


def test_loading_progress_is_one_bar_on_a_terminal(monkeypatch, caplog):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    caplog.set_level(logging.INFO, logger="statebridge.connector.rank.startup")
    with WeightProgress("prefill rank 0", bar=True, interval=0.0) as progress:
        progress(2 << 20)
    assert progress.nbytes == 2 << 20 and caplog.records == []
    assert "prefill rank 0: weights" in out.getvalue() and "2.00M" in out.getvalue()
    # Only rank 0 draws it; the others stay quiet on a terminal but for their phase lines.
    assert WeightProgress("decode rank 1", tp_rank=1)._bar is None


def test_fmt_bytes():
    assert [fmt_bytes(n) for n in (512, 12 << 10, 260 << 20, 3 << 29)] == \
        ["512 B", "12.0 KiB", "260.0 MiB", "1.5 GiB"]


def test_weight_memory_counts_storages_once_and_leaves_out_the_rank_buffer(tmp_path):
    class Holder:                         # a statebridge object: walked
        pass
    Holder.__module__ = "statebridge.test"
    buffer = torch.zeros(1000, dtype=torch.uint8)
    w = torch.zeros(10, 4)                                   # 160 bytes
    h = Holder()
    h.w, h.view, h.tied = w, w[:5], {"again": w}
    h.layers = [torch.zeros(3, dtype=torch.float64), buffer[10:20]]
    assert tensor_bytes(h, exclude=(buffer,)) == 160 + 24
    assert tensor_bytes(h, exclude=(buffer,), exclude_ranges=(
        (w.data_ptr(), w.data_ptr() + 160),)) == 24
    # A file mapped into this process: its resident pages and its range.
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * (3 * mmap.PAGESIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m[:]                                                   # touch every page
        assert mapped_bytes(str(tmp_path)) == 3 * mmap.PAGESIZE
        assert [b - a for a, b in mapped_ranges(str(tmp_path))] == [3 * mmap.PAGESIZE]
    assert mapped_bytes(str(tmp_path)) == 0 and mapped_ranges(str(tmp_path)) == ()


def test_freed_heap_goes_back_to_the_system():
    """Many freed small temporaries (what sharding leaves) stay in the heap until trimmed."""
    def anonymous() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))
    junk = [bytearray(64 << 10) for _ in range(3000)]            # ~190 MiB below mmap size
    keep = junk[-1]
    del junk
    before = anonymous()
    assert release_free_heap()
    assert anonymous() < before - (100 << 10)                   # KiB: at least 100 MiB back
    assert len(keep) == 64 << 10
