"""The text layer without processes: the bundled tokenizer, incremental detokenization, stop
strings and EOS, chat templates."""

from __future__ import annotations

import json
import random

import pytest

from statebridge.errors import ConfigError, InvalidRequestError
from statebridge.models.checkpoint import _preset_config, make_checkpoint
from statebridge.models.tokenizer import train_tokenizer
from statebridge.node.text import NoChatTemplateError, TextTokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "lfm2"
    make_checkpoint("lfm2", out, preset="tiny")
    return out


@pytest.fixture(scope="module")
def tok(tiny):
    return TextTokenizer.from_dir(tiny)


CONFIGS = [pytest.param(arch, preset, id=f"{arch}-{preset}")
           for arch in ("lfm2", "mamba2", "lfm2-hybrid", "granite-hybrid")
           for preset in ("tiny", "small")]


@pytest.mark.parametrize("arch,preset", CONFIGS)
def test_vocab_is_exactly_the_configs_and_specials_sit_at_its_ids(arch, preset):
    config = _preset_config(arch, preset, "float32", None)
    tokenizer = train_tokenizer(config)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    assert tokenizer.token_to_id("<|pad|>") == config["pad_token_id"]
    assert tokenizer.token_to_id("<|startoftext|>") == config["bos_token_id"]
    assert tokenizer.token_to_id("<|im_end|>") == config["eos_token_id"]
    for i in range(config["vocab_size"]):        # every id the model can sample decodes
        assert isinstance(tokenizer.decode([i]), str)
    assert train_tokenizer(config).to_str() == tokenizer.to_str()      # deterministic


def test_loads_with_transformers_and_tokenizers(tiny, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny))
    text = "Hello! How are you today? The river ran through the valley."
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text == tok.decode(tok.encode(text))
    messages = [{"role": "user", "content": "How many days are there in a week?"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages)
    assert hf.eos_token_id in tok.eos_token_ids
    assert tok.eos_token_ids == {json.loads((tiny / "config.json").read_text())["eos_token_id"]}


def _deltas(tok, ids, stop=(), chunk=1):
    stream = tok.stream(stop)
    out = []
    for i in range(0, len(ids), chunk):
        delta, finish = stream.push(ids[i:i + chunk])
        out.append(delta)
        if finish:
            return out, finish, stream
    out.append(stream.close())
    return out, None, stream


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_the_full_decode(tok, seed, chunk):
    rng = random.Random(seed)
    eos = tok.eos_token_ids
    ids = [t for t in (rng.randrange(tok.vocab_size) for _ in range(40)) if t not in eos]
    deltas, finish, stream = _deltas(tok, ids, chunk=chunk)
    assert finish is None
    assert "".join(deltas) == tok.decode(ids)
    assert stream.tokens == len(ids)


def test_an_incomplete_utf8_tail_comes_out_at_close(tmp_path):
    config = _preset_config("lfm2", "small", "float32", None)       # every byte in the vocab
    tokenizer = train_tokenizer(config)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer.from_dir(tmp_path)
    ids = tok.encode("café ✓ done")
    deltas, _, _ = _deltas(tok, ids)
    assert "".join(deltas) == "café ✓ done"
    cut = ids[:-3]                   # may end inside a multi-byte character
    assert "".join(_deltas(tok, cut)[0]) == tok.decode(cut)


@pytest.mark.parametrize("stop,want", [
    (("river",), "The old man rowed down the "),
    ((" down", "old"), "The "),
    (("zzz",), None),
    (("n r",), "The old ma"),
], ids=["one", "earliest-of-two", "absent", "spans-tokens"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_strings_cut_the_text_before_them(tok, stop, want, chunk):
    text = "The old man rowed down the river to the town."
    ids = tok.encode(text)
    deltas, finish, stream = _deltas(tok, ids, stop, chunk)
    if want is None:
        assert finish is None and "".join(deltas) == text
    else:
        assert finish == "stop" and "".join(deltas) == want
        assert stream.tokens <= len(ids)
        for i in range(len(deltas)):     # never sent a piece of the stop string, then cut it
            assert want.startswith("".join(deltas[:i + 1]))


def test_eos_stops_and_is_not_text(tok):
    (eos,) = tok.eos_token_ids
    ids = tok.encode("Good morning.") + [eos] + tok.encode(" More")
    deltas, finish, stream = _deltas(tok, ids)
    assert finish == "stop" and "".join(deltas) == "Good morning."
    assert stream.tokens == len(tok.encode("Good morning.")) + 1
    assert stream.push([5]) == ("", "stop")


def test_chat_template_renders_chatml_with_content_parts(tok):
    prompt = tok.apply_chat_template([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text",
                                                                        "text": " there"}]}])
    assert prompt == ("<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids[0] == tok.tokenizer.token_to_id("<|startoftext|>")
    assert tok.tokenizer.token_to_id("<|im_start|>") in ids


@pytest.mark.parametrize("messages", [
    [{"content": "no role"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
    [{"role": "user", "content": 7}],
    ["text"],
], ids=["no-role", "image-part", "int-content", "not-an-object"])
def test_bad_messages_are_invalid_requests(tok, messages):
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(messages)


def test_no_chat_template_is_its_own_invalid_request(tiny, tmp_path):
    (tmp_path / "tokenizer.json").write_text((tiny / "tokenizer.json").read_text())
    tok = TextTokenizer.from_dir(tmp_path)
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_checkpoint_without_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
