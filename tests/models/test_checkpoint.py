"""make_checkpoint writes what transformers loads; Checkpoint reads shards lazily."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from statebridge.errors import ConfigError, ShapeError, UnsupportedModelError
from statebridge.hf_config import ModelConfig
from statebridge.models import Checkpoint, ModelRunner, make_checkpoint
from tests.models._helpers import PROMPTS, generate, make_cache
from tests.models.conftest import reference_greedy

ARCHS = ["lfm2", "mamba2"]


def _weights(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_make_checkpoint_loads_in_transformers_and_agrees(tmp_path, transformers_module, arch,
                                                          sharded):
    tf = transformers_module
    path = make_checkpoint(arch, tmp_path / arch, "tiny", seed=3,
                           max_shard_bytes=120_000 if sharded else None)
    assert (path / "model.safetensors.index.json").exists() == sharded
    model, info = tf.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    model.eval()
    expected_cls = {"lfm2": "Lfm2ForCausalLM", "mamba2": "Mamba2ForCausalLM"}[arch]
    assert type(model).__name__ == expected_cls
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # transformers holds exactly our weights (nothing re-initialised or renamed)
    ours = _weights(path)
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in ours
        assert torch.equal(theirs["lm_head.weight"], ours[model.base_model_prefix +
                                                           (".embed_tokens.weight" if arch == "lfm2"
                                                            else ".embeddings.weight")])
    # the config round-trips through transformers' own class
    ours_cfg = json.loads((path / "config.json").read_text())
    assert model.config.vocab_size == ours_cfg["vocab_size"] == 256
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 4
    # greedy tokens agree
    runner = ModelRunner(path, 1, 0, make_cache(str(path), 1, "DLS"))
    tokens = generate(runner, PROMPTS, [0, 1, 2, 3, 4])
    for prompt, got in zip(PROMPTS, tokens):
        want, margin = reference_greedy(model, prompt, len(got))
        assert margin > 1e-3
        assert got == want, f"{arch} prompt length {len(prompt)}: {got} != {want}"


def test_make_checkpoint_is_deterministic_and_seeded(tmp_path):
    a = _weights(make_checkpoint("mamba2", tmp_path / "a", seed=5))
    b = _weights(make_checkpoint("mamba2", tmp_path / "b", seed=5))
    c = _weights(make_checkpoint("mamba2", tmp_path / "c", seed=6))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_make_checkpoint_presets_overrides_and_dtype(tmp_path):
    path = make_checkpoint("mamba2", tmp_path / "m", "small", overrides={"n_groups": 2},
                           dtype="bfloat16")
    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    assert config.n_groups == 2 and config.dtype == "bfloat16"
    assert config.hidden_size == 256 and config.num_layers == 8
    with Checkpoint(path) as ckpt:
        ckpt.check(config.weight_shapes())
        assert ckpt.dtype("lm_head.weight") == torch.bfloat16
    # a rewrite removes the old weight files (here: single file -> shards)
    make_checkpoint("mamba2", path, "tiny", max_shard_bytes=50_000)
    assert not (path / "model.safetensors").exists()
    with pytest.raises(ConfigError, match="already holds"):
        make_checkpoint("mamba2", path, "tiny", overwrite=False)


@pytest.mark.parametrize("arch,preset,extra", [
    ("lfm2", "huge", {}), ("gpt2", "tiny", {}),
])
def test_make_checkpoint_rejects_unknown_names(tmp_path, arch, preset, extra):
    with pytest.raises(ConfigError, match=preset if arch == "lfm2" else arch):
        make_checkpoint(arch, tmp_path / "x", preset, overrides=extra)


def test_make_checkpoint_writes_attention_layers(tmp_path):
    path = make_checkpoint("lfm2", tmp_path / "x", overrides={
        "layer_types": ["conv", "full_attention", "conv", "conv"]})
    with Checkpoint(path) as ckpt:
        names = set(ckpt.names())
    assert "model.layers.1.self_attn.q_layernorm.weight" in names
    assert not any(n.startswith("model.layers.1.conv.") for n in names)
    assert "model.layers.0.conv.in_proj.weight" in names


@pytest.mark.parametrize("fields", [
    dict(intermediate_size=12288),
    dict(intermediate_size=160, block_multiple_of=16),
    dict(intermediate_size=1000, block_ffn_dim_multiplier=1.5, block_multiple_of=64),
    dict(intermediate_size=1000, block_ffn_dim_multiplier=0.7, block_multiple_of=1),
    dict(intermediate_size=10752, block_auto_adjust_ff_dim=False),
    dict(intermediate_size=96, block_auto_adjust_ff_dim=False, block_ffn_dim_multiplier=3.0),
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_lfm2_ff_dim_matches_transformers(transformers_module, fields):
    tf = transformers_module
    config = tf.Lfm2Config(hidden_size=8, num_hidden_layers=1, layer_types=["conv"], **fields)
    hf_width = tf.models.lfm2.modeling_lfm2.Lfm2MLP(config).w1.out_features
    raw = {"model_type": "lfm2", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1,
           "layer_types": ["conv"], **fields}
    assert ModelConfig.from_dict(raw).ff_dim == hf_width


def test_lazy_tensor_reads_only_what_is_narrowed(tmp_path):
    path = make_checkpoint("lfm2", tmp_path / "l", "tiny")
    with Checkpoint(path) as ckpt:
        name = "model.layers.0.conv.conv.weight"  # [64, 1, 3]
        full = ckpt.get(name)
        ckpt.bytes_read.clear()
        lazy = ckpt.lazy(name)
        squeezed = lazy[:, 0, :]
        assert squeezed.shape == (64, 3) and ckpt.bytes_read[name] == 0
        part = squeezed.narrow(0, 16, 8)
        assert torch.equal(part, full[16:24, 0, :])
        assert ckpt.bytes_read[name] == 8 * 3 * 4
        cols = ckpt.lazy("model.layers.0.feed_forward.w2.weight").narrow(1, 32, 32)
        assert cols.shape == (64, 32)
        # anything else materialises (correct, just not frugal)
        assert torch.equal(torch.cat([lazy[:2]], dim=0), full[:2])
        assert torch.equal(lazy.clone(), full)
        as_bf16 = ckpt.lazy(name, dtype=torch.bfloat16)[:, 0, :].narrow(0, 0, 4)
        assert as_bf16.dtype == torch.bfloat16
        with pytest.raises(ShapeError):
            lazy.narrow(0, 60, 8)


def test_special_floats_round_trip(tmp_path):
    path = make_checkpoint("mamba2", tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    assert raw["time_step_limit"] == [0.0, {"__float__": "Infinity"}]  # transformers 5's form
    assert ModelConfig.from_dict(raw).time_step_limit == (0.0, float("inf"))
    raw["time_step_limit"] = [0.0, float("inf")]  # the bare form older writers use
    assert ModelConfig.from_dict(raw).time_step_limit == (0.0, float("inf"))


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_checkpoint_close_to_transformers(tmp_path, transformers_module, arch):
    """bf16 weights: our prefill and N-1 decode logits stay within bf16 rounding of
    transformers' (LFM2 is bit-identical; Mamba2's scans differ in order)."""
    path = make_checkpoint(arch, tmp_path / arch, "tiny", seed=1, dtype="bfloat16")
    model = transformers_module.AutoModelForCausalLM.from_pretrained(path).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = list(range(3, 20))
    with torch.no_grad():
        want = model(torch.tensor([prompt]), use_cache=False).logits[0, -1].float()
    runner = ModelRunner(path, 1, 0, make_cache(str(path), 1, "LSD"))
    assert runner.dtype == torch.bfloat16
    whole = runner.prefill([prompt], [0])[0]
    runner.prefill([prompt[:-1]], [1])
    stepped = runner.decode([prompt[-1]], [1])[0]
    scale = want.abs().max().item()
    for got in (whole, stepped):
        assert (got - want).abs().max().item() <= 0.05 * scale
        assert got.argmax() == want.argmax()


# -- hybrid archs: LFM2 with attention, dense Granite-4.0-H ------------------------------------

HYBRID_ARCHS = {"lfm2-hybrid": "Lfm2ForCausalLM", "granite-hybrid": "GraniteMoeHybridForCausalLM"}
KV_BLOCK = 8
#: 1 token (the N-1 prefill is empty), and lengths around the KV block size of 8 (a prefill
#: that ends a block, one that spills a token into the next, decodes crossing a block edge).
HYBRID_PROMPTS: tuple[tuple[int, ...], ...] = (
    (7,), tuple((i * 29 + 3) % 250 for i in range(8)), tuple((i * 37 + 5) % 250 for i in range(9)),
    tuple((i * 53 + 17) % 250 for i in range(17)),
)
HYBRID_NEW_TOKENS = 5


def _greedy_with_kv(path, tp_size: int, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy tokens of a TP group of threads with a KV block pool: prefill ``p[:-1]``, then
    decode ``p[-1]`` and every generated token (block tables reversed, so that no request's
    blocks are contiguous or in order)."""
    from statebridge.connector.rank import KVBlocks
    from statebridge.models import ThreadGroup
    from statebridge.state.kv import BlockGeometry

    group = ThreadGroup(tp_size)
    tables, nxt = [], 0
    for p in prompts:
        n = -(-(len(p) + new_tokens) // KV_BLOCK)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
        nxt += n
    pages = list(range(len(prompts)))

    def run(rank: int) -> list[list[int]]:
        cache = make_cache(str(path), tp_size, "DLS")
        geo = BlockGeometry(cache.geometry.spec.kv, tp_size, "LH", KV_BLOCK, nxt)
        kv = KVBlocks(geo, torch.full((geo.nbytes,), 255, dtype=torch.uint8), 0)  # NaN garbage
        runner = ModelRunner(path, tp_size, rank, cache, kv=kv,
                             all_reduce=group.all_reduce(rank))
        runner.prefill([p[:-1] for p in prompts], pages, blocks=tables)
        tokens = [p[-1] for p in prompts]
        positions = [len(p) - 1 for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(new_tokens):
            logits = runner.decode(tokens, pages, blocks=tables, positions=positions)
            assert bool(torch.isfinite(logits).all())
            tokens = logits.argmax(-1).tolist()
            positions = [x + 1 for x in positions]
            for o, t in zip(out, tokens):
                o.append(t)
        return out

    results = group.run(run)
    assert all(r == results[0] for r in results)       # every rank samples the same tokens
    return results[0]


@pytest.fixture(scope="module", params=list(HYBRID_ARCHS))
def hybrid_checkpoint(request, tmp_path_factory, transformers_module):
    """(arch, path, transformers model, reference greedy tokens) of a tiny hybrid checkpoint."""
    arch = request.param
    path = make_checkpoint(arch, tmp_path_factory.mktemp(arch), "tiny", seed=2)
    model, info = transformers_module.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True)
    model.eval()
    torch.set_num_threads(1)
    refs = [reference_greedy(model, p, HYBRID_NEW_TOKENS) for p in HYBRID_PROMPTS]
    return arch, path, model, info, refs


def test_hybrid_checkpoint_loads_in_transformers(hybrid_checkpoint):
    arch, path, model, info, refs = hybrid_checkpoint
    assert type(model).__name__ == HYBRID_ARCHS[arch]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = _weights(path)
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    config = ModelConfig.load(path)
    assert set(ours) == set(config.weight_shapes())
    hf = model.config
    assert config.attention_layers and config.attention_layers[0] > 0   # conv / mamba first
    assert [i for i, t in enumerate(hf.layer_types) if t == "full_attention"] == \
        list(config.attention_layers)
    if arch == "lfm2-hybrid":
        assert (hf.num_attention_heads, hf.num_key_value_heads, config.head_dim) == (8, 4, 8)
        assert hf.tie_word_embeddings and "lm_head.weight" not in ours
        assert hf.rope_parameters["rope_theta"] == 1e6
        for name in ("q_layernorm", "k_layernorm"):
            w = ours[f"model.layers.2.self_attn.{name}.weight"]
            assert (w - 1).abs().max() < 0.5                       # norms ~1
    else:
        assert hf.num_local_experts == 0 and hf.mamba_n_groups == 1
        assert hf.num_key_value_heads == 2 and hf.position_embedding_type == "nope"
        assert hf.shared_intermediate_size % 4 == 0
        assert not hf.tie_word_embeddings and "lm_head.weight" in ours
        for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                    "logits_scaling"):
            assert getattr(hf, key) != 1.0 and getattr(config, key) == getattr(hf, key), key
        a_log = ours["model.layers.0.mamba.A_log"]
        assert (a_log >= 0).all() and (a_log <= math.log(16.0) + 1e-6).all()
    # well conditioned: no near ties on the greedy paths
    assert min(margin for _, margin in refs) > 1e-3


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_hybrid_checkpoint_greedy_matches_transformers(hybrid_checkpoint, tp_size):
    arch, path, model, info, refs = hybrid_checkpoint
    got = _greedy_with_kv(path, tp_size, HYBRID_PROMPTS, HYBRID_NEW_TOKENS)
    for prompt, tokens, (want, _) in zip(HYBRID_PROMPTS, got, refs):
        assert tokens == want, f"{arch} TP={tp_size} prompt length {len(prompt)}: " \
                               f"{tokens} != {want}"


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_hybrid_small_preset_is_valid(tmp_path, arch):
    path = make_checkpoint(arch, tmp_path / arch, "small")
    config = ModelConfig.load(path)
    with Checkpoint(path) as ckpt:
        ckpt.check(config.weight_shapes())
    assert config.hidden_size == 256 and config.num_layers == 16
    assert 0 < len(config.attention_layers) < config.num_layers / 2
    assert config.layer_types[0] != "full_attention"


