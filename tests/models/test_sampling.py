"""sample(): greedy, temperature, top-p; deterministic with a seeded generator."""

from __future__ import annotations

import math

import pytest
import torch

from statebridge.errors import ConfigError, ShapeError
from statebridge.models import greedy, sample


def _logits(rows: int = 64, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_greedy():
    logits = _logits()
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert torch.equal(sample(logits, 0.0, 0.5, torch.Generator().manual_seed(1)),
                       logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 5e-6])
def test_a_temperature_below_the_minimum_is_greedy_not_nan(temperature):
    """Logits / 1e-40 overflow float32 (NaN probabilities, an arbitrary token); below
    MIN_TEMPERATURE a row is greedy."""
    logits = _logits(rows=32) + 100.0
    got = sample(logits, temperature, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(got, logits.argmax(-1))


def test_ties_take_the_first_index_like_transformers():
    assert greedy(torch.tensor([[1.0, 3.0, 3.0, 0.0]])).tolist() == [1]


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = _logits(rows=256)
    a = sample(logits, 1.0, 0.9, torch.Generator().manual_seed(7))
    b = sample(logits, 1.0, 0.9, torch.Generator().manual_seed(7))
    c = sample(logits, 1.0, 0.9, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(20000, 3)
    tokens = sample(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    assert torch.allclose(freq, probs, atol=0.02), freq
    # temperature 2 flattens: p^(1/2) renormalised
    flat = probs.sqrt() / probs.sqrt().sum()
    tokens = sample(logits, 2.0, 1.0, torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    assert torch.allclose(freq, flat, atol=0.02), freq


@pytest.mark.parametrize("top_p,allowed", [(0.4, {0}), (0.5, {0}), (0.6, {0, 1}),
                                           (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    tokens = sample(logits, 1.0, top_p, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == allowed


def test_per_row_parameters():
    logits = _logits(rows=3)
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits, [0.0, 1.0, 0.0], [1.0, 0.5, 0.1], gen)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(temperature=-0.5), ConfigError, "temperature"),
    (dict(temperature=math.nan), ConfigError, "temperature"),
    (dict(temperature=1.0, top_p=0.0), ConfigError, "top_p"),
    (dict(temperature=1.0, top_p=1.5), ConfigError, "top_p"),
    (dict(temperature=[1.0, 1.0]), ShapeError, "temperature has 2 values for 4 rows"),
])
def test_bad_parameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        sample(_logits(rows=4), **kwargs)


def test_bad_logits():
    with pytest.raises(ShapeError, match="logits"):
        sample(torch.zeros(5))
    with pytest.raises(ShapeError, match="logits"):
        greedy(torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("k", [0, 1, 5, 20], ids=lambda k: f"k{k}")
def test_token_logprobs_are_the_raw_log_softmax_and_its_top_k(k):
    from statebridge.models.sampling import token_logprobs

    row = [0.5, -1.25, 3.0, 3.0, 0.0, 2.0] + [-4.0] * 30
    norm = math.log(sum(math.exp(v) for v in row))
    expected = [v - norm for v in row]
    chosen, ids, values = token_logprobs(torch.tensor([row]), 5, k)
    assert chosen == pytest.approx(expected[5], abs=1e-6)
    # Most likely first; the tie (ids 2 and 3) keeps the lower id first.
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    assert list(ids) == order
    assert list(values) == pytest.approx([expected[i] for i in order], abs=1e-6)


@pytest.mark.parametrize("k, token, error", [(21, 0, ConfigError), (-1, 0, ConfigError),
                                             (True, 0, ConfigError), (2, 36, ShapeError)],
                         ids=["over-the-cap", "negative", "bool", "token-outside"])
def test_token_logprobs_refuse_bad_values(k, token, error):
    from statebridge.models.sampling import token_logprobs

    with pytest.raises(error, match=str(k) if error is ConfigError else "36"):
        token_logprobs(torch.zeros(1, 36), token, k)
