"""Mixers vs Hugging Face transformers (the oracle), at TP=1 and summed over TP=2/4 ranks.

HF runs one sequence at a time (batch 1, its torch path on CPU) with a ``DynamicCache`` built
from the config; the cache keeps ``K`` conv columns per channel where we keep ``S = K - 1``, so
our state is compared with HF's last K-1 columns. Each TP rank's state must equal its channel
(or head) slice of the TP=1 state; replicated Mamba2 B/C (n_groups == 1) are the full group.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Lfm2Config, Mamba2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

from statebridge.errors import ConfigError
from statebridge.hf_config import ModelConfig
from statebridge.kernels import registry
from statebridge.kernels.layers import Mamba2Mixer, ShortConvMixer
from statebridge.models.tp import mamba2_from_hf, short_conv_from_hf

from .helpers import ThreadGroup, conv_region, qsl_of, ssm_region

pytestmark = pytest.mark.usefixtures("nan_empty")

F32 = torch.float32
NUM_PAGES, LAYERS, LAYER = 6, 2, 1
LENS = [5, 1, 3]  # one sequence shorter than K - 1
SLOTS = torch.tensor([3, 0, 5], dtype=torch.int32)


def ours(config):
    """transformers' config object as statebridge reads it (its config.json dict)."""
    return ModelConfig.from_dict(config.to_dict())


def hf_run(module, config, seqs, next_tokens):
    """Per sequence: HF prefill then one decode step. Returns prefill outputs (packed ``[T, h]``),
    decode outputs ``[B, h]``, and the cache states after prefill and after decode."""
    outs, dec, after_prefill, after_decode = [], [], [], []
    with torch.no_grad():
        for seq, nxt in zip(seqs, next_tokens):
            cache = DynamicCache(config=config)
            outs.append(module(seq[None], cache=cache)[0])
            after_prefill.append(_snapshot(cache))
            dec.append(module(nxt[None, None], cache=cache)[0, 0])
            after_decode.append(_snapshot(cache))
    return torch.cat(outs), torch.stack(dec), after_prefill, after_decode


def _snapshot(cache):
    conv = cache.get_conv_state(0)[0, :, 1:].clone()  # HF keeps K columns; the state is the last K-1
    ssm = cache.get_recurrent_state(0)
    return conv, None if ssm is None else ssm[0].clone()


def _inputs(hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, hidden, generator=gen) for n in LENS]
    next_tokens = torch.randn(len(LENS), hidden, generator=gen)
    return seqs, next_tokens


# --------------------------------------------------------------------------- ShortConv

# (id, hidden, K, bias, tp_size, conv layout, provider)
SHORT_CONV_CASES = [
    ("k3-tp1-lsd-ref", 12, 3, False, 1, "LSD", "ref"),
    ("k3-bias-tp1-dls-triton", 12, 3, True, 1, "DLS", "triton"),
    ("k4-bias-tp2-lds-triton", 16, 4, True, 2, "LDS", "triton"),
    ("k2-tp4-lsd-ref", 16, 2, False, 4, "LSD", "ref"),
    ("k3-bias-tp4-dls-triton", 16, 3, True, 4, "DLS", "triton"),
]


@pytest.mark.parametrize("case", SHORT_CONV_CASES, ids=[c[0] for c in SHORT_CONV_CASES])
def test_short_conv_matches_hf(case, assert_close):
    _, hidden, width, bias, tp, layout, provider = case
    config = Lfm2Config(
        hidden_size=hidden, conv_L_cache=width, conv_bias=bias, num_hidden_layers=1, layer_types=["conv"],
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=16, vocab_size=32,
    )
    torch.manual_seed(10)
    hf = Lfm2ShortConv(config, layer_idx=0).eval()
    seqs, next_tokens = _inputs(hidden, seed=11)
    want_out, want_dec, want_state, want_state_dec = hf_run(hf, config, seqs, next_tokens)

    d_local = hidden // tp
    got_out = torch.zeros_like(want_out)
    got_dec = torch.zeros_like(want_dec)
    for rank in range(tp):
        mixer = short_conv_from_hf(
            ours(config), hf.state_dict(), tp, rank, provider=provider, cls=registry.get("short_conv")
        )
        _, views = conv_region(layout, NUM_PAGES, LAYERS, d_local, width - 1, F32, seed=rank)
        conv = views[LAYER]
        conv[SLOTS.long()] = float("nan")  # fresh requests: the old contents must not be read
        with torch.no_grad():
            got_out += mixer.prefill(torch.cat(seqs), conv, qsl_of(LENS), SLOTS, torch.zeros(3, dtype=torch.bool))
            channels = slice(rank * d_local, (rank + 1) * d_local)
            for i, slot in enumerate(SLOTS.tolist()):
                assert_close(conv[slot], want_state[i][0][channels], F32)
            got_dec += mixer.decode(next_tokens, conv, SLOTS)
            for i, slot in enumerate(SLOTS.tolist()):
                assert_close(conv[slot], want_state_dec[i][0][channels], F32)
    # the sum of the per-rank partial outputs is what the all-reduce would produce
    assert_close(got_out, want_out, F32)
    assert_close(got_dec, want_dec, F32)


