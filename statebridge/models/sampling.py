"""Next-token sampling from ``[B, V]`` logits: greedy, temperature, nucleus (top-p).

Deterministic given a ``torch.Generator``: a sample is ``argmax(p / e)`` with ``e ~ Exp(1)``
drawn from the generator (the exponential race, equivalent to sampling from ``p``), so the same
seed and logits give the same tokens. Rows with a temperature below :data:`MIN_TEMPERATURE`
(0 included) are greedy and draw nothing: dividing logits by a smaller one overflows float32.

:func:`sampling_problem` is the one check of a request's sampling values, used by every front
door of the decode node before a request is admitted: the values are checked as the sampler
uses them (float32), so a value that passes can never fail a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import math
import struct

import torch

from statebridge.errors import ConfigError, ShapeError

__all__ = ["sample", "greedy", "sampling_problem", "token_logprobs", "MIN_TEMPERATURE",
           "MAX_TEMPERATURE", "MAX_LOGPROBS", "SEED_MIN", "SEED_END"]

#: Temperatures below this sample greedily (vLLM's threshold too).
MIN_TEMPERATURE = 1e-5
#: The highest temperature a request may ask for (OpenAI's limit).
MAX_TEMPERATURE = 2.0
#: The most top log-probabilities a request may ask for per token (vLLM's default
#: ``max_logprobs``; OpenAI's chat API allows 20 too).
MAX_LOGPROBS = 20
#: A request's seed is a signed 64-bit integer: ``SEED_MIN <= seed < SEED_END``.
SEED_MIN, SEED_END = -(1 << 63), 1 << 63


def _float32(value: float) -> float:
    """``value`` rounded to float32 (inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def sampling_problem(temperature: float, top_p: float, seed: int) -> tuple[str, str] | None:
    """``(parameter, why)`` when a request's sampling values cannot be used, else None.

    ``temperature``: a number in ``[0, MAX_TEMPERATURE]`` (below ``MIN_TEMPERATURE``: greedy).
    ``top_p``: in ``(0, 1]`` both as given and in float32, the sampler's dtype (``1e-300`` is
    0 there). ``seed``: an integer in ``[SEED_MIN, SEED_END)``. Pure Python, no tensors."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature <= MAX_TEMPERATURE:
        return "temperature", f"temperature={temperature!r} is not in [0, {MAX_TEMPERATURE}]"
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        return "top_p", f"top_p={top_p!r} is not in (0, 1]"
    if not _float32(top_p) > 0:
        return "top_p", (f"top_p={top_p!r} is 0 in float32, the sampler's dtype (the smallest "
                         f"top_p is about 1.4e-45)")
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed < SEED_END:
        return "seed", f"seed={seed!r} is not a signed 64-bit integer"
    return None


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
        temperature: ``>= 0``, one for all rows or one per row; below ``MIN_TEMPERATURE``
            (0 included) means greedy.
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
    hot = (temps >= MIN_TEMPERATURE).nonzero().flatten()
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


def token_logprobs(logits: torch.Tensor, token: int,
                   k: int) -> tuple[float, tuple[int, ...], tuple[float, ...]]:
    """The log-probability of ``token`` and the ``k`` most likely tokens with theirs, from one
    row's ``[1, V]`` (or ``[V]``) logits: the model's raw distribution, before temperature
    and top-p (vLLM's default, ``raw_logprobs``), in float32. Ties keep the lower id first
    (so the top-1 of a greedy row is its token). ``0 <= k <= MAX_LOGPROBS``."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise ConfigError(f"top logprobs k={k!r} is not in [0, {MAX_LOGPROBS}]")
    row = logits.reshape(-1).float()
    if not 0 <= token < row.numel():
        raise ShapeError(f"token {token} is outside the {row.numel()} logits")
    logp = torch.log_softmax(row, dim=-1)
    chosen = float(logp[token])
    if not k:
        return chosen, (), ()
    # (topk's choice and order among equal values are unspecified: every id at least as
    # likely as the k-th, in id order, stably sorted by value gives a defined one.)
    kth = torch.topk(logp, min(row.numel(), k)).values[-1]
    candidates = (logp >= kth).nonzero().flatten()
    values, order = torch.sort(logp[candidates], descending=True, stable=True)
    ids = candidates[order[:k]]
    return chosen, tuple(ids.tolist()), tuple(values[:k].tolist())
