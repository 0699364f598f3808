"""Attention (LFM2, Granite) and Granite's Mamba2 layer vs Hugging Face transformers' modules
(the oracle), at TP=1 and summed over TP=2/4 ranks, K and V in a real KV block pool.

HF runs one sequence at a time (batch 1) with a ``DynamicCache``: a prefill of the sequence,
then one decode step. Our side prefills the sequences as one varlen batch into scattered blocks
of a NaN-poisoned pool (any layout), then decodes one token per sequence through the block
tables. Each rank's K and V must equal its KV heads' slice of HF's cache (a replicated head,
``tp > num_kv_heads``, the one head the rank holds); the sum of the ranks' partial outputs is
what the all-reduce would produce.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GraniteMoeHybridConfig, Lfm2Config
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridAttention,
    GraniteMoeHybridMambaLayer,
    GraniteMoeHybridRotaryEmbedding,
)
from transformers.models.lfm2.modeling_lfm2 import Lfm2Attention, Lfm2RotaryEmbedding

from statebridge.hf_config import ModelConfig
from statebridge.models.tp import attention_from_hf, mamba2_from_hf
from statebridge.state.kv import BlockGeometry
from statebridge.state.sharding import kv_heads
from statebridge.state.spec import KVSpec

from .helpers import ThreadGroup, conv_region, qsl_of, ssm_region

pytestmark = pytest.mark.usefixtures("nan_empty")

F32 = torch.float32
BLOCK = 4
LENS = [5, 1, 4, 9]          # block+1, 1, block, several blocks (decode crosses 4 -> 5 and 9 -> 10)
NUM_BLOCKS = 16


def ours(config):
    return ModelConfig.from_dict(config.to_dict())


def _inputs(hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=gen) for n in LENS], \
        torch.randn(len(LENS), hidden, generator=gen)


def hf_attention_run(module, rotary, config, seqs, next_tokens):
    """Per sequence: HF prefill, then one decode step. Returns prefill outputs ``[T, h]``,
    decode outputs ``[B, h]`` and each sequence's cached K and V ``[Hkv, n + 1, P]``."""
    outs, dec, keys, values = [], [], [], []
    with torch.no_grad():
        for seq, nxt in zip(seqs, next_tokens):
            cache = DynamicCache(config=config)
            n = seq.shape[0]

            def run(x, start):
                pos = torch.arange(start, start + x.shape[0])[None]
                emb = rotary(x[None], pos) if rotary is not None else None
                return module(x[None], position_embeddings=emb, attention_mask=None,
                              cache=cache)[0][0]
            outs.append(run(seq, 0))
            dec.append(run(nxt[None], n)[0])
            keys.append(cache.layers[0].keys[0].clone())
            values.append(cache.layers[0].values[0].clone())
    return torch.cat(outs), torch.stack(dec), keys, values


