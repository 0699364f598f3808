"""Test-wide setup and the shared helpers of the statebridge test suite.

1. Triton interpreter. Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated* with
   ``@triton.jit`` (``triton.runtime.jit.jit`` checks ``knobs.runtime.interpret``), i.e. when
   ``statebridge.kernels`` is imported, not when the kernel runs. So it is set here, before any
   test module is imported, whenever there is no CUDA device; importing torch does not import
   triton. ``tests/kernels/test_conftest_helpers.py`` checks that the kernels really are
   interpreted on CPU.
2. ``nan_empty``: ``torch.empty``/``torch.empty_like`` return NaN-filled float tensors, so an
   output element a kernel forgets to write fails the comparison instead of passing by luck.
3. ``assert_close``: the ONE comparison helper, with tolerances paired with dtypes. It raises
   (never warns) when any element is outside tolerance or not finite.
4. Markers (pyproject.toml): ``exhaustive`` tests -- the full real-process matrices, whose
   cases are covered by default in process against the byte oracle and by a covering subset
   through real processes -- are deselected unless the ``-m`` expression names them
   (``python -m pytest -m exhaustive``); ``slow`` marks what ``-m "not slow"`` (the developer
   loop) leaves out.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


#: Marked ``slow`` here (node id prefixes; ``-m "not slow"`` is the developer loop): each starts
#: rank processes or nodes, or measures, for ~10 s or more on two cores. A test whose name
#: ends in ``_in_process`` is never slow (the in-process side of a real-process matrix).
SLOW = (
    "tests/bench/test_bench.py",                # benchmark runs: groups of rank processes
    "tests/bench/test_bench_transport.py",
    "tests/bench/test_nixl.py",
    "tests/bench/test_bench_prefix_cache.py",   # real nodes through HTTP
    "tests/bench/test_bench_prefix_caching.py",
    "tests/bench/test_copylimit.py::test_the_limit_is_the_best_candidate_and_names_it",
    "tests/bench/test_copylimit.py::test_only_the_candidates_asked_for_are_measured",
    "tests/connector/test_connector.py",        # the real-process matrices and their subsets
    "tests/connector/test_kv_connector.py",
    "tests/connector/test_faults.py",           # killed, frozen and restarted ranks
    "tests/connector/test_supervision.py",
    "tests/connector/test_reconnect.py",
    "tests/connector/test_runtime.py",
    "tests/connector/test_verify.py",
    "tests/connector/test_device_memory.py",
    "tests/connector/test_probes.py",
    "tests/connector/test_security.py::test_keyed_groups_transfer_and_refuse_intruders",
    "tests/e2e/",                               # nodes: pairs, fault matrix, soak, HTTP
    "tests/test_cli.py::test_a_node_whose_ranks_do_not_start_in_time_exits_2_naming_them",
    "tests/models/test_runner.py::test_tp_processes_match_transformers",     # gloo processes
    "tests/models/test_distributed.py::test_a_gloo_groups_ranks_listen_only_on_the_rendezvous_host",
    "tests/models/test_distributed.py::test_a_rank_that_never_comes_fails_the_others_within_the_timeout_naming_it",
    "tests/models/test_runner_chunked.py::test_batched_chunked_prefill_equals_one_at_a_time",
    "tests/models/test_runner_paths.py::test_triton_path_matches_transformers",  # interpreted
    "tests/kernels/test_attention_chunked.py::test_chunks_equal_the_tail_of_whole_sequence_attention[long-context",
    "tests/kernels/test_gather.py::test_gather_matches_a_per_run_copy[triton-many-small-runs]",
)


@pytest.hookimpl(tryfirst=True)     # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark SLOW; deselect ``exhaustive`` tests unless ``-m`` mentions that marker; the GPU
    compile check (tests/kernels/_background_compile.py) runs last."""
    for item in items:
        if item.nodeid.startswith(SLOW) and not item.name.split("[")[0].endswith("_in_process"):
            item.add_marker(pytest.mark.slow)
    if "exhaustive" not in (config.option.markexpr or ""):
        keep, drop = [], []
        for item in items:
            (drop if item.get_closest_marker("exhaustive") else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if hasattr(config, "workerinput"):     # an xdist worker: see _xdist_order
        items[:] = _xdist_order(items)
    items.sort(key=_is_compile_check)   # stable: last


#: The longest files with two workers (the sum of their tests' durations, 2026-12-06, ranks
#: forked by the fork server): under xdist they start first, in this order (_xdist_order).
LONGEST = (
    "tests/vllm/test_vllm_pd.py",               # ~6 min: two vLLM instances a case
    "tests/vllm/test_vllm_serve.py",            # ~2 min: vllm serve x2 + the proxy
    "tests/e2e/test_disaggregated.py",          # ~2.2 min
    "tests/e2e/test_fault_matrix.py",           # ~1.9 min
    "tests/connector/test_kv_connector.py",     # ~0.7 min
    "tests/bench/test_bench.py",                # ~1 min
)


def _xdist_order(items):
    """The order in which xdist hands out files (``--dist loadfile --no-loadscope-reorder``,
    pyproject.toml): LONGEST first, then the other files with a ``slow`` test, then the rest,
    each group in collection order and each file's tests in theirs; the compile check's file
    last (its test waits for the background compile). Longest first keeps one long file from
    starting last and running alone while the other workers have nothing left."""
    def file(item):
        return item.nodeid.split("::", 1)[0]

    first = {name: i for i, name in enumerate(LONGEST)}
    slow = {file(i) for i in items if i.get_closest_marker("slow") and not _is_compile_check(i)}
    compile_check = {file(i) for i in items if _is_compile_check(i)}
    position: dict[str, int] = {}
    for item in items:
        position.setdefault(file(item), len(position))

    def key(item):
        name = file(item)
        if name in compile_check:
            return (3, 0)
        if name in first:
            return (0, first[name])
        return (1 if name in slow else 2, position[name])

    return sorted(items, key=key)     # stable: each file's tests keep their order


#: The node id suffix of the compile check's test (tests/kernels/_background_compile.py).
_COMPILE_CHECK = "test_compile.py::test_every_variant_compiles_for_sm90_and_every_kernel_for_sm80"
#: The key of the compile check's folder in an xdist worker's ``workerinput``.
_COMPILE_CHECK_DIR = "statebridge_compile_check_dir"


def _is_compile_check(item) -> bool:
    # --dist loadgroup appends "@group" to the node ids of grouped tests
    return item.nodeid.partition("@")[0].endswith(_COMPILE_CHECK)


def pytest_configure(config):
    """Name the compile check's folder: the session's owner (no xdist, or xdist's controller)
    chooses it, xdist's workers take the owner's (``pytest_configure_node``)."""
    from tests.kernels import _background_compile

    _background_compile.configure(getattr(config, "workerinput", {}).get(_COMPILE_CHECK_DIR))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist's controller) Hand each worker the session's compile check folder."""
    from tests.kernels import _background_compile

    node.workerinput[_COMPILE_CHECK_DIR] = str(_background_compile.folder())


def pytest_collection_finish(session):
    """Start the GPU compile check in the background, at idle priority, when its test runs in
    this session (minutes of CPU that need nothing from the other tests). Under xdist every
    worker collects every test: the first to get here starts it, once for the session."""
    if any(_is_compile_check(item) for item in session.items) \
            and not session.config.option.collectonly:
        from tests.kernels import _background_compile

        _background_compile.start()


def pytest_unconfigure(config):
    """The session's owner ends the compile check if it still runs and removes its files."""
    if not hasattr(config, "workerinput"):
        from tests.kernels import _background_compile

        _background_compile.stop()


# (atol, rtol) per dtype of the compared computation. Integers and bytes compare exactly.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise AssertionError unless ``actual`` matches ``expected`` within ``dtype``'s tolerance.

    Shapes must be equal; any NaN or inf in either tensor fails (an unwritten NaN-filled output
    never passes). Float comparisons are ``|a - e| <= atol + rtol * |e|`` in float64; integer
    and bool dtypes must match exactly.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(f"expected two tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: actual {list(actual.shape)} vs expected {list(expected.shape)}")
    if dtype.is_floating_point:
        if dtype not in TOLERANCES:
            raise AssertionError(f"no tolerance for dtype {dtype}")
        atol, rtol = TOLERANCES[dtype]
        a = actual.detach().to("cpu", torch.float64)
        e = expected.detach().to("cpu", torch.float64)
        for name, t in (("actual", a), ("expected", e)):
            bad = (~torch.isfinite(t)).nonzero()
            if bad.numel():
                raise AssertionError(f"{name} has {bad.shape[0]} non-finite elements, first at {bad[0].tolist()}")
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False, check_dtype=False)
    else:
        if not torch.equal(actual.detach().cpu(), expected.detach().cpu()):
            diff = (actual.detach().cpu() != expected.detach().cpu()).nonzero()
            raise AssertionError(f"{diff.shape[0]} elements differ exactly, first at {diff[0].tolist()}")


@pytest.fixture(scope="session")
def shared_pools():
    """One set of rank hosts for the session: ``(prefill hosts, decode hosts)``, 4 and 8,
    each host started when a group first needs it (``RankHostPool(lazy=True)``). For the
    modules whose groups only need some ranks; a test that kills or stops a host process
    (SIGKILL, SIGSTOP) takes its own pool instead."""
    from statebridge.testing.hosts import RankHostPool
    from tests.connector._helpers import log_to_stderr

    with RankHostPool(4, initializer=log_to_stderr, lazy=True) as prefill_hosts, \
            RankHostPool(8, initializer=log_to_stderr, lazy=True) as decode_hosts:
        yield prefill_hosts, decode_hosts


@pytest.fixture(scope="session")
def assert_close():
    """The one comparison helper: ``assert_close(actual, expected, dtype)``."""
    return _assert_close


@pytest.fixture
def nan_empty(monkeypatch):
    """Make ``torch.empty``/``torch.empty_like`` fill floating tensors with NaN for one test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