# --------------------------------------------------------------------------- Mamba2


def mamba2_config(hidden, heads, head_dim, groups, d_state, width, chunk, use_bias, conv_bias):
    return Mamba2Config(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim, expand=heads * head_dim // hidden, n_groups=groups,
        state_size=d_state, conv_kernel=width, chunk_size=chunk, use_bias=use_bias, use_conv_bias=conv_bias,
        num_hidden_layers=1, vocab_size=32, layer_norm_epsilon=1e-5,
    )


def hf_mamba2(config, seed):
    torch.manual_seed(seed)
    hf = HFMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():  # make every per-head parameter distinct so a wrong head slice shows
        heads = config.num_heads
        hf.A_log.copy_(torch.log(torch.linspace(0.5, 3.0, heads)))
        hf.D.copy_(torch.randn(heads))
        hf.dt_bias.copy_(torch.randn(heads) * 0.5)
        hf.norm.weight.copy_(1 + 0.2 * torch.randn(hf.norm.weight.shape))
    return hf


def conv_slices(config, tp, rank):
    """Global conv channels of rank r, in its local order [x_r | B_r | C_r]."""
    inner = config.hidden_size * config.expand
    gn = config.n_groups * config.state_size
    x = torch.arange(rank * inner // tp, (rank + 1) * inner // tp)
    if config.n_groups == 1 and tp > 1:
        b = torch.arange(inner, inner + gn)
    else:
        b = torch.arange(inner + rank * gn // tp, inner + (rank + 1) * gn // tp)
    return torch.cat([x, b, b + gn])


# (id, hidden, H, P, G, N, K, chunk, use_bias, conv_bias, tp, conv layout, ssm layout, provider)
MAMBA2_CASES = [
    ("g2-tp1-lsd-lhpn-ref", 8, 4, 4, 2, 3, 4, 4, True, True, 1, "LSD", "LHPN", "ref"),
    ("g2-tp1-dls-hlpn-triton", 8, 4, 4, 2, 3, 4, 4, False, True, 1, "DLS", "HLPN", "triton"),
    ("g1-tp1-lds-lhpn-triton", 8, 4, 4, 1, 3, 3, 2, True, False, 1, "LDS", "LHPN", "triton"),
    ("g1-replicated-bc-tp2-lds-lhpn-ref", 8, 8, 2, 1, 3, 4, 4, True, True, 2, "LDS", "LHPN", "ref"),
    ("g2-split-bc-tp2-dls-hlpn-triton", 8, 8, 2, 2, 3, 4, 4, False, True, 2, "DLS", "HLPN", "triton"),
    ("g1-replicated-bc-tp4-dls-hlpn-ref", 8, 8, 2, 1, 3, 4, 4, False, True, 4, "DLS", "HLPN", "ref"),
    ("g4-split-bc-tp4-lsd-lhpn-ref", 8, 8, 2, 4, 3, 2, 4, True, False, 4, "LSD", "LHPN", "ref"),
]


@pytest.mark.parametrize("case", MAMBA2_CASES, ids=[c[0] for c in MAMBA2_CASES])
def test_mamba2_matches_hf(case, assert_close):
    _, hidden, heads, hd, groups, n, width, chunk, use_bias, conv_bias, tp, conv_layout, ssm_layout, provider = case
    config = mamba2_config(hidden, heads, hd, groups, n, width, chunk, use_bias, conv_bias)
    hf = hf_mamba2(config, seed=20)
    seqs, next_tokens = _inputs(hidden, seed=21)
    want_out, want_dec, want_state, want_state_dec = hf_run(hf, config, seqs, next_tokens)

    needs_all_reduce = groups == 1 and tp > 1
    group = ThreadGroup(tp)
    h_local = heads // tp

    def rank_run(rank):
        mixer = mamba2_from_hf(
            ours(config), hf.state_dict(), tp, rank, provider=provider,
            all_reduce=group.all_reduce(rank) if needs_all_reduce else None,
        )
        _, conv_views = conv_region(conv_layout, NUM_PAGES, LAYERS, mixer.conv_dim_local, width - 1, F32, seed=rank)
        _, ssm_views = ssm_region(ssm_layout, NUM_PAGES, LAYERS, h_local, hd, n, F32, seed=rank + 7)
        conv, ssm = conv_views[LAYER], ssm_views[LAYER]
        conv[SLOTS.long()] = float("nan")
        ssm[SLOTS.long()] = float("nan")
        with torch.no_grad():
            out = mixer.prefill(torch.cat(seqs), conv, ssm, qsl_of(LENS), SLOTS, torch.zeros(3, dtype=torch.bool))
            states = (conv[SLOTS.long()].clone(), ssm[SLOTS.long()].clone())
            dec = mixer.decode(next_tokens, conv, ssm, SLOTS)
            states_dec = (conv[SLOTS.long()].clone(), ssm[SLOTS.long()].clone())
        return out, dec, states, states_dec

    if needs_all_reduce:
        assert provider == "ref"  # the Triton interpreter is not thread-safe
        results = group.run(rank_run)
    else:
        results = [rank_run(r) for r in range(tp)]

    assert_close(sum(r[0] for r in results), want_out, F32)
    assert_close(sum(r[1] for r in results), want_dec, F32)
    for rank, (_, _, states, states_dec) in enumerate(results):
        chans = conv_slices(config, tp, rank)
        head_range = slice(rank * h_local, (rank + 1) * h_local)
        for i in range(len(LENS)):
            assert_close(states[0][i], want_state[i][0][chans], F32)
            assert_close(states[1][i], want_state[i][1][head_range], F32)
            assert_close(states_dec[0][i], want_state_dec[i][0][chans], F32)
            assert_close(states_dec[1][i], want_state_dec[i][1][head_range], F32)


@pytest.mark.parametrize("provider", ["ref", "triton"])
def test_mamba2_prefill_in_two_calls_matches_hf(provider, assert_close):
    """A prompt prefilled in two calls (the second continues from the state the first wrote,
    has_initial_state=True) equals HF's single prefill, output and state."""
    config = mamba2_config(8, 4, 4, 2, 3, 4, 4, False, True)
    hf = hf_mamba2(config, seed=30)
    gen = torch.Generator().manual_seed(31)
    prompt = torch.randn(11, 8, generator=gen)
    want_out, _, want_state, _ = hf_run(hf, config, [prompt], torch.zeros(1, 8))

    mixer = mamba2_from_hf(ours(config), hf.state_dict(), provider=provider)
    _, conv_views = conv_region("LSD", NUM_PAGES, LAYERS, mixer.conv_dim_local, 3, F32)
    _, ssm_views = ssm_region("HLPN", NUM_PAGES, LAYERS, 4, 4, 3, F32)
    conv, ssm = conv_views[0], ssm_views[0]
    slot = torch.tensor([2], dtype=torch.int32)
    with torch.no_grad():
        first = mixer.prefill(prompt[:6], conv, ssm, qsl_of([6]), slot, torch.tensor([False]))
        second = mixer.prefill(prompt[6:], conv, ssm, qsl_of([5]), slot, torch.tensor([True]))
    assert_close(torch.cat([first, second]), want_out, F32)
    assert_close(conv[2], want_state[0][0], F32)
    assert_close(ssm[2], want_state[0][1], F32)


# --------------------------------------------------------------------------- config errors, registry


def test_mamba2_rejects_unshardable_groups_and_missing_all_reduce():
    config = mamba2_config(8, 8, 2, 2, 3, 4, 4, False, True)
    hf = hf_mamba2(config, seed=40)
    with pytest.raises(ConfigError, match="n_groups 2 is neither divisible by TP size 4 nor 1"):
        mamba2_from_hf(ours(config), hf.state_dict(), 4, 0)
    config1 = mamba2_config(8, 8, 2, 1, 3, 4, 4, False, True)
    hf1 = hf_mamba2(config1, seed=41)
    with pytest.raises(ConfigError, match="all_reduce"):
        mamba2_from_hf(ours(config1), hf1.state_dict(), 2, 1)
    with pytest.raises(ConfigError, match=r"TP rank must be in \[0, 2\), got 2"):
        mamba2_from_hf(ours(config), hf.state_dict(), 2, 2)


def test_short_conv_rejects_unknown_provider():
    config = Lfm2Config(hidden_size=8, conv_L_cache=3, num_hidden_layers=1, layer_types=["conv"],
                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=16, vocab_size=32)
    hf = Lfm2ShortConv(config, layer_idx=0)
    with pytest.raises(ConfigError, match="'cuda-graph'"):
        short_conv_from_hf(ours(config), hf.state_dict(), provider="cuda-graph")
    with pytest.raises(ConfigError, match="'B': size 8 is not divisible by TP size 3"):
        short_conv_from_hf(ours(config), hf.state_dict(), 3, 0)
    with pytest.raises(ConfigError, match="expected a Lfm2ModelConfig"):
        short_conv_from_hf(config.to_dict(), hf.state_dict())


def test_registry_names_swaps_and_rejects_unknown():
    assert registry.get("short_conv") is ShortConvMixer
    assert registry.get("mamba2") is Mamba2Mixer
    with pytest.raises(ConfigError, match="'gdn'"):
        registry.get("gdn")
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("mamba2", object())

    class Custom(ShortConvMixer):
        pass

    registry.register("short_conv", Custom, replace=True)
    try:
        assert registry.get("short_conv") is Custom
        config = Lfm2Config(hidden_size=8, num_hidden_layers=1, layer_types=["conv"], vocab_size=32)
        weights = Lfm2ShortConv(config, layer_idx=0).state_dict()
        assert type(short_conv_from_hf(ours(config), weights, cls=registry.get("short_conv"))) is Custom
    finally:
        registry.register("short_conv", ShortConvMixer, replace=True)
    assert registry.get("short_conv") is ShortConvMixer