def _tables():
    """Scattered, non-monotonic block tables covering each sequence plus its decode token."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    tables, at = [], 0
    for n in LENS:
        need = -(-(n + 1) // BLOCK)
        tables.append(order[at:at + need])
        at += need
    return tables


def run_ranks(config, hf_state, tp, layout, provider):
    """Every rank's (prefill partial, decode partial, K, V per sequence ``[Hkv_l, n + 1, P]``)."""
    cfg = ours(config)
    spec = KVSpec((0,), cfg.num_key_value_heads, cfg.head_dim, "float32")
    seqs, next_tokens = _inputs(cfg.hidden_size, seed=3)
    tables = _tables()
    results = []
    for rank in range(tp):
        mixer = attention_from_hf(cfg, hf_state, tp, rank, provider=provider)
        geo = BlockGeometry(spec, tp, layout, BLOCK, NUM_BLOCKS)
        # The pool starts inside a larger buffer and is NaN everywhere: nothing unwritten may
        # be read.
        raw = torch.full((geo.nbytes // 4 + 3,), float("nan"), dtype=F32).view(torch.uint8)
        k_cache, v_cache = geo.view(raw[12:], 0)
        with torch.no_grad():
            out = mixer.prefill(torch.cat(seqs), k_cache, v_cache, qsl_of(LENS).long(),
                                [torch.tensor(t) for t in tables])
            width = max(len(t) for t in tables)
            table = torch.full((len(LENS), width), -1, dtype=torch.int64)
            for b, t in enumerate(tables):
                table[b, :len(t)] = torch.tensor(t)
            dec = mixer.decode(next_tokens, k_cache, v_cache, table, torch.tensor(LENS))
        ks, vs = [], []
        for n, t in zip(LENS, tables):
            idx = torch.tensor(t)
            ks.append(k_cache[idx].permute(1, 0, 2, 3).reshape(geo.heads, -1, cfg.head_dim)[:, :n + 1])
            vs.append(v_cache[idx].permute(1, 0, 2, 3).reshape(geo.heads, -1, cfg.head_dim)[:, :n + 1])
        results.append((out, dec, ks, vs, kv_heads(spec, tp, rank)))
    return seqs, next_tokens, results


def check(results, want_out, want_dec, want_k, want_v, assert_close):
    assert_close(sum(r[0] for r in results), want_out, F32)
    assert_close(sum(r[1] for r in results), want_dec, F32)
    for _, _, ks, vs, (first, count) in results:
        heads = slice(first, first + count)
        for b in range(len(LENS)):
            assert_close(ks[b], want_k[b][heads], F32)
            assert_close(vs[b], want_v[b][heads], F32)


# (id, q heads, KV heads, head_dim, tp, KV layout, provider): split and replicated KV heads
LFM2_CASES = [
    ("h4-kv2-tp1-HB-ref", 4, 2, 8, 1, "HB", "ref"),
    ("h4-kv2-tp1-LH-triton", 4, 2, 8, 1, "LH", "triton"),
    ("h8-kv4-tp2-BH-ref", 8, 4, 4, 2, "BH", "ref"),
    ("h8-kv2-tp4-replicated-HB-ref", 8, 2, 4, 4, "HB", "ref"),
    ("h4-kv4-tp4-LH-triton", 4, 4, 8, 4, "LH", "triton"),
]


@pytest.mark.parametrize("case", LFM2_CASES, ids=[c[0] for c in LFM2_CASES])
def test_lfm2_attention_matches_hf(case, assert_close):
    _, heads, kv, head_dim, tp, layout, provider = case
    config = Lfm2Config(hidden_size=heads * head_dim, num_attention_heads=heads,
                        num_key_value_heads=kv, num_hidden_layers=1,
                        layer_types=["full_attention"], intermediate_size=16, vocab_size=32,
                        rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    config._attn_implementation = "sdpa"
    torch.manual_seed(40)
    hf = Lfm2Attention(config, layer_idx=0).eval()
    with torch.no_grad():   # distinct per-head norms, so a wrong head slice shows
        hf.q_layernorm.weight.copy_(1 + 0.3 * torch.randn(head_dim))
        hf.k_layernorm.weight.copy_(1 + 0.3 * torch.randn(head_dim))
    seqs, next_tokens, results = run_ranks(config, hf.state_dict(), tp, layout, provider)
    want = hf_attention_run(hf, Lfm2RotaryEmbedding(config), config, seqs, next_tokens)
    check(results, *want, assert_close)


GRANITE_CASES = [
    ("nope-kv2-tp1-HB-ref", None, False, 2, 1, "HB", "ref"),
    ("rope-bias-kv2-tp2-LH-triton", "rope", True, 2, 2, "LH", "triton"),
    ("nope-kv2-tp4-replicated-BH-ref", None, False, 2, 4, "BH", "ref"),
    ("rope-kv4-tp4-HB-ref", "rope", True, 4, 4, "HB", "ref"),
]


@pytest.mark.parametrize("case", GRANITE_CASES, ids=[c[0] for c in GRANITE_CASES])
def test_granite_attention_matches_hf(case, assert_close):
    _, position, bias, kv, tp, layout, provider = case
    config = GraniteMoeHybridConfig(
        hidden_size=32, num_attention_heads=8, num_key_value_heads=kv, num_hidden_layers=1,
        layer_types=["attention"], num_local_experts=0, vocab_size=32,
        position_embedding_type=position, attention_bias=bias, attention_multiplier=0.3,
        shared_intermediate_size=16, rope_theta=50.0, mamba_n_heads=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(41)
    hf = GraniteMoeHybridAttention(config, layer_idx=0).eval()
    if bias:
        with torch.no_grad():
            for proj in (hf.q_proj, hf.k_proj, hf.v_proj, hf.o_proj):
                proj.bias.copy_(0.2 * torch.randn(proj.bias.shape))
    seqs, next_tokens, results = run_ranks(config, hf.state_dict(), tp, layout, provider)
    rotary = GraniteMoeHybridRotaryEmbedding(config) if position == "rope" else None
    want = hf_attention_run(hf, rotary, config, seqs, next_tokens)
    check(results, *want, assert_close)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_granite_mamba_layer_with_one_group_matches_hf(tp, assert_close):
    """GraniteMoeHybridMambaLayer with n_groups = 1 (Granite-4.0-H): B and C replicated on
    every rank, the gated norm's group spanning ranks (through the all-reduce)."""
    config = GraniteMoeHybridConfig(
        hidden_size=16, num_hidden_layers=1, layer_types=["mamba"], num_local_experts=0,
        vocab_size=32, mamba_n_heads=8, mamba_d_head=4, mamba_d_state=4, mamba_n_groups=1,
        mamba_d_conv=4, mamba_chunk_size=4, mamba_expand=2, mamba_proj_bias=True,
        num_attention_heads=4, shared_intermediate_size=16)
    torch.manual_seed(42)
    hf = GraniteMoeHybridMambaLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        hf.A_log.copy_(torch.log(torch.linspace(0.5, 3.0, 8)))
        hf.D.copy_(torch.randn(8))
        hf.dt_bias.copy_(torch.randn(8) * 0.5)
        hf.norm.weight.copy_(1 + 0.2 * torch.randn(hf.norm.weight.shape))
    seqs, next_tokens = _inputs(16, seed=43)
    outs, dec = [], []
    with torch.no_grad():
        for seq, nxt in zip(seqs, next_tokens):
            cache = DynamicCache(config=config)
            outs.append(hf(seq[None], cache=cache)[0])
            dec.append(hf(nxt[None, None], cache=cache)[0, 0])
    want_out, want_dec = torch.cat(outs), torch.stack(dec)

    group = ThreadGroup(tp)
    slots = torch.tensor([3, 0, 5, 1], dtype=torch.int32)

    def rank_run(rank):
        mixer = mamba2_from_hf(ours(config), hf.state_dict(), tp, rank, provider="ref",
                               all_reduce=group.all_reduce(rank))
        _, conv_views = conv_region("DLS", 6, 1, mixer.conv_dim_local, 3, F32, seed=rank)
        _, ssm_views = ssm_region("HLPN", 6, 1, 8 // tp, 4, 4, F32, seed=rank + 7)
        conv, ssm = conv_views[0], ssm_views[0]
        with torch.no_grad():
            out = mixer.prefill(torch.cat(seqs), conv, ssm, qsl_of(LENS), slots,
                                torch.zeros(len(LENS), dtype=torch.bool))
            return out, mixer.decode(next_tokens, conv, ssm, slots)

    results = group.run(rank_run)
    assert_close(sum(r[0] for r in results), want_out, F32)
    assert_close(sum(r[1] for r in results), want_dec, F32)
