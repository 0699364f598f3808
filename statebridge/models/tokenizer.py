"""A small tokenizer for the checkpoints :func:`~statebridge.models.checkpoint.make_checkpoint`
writes: byte-level BPE trained with the ``tokenizers`` library on a text bundled with the package
(``tokenizer_corpus.txt``; no download), so that the demo and the HTTP front door send and print
text.

What lands in the checkpoint directory, as ``save_pretrained`` of a fast tokenizer writes it::

    tokenizer.json          the BPE model, byte-level pre-tokenizer and decoder, special tokens
    tokenizer_config.json   bos / eos / pad / unk tokens, the chat template (ChatML), class

- The vocabulary has exactly the config's ``vocab_size`` entries, and every id decodes to
  visible text (a random model samples every id alike; an id that decodes to nothing would make
  its completion's text empty). The merges trained on the bundled text come first; when the
  text runs out of merges (it has a few hundred), the rest is filled with ordinary BPE tokens,
  each with the merge that makes it: the bundled text's words whole, then (with every byte in
  the vocabulary) the visible characters of two UTF-8 bytes (Latin, Greek, Cyrillic, Hebrew,
  Arabic...), the numbers 0-999, then letter sequences (``ab``, `` ab``, `` Ab``, ``Ab``, ...),
  as many as it takes.
- The only special tokens are the real ones, at the config's ids: ``pad_token_id``,
  ``bos_token_id`` and ``eos_token_id`` (``<|im_end|>``, which also ends an assistant turn in
  the chat template), then ``<unk>`` and ``<|im_start|>`` on the next free ids. They decode to
  their own text unless skipped.
- The exceptions to "visible": the single-byte tokens of whitespace and control bytes (a space,
  a newline, ...) decode to that byte, and the single bytes 0x80-0xff that only begin or
  continue a character decode to U+FFFD alone. They stay: without them text with spaces or
  newlines, or any character, would not encode.
- Vocabularies too small for all 256 bytes (the tiny presets: 256) start from the bytes of the
  bundled text; characters outside it encode to ``<unk>``. Larger ones start from every byte,
  so any text encodes and decodes back to itself.
- Deterministic: the same config writes the same files.

It loads with ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import itertools
import json
import string
import unicodedata
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from statebridge.errors import ConfigError

__all__ = ["CHAT_TEMPLATE", "train_tokenizer", "write_tokenizer"]

#: ChatML, as LFM2 uses it: ``<|im_start|>role\ncontent<|im_end|>\n`` per message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

BOS, EOS, PAD, UNK, IM_START = "<|startoftext|>", "<|im_end|>", "<|pad|>", "<unk>", "<|im_start|>"


def _corpus() -> list[str]:
    text = resources.files("statebridge.models").joinpath("tokenizer_corpus.txt").read_text(
        encoding="utf-8")
    return [line for line in text.splitlines(keepends=True) if line.strip()]


def _special_tokens(config: Mapping[str, Any]) -> dict[int, str]:
    """The special tokens by id: pad / bos / eos at the config's ids, then unk and im_start on
    the next free ids."""
    vocab = int(config["vocab_size"])
    by_id: dict[int, str] = {}
    for key, token in (("pad_token_id", PAD), ("bos_token_id", BOS), ("eos_token_id", EOS)):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or not 0 <= value < vocab or value in by_id:
            raise ConfigError(f"{key}={value!r} cannot hold {token} in a vocabulary of {vocab} "
                              f"(taken: {by_id})")
        by_id[value] = token
    free = (i for i in range(vocab) if i not in by_id)
    for token in (UNK, IM_START):
        i = next(free, None)
        if i is None:
            raise ConfigError(f"vocab_size={vocab} has no id left for {token}")
        by_id[i] = token
    return by_id


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _visible(text: str) -> bool:
    return any(c.isprintable() and not c.isspace() for c in text)


class _Filler:
    """Grows a byte-level BPE vocabulary with tokens that decode to visible text, each made by
    one merge of two tokens already in it."""

    def __init__(self, tokens: list[str], merges: list[tuple[str, str]]) -> None:
        self.tokens, self.merges = tokens, merges
        self.known = set(tokens)
        self._byte = _byte_level_chars()
        self._char = {b: c for c, b in self._byte.items()}

    def byte_level(self, text: str) -> str:
        return "".join(self._char[b] for b in text.encode("utf-8"))

    def add(self, token: str) -> bool:
        if len(token) < 2 or token in self.known:
            return False
        try:
            text = bytes(self._byte[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):      # not byte-level, or not whole characters
            return False
        if not _visible(text):
            return False
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in self.known and right in self.known:
                self.tokens.append(token)
                self.merges.append((left, right))
                self.known.add(token)
                return True
        return False

    def candidates(self, corpus: list[str]) -> Iterator[str]:
        """Byte-level candidates in the order they are taken."""
        from tokenizers import pre_tokenizers

        split = pre_tokenizers.ByteLevel(add_prefix_space=False)
        counts: dict[str, int] = {}
        for line in corpus:
            for word, _ in split.pre_tokenize_str(line):
                counts[word] = counts.get(word, 0) + 1
        for word in sorted(counts, key=lambda w: -counts[w]):    # stable: first seen first
            for end in range(2, len(word) + 1):                   # its prefixes, then it whole
                yield word[:end]
        for code in range(0x80, 0x800):               # the characters of two UTF-8 bytes
            if unicodedata.category(chr(code))[0] in "LNPS":
                yield self.byte_level(chr(code))
        for number in range(1000):
            yield str(number)
            yield self.byte_level(f" {number}")
        for length in itertools.count(1):             # ab, " ab", " Ab", Ab, ...
            for letters in itertools.product(string.ascii_lowercase, repeat=length):
                piece = "".join(letters)
                for text in (piece, f" {piece}", f" {piece.capitalize()}", piece.capitalize()):
                    yield self.byte_level(text)


def train_tokenizer(config: Mapping[str, Any]):
    """A ``tokenizers.Tokenizer`` of exactly ``config["vocab_size"]`` ids for ``config`` (a
    checkpoint's config.json as a dict)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = config.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"vocab_size must be a positive integer, got {vocab!r}")
    specials = _special_tokens(config)
    regular = vocab - len(specials)
    corpus = _corpus()
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    full_bytes = vocab >= len(byte_alphabet) + len(specials) + 64
    trainer = trainers.BpeTrainer(
        vocab_size=regular, show_progress=False, min_frequency=2,
        initial_alphabet=byte_alphabet if full_bytes else [])
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    trained = spec["model"]["vocab"]
    tokens = sorted(trained, key=trained.__getitem__)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in spec["model"]["merges"]]
    if len(tokens) > regular:
        raise ConfigError(f"trained tokenizer has {len(tokens)} ids, more than the "
                          f"{regular} that vocab_size {vocab} leaves beside {len(specials)} "
                          f"special tokens")
    if len(tokens) < regular:
        filler = _Filler(tokens, merges)
        for candidate in filler.candidates(corpus):
            if filler.add(candidate) and len(tokens) == regular:
                break
    free = (i for i in range(vocab) if i not in specials)
    ids = {token: next(free) for token in tokens}
    ids.update({token: i for i, token in specials.items()})
    spec["model"]["vocab"] = dict(sorted(ids.items(), key=lambda item: item[1]))
    spec["model"]["merges"] = [list(m) for m in merges]
    spec["added_tokens"] = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i, token in sorted(specials.items())]
    tok = Tokenizer.from_str(json.dumps(spec))
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise ConfigError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, "
                          f"expected {vocab}")
    for i, token in specials.items():
        if tok.token_to_id(token) != i:
            raise ConfigError(f"special token {token} got id {tok.token_to_id(token)}, "
                              f"expected {i}")
    return tok


def write_tokenizer(config: Mapping[str, Any], out_dir: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``config`` into ``out_dir``."""
    out = Path(out_dir)
    tok = train_tokenizer(config)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    tokens = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "pad_token_id")):
        if config.get(name) is None:
            tokens[key] = None
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config.get("max_position_embeddings") or 8192),
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
