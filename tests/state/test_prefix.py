"""Prefix hashes, checkpoint keys and the longest usable prefix, against a brute-force model that
compares token lists (never the hashes under test)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random

import numpy as np
import pytest

from statebridge.errors import ConfigError
from statebridge.state import prefix
from statebridge.state.kv import BlockGeometry
from statebridge.state.layout import PageGeometry
from statebridge.state.prefix import Checkpoint, PrefixHasher, PrefixIndex, PrefixSalt
from statebridge.state.spec import StateSpec

BS, STRIDE = 4, 8                # small sizes: a prompt of 37 tokens spans 9 full blocks + 1

SPEC = StateSpec.from_config({"model_type": "lfm2", "hidden_size": 8, "conv_L_cache": 3,
                              "num_attention_heads": 4, "num_key_value_heads": 2,
                              "layer_types": ["conv", "full_attention", "conv"]})
SALT = PrefixSalt(model="m", spec_json=SPEC.to_json(), page_layout="DLS", page_size=256,
                  kv_layout="HBLCTE", kv_block_size=BS, tp_size=2, num_ranks=2)


def hasher(salt=SALT, block_size=BS, stride=STRIDE) -> PrefixHasher:
    return PrefixHasher(salt, block_size, stride=stride)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(length)]


# -- the salt ------------------------------------------------------------------------------------
OTHER = {"model": "m2", "spec_json": StateSpec.from_config(
             {"model_type": "lfm2", "hidden_size": 8, "conv_L_cache": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "torch_dtype": "bfloat16",
              "layer_types": ["conv", "full_attention", "conv"]}).to_json(),
         "page_layout": "LDS", "page_size": 320, "kv_layout": "BHLCTE", "kv_block_size": 8,
         "tp_size": 4, "num_ranks": 4}


def test_other_salt_fields_cover_every_field():
    assert set(OTHER) == {f.name for f in dataclasses.fields(PrefixSalt)}
    assert all(getattr(SALT, k) != v for k, v in OTHER.items())


@pytest.mark.parametrize("field", sorted(OTHER))
def test_every_salt_field_changes_every_hash_and_key(field):
    changed = dataclasses.replace(SALT, **{field: OTHER[field]})
    assert changed.digest() != SALT.digest()
    tokens = prompt_of(13)
    a, b = hasher().prompt(tokens), PrefixHasher(changed.digest(), BS, stride=STRIDE).prompt(tokens)
    assert a.hasher.root != b.hasher.root
    assert all(x != y for x, y in zip(a.hashes, b.hashes)) and len(a.hashes) == 3
    assert all(a.key_at(n) != b.key_at(n) for n in range(1, 14))


def test_salt_of_real_geometries_tells_layouts_tp_and_block_sizes_apart():
    digests = {}
    for layout, kv_layout, tp, bs in itertools.product(("DLS", "LDS", "LSD"), ("HB", "BH"),
                                                       (1, 2), (4, 16)):
        pages = PageGeometry(SPEC, tp, layout)
        blocks = BlockGeometry(SPEC.kv, tp, kv_layout, bs, 8)
        salt = PrefixSalt.of(SPEC, pages, blocks)
        assert (salt.page_layout, salt.kv_layout, salt.tp_size, salt.num_ranks,
                salt.kv_block_size, salt.page_size) == (
            layout, blocks.layout.order, tp, tp, bs, pages.page_size)
        digests[(layout, kv_layout, tp, bs)] = salt.digest()
    assert len(set(digests.values())) == len(digests) == 24
    no_kv = PrefixSalt.of(SPEC, PageGeometry(SPEC, 1, "DLS"))
    assert (no_kv.kv_layout, no_kv.kv_block_size) == ("", 0)


def test_salt_and_hasher_reject_bad_values():
    with pytest.raises(ConfigError, match="tp_size"):
        dataclasses.replace(SALT, tp_size=0)
    with pytest.raises(ConfigError, match="kv_block_size"):
        dataclasses.replace(SALT, kv_block_size=-1)
    with pytest.raises(ConfigError, match="differs from the KV block size"):
        PrefixHasher(SALT, 8)
    for bad in (-1, True, 2.0):
        with pytest.raises(ConfigError, match="stride"):
            PrefixHasher(SALT, BS, stride=bad)
    with pytest.raises(ConfigError, match="salt"):
        PrefixHasher(b"", BS)


# -- hashes and keys -----------------------------------------------------------------------------
def test_any_token_changes_exactly_the_hashes_and_keys_that_cover_it():
    h = hasher()
    tokens = prompt_of(37)
    base = h.prompt(tokens)
    assert len(base.hashes) == 37 // BS
    for j in range(37):
        changed = list(tokens)
        changed[j] += 1
        other = h.prompt(changed)
        for i in range(len(base.hashes)):              # block i covers tokens [0, (i+1)*BS)
            assert (base.hashes[i] != other.hashes[i]) == (j < (i + 1) * BS), (j, i)
        for n in range(1, 38):
            assert (base.key_at(n) != other.key_at(n)) == (j < n), (j, n)


@pytest.mark.parametrize("block_size", [1, 4, 16, 27, 28, 29, 32, 60, 64],
                         ids=lambda bs: f"bs{bs}")             # 16 + 4 * bs vs 128-byte blocks
def test_block_hashes_are_the_documented_chain_in_c_and_in_python(monkeypatch, block_size):
    """h[i] = blake2b(h[i-1] | tokens of block i as little-endian int32, digest_size=16) with
    h[-1] = root, whether the C extension or its hashlib fallback computes it."""
    pytest.importorskip("statebridge.state._chainhash", reason="C extension not built")
    h = hasher(salt=b"s", block_size=block_size)
    for length in (0, block_size - 1, block_size, 5 * block_size + 3, 40 * block_size):
        tokens = prompt_of(length, seed=length)
        if tokens:
            tokens[-1] = 2**31 - 1                              # the largest id
        raw = np.asarray(tokens, "<i4").tobytes()
        expected, prev = [], h.root
        for i in range(len(tokens) // block_size):
            block = raw[i * block_size * 4:(i + 1) * block_size * 4]
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            expected.append(prev)
        assert prefix._chain is not prefix._chain_hashes      # the C one, built by pip install
        assert h.prompt(tokens).hashes == expected
        assert h.first_hash(raw) == (expected[0] if expected else None)   # from the wire
        monkeypatch.setattr(prefix, "_chain", prefix._chain_hashes)
        assert h.prompt(tokens).hashes == expected
        assert h.first_hash(raw) == (expected[0] if expected else None)
        monkeypatch.undo()


def test_keys_are_the_documented_hash():
    """key(n) = blake2b("ckpt" | anchor(n) | tokens[(n//bs)*bs:n] | n as 8 bytes LE, 16)."""
    h = hasher()
    tokens = prompt_of(37)
    p = h.prompt(tokens)
    raw = np.asarray(tokens, "<i4").tobytes()
    for n in range(1, 38):
        tail = raw[n // BS * BS * 4:n * 4]
        expected = hashlib.blake2b(b"ckpt" + p.anchor(n) + tail + n.to_bytes(8, "little"),
                                   digest_size=16).digest()
        assert p.key_at(n) == p.checkpoint(n).key == expected, n


def test_keys_name_the_prefix_only():
    h = hasher()
    tokens = prompt_of(37)
    long = h.prompt(tokens + prompt_of(11, seed=1))
    keys = [h.prompt(tokens).key_at(n) for n in range(1, 38)]
    assert len(set(keys)) == 37                        # every length its own key
    for n in range(1, 38):
        assert long.key_at(n) == keys[n - 1] == h.checkpoint_key(tokens, n) \
            == h.checkpoint_key(tokens[:n], n)
        assert h.prompt(tokens[:n]).key_at(n) == keys[n - 1]
        assert long.anchor(n) == (long.hashes[n // BS - 1] if n >= BS else h.root)
        assert long.checkpoint(n) == Checkpoint(keys[n - 1], n, long.anchor(n))


@pytest.mark.parametrize("container", [list, tuple, lambda t: np.asarray(t, np.int64),
                                       lambda t: np.asarray(t, np.int32),
                                       lambda t: np.asarray(t, np.uint32)],
                         ids=["list", "tuple", "int64", "int32", "uint32"])
def test_the_container_does_not_matter(container):
    tokens = prompt_of(21) + [2**31 - 1, 0]
    h = hasher()
    assert h.prompt(container(tokens)).hashes == h.prompt(tokens).hashes
    assert h.prompt(container(tokens)).key_at(23) == h.prompt(tokens).key_at(23)


def test_the_stride_does_not_change_keys_but_the_block_size_does():
    tokens = prompt_of(20)
    a = PrefixHasher(b"s", 4, stride=8).prompt(tokens)
    b = PrefixHasher(b"s", 4, stride=256).prompt(tokens)
    c = PrefixHasher(b"s", 5, stride=8).prompt(tokens)
    assert [a.key_at(n) for n in range(1, 21)] == [b.key_at(n) for n in range(1, 21)]
    assert not {a.key_at(n) for n in range(1, 21)} & {c.key_at(n) for n in range(1, 21)}


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], [[1, 2]], np.asarray([5, -1], np.int32),
                                 np.asarray([2**31], np.uint32), np.asarray([-2, 2**40])],
                         ids=["negative", "int32-overflow", "float", "2-D", "int32-negative",
                              "uint32-overflow", "int64-both"])
def test_bad_tokens_are_refused(bad):
    with pytest.raises(ConfigError):
        hasher().prompt(bad)


def test_key_lengths_out_of_range_are_refused():
    p = hasher().prompt(prompt_of(5))
    for n in (0, 6, -1, True):
        with pytest.raises(ConfigError):
            p.key_at(n)


@pytest.mark.parametrize("length, start, expected", [
    (21, 0, [8, 16, 21]), (16, 0, [8, 16]), (21, 8, [16, 21]), (21, 9, [16, 21]),
    (16, 16, []), (5, 0, [5]), (1, 0, [1]), (0, 0, []), (9, 7, [8, 9]), (24, 3, [8, 16, 24])])
def test_checkpoint_positions(length, start, expected):
    assert hasher().checkpoint_positions(length, start) == expected


@pytest.mark.parametrize("length, start, expected", [
    (21, 0, [21]), (16, 8, [16]), (16, 16, []), (1, 0, [1]), (0, 0, [])])
def test_without_a_stride_only_the_prompt_end_is_a_checkpoint(length, start, expected):
    assert PrefixHasher(SALT, BS, stride=0).checkpoint_positions(length, start) == expected


# -- the index -----------------------------------------------------------------------------------
def brute_longest(cached: list[tuple[list[int], int]], query: list[int], cap: int | None = None):
    """The longest n <= cap (default len - 1) with some cached (prompt, n) whose first n tokens
    are the query's first n."""
    limit = len(query) - 1 if cap is None else min(cap, len(query))
    best = 0
    for tokens, n in cached:
        if n <= limit and len(query) >= n and tokens[:n] == query[:n]:
            best = max(best, n)
    return best


def index_of(h, cached):
    index = PrefixIndex()
    for tokens, n in cached:
        c = h.prompt(tokens).checkpoint(n)
        if c.key not in index:
            index.add(c, (tuple(tokens[:n]), n))
    return index


def test_longest_at_every_position_of_one_cached_prompt():
    h = hasher()
    tokens = prompt_of(37)
    positions = h.checkpoint_positions(37)             # 8, 16, 24, 32, 37
    index = index_of(h, [(tokens, n) for n in positions])
    for length in range(0, 50):                        # the same prompt cut or extended
        query = (tokens + prompt_of(13, seed=7))[:length]
        expected = max([n for n in positions if n <= length - 1], default=0)
        match = index.longest(h.prompt(query))
        assert match.tokens == expected, length
        if expected:
            assert match.entry == (tuple(tokens[:expected]), expected)
            assert match.key == h.prompt(query).key_at(expected)
        else:
            assert (match.key, match.entry) == (b"", None)


def test_a_prompt_equal_to_a_cached_one_leaves_its_last_token_to_prefill():
    h = hasher()
    tokens = prompt_of(37)
    index = index_of(h, [(tokens, n) for n in h.checkpoint_positions(37)])
    assert index.longest(h.prompt(tokens)).tokens == 32          # not 37: capped, rounded down
    assert index.longest(h.prompt(tokens), cap=37).tokens == 37  # a caller may allow it
    assert index.longest(h.prompt(tokens), cap=31).tokens == 24
    index = index_of(h, [(tokens, 37), (tokens, 36)])
    assert index.longest(h.prompt(tokens)).tokens == 36


def test_hits_that_end_inside_a_block_and_short_prompts():
    h = hasher()
    short = prompt_of(3)                                         # shorter than one block
    mid = prompt_of(14, seed=3)                                  # ends inside block 3
    index = index_of(h, [(short, 3), (short, 2), (mid, 14), (mid, 13), (mid, 8)])
    assert index.longest(h.prompt(short + [5])).tokens == 3
    assert index.longest(h.prompt(short)).tokens == 2
    assert index.longest(h.prompt(short[:1])).tokens == 0
    assert index.longest(h.prompt([])).tokens == 0
    assert index.longest(h.prompt(mid + [1, 2])).tokens == 14
    assert index.longest(h.prompt(mid[:13] + [mid[13] + 1])).tokens == 13   # differs at 13
    assert index.longest(h.prompt(mid[:12] + [mid[12] + 1, 0])).tokens == 8
    assert index.longest(h.prompt(mid[:9] + [mid[9] + 1] + mid[10:])).tokens == 8


def test_accept_skips_entries_and_remove_forgets_them():
    h = hasher()
    tokens = prompt_of(30)
    index = index_of(h, [(tokens, 8), (tokens, 16), (tokens, 21)])
    query = h.prompt(tokens)
    assert index.longest(query, accept=lambda e: e[1] != 21).tokens == 16
    key = query.key_at(16)
    assert index.remove(key) == (tuple(tokens[:16]), 16) and key not in index
    assert index.longest(query, accept=lambda e: e[1] != 21).tokens == 8
    with pytest.raises(KeyError):
        index.remove(key)
    with pytest.raises(ConfigError, match="indexed already"):
        index.add(query.checkpoint(8), None)
    assert sorted(c.tokens for c in index) == [8, 21] and len(index) == 2
    index.clear()
    assert index.longest(query).tokens == 0 and not len(index)


@pytest.mark.parametrize("seed", range(6))
def test_longest_matches_a_brute_force_model(seed):
    """Random prompts over a 3-token vocabulary (many shared prefixes), random checkpoint sets,
    random queries and caps."""
    rng = random.Random(seed)
    h = hasher()
    roots = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    prompts = []
    for _ in range(12):
        base = rng.choice(roots)
        cut = rng.randrange(len(base) + 1)
        prompts.append(base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 20))])
    cached = [(p, n) for p in prompts if p
              for n in rng.sample(range(1, len(p) + 1), min(len(p), 3))]
    index = index_of(h, cached)
    for _ in range(200):
        base = rng.choice(prompts + roots)
        query = base[:rng.randrange(len(base) + 1)] + [rng.randrange(3)
                                                      for _ in range(rng.randrange(0, 8))]
        cap = rng.choice([None, rng.randrange(0, 40)])
        assert index.longest(h.prompt(query), cap=cap).tokens == \
            brute_longest(cached, query, cap), (query, cap)


def test_prompts_that_share_blocks_and_differ_in_the_tail_are_both_found():
    h = hasher()
    a = prompt_of(14, seed=5)
    b = a[:13] + [a[13] + 1]                          # same full blocks, same length
    c = a[:8] + [a[8] + 1]                            # differs right after block 1
    index = index_of(h, [(a, 14), (b, 14), (c, 9)])
    assert index.longest(h.prompt(a + [0])).entry == (tuple(a), 14)
    assert index.longest(h.prompt(b + [0])).entry == (tuple(b), 14)
    assert index.longest(h.prompt(c + [0])).entry == (tuple(c), 9)
    index.remove(h.prompt(a).key_at(14))
    assert index.longest(h.prompt(a + [0])).tokens == 0
    assert index.longest(h.prompt(b + [0])).tokens == 14
