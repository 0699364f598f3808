"""Every Triton kernel variant the wrappers launch, declared in one place per kernel.

A :class:`Launcher` wraps one ``@triton.jit`` kernel together with the finite space of its
launches: one tuple of values per constexpr parameter, and one tuple of dtypes per group of
pointer parameters (the parameters of a group always get tensors of one dtype). The wrappers
launch only through their launcher, and every launch is checked against the space on the host
(dictionary look-ups on Python values; no device work, no synchronisation), so a wrapper cannot
launch a variant that is not declared: a change that adds one fails the interpreter tests at
once with :class:`~statebridge.errors.ConfigError`.

:meth:`Launcher.variants` enumerates the space for :mod:`statebridge.kernels.compile_check`,
which compiles each variant for ``sm_80`` and ``sm_90`` with Triton's compiler on any machine
(Triton's wheel ships ``ptxas``): the interpreter the CPU tests run under accepts code that the
compiler rejects. The enumeration holds EVERY combination of constexpr values, and every PAIR
of dtypes of two pointer groups (an all-pairs covering, e.g. bf16 activations with an fp32
state, and fp32 activations with a bf16 state): variant ``i`` takes constexpr combination
``i mod C`` and dtype row ``i mod R``, for ``max(C, R)`` variants. A dtype changes only the
element type of loads, stores and the operands of ``tl.dot``; the full product of dtypes would
multiply the compile time for little more.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from statebridge.errors import ConfigError

__all__ = ["Launcher", "Variant", "launchers", "FLOATS", "INDEX", "BOOLS", "VARLEN_SLOTS", "interpreted", "placeholder"]

FLOATS: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
INDEX: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
BOOLS: tuple[bool, ...] = (False, True)
#: The index arguments of a kernel over packed sequences on state slots: ``query_start_loc``,
#: the slot of each sequence and whether it has an initial state.
VARLEN_SLOTS: dict[str, tuple[torch.dtype, ...]] = {"p_qsl": INDEX, "p_slots": INDEX, "p_has_init": (torch.bool,)}

# torch dtype -> the element type Triton's signature strings use
_SIG = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.uint8: "u8",
    torch.bool: "i1",
}

_REGISTRY: dict[str, "Launcher"] = {}
_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor to pass for a pointer the kernel never reads (its flag is off), so
    the pointer keeps a declared dtype. Made once per device and dtype."""
    key = (torch.device(device), dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def launchers() -> tuple["Launcher", ...]:
    """Every launcher created so far (importing :mod:`statebridge.kernels` creates them all)."""
    return tuple(_REGISTRY.values())


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


@dataclass(frozen=True)
class Variant:
    """One compiled variant: what ``triton.compile(ASTSource(...))`` needs, by name."""

    launcher: str
    index: int
    signature: Mapping[str, str]
    constexprs: Mapping[str, object]

    @property
    def label(self) -> str:
        pointers = ",".join(f"{k}={v[1:]}" for k, v in self.signature.items() if v.startswith("*"))
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.launcher}[{flags}|{pointers}]"


