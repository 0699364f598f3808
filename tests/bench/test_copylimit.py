"""The copy limit (``statebridge bench``'s ``copy_limit_gbps``): the best of its candidates by
the copy's CPU, named; each candidate copies the right bytes. No timing thresholds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from statebridge.bench import _copylimit
from statebridge.bench._copylimit import CANDIDATES, Candidate, copy_limit
from statebridge.bench._nixl import _fill_pattern
from statebridge.errors import ConfigError

# (src rank, dst rank, bytes per request): odd sizes, a pair under the 64 KiB streaming-copy
# threshold, decode rank 1 reading two sources
PAIRS = [(0, 0, 300_001), (1, 1, 70_000), (0, 1, 4_097), (1, 2, 131_075)]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_candidates_are_every_mechanism_arrangement_and_source():
    assert {c.name for c in CANDIDATES} == {
        f"{m}/{c}/{s}" for m in ("shared_map", "cma") for c in ("per_core", "per_rank")
        for s in ("cold", "warm")}
    for c in CANDIDATES:
        assert Candidate.parse(c.name) == c


@pytest.mark.parametrize("name, match", [
    ("shared_map/per_rank", "MECHANISM/COPIERS/SOURCE.*'shared_map/per_rank'"),
    ("rdma/per_rank/warm", "mechanism.*'rdma'"),
    ("cma/per_thread/warm", "copiers.*'per_thread'"),
    ("cma/per_core/hot", "source.*'hot'"),
], ids=["short", "mechanism", "copiers", "source"])
def test_a_bad_candidate_name_is_refused_naming_it(name, match):
    with pytest.raises(ConfigError, match=match):
        Candidate.parse(name)


@pytest.mark.parametrize("pairs, kw, match", [
    (PAIRS, dict(src_tp=2, requests=0, pages=2), "requests must be an integer >= 1, got 0"),
    (PAIRS, dict(src_tp=2, requests=4, pages=0), "pages must be an integer >= 1, got 0"),
    (PAIRS, dict(src_tp=1, requests=4, pages=2), "source rank 1 outside src_tp 1"),
    ([(0, 0, 0)], dict(src_tp=1, requests=4, pages=2), r"no bytes to copy in \[\(0, 0, 0\)\]"),
    (PAIRS, dict(src_tp=2, requests=4, pages=2, candidates=()), "at least one candidate"),
], ids=["requests", "pages", "source-rank", "no-bytes", "no-candidate"])
def test_bad_input_is_refused_before_any_process_starts(pairs, kw, match):
    with pytest.raises(ConfigError, match=match):
        copy_limit(pairs, **kw)


@pytest.mark.parametrize("copiers, pages, per_core", [("per_core", 5, 2),
                                                      ("per_core", 1, 3),
                                                      ("per_rank", 4, 2)])
def test_jobs_copy_every_pair_once_per_request(copiers, pages, per_core):
    src_page, laid = [0, 0], []
    for s, d, n in PAIRS:
        laid.append((s, d, src_page[s], n))
        src_page[s] += n
    jobs = _copylimit._jobs(copiers, laid, src_page, pages, per_core)
    total = sum(n for *_, n in PAIRS)
    requests = 7
    copied = {}                                   # (request, src rank, src offset) -> bytes
    for job in jobs:
        assert job.bytes_per_request == total
        assert job.slot_bytes == sum(n for *_, n in job.pairs)
        ends = sorted((dst_off, dst_off + n) for _s, _so, dst_off, n in job.pairs)
        assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
        for i in range(job.first, requests, job.step):
            for s, src_off, _dst_off, n in job.pairs:
                assert (i, s, src_off) not in copied
                copied[i, s, src_off] = n
    assert copied == {(i, s, off): n for i in range(requests) for s, _d, off, n in laid}
    if copiers == "per_core":
        assert len(jobs) == per_core and all(j.slots == -(-pages // per_core) for j in jobs)
    else:                                          # one copier per decode rank, its own pairs
        assert len(jobs) == 3 and all(j.slots == pages and j.step == 1 for j in jobs)
        assert [sorted(p[0] for p in j.pairs) for j in jobs] == [[0], [0, 1], [1]]


def test_verify_finds_a_wrong_byte_in_the_last_request_copied():
    pairs = [(0, 100, 0, 5000), (1, 7, 5000, 3000)]
    src_page = [6000, 4000]
    sources = []
    for s in (0, 1):
        view = np.zeros(3 * src_page[s], dtype=np.uint8)
        _fill_pattern(view, s)
        sources.append(view)
    dst = torch.zeros(2 * 8000, dtype=torch.uint8)
    page, slot = 2, 1
    for s, src_off, dst_off, n in pairs:
        at = page * src_page[s] + src_off
        dst.numpy()[slot * 8000 + dst_off:slot * 8000 + dst_off + n] = sources[s][at:at + n]
    state = {"dst": dst, "pairs": pairs, "src_page": src_page, "slot_bytes": 8000,
             "last": (page, slot)}
    assert _copylimit._verify(state) == (8000, [])
    dst.numpy()[8000 + 5000 + 2999] ^= 1          # last byte of source 1's pair
    assert _copylimit._verify(state) == (8000, [(1, 7, 5000, 3000)])
    assert _copylimit._verify({}) == (0, [])      # a copier that copied nothing


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_limit_is_the_best_candidate_and_names_it():
    r = copy_limit(PAIRS, src_tp=2, requests=12, pages=3, copiers=2)
    assert set(r["candidates"]) == {c.name for c in CANDIDATES}
    figures = {name: c["gbps"] for name, c in r["candidates"].items()}
    assert all(_positive(g) for g in figures.values()), r["candidates"]
    assert r["gbps"] == max(figures.values())
    assert r["yardstick"] == max(figures, key=figures.get)
    assert r["bytes_per_request"] == sum(n for *_, n in PAIRS)
    for name, c in r["candidates"].items():
        assert c["copiers"] == (2 if "/per_core/" in name else 3), (name, c)
        assert _positive(c["cpu_us_per_request"]) and _positive(c["seconds"])
        # ranked by the copy's CPU, never below the wall-clock figure of the same pass
        assert 0 < c["cpu_share"] <= 1.05 and c["wall_gbps"] <= c["gbps"] * 1.05, (name, c)
        assert c["gbps"] == pytest.approx(c["wall_gbps"] / c["cpu_share"])
    assert r["copiers"] == r["candidates"][r["yardstick"]]["copiers"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_only_the_candidates_asked_for_are_measured():
    r = copy_limit(PAIRS, src_tp=2, requests=6, pages=2, candidates=["cma/per_rank/warm"])
    assert list(r["candidates"]) == ["cma/per_rank/warm"]
    assert r["yardstick"] == "cma/per_rank/warm" and _positive(r["gbps"])


@pytest.mark.parametrize("spans, copiers, cores, expected", [
    # two copiers on two cores, each busy half of the pass: the cores could copy twice as much
    ([(0.0, 1.0, 0.5), (0.2, 1.0, 0.5)], 2, 2, dict(gbps=2.0, wall_gbps=1.0, cpu_share=0.5)),
    # four copiers time-share two cores, which were all theirs: the wall-clock figure
    ([(0.0, 2.0, 1.0)] * 4, 4, 2, dict(gbps=0.5, wall_gbps=0.5, cpu_share=1.0)),
    # one copier on two cores uses one
    ([(0.0, 1.0, 0.25)], 1, 2, dict(gbps=4.0, wall_gbps=1.0, cpu_share=0.25)),
    # no CPU measured (a pass too short for the clock): the wall-clock figure
    ([(0.0, 0.5, 0.0)], 1, 2, dict(gbps=2.0, wall_gbps=2.0, cpu_share=0.0)),
], ids=["half-busy", "time-shared", "one-copier", "no-cpu"])
def test_a_pass_is_ranked_by_its_cpu_on_the_cores_it_can_use(monkeypatch, spans, copiers,
                                                              cores, expected):
    monkeypatch.setattr(_copylimit.os, "cpu_count", lambda: cores)
    got = _copylimit._figures(spans, copiers, requests=10, bytes_per_request=100_000_000)
    assert got == pytest.approx(dict(expected, copiers=copiers,
                                     seconds=max(s[1] for s in spans) - min(s[0] for s in spans),
                                     cpu_us_per_request=sum(s[2] for s in spans) / 10 * 1e6))
