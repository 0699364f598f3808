"""The test-suite helpers themselves: interpreter mode, NaN-filled empties, assert_close."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

# (import_module: the package's ``pack`` attribute is the function, which shadows the module)
_conv = importlib.import_module("statebridge.kernels.causal_conv1d")
_ssm = importlib.import_module("statebridge.kernels.ssm")
_ssd = importlib.import_module("statebridge.kernels.ssd")
_pack = importlib.import_module("statebridge.kernels.pack")
_attn = importlib.import_module("statebridge.kernels.attention")
from statebridge.kernels._launch import launchers  # noqa: E402

KERNELS = [launcher.kernel for launcher in launchers()]
assert len(KERNELS) >= 10 and _conv and _ssm and _ssd and _pack and _attn


def test_kernels_are_interpreted_exactly_when_there_is_no_cuda():
    # TRITON_INTERPRET is read at decoration time: conftest must have set it before the import.
    interpreted = [isinstance(kernel, InterpretedFunction) for kernel in KERNELS]
    if torch.cuda.is_available():
        assert interpreted == [os.environ.get("TRITON_INTERPRET") == "1"] * len(KERNELS)
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert all(interpreted), interpreted


def test_nan_empty_fills_floats_with_nan(nan_empty):
    assert torch.isnan(torch.empty(3, 4)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(2, dtype=torch.bfloat16))).all()
    assert torch.empty(5, dtype=torch.int32).shape == (5,)  # integers are left alone


def test_assert_close_pairs_tolerances_with_dtypes(assert_close):
    e = torch.ones(4)
    assert_close(e + 1e-6, e, torch.float32)
    with pytest.raises(AssertionError):
        assert_close(e + 1e-3, e, torch.float32)
    assert_close(e + 1e-3, e, torch.bfloat16)  # inside bf16 tolerance
    with pytest.raises(AssertionError):
        assert_close(e + 0.1, e, torch.bfloat16)


def test_assert_close_fails_on_nan_inf_shape_and_exact_dtypes(assert_close):
    e = torch.zeros(3)
    for bad in (torch.tensor([0.0, float("nan"), 0.0]), torch.tensor([0.0, 0.0, float("inf")])):
        with pytest.raises(AssertionError, match="non-finite"):
            assert_close(bad, e, torch.float32)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.full((3,), float("nan")), torch.full((3,), float("nan")), torch.float32)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.zeros(1, 3), e, torch.float32)
    with pytest.raises(AssertionError, match="differ exactly"):
        assert_close(torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([1, 3], dtype=torch.uint8), torch.uint8)
