"""Checkpoints made by transformers itself (the oracle) and their reference greedy tokens.

Each model is a tiny ``*ForCausalLM`` built from its config class, given well-conditioned random
weights (transformers' own init makes tied LFM2 logits echo the input token, a weak test), saved
with ``save_pretrained``. The reference continuation is repeated FULL forwards with
``use_cache=False`` (argmax of the last position, append, repeat): transformers' cached
``generate`` fails on an LFM2 config with only conv layers (its mask code needs an attention
layer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import filelock
import pytest
import torch

from tests.models._helpers import KV_PROMPTS, NEW_TOKENS, PROMPTS

#: name -> (config class, config kwargs, save_pretrained kwargs)
HF_MODELS = {
    # Tied embeddings, no biases, auto-adjusted MLP width 160 -> 112.
    "lfm2": ("Lfm2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=160, block_multiple_of=16,
        num_hidden_layers=3, layer_types=["conv"] * 3, conv_L_cache=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True), {}),
    # Untied, conv_bias (in_proj / conv / out_proj biases), width 4, MLP width 96 as given.
    "lfm2-bias": ("Lfm2Config", dict(
        vocab_size=128, hidden_size=32, intermediate_size=96, block_auto_adjust_ff_dim=False,
        num_hidden_layers=2, layer_types=["conv"] * 2, conv_L_cache=4, conv_bias=True,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False), {}),
    # n_groups = 1: B and C replicated at TP > 1; saved as a SHARDED checkpoint (index.json).
    "mamba2-g1": ("Mamba2Config", dict(
        vocab_size=128, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=1,
        num_hidden_layers=3, conv_kernel=4, chunk_size=8), {"max_shard_size": "40KB"}),
    # n_groups = 4 = TP: B and C split by groups; in_proj / out_proj biases.
    "mamba2-g4": ("Mamba2Config", dict(
        vocab_size=128, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=4,
        num_hidden_layers=2, conv_kernel=4, chunk_size=8, use_bias=True), {}),
    # LFM2 with attention layers (LFM2-1.2B's pattern: conv first, attention every ~3 layers),
    # 8 query / 4 KV heads of 8: GQA ratio 2, KV heads split up to TP 4; RoPE theta 1e6.
    "lfm2-hybrid": ("Lfm2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=160, block_multiple_of=16,
        num_hidden_layers=6, layer_types=["conv", "conv", "full_attention", "conv",
                                          "full_attention", "conv"],
        conv_L_cache=3, num_attention_heads=8, num_key_value_heads=4,
        tie_word_embeddings=True), {}),
    # Granite-4.0-H style, dense: n_groups = 1 (B/C replicated), 2 KV heads (replicated at TP 4),
    # no RoPE ("nope", as published), non-default multipliers, untied lm_head.
    "granite-hybrid": ("GraniteMoeHybridConfig", dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=5,
        layer_types=["mamba", "mamba", "attention", "mamba", "attention"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
        shared_intermediate_size=96, intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=8,
        position_embedding_type="nope", embedding_multiplier=3.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=2.5, tie_word_embeddings=False), {}),
    # The same with RoPE and biased attention projections (the model tests only).
    "granite-rope": ("GraniteMoeHybridConfig", dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=0, shared_intermediate_size=64,
        intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_proj_bias=True,
        position_embedding_type="rope", rope_theta=500.0, attention_bias=True,
        embedding_multiplier=1.5, attention_multiplier=0.125, residual_multiplier=0.7,
        logits_scaling=1.5), {}),
}

#: config class -> model class
MODEL_CLASSES = {"Lfm2Config": "Lfm2ForCausalLM", "Mamba2Config": "Mamba2ForCausalLM",
                 "GraniteMoeHybridConfig": "GraniteMoeHybridForCausalLM"}


@dataclass(frozen=True)
class HFModel:
    name: str
    path: str
    reference: tuple[tuple[int, ...], ...]   # greedy continuation of each of PROMPTS
    min_margin: float                        # smallest top-1 minus top-2 logit on those paths
    #: models with attention layers: the greedy continuation of each of KV_PROMPTS
    kv_reference: tuple[tuple[int, ...], ...] = ()


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Well-conditioned random weights in place (unit gain per linear, perturbed norms)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)))
            elif name.endswith("dt_bias"):
                continue  # transformers' init: softplus^-1 of dt in [1e-3, 0.1]
            elif "norm" in name or name.endswith(".D"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def reference_greedy(model: torch.nn.Module, prompt: tuple[int, ...],
                     new_tokens: int) -> tuple[list[int], float]:
    ids = list(prompt)
    out, margin = [], math.inf
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            top2 = logits.topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out, margin


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Tiny matmuls on one intra-op thread: with 2 threads on a busy 2-core machine each waits
    for the other core and a [9, 64] x [64, 192] matmul takes ~20 ms instead of ~15 us."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def transformers_module():
    return pytest.importorskip("transformers")


#: The one build of the session (see hf_models).
_BUILT: dict[str, dict[str, HFModel]] = {}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory, transformers_module) -> dict[str, HFModel]:
    """The checkpoints and reference tokens, built once per session: tests/e2e/conftest.py
    registers this same fixture again (pytest keeps one cache per registration), so the build
    is kept here and both registrations return it."""
    if "models" not in _BUILT:
        _BUILT["models"] = _shared_hf_models(tmp_path_factory, transformers_module)
    return _BUILT["models"]


def _shared_hf_models(tmp_path_factory, transformers_module) -> dict[str, HFModel]:
    """One build for all pytest-xdist workers of a run: the first worker builds into the
    run's shared temporary directory under a file lock; the others read its index."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _build_hf_models(tmp_path_factory.mktemp, transformers_module)
    root = tmp_path_factory.getbasetemp().parent / "hf-models"
    with filelock.FileLock(f"{root}.lock"):
        index = root / "index.json"
        if index.exists():
            return {name: HFModel(name, d["path"], tuple(map(tuple, d["reference"])),
                                  d["min_margin"], tuple(map(tuple, d["kv_reference"])))
                    for name, d in json.loads(index.read_text()).items()}
        root.mkdir()

        def mkdir(name: str) -> Path:
            (root / name).mkdir()
            return root / name
        out = _build_hf_models(mkdir, transformers_module)
        index.write_text(json.dumps({name: dataclasses.asdict(m) for name, m in out.items()}))
        return out


def _build_hf_models(mkdir, transformers_module) -> dict[str, HFModel]:
    """``mkdir(name)``: a new directory for checkpoint ``name``."""
    tf = transformers_module
    out = {}
    for i, (name, (config_cls, kwargs, save_kwargs)) in enumerate(HF_MODELS.items()):
        config = getattr(tf, config_cls)(**kwargs)
        model_cls = getattr(tf, MODEL_CLASSES[config_cls])
        torch.manual_seed(i)
        model = model_cls(config).eval()
        randomize_(model, seed=100 + i)
        path = mkdir(name)
        model.save_pretrained(path, **save_kwargs)
        hybrid = "attention" in "".join(getattr(config, "layer_types", None) or ())
        prompts = KV_PROMPTS if hybrid else PROMPTS
        refs, margins = zip(*(reference_greedy(model, p, NEW_TOKENS) for p in prompts))
        refs = tuple(tuple(r) for r in refs)
        out[name] = HFModel(name, str(path), refs[:len(PROMPTS)], min(margins),
                            refs if hybrid else ())
    return out
