"""ModelRunner against transformers: greedy tokens at TP 1, 2 and 4, the N-1 way."""

from __future__ import annotations

import pytest
import torch

from statebridge.models import ModelRunner
from tests.models._helpers import PROMPTS, generate, make_cache, run_tp_processes

#: A tie closer than this could flip under another summation order; the references are checked
#: to be far from it, so a token mismatch is a bug, not noise.
MIN_MARGIN = 1e-3

#: Layout per (model, TP): every layout runs at every TP degree somewhere.
LAYOUTS = {
    "lfm2": {1: "LSD", 2: "DLS", 4: "LDS"},
    "lfm2-bias": {1: "LDS", 2: "LSD", 4: "DLS"},
    "mamba2-g1": {1: "DLS", 2: "LDS", 4: "LSD"},
    "mamba2-g4": {1: "LSD", 2: "DLS", 4: "LDS"},
}
MODELS = tuple(LAYOUTS)


def _expect(hf_model, tokens, where: str) -> None:
    assert hf_model.min_margin > MIN_MARGIN, (
        f"{hf_model.name}: reference has a near tie ({hf_model.min_margin:.2e}); pick other "
        f"weights")
    for prompt, got, want in zip(PROMPTS, tokens, hf_model.reference):
        assert tuple(got) == want, (f"{hf_model.name} {where}: prompt of length {len(prompt)} "
                                    f"gave {got}, transformers {list(want)}")


@pytest.mark.parametrize("name", MODELS)
def test_tp1_matches_transformers(hf_models, name):
    hf_model = hf_models[name]
    cache = make_cache(hf_model.path, 1, LAYOUTS[name][1])
    runner = ModelRunner(hf_model.path, 1, 0, cache)
    pages = [6, 0, 3, 5, 1]  # any pages, in any order
    _expect(hf_model, generate(runner, PROMPTS, pages), "TP=1")


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_processes_match_transformers(hf_models, tp_size):
    """Real torch.distributed (gloo, 127.0.0.1) across spawned rank processes; every rank must
    produce the transformers tokens."""
    jobs = [{"name": name, "model_dir": hf_models[name].path, "layout": LAYOUTS[name][tp_size],
             "prompts": PROMPTS} for name in MODELS]
    per_rank = run_tp_processes(tp_size, jobs)
    for rank, results in enumerate(per_rank):
        for name in MODELS:
            _expect(hf_models[name], results[name], f"TP={tp_size} rank {rank}")


@pytest.mark.parametrize("name", ["lfm2-bias", "mamba2-g1"])
def test_batched_prefill_equals_one_by_one(hf_models, assert_close, name):
    path = hf_models[name].path
    runner = ModelRunner(path, 1, 0, make_cache(path, 1, "DLS"))
    batched = runner.prefill(PROMPTS, [0, 1, 2, 3, 4])
    states = runner.cache.buffer.clone()
    runner.reset(range(8))
    for b, prompt in enumerate(PROMPTS):
        assert_close(runner.prefill([prompt], [b])[0], batched[b], torch.float32)
    assert_close(runner.cache.buffer.view(torch.float32), states.view(torch.float32),
                 torch.float32)


@pytest.mark.parametrize("name", ["lfm2", "mamba2-g4"])
def test_chunked_prefill_with_resume(hf_models, assert_close, name):
    """prefill(p[:k]) then prefill(p[k:], resume=True) == prefill(p): state and logits."""
    path = hf_models[name].path
    runner = ModelRunner(path, 1, 0, make_cache(path, 1, "LSD"))
    prompt = PROMPTS[-1]
    whole = runner.prefill([prompt], [0])
    runner.prefill([prompt[:9]], [1])
    resumed = runner.prefill([prompt[9:]], [1], resume=True)
    assert_close(resumed, whole, torch.float32)
    assert_close(runner.cache.page_bytes(1).view(torch.float32),
                 runner.cache.page_bytes(0).view(torch.float32), torch.float32)
    # an empty chunk with resume leaves the state as it was
    before = runner.cache.page_bytes(1).clone()
    runner.prefill([()], [1], resume=True)
    assert torch.equal(runner.cache.page_bytes(1), before)