@pytest.mark.parametrize("arch,preset,needle", [
    ("granite", "tiny", "unknown arch 'granite'; expected one of ['lfm2', 'mamba2', "
                        "'lfm2-hybrid', 'granite-hybrid']"),
    ("lfm2-hybrid", "huge", "unknown preset 'huge' for arch 'lfm2-hybrid'; expected one of "
                            "['small', 'tiny', 'vllm']"),
])
def test_make_checkpoint_errors_name_the_value_and_the_choices(tmp_path, arch, preset, needle):
    with pytest.raises(ConfigError) as e:
        make_checkpoint(arch, tmp_path / "x", preset)
    assert needle in str(e.value)


def test_weights_read_are_the_processs_own_memory_not_views_of_the_file_mapping(tmp_path):
    """safetensors hands out whole tensors and row ranges as views of its file mapping; what a
    Checkpoint reads is copied out of it (a rank's weights are private memory, and closing the
    checkpoint unmaps the file with every page read for other shards)."""
    from statebridge.connector.rank.startup import mapped_bytes
    from statebridge.models.checkpoint import observe_reads

    path = make_checkpoint("lfm2", tmp_path / "m")
    seen = []
    with Checkpoint(path) as ckpt, observe_reads(seen.append):
        name = "model.embed_tokens.weight"
        assert ckpt.maps(name, ckpt._slice(name)[:])           # what safetensors hands out
        whole = ckpt.get(name)
        rows = ckpt.lazy(name).narrow(0, 3, 5)
        assert not ckpt.maps(name, whole) and not ckpt.maps(name, rows)
        assert mapped_bytes(str(path)) > 0
        assert seen == [whole.nbytes, rows.nbytes]
    assert mapped_bytes(str(path)) == 0
    assert torch.equal(rows, whole[3:8])
