"""bench/device_gather.py on the CPU: the requests it measures are the sizes it promises, and
its three methods move the same bytes (the gather interpreted, CUDA events faked by a clock)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from statebridge.bench import device_gather as dg


def test_the_cells_are_the_requests_the_check_promises():
    def size(name):
        return sum(int(g[:, 2].sum()) for g in dg.cell_runs(name))

    assert size("lfm2-1.2b-1k") == size("lfm2-1.2b-1k-scattered") == 81_920 + 12_582_912
    assert sum(len(g) for g in dg.cell_runs("lfm2-1.2b-1k-scattered")) >= 3000
    from statebridge.bench.hetero_tp import preset_spec

    assert size("mamba2-2.7b") == preset_spec("mamba2-2.7b").bytes_per_request()
    # decode rank 0 of TP 2: half the heads and x channels, the replicated B and C whole
    assert size("mamba2-2.7b") / 2 < size("mamba2-2.7b-tp2-LSD") < size("mamba2-2.7b")
    assert len(dg.cell_runs("mamba2-2.7b-tp2-LSD")[0]) > len(dg.cell_runs("mamba2-2.7b")[0])


class _ClockEvent:
    def __init__(self, enable_timing=False):
        self.t = 0.0

    def record(self, *args):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_measure_moves_every_byte_and_reports_each_method(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    groups = [np.array([[0, 0, 100], [200, 100, 50]]), np.array([[0, 0, 64], [640, 64, 32]])]
    r = dg.measure(groups, "cpu", repeat=2)
    assert (r["bytes"], r["runs"], r["byte_exact"]) == (246, 4, True)
    assert set(r["ms"]) == {"gather", "per_run", "d2d_copy"} and min(r["ms"].values()) >= 0
    table = dg.format_table({"device": "cpu", "cells": {"t": r, "bad": {"error": "E: x"}}})
    assert table.splitlines()[1].split()[:3] == ["t", "246", "4"]
    assert table.splitlines()[2] == f"{'bad':<24} error: E: x"


def test_without_a_gpu_the_benchmark_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert dg.main([]) == 2
    assert "no CUDA device visible" in capsys.readouterr().err
