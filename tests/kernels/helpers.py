"""Shared helpers of the kernel tests: page regions in every layout, and naive computations.

The naive functions are deliberately the slowest obvious way (per-token Python loops on tiny
shapes); they share no code with ``statebridge.kernels`` and are the independent oracle for the
torch references.
"""

from __future__ import annotations

import threading

import torch

CONV_LAYOUTS = ("LSD", "LDS", "DLS")
SSM_LAYOUTS = ("LHPN", "HLPN")

# Elements before the region in each page and after it (e.g. another state tensor, padding):
# the views never start at a page boundary and the page stride is not the region size.
REGION_OFFSET = 3
PAGE_PAD = 5


def _page_buffer(num_pages: int, region_shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    numel = 1
    for n in region_shape:
        numel *= n
    page = REGION_OFFSET + numel + PAGE_PAD
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(num_pages * page, generator=gen).to(dtype)
    strides = []
    acc = 1
    for n in reversed(region_shape):
        strides.append(acc)
        acc *= n
    region = flat.as_strided((num_pages, *region_shape), (page, *reversed(strides)), REGION_OFFSET)
    return flat, region


def conv_region(layout: str, num_pages: int, layers: int, dim: int, state_len: int, dtype: torch.dtype, seed: int = 0):
    """A flat page buffer and the per-layer conv views ``[num_pages, D, S]`` for ``layout``."""
    if layout == "LSD":
        flat, region = _page_buffer(num_pages, (layers, state_len, dim), dtype, seed)
        views = [region[:, l].transpose(-1, -2) for l in range(layers)]
    elif layout == "LDS":
        flat, region = _page_buffer(num_pages, (layers, dim, state_len), dtype, seed)
        views = [region[:, l] for l in range(layers)]
    elif layout == "DLS":
        flat, region = _page_buffer(num_pages, (dim, layers, state_len), dtype, seed)
        views = [region[:, :, l, :] for l in range(layers)]
    else:
        raise ValueError(layout)
    return flat, views


def ssm_region(
    layout: str, num_pages: int, layers: int, heads: int, head_dim: int, d_state: int, dtype: torch.dtype, seed: int = 0
):
    """A flat page buffer and the per-layer SSM views ``[num_pages, H, P, N]`` for ``layout``."""
    if layout == "LHPN":
        flat, region = _page_buffer(num_pages, (layers, heads, head_dim, d_state), dtype, seed)
        views = [region[:, l] for l in range(layers)]
    elif layout == "HLPN":
        flat, region = _page_buffer(num_pages, (heads, layers, head_dim, d_state), dtype, seed)
        views = [region[:, :, l] for l in range(layers)]
    else:
        raise ValueError(layout)
    return flat, views


def element_ids(flat: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Indices into ``flat`` of the elements of ``view`` (a strided view of ``flat``)."""
    ids = torch.arange(flat.numel())
    return ids.as_strided(view.shape, view.stride(), view.storage_offset() - flat.storage_offset()).reshape(-1)


def outside(flat: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``flat``'s elements that do not belong to ``view``."""
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    keep[element_ids(flat, view)] = False
    return flat[keep]


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous tensor (every other element of a wider one)."""
    wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    wide[..., ::2] = t
    wide[..., 1::2] = float("nan") if t.is_floating_point() else 0
    return wide[..., ::2]


def qsl_of(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


# ------------------------------------------------------------------ naive oracles


def naive_conv(xs: list[torch.Tensor], weight, bias, old_states: list[torch.Tensor | None], silu: bool):
    """Per-token causal conv. xs[i] ``[D, n_i]``, old_states[i] ``[D, S]`` or None (zeros).
    Returns (outputs ``[D, n_i]``, final states ``[D, S]``) in float64."""
    w = weight.double()
    dim, width = w.shape
    outs, finals = [], []
    for x, old in zip(xs, old_states):
        state_len = old.shape[1] if old is not None else width - 1
        if old is not None:
            hist = [old[:, s].double() for s in range(state_len)]
        else:
            hist = [torch.zeros(dim, dtype=torch.float64)] * state_len
        cols = []
        for t in range(x.shape[1]):
            hist = hist + [x[:, t].double()]
            acc = torch.zeros(dim, dtype=torch.float64) if bias is None else bias.double().clone()
            for k in range(width):
                acc = acc + w[:, k] * hist[len(hist) - width + k]
            cols.append(acc * torch.sigmoid(acc) if silu else acc)
        outs.append(torch.stack(cols, 1) if cols else torch.zeros(dim, 0, dtype=torch.float64))
        finals.append(torch.stack(hist[-state_len:], 1))
    return outs, finals


def naive_ssm(x, dt, A, B, C, D, z, state):
    """Per-token Mamba2 recurrence for one sequence, float64.
    x ``[T, H, P]``, dt ``[T, H]`` (final step sizes), A ``[H]``, B/C ``[T, G, N]``, D ``[H]``,
    ``[H, P]`` or None, z ``[T, H, P]`` or None, state ``[H, P, N]``. Returns (y ``[T, H, P]``, state)."""
    heads = x.shape[1]
    groups = B.shape[1]
    state = state.double().clone()
    ys = []
    for t in range(x.shape[0]):
        y_t = torch.zeros(x.shape[1:], dtype=torch.float64)
        for h in range(heads):
            g = h // (heads // groups)
            d = float(dt[t, h])
            state[h] = torch.exp(torch.tensor(d * float(A[h]), dtype=torch.float64)) * state[h] + d * torch.outer(
                x[t, h].double(), B[t, g].double()
            )
            y_t[h] = state[h] @ C[t, g].double()
            if D is not None:
                y_t[h] += D[h].double() * x[t, h].double()
            if z is not None:
                zz = z[t, h].double()
                y_t[h] = y_t[h] * zz * torch.sigmoid(zz)
        ys.append(y_t)
    if not ys:
        return torch.zeros(0, *x.shape[1:], dtype=torch.float64), state
    return torch.stack(ys), state


# ------------------------------------------------------------------ threads as TP ranks


class ThreadGroup:
    """Runs one function per TP rank in threads; ``all_reduce(rank)`` is a real barrier-based sum."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=120)
        self._slots: list[torch.Tensor | None] = [None] * size

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = t
            self._barrier.wait()
            total = self._slots[0].clone()
            for other in self._slots[1:]:
                total = total + other
            self._barrier.wait()  # nobody overwrites its slot before everyone has summed
            return total

        return reduce

    def run(self, fn):
        """``fn(rank)`` on every rank concurrently; returns the results in rank order."""
        results: list[object] = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # re-raised in the caller
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
