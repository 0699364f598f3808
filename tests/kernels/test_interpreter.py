"""The kernel tests' correction of Triton's interpreter (``tests/kernels/conftest.py``)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder


@triton.jit
def _dot_kernel(p_a, p_b, p_out):
    o = tl.arange(0, 16)
    b_a = tl.load(p_a + o[:, None] * 16 + o[None, :])
    b_b = tl.load(p_b + o[:, None] * 16 + o[None, :])
    tl.store(p_out + o[:, None] * 16 + o[None, :], tl.dot(b_a, b_b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interpreter_bf16_dot_is_corrected(dtype, interpreter_bf16_dot, monkeypatch):
    if not isinstance(_dot_kernel, InterpretedFunction):
        pytest.skip("kernels are compiled (CUDA): the interpreter is not used")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 16, generator=gen).to(dtype)
    want = a.double() @ b.double()
    out = torch.zeros(16, 16)
    _dot_kernel[(1,)](a, b, out)
    assert (out.double() - want).abs().max() < 1e-4  # fp32 accumulation of exact products

    # Without the correction, bf16 is wrong (raw bit patterns multiplied); others are unchanged.
    monkeypatch.setattr(InterpreterBuilder, "create_dot", interpreter_bf16_dot)
    out.zero_()
    _dot_kernel[(1,)](a, b, out)
    wrong = (out.double() - want).abs().max() > 1.0
    assert wrong == (dtype == torch.bfloat16)