@pytest.mark.parametrize("name", ["lfm2", "mamba2-g1"])
def test_empty_prompt_leaves_zero_state_and_zero_logits(hf_models, name):
    path = hf_models[name].path
    runner = ModelRunner(path, 1, 0, make_cache(path, 1, "LDS"))
    runner.prefill([PROMPTS[3], PROMPTS[4]], [2, 3])  # dirty the pages
    assert runner.cache.page_bytes(2).any()
    logits = runner.prefill([(), PROMPTS[2]], [2, 3])
    assert logits.shape == (2, runner.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert not logits[0].any(), "an empty prompt's row is the all-zero placeholder"
    assert logits[1].abs().sum() > 0
    assert not runner.cache.page_bytes(2).any(), "an empty prompt must leave the zero state"
    runner.reset([3])
    assert not runner.cache.page_bytes(3).any()
    assert runner.prefill([], []).shape == (0, runner.vocab_size)
    assert runner.decode([], []).shape == (0, runner.vocab_size)


def test_state_dtype_can_differ_from_weights(hf_models):
    """A cache whose SSM state is bf16 while weights are fp32 still runs (loose agreement)."""
    path = hf_models["mamba2-g4"].path
    cache = make_cache(path, 1, "DLS", ssm_dtype="bfloat16")
    runner = ModelRunner(path, 1, 0, cache)
    tokens = generate(runner, PROMPTS[:3], [0, 1, 2], new_tokens=2)
    assert all(len(t) == 2 for t in tokens)


@pytest.mark.parametrize("name,tp_size,rank", [("lfm2", 2, 1), ("mamba2-g1", 4, 2),
                                               ("mamba2-g4", 2, 0)])
def test_rank_reads_only_its_shard(hf_models, name, tp_size, rank):
    """Split weights are read shard-wise (safetensors get_slice); replicated ones whole."""
    from statebridge.models import Checkpoint, ThreadGroup

    path = hf_models[name].path
    runner = ModelRunner(path, tp_size, rank, make_cache(path, tp_size, "LSD"),
                         all_reduce=ThreadGroup(tp_size).all_reduce(rank))
    with Checkpoint(path) as ckpt:
        shapes = ckpt.config.weight_shapes()
        cfg = ckpt.config
    full = {n: 4 * torch.Size(s).numel() for n, s in shapes.items()}
    read = runner.bytes_read
    assert set(read) == set(shapes), "every weight is read, nothing else"
    if name == "lfm2":
        split = ["model.layers.0.conv.in_proj.weight", "model.layers.0.conv.conv.weight",
                 "model.layers.0.conv.out_proj.weight", "model.layers.0.feed_forward.w1.weight",
                 "model.layers.0.feed_forward.w2.weight"]
        whole = ["model.embed_tokens.weight", "model.layers.0.operator_norm.weight"]
    else:
        split = ["backbone.layers.0.mixer.out_proj.weight", "backbone.layers.0.mixer.A_log",
                 "backbone.layers.0.mixer.norm.weight"]
        whole = ["backbone.embeddings.weight", "lm_head.weight", "backbone.layers.0.norm.weight"]
        # in_proj rows [z I | x I | B GN | C GN | dt H]: B and C whole when G == 1 < t
        inner, gn = cfg.num_heads * cfg.head_dim, cfg.n_groups * cfg.state_size
        bc = 2 * gn if cfg.n_groups == 1 else 2 * gn // tp_size
        rows = 2 * inner // tp_size + bc + cfg.num_heads // tp_size
        assert read["backbone.layers.0.mixer.in_proj.weight"] == 4 * rows * cfg.hidden_size
    for n in split:
        assert read[n] == full[n] // tp_size, n
    for n in whole:
        assert read[n] == full[n], n


def _transformers_states(model, prompt) -> dict[tuple[int, str], torch.Tensor]:
    """Every layer's state after ``prompt`` in transformers, in our canonical axes:
    conv ``[channel, S]`` (the last S = K-1 conv inputs), SSM ``[H, P, N]``."""
    ids = torch.tensor([prompt])
    states = {}
    with torch.no_grad():
        if model.config.model_type == "mamba2":
            cache = model(ids, use_cache=True).cache
            for i in range(model.config.num_hidden_layers):
                width = model.config.conv_kernel
                states[(i, "conv")] = cache.get_conv_state(i)[0][:, -(width - 1):]
                states[(i, "ssm")] = cache.get_recurrent_state(i)[0]
            return states
        # LFM2: a cached forward needs an attention layer, so read B*x off in_proj's output.
        captured = {}
        hooks = [layer.conv.in_proj.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(i, out[0]))
            for i, layer in enumerate(model.model.layers)]
        try:
            model(ids, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        width = model.config.conv_L_cache
        for i, bcx in captured.items():
            B, _, x = bcx.chunk(3, dim=-1)
            bx = torch.cat([torch.zeros(width - 1, B.shape[1]), B * x])  # zero state before
            states[(i, "conv")] = bx[-(width - 1):].t()
    return states


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_page_holds_the_transformers_state(hf_models, transformers_module, assert_close, name,
                                           tp_size):
    """After prefill, page p of rank r holds rank r's channels of transformers' state of every
    layer, at the region the spec gives that layer -- the contract a transfer relies on."""
    from statebridge.models import ThreadGroup
    from statebridge.testing.synthetic import rank_channels

    path = hf_models[name].path
    model = transformers_module.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = PROMPTS[3]
    want = _transformers_states(model, prompt)
    group = ThreadGroup(tp_size)
    caches = [make_cache(path, tp_size, LAYOUTS[name][tp_size]) for _ in range(tp_size)]

    def prefill(rank: int) -> ModelRunner:
        runner = ModelRunner(path, tp_size, rank, caches[rank], all_reduce=group.all_reduce(rank))
        runner.prefill([prompt], [3])
        return runner

    runners = group.run(prefill)
    spec = caches[0].geometry.spec
    for rank, (runner, cache) in enumerate(zip(runners, caches)):
        for layer, (g, j) in runner.layer_slots.items():
            assert spec.groups[g].layer_ids[j] == layer
            for tensor in [t.name for t in spec.groups[g].tensors]:
                got = cache.view(g, tensor, j)[3]
                expected = want[(layer, tensor)][rank_channels(spec, g, tensor, tp_size, rank)]
                assert_close(got, expected, torch.float32)
