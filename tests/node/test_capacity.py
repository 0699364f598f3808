"""KV pools sized in tokens or GiB per node, the pool that binds a pair, max_model_len, and the
UCX warning switch of the ranks."""

from __future__ import annotations

import pytest

from statebridge.config import DEFAULT_KV_REQUESTS, NodeConfig
from statebridge.connector.data.env import quiet_unused_env_warnings
from statebridge.errors import ConfigError
from statebridge.models.checkpoint import make_checkpoint
from statebridge.node.capacity import capacity_message, max_model_len, pair_bounds
from statebridge.state.spec import StateSpec

# make-checkpoint lfm2-hybrid tiny: 2 attention layers x 4 KV heads x 8 dims, float32:
# K and V of one token = 2 x 2 x 4 x 8 x 4 bytes at TP 1.
TOKEN_BYTES_TP1 = 512


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return StateSpec.from_pretrained(make_checkpoint("lfm2-hybrid",
                                                     tmp_path_factory.mktemp("ck") / "m"))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_pool_in_tokens_holds_those_tokens_at_any_tp(spec, tp):
    assert NodeConfig(kv_tokens=1000).num_blocks(spec, tp) == 63           # ceil(1000 / 16)
    default = NodeConfig(max_prompt_len=100, max_new_tokens=28)
    assert default.kv_tokens_default() == DEFAULT_KV_REQUESTS * 128
    assert default.num_blocks(spec, tp) == DEFAULT_KV_REQUESTS * 128 // 16


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_pool_in_gib_is_split_over_the_ranks(spec, tp):
    per_block = TOKEN_BYTES_TP1 * 16 // tp
    assert NodeConfig(kv_gib=0.5).num_blocks(spec, tp) == (1 << 29) // tp // per_block


def test_the_per_rank_bytes_knob_still_sizes_the_pool(spec):
    assert NodeConfig(kv_memory=1 << 20).num_blocks(spec, 1) == (1 << 20) // (512 * 16)
    assert NodeConfig(kv_memory=1 << 20).num_blocks(spec, 2) == (1 << 20) // (256 * 16)


@pytest.mark.parametrize("field,value", [
    ("kv_tokens", -1), ("kv_tokens", 2.5), ("kv_gib", -2.0), ("kv_gib", float("nan")),
    ("kv_gib", float("inf")), ("kv_gib", "1"), ("kv_memory", -4), ("kv_blocks", True)])
def test_a_bad_pool_size_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be .*got {value!r}"):
        NodeConfig(**{field: value})


def test_two_pool_sizes_at_once_are_refused_naming_both():
    with pytest.raises(ConfigError, match="kv_tokens=100, kv_gib=2"):
        NodeConfig(kv_tokens=100, kv_gib=2)


def test_a_pool_larger_than_the_machine_is_refused_naming_the_value(spec):
    per_block = TOKEN_BYTES_TP1 * 16 // 2
    with pytest.raises(ConfigError, match=r"kv_tokens=1600: 100 KV blocks per rank x "
                                          rf"{per_block} bytes x TP 2 = {100 * per_block * 2} "
                                          r"bytes exceeds this machine's memory of 1000 bytes"):
        NodeConfig(kv_tokens=1600).num_blocks(spec, 2, physical_memory=1000)
    with pytest.raises(ConfigError, match=r"kv_gib=1e\+06: "):
        NodeConfig(kv_gib=1e6).num_blocks(spec, 2)
    with pytest.raises(ConfigError, match="kv_gib=1e-09 holds no KV block"):
        NodeConfig(kv_gib=1e-9).num_blocks(spec, 2)


def _bounds(**overrides):
    args = dict(decode_id="decode-d", decode_tp=2, decode_pages=64, decode_blocks=2730,
                prefill_id="prefill-p", prefill_tp=1, prefill_pages=64, prefill_blocks=1365,
                block_size=16, max_prompt_len=1024, max_model_len=1280)
    args.update(overrides)
    return pair_bounds(**args)


def test_equal_bytes_per_rank_make_the_lower_tp_prefill_pool_bind():
    # 256 MiB per rank of LFM2-1.2B's KV (12 KiB a token at TP 1): 21,840 tokens on the TP 1
    # prefill rank, 43,680 on each TP 2 decode rank; 1k-token prompts, 256 new tokens.
    bounds = _bounds()
    assert (bounds[0].side, bounds[0].pool, bounds[0].requests) == ("prefill", "KV pool",
                                                                     1365 // 64)
    warn, line = capacity_message(bounds)
    assert warn
    assert line.startswith("21 requests of the longest length fit at once; the binding pool "
                           "is the KV pool of prefill node prefill-p (TP 1): 21,840 tokens per "
                           "rank = 21 requests of 1,023 tokens")
    assert "the KV pool of decode node decode-d (TP 2): 43,680 tokens per rank = 34 " \
           "requests of 1,280 tokens" in line
    assert "not the 64 pages, bounds concurrency" in line


def test_a_binding_decode_pool_is_said_not_warned_about():
    warn, line = capacity_message(_bounds(decode_blocks=400))        # 400 // 80 = 5 requests
    assert not warn
    assert line.startswith("5 requests of the longest length fit at once; the binding pool is "
                           "the KV pool of decode node decode-d (TP 2)")
    assert "not the 64 pages, bounds concurrency" in line


def test_pages_binding_is_no_warning_and_a_pool_without_kv_bounds_nothing():
    warn, line = capacity_message(_bounds(decode_pages=8))
    assert not warn and "binding pool is the pages of decode node decode-d (TP 2): 8 pages" \
        in line
    bounds = _bounds(decode_blocks=0, prefill_blocks=0, prefill_pages=4)
    assert [b.pool for b in bounds] == ["pages", "pages"] and bounds[0].side == "prefill"


def test_a_pool_that_holds_no_longest_request_says_so():
    warn, line = capacity_message(_bounds(prefill_blocks=10))
    assert warn and line.startswith("0 requests of the longest length fit at once")
    assert "A request of 1,023 tokens never fits in it" in line


def test_max_model_len_is_what_one_decode_rank_holds_at_most():
    assert max_model_len(12288, 4096) == 4096
    assert max_model_len(1500, 4096) == 1500
    assert max_model_len(1500, 0) == 1500                    # no KV pool: the limits


def test_the_ucx_warning_switch_keeps_a_users_setting():
    env: dict[str, str] = {}
    assert quiet_unused_env_warnings(env) and env == {"UCX_WARN_UNUSED_ENV_VARS": "n"}
    env = {"UCX_WARN_UNUSED_ENV_VARS": "y"}
    assert not quiet_unused_env_warnings(env) and env == {"UCX_WARN_UNUSED_ENV_VARS": "y"}