class Launcher:
    """One Triton kernel and the declared space of its launches.

    Args:
        kernel: the ``@triton.jit`` function (interpreted or not).
        name: a unique name, ``module.kernel``.
        constexprs: every constexpr parameter -> the tuple of values the wrapper may pass.
        dtypes: a pointer parameter name, or a tuple of names that always share one dtype ->
            the tuple of dtypes they may have. Every pointer parameter is named once.
        floats: the scalar parameters that are floats (the other scalars are integers).
    """

    def __init__(
        self,
        kernel: object,
        *,
        name: str,
        constexprs: Mapping[str, Sequence[object]],
        dtypes: Mapping[str | tuple[str, ...], Sequence[torch.dtype]],
        floats: Sequence[str] = (),
    ) -> None:
        self.kernel = kernel
        self.name = name
        self.arg_names: tuple[str, ...] = tuple(kernel.arg_names)
        self.constexprs = {k: tuple(v) for k, v in constexprs.items()}
        self.groups: list[tuple[tuple[str, ...], tuple[torch.dtype, ...]]] = [
            ((k,) if isinstance(k, str) else tuple(k), tuple(v)) for k, v in dtypes.items()
        ]
        self.floats = tuple(floats)
        pointers = [n for names, _ in self.groups for n in names]
        unknown = [n for n in [*self.constexprs, *pointers, *self.floats] if n not in self.arg_names]
        if unknown or len(set(pointers)) != len(pointers):
            raise ConfigError(f"launcher {name}: parameters {unknown or pointers} do not match {self.arg_names}")
        self._position = {n: i for i, n in enumerate(self.arg_names)}
        self._runtime = [n for n in self.arg_names if n not in self.constexprs]
        self._allowed = {k: frozenset(v) for k, v in self.constexprs.items()}
        self._group_of = [(tuple(self._runtime.index(n) for n in names), frozenset(ds)) for names, ds in self.groups]
        if name in _REGISTRY:
            raise ConfigError(f"launcher {name} is declared twice")
        _REGISTRY[name] = self

    # -- launching ---------------------------------------------------------------------------
    def check_runnable(self, *tensors: torch.Tensor | None) -> None:
        """Raise :class:`ConfigError` when the kernel cannot run on the tensors' device.

        Compiled Triton kernels need CUDA tensors; on CPU they run only under
        ``TRITON_INTERPRET=1``, which Triton reads when the kernel is *decorated*, i.e. when
        this package is imported.
        """
        device = next(t.device for t in tensors if t is not None)
        if device.type != "cuda" and not interpreted(self.kernel):
            raise ConfigError(
                f"the Triton kernels need CUDA tensors, got tensors on {device}; use provider='ref' "
                "or set TRITON_INTERPRET=1 before statebridge.kernels is imported"
            )

    def __call__(self, grid: tuple[int, ...], *args: object, **constexprs: object) -> None:
        """``kernel[grid](*args, **constexprs)`` after checking the launch is declared."""
        if constexprs.keys() != self._allowed.keys():
            raise ConfigError(f"{self.name}: constexprs {sorted(constexprs)} are not {sorted(self._allowed)}")
        for key, value in constexprs.items():
            if value not in self._allowed[key]:
                raise ConfigError(
                    f"{self.name}: {key}={value!r} is not a declared variant {self.constexprs[key]}; declare it so "
                    "the compile check builds it"
                )
        if len(args) != len(self._runtime):
            raise ConfigError(f"{self.name}: {len(args)} runtime arguments, expected {len(self._runtime)}")
        for positions, allowed in self._group_of:
            first = args[positions[0]].dtype
            for p in positions:
                dtype = args[p].dtype
                if dtype not in allowed or dtype != first:
                    names = [self._runtime[q] for q in positions]
                    raise ConfigError(
                        f"{self.name}: {self._runtime[p]} has dtype {dtype}; the group {names} must share one "
                        f"declared dtype of {sorted(map(str, allowed))}"
                    )
        self._launch(grid, args, constexprs)

    def _launch(self, grid: tuple[int, ...], args: tuple[object, ...], constexprs: dict[str, object]) -> None:
        self.kernel[grid](*args, **constexprs)

    # -- the compile check -------------------------------------------------------------------
    def variants(self) -> list[Variant]:
        """Every constexpr combination, and every pair of dtypes of two pointer groups."""
        keys = list(self.constexprs)
        combos = list(itertools.product(*(self.constexprs[k] for k in keys))) or [()]
        rows = all_pairs([ds for _, ds in self.groups])
        out = []
        for i in range(max(len(combos), len(rows))):
            constexprs = dict(zip(keys, combos[i % len(combos)]))
            row = rows[i % len(rows)]
            dtypes = {n: row[g] for g, (names, _) in enumerate(self.groups) for n in names}
            out.append(Variant(self.name, i, self._signature(dtypes, constexprs), constexprs))
        return out

    def _signature(self, dtypes: Mapping[str, torch.dtype], constexprs: Mapping[str, object]) -> dict[str, str]:
        sig = {}
        for n in self.arg_names:
            if n in constexprs:
                sig[n] = "constexpr"
            elif n in dtypes:
                sig[n] = "*" + _SIG[dtypes[n]]
            else:
                sig[n] = "fp32" if n in self.floats else "i32"
        return sig


def all_pairs(params: Sequence[Sequence[object]]) -> list[tuple[object, ...]]:
    """Rows that hold every pair of values of every two parameters at least once (greedy:
    each row starts from the first uncovered pair and adds, parameter by parameter, the value
    that covers most uncovered pairs). Deterministic; ``[()]`` without parameters."""
    k = len(params)
    if k == 0:
        return [()]
    if k == 1:
        return [(v,) for v in params[0]]
    uncovered = {
        (i, a, j, b)
        for i in range(k)
        for j in range(i + 1, k)
        for a in range(len(params[i]))
        for b in range(len(params[j]))
    }
    rows = []
    while uncovered:
        i0, a0, j0, b0 = min(uncovered)
        row: dict[int, int] = {i0: a0, j0: b0}
        for p in range(k):
            if p in row:
                continue

            def gain(v: int) -> int:
                return sum(((q, row[q], p, v) if q < p else (p, v, q, row[q])) in uncovered for q in row)

            row[p] = max(range(len(params[p])), key=lambda v: (gain(v), -v))
        for i in range(k):
            for j in range(i + 1, k):
                uncovered.discard((i, row[i], j, row[j]))
        rows.append(tuple(params[p][row[p]] for p in range(k)))
    return rows


def iter_variants() -> Iterator[Variant]:
    """Every declared variant of every launcher, in a stable order."""
    for launcher in launchers():
        yield from launcher.variants()
