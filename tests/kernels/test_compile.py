"""Every Triton kernel variant the wrappers launch compiles for sm_90 (H100 / H200), and each
kernel's first variant for sm_80 (A100), on this machine.

The CPU tests run the kernels under Triton's interpreter, which accepts code that Triton's
compiler rejects; a GPU user would be the first to find out. The variants come from the
launchers the wrappers launch through (``statebridge/kernels/_launch.py``), so this cannot
drift from the runtime: a wrapper that launches an undeclared variant fails its own tests
(``test_undeclared_launch_is_refused``).

The compile runs in two worker processes without ``TRITON_INTERPRET`` (the kernels must be real
``JITFunction`` objects when they are decorated) and with an empty Triton cache, so every
variant is compiled for real.
"""

from __future__ import annotations

import json

import pytest
import torch

import statebridge.kernels  # noqa: F401  (declares every launcher)
from statebridge.errors import ConfigError
from statebridge.kernels._launch import all_pairs, iter_variants, launchers

from . import _background_compile

#: Compiled for every variant (ARCHS) and for the first variant of each launcher (SAMPLED:
#: the variants differ in dtypes and constexprs, which sm_90 covers; ``compile_check --arch
#: 90 80`` builds them all).
ARCHS = _background_compile.ARCHS
SAMPLED = _background_compile.SAMPLED


def test_every_kernel_has_a_launcher_and_variants():
    names = {launcher.name for launcher in launchers()}
    assert {
        "causal_conv1d.fwd",
        "causal_conv1d.update",
        "ssm.selective_state_update",
        "ssm.scan_chunk_state",
        "ssm.scan_state_passing",
        "ssm.scan_chunk_scan",
        "attention.decode_split",
        "attention.decode_combine",
        "attention.prefill_varlen",
        "pack.copy_runs",
    } <= names
    for launcher in launchers():
        variants = launcher.variants()
        combos = 1
        for values in launcher.constexprs.values():
            combos *= len(values)
        # every constexpr combination is in the enumeration
        seen = {tuple(v.constexprs.values()) for v in variants}
        assert len(seen) == combos, launcher.name
        # every pair of dtypes of two pointer groups is in it too
        groups = [names for names, _ in launcher.groups]
        rows = {tuple(v.signature[names[0]] for names in groups) for v in variants}
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                pairs = {(r[i], r[j]) for r in rows}
                assert len(pairs) == len(launcher.groups[i][1]) * len(launcher.groups[j][1]), (launcher.name, i, j)


def test_all_pairs_covers_every_pair_and_is_small():
    params = [(0, 1, 2)] * 4 + [("a", "b")] * 2
    rows = all_pairs(params)
    for i in range(len(params)):
        for j in range(i + 1, len(params)):
            assert {(r[i], r[j]) for r in rows} == {(a, b) for a in params[i] for b in params[j]}
    assert len(rows) <= 15  # far below the 324 of the full product
    assert all_pairs([]) == [()]
    assert all_pairs([(1, 2)]) == [(1,), (2,)]


def test_undeclared_launch_is_refused():
    """A wrapper cannot launch a variant the compile check does not build."""
    from statebridge.kernels.causal_conv1d import _UPDATE

    x = torch.zeros(1, 4, 1)
    with pytest.raises(ConfigError, match="K=5 is not a declared variant"):
        _UPDATE((1, 1), *([x] * 6), *([1] * 14), K=5, HAS_BIAS=False, SILU=False, HAS_SLOTS=False,
                BLOCK_D=128, BLOCK_S=4)
    with pytest.raises(ConfigError, match="p_slots has dtype torch.float32"):
        _UPDATE((1, 1), *([x] * 6), *([1] * 14), K=4, HAS_BIAS=False, SILU=False, HAS_SLOTS=False,
                BLOCK_D=128, BLOCK_S=4)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about a minute on two cores; more on a loaded machine
def test_every_variant_compiles_for_sm90_and_every_kernel_for_sm80():
    # Started at session start in the background (tests/kernels/_background_compile.py); this
    # test runs last and collects the result.
    returncode, output, report = _background_compile.result(timeout=1200)
    assert report.exists(), output
    result = json.loads(report.read_text())
    failures = [f"{r['variant']} sm_{r['arch']}: {r['error']}" for r in result["rows"] if not r["ok"]]
    assert not result["worker_errors"], result["worker_errors"]
    assert not failures, "\n".join(failures)
    expected = {(v.label, arch) for v in iter_variants() for arch in ARCHS}
    first: dict[str, str] = {}
    for v in iter_variants():
        first.setdefault(v.launcher, v.label)
    expected |= {(label, arch) for label in first.values() for arch in SAMPLED}
    assert len(first) == len(launchers())
    assert {(r["variant"], r["arch"]) for r in result["rows"]} == expected
    assert returncode == 0, output
