"""A small tokenizer for the checkpoints :func:`~statebridge.models.checkpoint.make_checkpoint`
writes: byte-level BPE trained with the ``tokenizers`` library on a text bundled with the package
(``tokenizer_corpus.txt``; no download), so that the demo and the HTTP front door send and print
text.

What lands in the checkpoint directory, as ``save_pretrained`` of a fast tokenizer writes it::

    tokenizer.json          the BPE model, byte-level pre-tokenizer and decoder, special tokens
    tokenizer_config.json   bos / eos / pad / unk tokens, the chat template (ChatML), class

- The vocabulary has exactly the config's ``vocab_size`` entries: trained merges up to it, then
  reserved special tokens (``<|reserved_N|>``) if the text runs out of merges, so every id the
  model can sample decodes (a reserved or special token decodes to nothing).
- The special tokens sit at the config's ids: ``pad_token_id``, ``bos_token_id`` and
  ``eos_token_id`` (``<|im_end|>``, which also ends an assistant turn in the chat template), then
  ``<unk>`` and ``<|im_start|>`` on the next free ids.
- Vocabularies too small for all 256 bytes (the tiny presets: 256) start from the bytes of the
  bundled text; characters outside it encode to ``<unk>``. Larger ones start from every byte.
- Deterministic: the same config writes the same files.

It loads with ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import json
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


def _special_tokens(config: Mapping[str, Any]) -> list[str]:
    """The special tokens in id order: pad / bos / eos at the config's ids, then unk and
    im_start on the next free ids (gaps filled with reserved tokens)."""
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
        by_id[next(free)] = token
    top = max(by_id)
    return [by_id.get(i, f"<|reserved_gap_{i}|>") for i in range(top + 1)]


def train_tokenizer(config: Mapping[str, Any]):
    """A ``tokenizers.Tokenizer`` of exactly ``config["vocab_size"]`` ids for ``config`` (a
    checkpoint's config.json as a dict)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = int(config["vocab_size"])
    specials = _special_tokens(config)
    corpus = _corpus()
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    full_bytes = vocab >= len(byte_alphabet) + len(specials) + 64
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, show_progress=False, min_frequency=2,
        initial_alphabet=byte_alphabet if full_bytes else [])
    tok.train_from_iterator(corpus, trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have > vocab:
        raise ConfigError(f"trained tokenizer has {have} ids, more than vocab_size {vocab}")
    if have < vocab:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - have)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise ConfigError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, "
                          f"expected {vocab}")
    for i, token in enumerate(specials):
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
