"""Checks shared by the kernel wrappers: shapes, dtypes, devices, and where Triton may run.

Letter table used in every docstring of this package (the same as ``state/layout.py``):
B requests (or state slots), T tokens, L layers, D channels, K conv width, S state length
(``K - 1``), H heads, P head dim, N d_state, G groups, R byte runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import torch

from statebridge.errors import ConfigError, ShapeError

Provider = Literal["auto", "ref", "triton"]
PROVIDERS: tuple[str, ...] = ("auto", "ref", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "silu", "swish")

_Fn = TypeVar("_Fn", bound=Callable)


def reference_of(op: Callable) -> Callable[[_Fn], _Fn]:
    """Declare the decorated plain-torch function the reference of the Triton wrapper ``op``.

    A reference takes ``op``'s arguments, makes the same checks and returns the same result (the
    tests hold the two equal), so it takes ``op``'s docstring and annotations rather than
    repeating them; its parameters (names, kinds, defaults) must be ``op``'s, checked here.
    """

    def parameters(fn: Callable) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    def declare(ref: _Fn) -> _Fn:
        if parameters(ref) != parameters(op):
            raise TypeError(f"{ref.__qualname__} must take the parameters of {op.__qualname__}: "
                            f"{inspect.signature(op)}")
        ref.__doc__ = op.__doc__
        ref.__annotations__ = dict(op.__annotations__)
        return ref

    return declare


def check_provider(provider: str) -> str:
    """Return ``provider`` if it names a kernel provider, else raise :class:`ConfigError`."""
    if provider not in PROVIDERS:
        raise ConfigError(f"unknown kernel provider {provider!r}; expected one of {PROVIDERS}")
    return provider


def use_triton(provider: str, device: torch.device) -> bool:
    """Whether ``provider`` resolves to the Triton kernels for tensors on ``device``.

    ``auto`` picks Triton on CUDA and the torch references elsewhere.
    """
    check_provider(provider)
    if provider == "auto":
        return device.type == "cuda"
    return provider == "triton"


def check_activation(activation: str | None) -> bool:
    """Return whether ``activation`` asks for SiLU; raise :class:`ConfigError` if unknown."""
    if activation not in ACTIVATIONS:
        raise ConfigError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    return activation is not None


def check_dims(name: str, t: torch.Tensor, dims: int | Sequence[int]) -> None:
    """Raise :class:`ShapeError` unless ``t.dim()`` is one of ``dims``."""
    allowed = (dims,) if isinstance(dims, int) else tuple(dims)
    if t.dim() not in allowed:
        raise ShapeError(f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise :class:`ShapeError` unless ``t`` has ``shape`` (``None`` matches any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ShapeError(f"{name} must have shape {want}, got {list(t.shape)}")


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise :class:`ShapeError` unless ``t`` has a floating dtype the kernels support."""
    if t.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{name} must be one of {FLOAT_DTYPES}, got {t.dtype}")


def check_int(name: str, t: torch.Tensor) -> None:
    """Raise :class:`ShapeError` unless ``t`` has an int32 or int64 dtype."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"{name} must be int32 or int64, got {t.dtype}")


def check_slots(
    state_name: str, state: torch.Tensor, indices_name: str, indices: torch.Tensor | None, batch: int
) -> None:
    """Raise :class:`ShapeError` unless ``indices`` names a slot of ``state`` per request (``[B]``
    int32/int64), or is None and ``state`` has a slot for each request (request b uses slot b)."""
    if indices is None:
        if state.shape[0] < batch:
            raise ShapeError(
                f"without {indices_name} request b uses slot b, so {state_name} needs >= {batch} slots, "
                f"got {list(state.shape)}"
            )
    else:
        check_int(indices_name, indices)
        check_shape(indices_name, indices, (batch,))


def check_varlen(
    query_start_loc: torch.Tensor, slots_name: str, slots: torch.Tensor, has_initial_state: torch.Tensor
) -> int:
    """Check the index tensors of packed sequences on state slots; return their number B.

    ``query_start_loc`` ``[B + 1]`` and ``slots`` ``[B]`` int32/int64, ``has_initial_state``
    ``[B]`` bool."""
    check_dims(slots_name, slots, 1)
    batch = slots.shape[0]
    check_int("query_start_loc", query_start_loc)
    check_shape("query_start_loc", query_start_loc, (batch + 1,))
    check_int(slots_name, slots)
    check_shape("has_initial_state", has_initial_state, (batch,))
    if has_initial_state.dtype != torch.bool:
        raise ShapeError(f"has_initial_state must be bool, got {has_initial_state.dtype}")
    return batch


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """Return the one device of the given tensors; raise :class:`ShapeError` if they differ."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ShapeError(f"tensors must be on one device, got {devices}")
    return next(iter(devices.values()))


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()
