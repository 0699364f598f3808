"""``statebridge check-gpu``: on a CPU machine it exits at once naming the missing device; the
report and the table are assembled from its parts, which are faked here (small Python
commands that pass, fail, hang, crash, skip everything, or write the figures a real part
writes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from statebridge import gpucheck
from statebridge.gpucheck import Part

_GPU = {"name": "Fake H100", "count": 1}


def test_on_a_machine_without_a_gpu_it_exits_non_zero_at_once(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "statebridge.cli", "check-gpu", "--out",
                           str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert gpucheck.NO_DEVICE in proc.stderr
    assert not out.exists()


def _junit(path, tests, failures=0, skipped=0) -> str:
    return (f"open({str(path)!r}, 'w').write('<testsuites><testsuite name=\"pytest\" "
            f"tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">"
            f"</testsuite></testsuites>')")


CELLS = {"device": "Fake H100", "cells": {
    "lfm2-1.2b-1k": {"bytes": 12664832, "runs": 9, "byte_exact": True,
                     "ms": {"gather": 0.01, "per_run": 0.05, "d2d_copy": 0.009},
                     "gbps": {}, "gather_vs_limit": 0.9, "gather_speedup_vs_per_run": 5.0,
                     "gather_launch_cpu_us": 12.0},
    "mamba2-2.7b": {"error": "RuntimeError: out of memory"}}}


def _fake_parts(tmp_path):
    def make(out_dir):
        def py(code):
            return [sys.executable, "-c", textwrap.dedent(code)]

        return [
            Part("kernels", "fake tests", py(_junit(tmp_path / "k.xml", 10, skipped=2)), 30,
                 output=str(tmp_path / "k.xml"), kind="pytest"),
            Part("runner", "fake failing tests",
                 py(_junit(tmp_path / "r.xml", 3, failures=1) + "\nraise SystemExit(1)"), 30,
                 output=str(tmp_path / "r.xml"), kind="pytest"),
            Part("skipped", "every test skipped", py(_junit(tmp_path / "s.xml", 4, skipped=4)),
                 30, output=str(tmp_path / "s.xml"), kind="pytest"),
            Part("nodes", "hangs", py("import time; print('starting'); time.sleep(60)"), 1.5),
            Part("crash", "crashes", py("import os; os.abort()"), 30),
            Part("gather", "writes cells",
                 py(f"import json; json.dump({CELLS!r}, open({str(tmp_path / 'g.json')!r}, 'w'))"),
                 30, output=str(tmp_path / "g.json"), kind="json"),
        ]
    return make


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = gpucheck.main(str(out), visible=lambda: 1, make_parts=_fake_parts(tmp_path),
                       device=lambda: _GPU)
    assert rc == 1
    report = json.loads(out.read_text())
    status = {r["name"]: r["status"] for r in report["parts"]}
    assert status == {"kernels": "passed", "runner": "failed", "skipped": "failed",
                      "nodes": "timeout", "crash": "failed", "gather": "passed"}
    assert report["passed"] is False and report["device"] == _GPU
    parts = {r["name"]: r for r in report["parts"]}
    assert parts["kernels"]["figures"] == {"tests": 10, "failures": 0, "errors": 0,
                                           "skipped": 2, "passed": 8}
    assert parts["nodes"]["seconds"] < 30 and parts["nodes"]["rc"] is None
    assert parts["crash"]["rc"] != 0
    assert parts["gather"]["figures"] == CELLS
    table = capsys.readouterr().out
    assert "kernels  passed" in table and "8 passed, 0 failed, 2 skipped" in table
    assert "nodes    timeout" in table
    assert "lfm2-1.2b-1k" in table and "error: RuntimeError: out of memory" in table
    assert table.rstrip().endswith("device check FAILED")


def test_all_parts_passing_exit_zero_and_a_subset_runs_alone(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = gpucheck.main(str(out), parts=["kernels", "gather"], visible=lambda: 1,
                       make_parts=_fake_parts(tmp_path), device=lambda: _GPU)
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["parts"]] == ["kernels", "gather"]
    assert report["passed"] is True
    assert capsys.readouterr().out.rstrip().endswith("device check passed")


def test_parts_past_the_total_bound_are_recorded_as_not_started(tmp_path):
    out = tmp_path / "report.json"
    rc = gpucheck.main(str(out), parts=["nodes", "kernels"], visible=lambda: 1,
                       make_parts=_fake_parts(tmp_path), device=lambda: _GPU, total=4.0)
    report = json.loads(out.read_text())
    assert rc == 1
    assert [(r["name"], r["status"]) for r in report["parts"]] == \
        [("kernels", "timeout"), ("nodes", "timeout")]
    assert all("not started" in r["tail"][0] for r in report["parts"])


def test_the_real_parts_are_the_checks_the_device_check_promises():
    parts = {p.name: p for p in gpucheck.default_parts("/tmp/x")}
    assert list(parts) == ["kernels", "runner", "nodes", "gather"]
    assert parts["kernels"].argv[3:5] == ["-m", "cuda"] and "tests/kernels" in parts["kernels"].argv
    assert "tests/models" in parts["runner"].argv
    nodes = parts["nodes"].argv
    assert nodes[nodes.index("--prefill-tp") + 1] == "1"
    assert nodes[nodes.index("--decode-tp") + 1] == "2"
    assert nodes[nodes.index("--device") + 1] == "cuda"
    assert sum(p.seconds for p in parts.values()) <= gpucheck.TOTAL_SECONDS < 5 * 60
    assert (gpucheck.repo_root() / "tests" / "kernels" / "test_cuda.py").exists()


@pytest.mark.parametrize("argv", [["check-gpu", "--part", "bogus"]])
def test_an_unknown_part_is_refused(argv, capsys):
    from statebridge.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "'bogus'" in capsys.readouterr().err
