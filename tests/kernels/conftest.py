"""Kernel tests: make Triton's interpreter multiply bf16 blocks as a GPU does.

The interpreter holds bf16 blocks as their raw 16-bit patterns (numpy has no bf16) and its
``tl.dot`` multiplies those integers, so any bf16 ``tl.dot`` returns garbage on CPU (a GPU
multiplies the values with fp32 accumulation). The kernels use bf16 ``tl.dot`` on purpose (the
tensor cores), so the interpreter is corrected here, for the kernel tests only: bf16 operands
are widened to fp32 (exact) before the product. ``test_interpreter_bf16_dot_is_corrected``
checks both the bug and the correction, so a Triton release that fixes it shows up.
"""

from __future__ import annotations

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter

_original_create_dot = interpreter.InterpreterBuilder.create_dot


def _bf16_to_fp32(handle):
    bits = np.asarray(handle.data).astype(np.uint32) << 16
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16:
        a = _bf16_to_fp32(a)
    if b.dtype.scalar == tl.bfloat16:
        b = _bf16_to_fp32(b)
    return _original_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


@pytest.fixture(autouse=True, scope="session")
def interpreter_bf16_dot():
    """The correction above, for the whole kernel test session."""
    interpreter.InterpreterBuilder.create_dot = _create_dot
    yield _original_create_dot
    interpreter.InterpreterBuilder.create_dot = _original_create_dot
