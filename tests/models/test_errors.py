"""Bad checkpoints, caches and calls raise typed errors that name the offending value."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from statebridge.errors import (
    CacheError,
    ConfigError,
    ShapeError,
    UnknownPageError,
    UnsupportedModelError,
)
from statebridge.models import ModelRunner, ThreadGroup, make_checkpoint
from tests.models._helpers import make_cache


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory):
    return make_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), "tiny")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_lfm2_attention_layers_need_the_kv_pool(tmp_path, transformers_module):
    """A checkpoint made by transformers with an attention layer at index 2: the runner names
    the attention layers and the missing KV block pool."""
    tf = transformers_module
    config = tf.Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           layer_types=["conv", "conv", "full_attention", "conv"])
    tf.Lfm2ForCausalLM(config).save_pretrained(tmp_path)
    cache = make_cache(str(tmp_path), 1, "DLS")
    with pytest.raises(ConfigError, match=r"attention layers \[2\].*KV block pool"):
        ModelRunner(tmp_path, 1, 0, cache)


def test_kv_pool_of_another_model_is_refused(tmp_path, transformers_module):
    from statebridge.connector.rank import KVBlocks
    from statebridge.state.kv import BlockGeometry
    from statebridge.state.spec import KVSpec

    tf = transformers_module
    config = tf.Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           layer_types=["conv", "full_attention", "conv"])
    tf.Lfm2ForCausalLM(config).save_pretrained(tmp_path)
    cache = make_cache(str(tmp_path), 1, "DLS")
    geo = BlockGeometry(KVSpec((1,), 4, 8, "float32"), 1, "HB", 4, 8)   # 4 KV heads, not 2
    kv = KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8), 0)
    with pytest.raises(ConfigError, match=r"'num_kv_heads': 4.*'num_kv_heads': 2"):
        ModelRunner(tmp_path, 1, 0, cache, kv=kv)


def test_granite_moe_checkpoint_is_refused_naming_the_key(tmp_path, transformers_module):
    """A MoE Granite-4.0-H-style checkpoint made by transformers is refused by the config
    reader (so by the runner and the node's weight check) naming num_local_experts; the dense
    one passes the weight check."""
    from statebridge.node.checks import check_weights

    tf = transformers_module
    kwargs = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                  layer_types=["mamba", "attention", "mamba"], num_attention_heads=4,
                  num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=8,
                  shared_intermediate_size=32)
    tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
        num_local_experts=4, num_experts_per_tok=2, **kwargs)).save_pretrained(tmp_path / "moe")
    with pytest.raises(UnsupportedModelError, match=r"num_local_experts=4"):
        check_weights(tmp_path / "moe", 1)
    tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
        num_local_experts=0, **kwargs)).save_pretrained(tmp_path / "dense")
    check_weights(tmp_path / "dense", 2)
    with pytest.raises(ConfigError, match=r"unknown arch 'granitemoehybrid'; expected one of"):
        make_checkpoint("granitemoehybrid", tmp_path / "made")


def test_lfm2_without_layer_types_is_all_attention_like_transformers(tmp_path, lfm2_dir):
    """transformers reads a config with neither layer_types nor full_attn_idxs as ALL
    attention; so do the state spec and the runner (which has no recurrent state to serve)."""
    path = _copy(lfm2_dir, tmp_path / "m")
    _edit_config(path, lambda c: (c.pop("layer_types"), c.pop("full_attn_idxs")))
    with pytest.raises(UnsupportedModelError, match=r"no conv layers"):
        make_cache(str(path), 1, "DLS")
    with pytest.raises(UnsupportedModelError, match=r"no conv layers"):
        ModelRunner(path, 1, 0, make_cache(str(lfm2_dir), 1, "DLS"))


def test_missing_weight_is_named(tmp_path, lfm2_dir):
    path = _copy(lfm2_dir, tmp_path / "m")
    _edit_weights(path, lambda t: t.pop("model.layers.1.conv.out_proj.weight"))
    with pytest.raises(ConfigError, match=r"no weight 'model\.layers\.1\.conv\.out_proj\.weight'"):
        ModelRunner(path, 1, 0, make_cache(str(path), 1, "DLS"))


def test_missing_lm_head_of_untied_model_is_named(tmp_path, lfm2_dir):
    path = _copy(lfm2_dir, tmp_path / "m")
    _edit_config(path, lambda c: c.update(tie_word_embeddings=False))
    with pytest.raises(ConfigError, match=r"no weight 'lm_head\.weight'"):
        ModelRunner(path, 1, 0, make_cache(str(path), 1, "DLS"))


def test_wrong_shape_is_named(tmp_path, lfm2_dir):
    path = _copy(lfm2_dir, tmp_path / "m")
    name = "model.layers.0.feed_forward.w2.weight"
    _edit_weights(path, lambda t: t.update({name: t[name].t().contiguous()}))
    with pytest.raises(ShapeError, match=rf"{name.replace('.', '[.]')}' has shape \[128, 64\], "
                                         r"expected \[64, 128\]"):
        ModelRunner(path, 1, 0, make_cache(str(path), 1, "DLS"))


def test_integer_weight_is_refused(tmp_path, lfm2_dir):
    path = _copy(lfm2_dir, tmp_path / "m")
    name = "model.embedding_norm.weight"
    _edit_weights(path, lambda t: t.update({name: torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(ShapeError, match=rf"'{name}' has dtype torch.int32"):
        ModelRunner(path, 1, 0, make_cache(str(path), 1, "DLS"))


def test_broken_checkpoint_directories(tmp_path, lfm2_dir):
    with pytest.raises(ConfigError, match="not found"):
        ModelRunner(tmp_path / "nope", 1, 0, make_cache(str(lfm2_dir), 1, "DLS"))
    path = _copy(lfm2_dir, tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        ModelRunner(path, 1, 0, make_cache(str(lfm2_dir), 1, "DLS"))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="'model-00001-of-00002.safetensors' listed in the index"):
        ModelRunner(path, 1, 0, make_cache(str(lfm2_dir), 1, "DLS"))
    path = _copy(lfm2_dir, tmp_path / "corrupt")
    (path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ConfigError, match="not valid safetensors"):
        ModelRunner(path, 1, 0, make_cache(str(lfm2_dir), 1, "DLS"))
    path = _copy(lfm2_dir, tmp_path / "gpt")
    _edit_config(path, lambda c: c.update(model_type="gpt2"))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        ModelRunner(path, 1, 0, make_cache(str(lfm2_dir), 1, "DLS"))


def test_cache_must_match_model_and_tp(tmp_path, lfm2_dir):
    with pytest.raises(ConfigError, match="tp_size=2, runner has tp_size=1"):
        ModelRunner(lfm2_dir, 1, 0, make_cache(str(lfm2_dir), 2, "DLS"))
    other = make_checkpoint("mamba2", tmp_path / "mamba2")
    with pytest.raises(ConfigError, match="does not describe"):
        ModelRunner(lfm2_dir, 1, 0, make_cache(str(other), 1, "DLS"))
    with pytest.raises(ConfigError, match="needs an all_reduce"):
        ModelRunner(lfm2_dir, 2, 0, make_cache(str(lfm2_dir), 2, "DLS"))
    with pytest.raises(ConfigError, match=r"tp_rank must be in \[0, 2\), got 2"):
        ModelRunner(lfm2_dir, 2, 2, make_cache(str(lfm2_dir), 2, "DLS"),
                    all_reduce=ThreadGroup(2).all_reduce(0))


def test_mlp_width_not_divisible_by_tp(tmp_path):
    path = make_checkpoint("lfm2", tmp_path / "m", overrides={
        "block_auto_adjust_ff_dim": False, "intermediate_size": 98})
    with pytest.raises(ConfigError, match="MLP width 98 .* not divisible by tp_size=4"):
        ModelRunner(path, 4, 0, make_cache(str(path), 4, "DLS"),
                    all_reduce=ThreadGroup(4).all_reduce(0))


def test_bad_calls(lfm2_dir):
    runner = ModelRunner(lfm2_dir, 1, 0, make_cache(str(lfm2_dir), 1, "DLS", num_pages=4))
    with pytest.raises(ShapeError, match=r"prompt 1: token id 256 outside the vocabulary "
                                         r"\[0, 256\)"):
        runner.prefill([[1, 2], [3, 256]], [0, 1])
    with pytest.raises(ShapeError, match="token id -1"):
        runner.decode([-1], [0])
    with pytest.raises(ShapeError, match="2 pages for 1 requests"):
        runner.decode([1], [0, 1])
    with pytest.raises(UnknownPageError, match="page 4"):
        runner.decode([1], [4])
    with pytest.raises(CacheError, match="page 2 appears twice"):
        runner.prefill([[1], [2]], [2, 2])
    with pytest.raises(ShapeError, match="sequence of token ids"):
        runner.decode([[1, 2]], [0])
