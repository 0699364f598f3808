"""Text in and out of a checkpoint: its tokenizer, incremental detokenization while streaming,
stop strings, and its chat template.

- :class:`TextTokenizer` loads ``tokenizer.json`` (through ``tokenizers``) and
  ``tokenizer_config.json`` (special tokens, ``chat_template``) from a checkpoint directory.
- :class:`TextStream` turns the token ids of one request into text deltas as they arrive (the
  ``tokenizers`` library's ``DecodeStream``, which holds back a token until its UTF-8 is whole),
  and says when to stop: an EOS token id, or a stop string in the text (the text is cut before
  it). While stop strings are set, the last ``len(longest stop) - 1`` characters are held back,
  so a stop string that spans two deltas is never half sent. The deltas of a request that runs
  to its length add up to ``tokenizer.decode(tokens)``.
- Chat templates are Jinja, rendered in a sandbox as transformers renders them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from statebridge.errors import ConfigError, InvalidRequestError

__all__ = ["TextTokenizer", "TextStream", "NoChatTemplateError"]

#: Token texts :meth:`TextTokenizer.token_text` keeps (cleared when full).
_TOKEN_TEXTS = 1 << 16


class NoChatTemplateError(InvalidRequestError):
    """The checkpoint's tokenizer has no chat template: chat requests cannot be rendered."""


class TextTokenizer:
    """A checkpoint's tokenizer: encode, decode, EOS ids, chat template."""

    def __init__(self, tokenizer, *, eos_token_ids: Iterable[int] = (),
                 bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, path: str = "") -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template or None
        self.path = path
        self._template = None
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "TextTokenizer":
        """The tokenizer of checkpoint ``model_dir``; ConfigError naming the file if it has
        none."""
        from tokenizers import Tokenizer

        path = os.path.join(os.fspath(model_dir), "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"checkpoint {os.fspath(model_dir)!r} has no tokenizer.json (text "
                              f"needs one; `statebridge make-checkpoint` writes one)")
        tokenizer = Tokenizer.from_file(path)
        settings = _read_json(os.path.join(os.fspath(model_dir), "tokenizer_config.json"))
        model = _read_json(os.path.join(os.fspath(model_dir), "config.json"))
        bos, eos = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
        eos_ids = set()
        configured = model.get("eos_token_id")
        eos_ids.update(configured if isinstance(configured, list) else
                       [configured] if isinstance(configured, int) else [])
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            eos_ids.add(tokenizer.token_to_id(eos))
        template = settings.get("chat_template")
        if isinstance(template, list):             # [{"name": "default", "template": ...}]
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        chat_file = os.path.join(os.fspath(model_dir), "chat_template.jinja")
        if template is None and os.path.isfile(chat_file):
            with open(chat_file, encoding="utf-8") as f:
                template = f.read()
        return cls(tokenizer, eos_token_ids=eos_ids, bos_token=bos, eos_token=eos,
                   chat_template=template if isinstance(template, str) else None,
                   path=os.fspath(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as it is (special tokens written in it are recognised; no BOS
        is added: a chat template adds its own)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, as :meth:`encode`, in one call that releases the
        interpreter lock while it works (``tokenizers``' batch encoder; its single ``encode``
        holds the lock for the whole text): other threads -- the node's loop -- run meanwhile.
        Call it from a worker thread."""
        batch = getattr(self.tokenizer, "encode_batch_fast", None) or self.tokenizer.encode_batch
        return [e.ids for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """The text of one token as log-probabilities name it: special tokens written out,
        a piece of a multi-byte character as U+FFFD (as vLLM names them)."""
        cache = self._token_texts
        text = cache.get(token)
        if text is None:
            if len(cache) >= _TOKEN_TEXTS:
                cache.clear()
            text = cache[token] = self.tokenizer.decode([int(token)],
                                                        skip_special_tokens=False)
        return text

    def stream(self, stop: Sequence[str] = (), *, ignore_eos: bool = False) -> "TextStream":
        return TextStream(self, stop, ignore_eos=ignore_eos)

    # -- chat ---------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role", "content"}]``; ``content`` a string or
        a list of ``{"type": "text", "text"}`` parts). NoChatTemplateError when the checkpoint
        has no template; InvalidRequestError when the messages do not render."""
        if self.chat_template is None:
            raise NoChatTemplateError(f"the model's tokenizer ({self.path or 'in memory'}) has "
                                      f"no chat template; use /v1/completions with a prompt")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(
                messages=[_message(m) for m in messages], add_generation_prompt=bool(
                    add_generation_prompt), bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except InvalidRequestError:
            raise
        except Exception as e:          # jinja raises many types for a template's own errors
            raise InvalidRequestError(f"the chat template does not render these messages: "
                                      f"{type(e).__name__}: {e}") from None


@dataclass(eq=False)
class TextStream:
    """One request's text: :meth:`push` token ids as they come, get ``(delta, finish)`` back;
    ``finish`` is ``"stop"`` once an EOS id or a stop string is met (nothing after it counts),
    else None. :meth:`close` returns the text held back at the end (the request ran to its
    length). ``tokens`` counts the ids consumed (the EOS one included)."""

    tokenizer: TextTokenizer
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    _ids: list[int] = field(default_factory=list)
    _sent: int = 0
    _checked: int = 0

    def __post_init__(self) -> None:
        from tokenizers.decoders import DecodeStream

        self.stop = tuple(s for s in self.stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._decoder = DecodeStream(skip_special_tokens=True)

    def push(self, ids: Iterable[int]) -> tuple[str, str | None]:
        if self.finish is not None:
            return "", self.finish
        for token in ids:
            self.tokens += 1
            if not self.ignore_eos and token in self.tokenizer.eos_token_ids:
                self.finish = "stop"
                return self._take(len(self.text)), self.finish
            self._ids.append(token)
            piece = self._decoder.step(self.tokenizer.tokenizer, int(token))
            if piece:
                self.text += piece
                if self._find_stop():
                    return self._take(len(self.text)), self.finish
        return self._take(len(self.text) - self._hold), None

    def close(self) -> str:
        """The rest of the text once no more tokens come (what ``decode`` of every id gives
        beyond what was sent, e.g. an incomplete UTF-8 tail)."""
        if self.finish is None:
            full = self.tokenizer.decode(self._ids)
            if full.startswith(self.text) and len(full) > len(self.text):
                self.text = full
                self._find_stop()
        return self._take(len(self.text))

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self._checked - self._hold)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        self._checked = len(self.text)
        if not found:
            return False
        self.text = self.text[:min(found)[0]]
        self.finish = "stop"
        return True

    def _take(self, upto: int) -> str:
        upto = min(upto, len(self.text))
        if upto <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent:upto], upto
        return delta


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path!r}: {e}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """``"<s>"`` or transformers' ``{"content": "<s>", ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _message(message: Any) -> dict:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"a message must be an object with a string role, got "
                                  f"{message!r:.200}")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"only text content parts are supported, got "
                                          f"{part!r:.200}")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise InvalidRequestError(f"message content must be a string or a list of text parts, "
                                  f"got {type(content).__name__}")
    return {**message, "content": content}


def _compile(template: str):
    """The template in jinja2's immutable sandbox, with transformers' extras
    (``raise_exception``, ``tojson``), as transformers compiles chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise InvalidRequestError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                  ensure_ascii=False)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ConfigError(f"the checkpoint's chat template does not compile: {e}") from None
