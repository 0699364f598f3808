"""Next-token sampling from ``[B, V]`` logits: greedy, temperature, nucleus (top-p).

Deterministic given a ``torch.Generator``: a sample is ``argmax(p / e)`` with ``e ~ Exp(1)``
drawn from the generator (the exponential race, equivalent to sampling from ``p``), so the same
seed and logits give the same tokens. Rows with temperature 0 are greedy and draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from statebridge.errors import ConfigError, ShapeError

__all__ = ["sample", "greedy"]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 argmax of ``[B, V]`` logits (the first index on ties, like transformers)."""
    _check_logits(logits)
    return logits.argmax(dim=-1)


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 \
            or not logits.is_floating_point():
        raise ShapeError(f"logits must be a floating [B, V] tensor, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")


def _per_row(value: float | Sequence[float] | torch.Tensor, rows: int, name: str,
             device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32).flatten()
    if t.numel() == 1:
        t = t.expand(rows)
    if t.numel() != rows:
        raise ShapeError(f"{name} has {t.numel()} values for {rows} rows")
    return t.to(device)


def sample(logits: torch.Tensor, temperature: float | Sequence[float] | torch.Tensor = 0.0,
           top_p: float | Sequence[float] | torch.Tensor = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` floating logits.
        temperature: ``>= 0``, one for all rows or one per row; 0 means greedy.
        top_p: in ``(0, 1]``, one or per row: keep the smallest set of most likely tokens whose
            probability reaches ``top_p`` (always at least the most likely one).
        generator: source of randomness (on the logits' device); None uses torch's global one.

    Returns ``[B]`` int64 token ids.
    """
    _check_logits(logits)
    rows = logits.shape[0]
    temps = _per_row(temperature, rows, "temperature", logits.device)
    ps = _per_row(top_p, rows, "top_p", logits.device)
    if bool(torch.isnan(temps).any()) or bool((temps < 0).any()):
        raise ConfigError(f"temperature must be >= 0, got {temperature!r}")
    if bool(torch.isnan(ps).any()) or bool((ps <= 0).any()) or bool((ps > 1).any()):
        raise ConfigError(f"top_p must be in (0, 1], got {top_p!r}")
    out = logits.argmax(dim=-1)
    hot = (temps > 0).nonzero().flatten()
    if hot.numel() == 0:
        return out
    scaled = logits[hot].float() / temps[hot, None]
    probs = torch.softmax(scaled, dim=-1)
    p = ps[hot]
    if bool((p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = before >= p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    out[hot] = (probs / race).argmax(dim=-1)
    return out
