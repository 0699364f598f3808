"""make-checkpoint's tokenizer covers its whole vocabulary with visible text: every id a model
can sample decodes to something a reader sees, at the tiny presets' 256, the small presets'
2,048 and a real model's 65,536; only the real special tokens are special, at the config's ids;
text round-trips. (Loading, streaming and the chat template: tests/node/test_text.py.)"""

from __future__ import annotations

import json
import random

import pytest

from statebridge.errors import ConfigError
from statebridge.models.checkpoint import _preset_config
from statebridge.models.tokenizer import train_tokenizer, write_tokenizer

PAD, BOS, EOS, UNK, IM_START = "<|pad|>", "<|startoftext|>", "<|im_end|>", "<unk>", "<|im_start|>"

# Bytes whose single-byte token cannot show anything: C0 controls, the space, DEL.
INVISIBLE_BYTES = {bytes([b]) for b in range(0x21)} | {b"\x7f"}

#: id -> (config, special tokens by id, whether every byte is in the vocabulary)
CASES = {
    "lfm2-tiny-256": (_preset_config("lfm2", "tiny", "float32", None),
                      {0: PAD, 1: BOS, 2: EOS, 3: UNK, 4: IM_START}, False),
    "mamba2-tiny-256": (_preset_config("mamba2", "tiny", "float32", None),
                        {0: BOS, 1: PAD, 2: EOS, 3: UNK, 4: IM_START}, False),
    "lfm2-small-2048": (_preset_config("lfm2-hybrid", "small", "float32", None),
                        {0: PAD, 1: BOS, 2: EOS, 3: UNK, 4: IM_START}, True),
    "mamba2-small-2048": (_preset_config("mamba2", "small", "float32", None),
                          {0: BOS, 1: PAD, 2: EOS, 3: UNK, 4: IM_START}, True),
    "lfm2-65536": (_preset_config("lfm2-hybrid", "small", "float32", {"vocab_size": 65536}),
                   {0: PAD, 1: BOS, 2: EOS, 3: UNK, 4: IM_START}, True),
    # Special ids apart: the ids between them are ordinary tokens, not placeholders.
    "gaps-1000": (_preset_config("lfm2", "tiny", "float32", {
        "vocab_size": 1000, "pad_token_id": 9, "bos_token_id": 0, "eos_token_id": 500}),
        {9: PAD, 0: BOS, 500: EOS, 1: UNK, 2: IM_START}, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    config, specials, full_bytes = CASES[request.param]
    return config, specials, full_bytes, train_tokenizer(config)


def test_every_id_decodes_to_visible_text(case):
    config, specials, full_bytes, tok = case
    vocab = config["vocab_size"]
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    invisible = set()
    for i in range(vocab):
        if i in specials:
            assert tok.decode([i], skip_special_tokens=False) == specials[i]
            continue
        text = tok.decode([i], skip_special_tokens=True)
        assert text != "", (i, tok.id_to_token(i))
        if not any(c.isprintable() and not c.isspace() for c in text):
            invisible.add(text.encode("utf-8"))
    # The only exceptions: single-byte whitespace / control tokens (needed to encode text).
    if full_bytes:
        assert invisible == INVISIBLE_BYTES
    else:                                   # the bundled text's bytes: a space and a newline
        assert invisible == {b" ", b"\n"}


def test_only_the_real_special_tokens_are_special_at_the_configs_ids(case):
    config, specials, _, tok = case
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    assert added == specials
    assert all(t.special for t in tok.get_added_tokens_decoder().values())
    assert tok.token_to_id(PAD) == config["pad_token_id"]
    assert tok.token_to_id(BOS) == config["bos_token_id"]
    assert tok.token_to_id(EOS) == config["eos_token_id"]
    assert not [t for t in tok.get_vocab() if "reserved" in t]


def test_every_ordinary_token_is_a_byte_or_made_by_one_merge(case):
    """Real BPE entries: a token longer than one byte-level character is the result of a merge
    of two tokens of the vocabulary (so text containing it can encode to it)."""
    _, specials, _, tok = case
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    merges = {"".join(pair) for pair in spec["model"]["merges"]}
    for pair in spec["model"]["merges"]:
        assert pair[0] in vocab and pair[1] in vocab, pair
    for token, i in vocab.items():
        if i not in specials and len(token) > 1:
            assert token in merges, (i, token)


SAMPLE = ("The old man rowed down the river, and the mist lay low over the water.\n"
          "When the sun came over the hills, 42 birds called to one another!")
UNICODE = "Café, Ünïcode and ✓ 漢字 🙂 -- two  spaces,\ttab\r\nand \x00 control."


def test_text_round_trips(case):
    _, _, full_bytes, tok = case
    texts = [SAMPLE] + ([UNICODE, "".join(chr(c) for c in range(32, 0x800))] if full_bytes
                        else [])
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert tok.encode(tok.decode(ids), add_special_tokens=False).ids == ids
        assert tok.token_to_id(UNK) not in ids


def test_random_ids_make_visible_text(case):
    """What a random model does: sample ids uniformly. The text is not empty."""
    config, specials, _, tok = case
    rng = random.Random(0)
    ids = [i for i in (rng.randrange(config["vocab_size"]) for _ in range(16)) if i not in specials]
    text = tok.decode(ids)
    assert sum(not c.isspace() for c in text) >= len(ids)


def test_the_65536_tokenizer_is_deterministic_and_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config, specials, _ = CASES["lfm2-65536"]
    write_tokenizer(config, tmp_path)
    first = (tmp_path / "tokenizer.json").read_text()
    write_tokenizer(config, tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == first
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(hf) == 65536
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    rng = random.Random(1)
    ids = [rng.randrange(5, 65536) for _ in range(64)]
    assert hf.decode(ids).strip()
    assert hf.encode(SAMPLE, add_special_tokens=False) == train_tokenizer(config).encode(
        SAMPLE, add_special_tokens=False).ids
    rendered = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert rendered == "<|startoftext|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("vocab", [0, "256", True])
def test_a_bad_vocab_size_is_a_config_error(vocab):
    config = dict(CASES["lfm2-tiny-256"][0], vocab_size=vocab)
    with pytest.raises(ConfigError, match="vocab_size"):
        train_tokenizer(config)
