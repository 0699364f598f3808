"""Reading an OpenAI request: the API key, the body under its limits, the sampling
parameters, the prompt or the chat messages as token ids. Everything that can be refused
without work is refused first (a body over the limit while it is read, a batch that can never
be in flight, a text too long to fit), each with a 400-family :class:`ApiError` naming the
value."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from statebridge.config import HttpConfig
from statebridge.errors import InvalidRequestError
from statebridge.models.sampling import MAX_LOGPROBS, sampling_problem
from statebridge.node.http.errors import ApiError, bad
from statebridge.node.text import NoChatTemplateError, TextTokenizer

__all__ = ["RequestReader", "Sampling", "MAX_STOP", "MAX_CHARS_PER_TOKEN", "INLINE_CHARS",
           "TOKENIZE_THREADS"]

#: Most stop strings a request may give (OpenAI allows 4).
MAX_STOP = 16
#: The most characters one token of a prompt is taken to cover: a text prompt longer than
#: ``MAX_CHARS_PER_TOKEN * max_prompt_len`` characters cannot fit and is refused from its
#: length, before it is tokenized (real text averages 3-5 characters per token).
MAX_CHARS_PER_TOKEN = 32
#: Texts up to this many characters in all are tokenized on the server's loop (a fraction of
#: a millisecond); longer ones in the tokenizer pool, which releases the interpreter lock.
INLINE_CHARS = 4096
#: Threads of the tokenizer pool (long prompts queue there rather than crowd the CPUs).
TOKENIZE_THREADS = 2


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    #: Top log-probabilities per token (-1: none; completions' ``logprobs``, chat's
    #: ``top_logprobs`` with ``logprobs: true``).
    logprobs: int = -1
    #: vLLM's ``return_token_ids``: the prompt's and the generated token ids in the answer.
    return_token_ids: bool = False
    #: vLLM's ``return_tokens_as_token_ids``: logprob tokens written ``"token_id:N"``.
    tokens_as_ids: bool = False


_MISSING = object()


def show(value: Any) -> str:
    """``value`` as JSON for an error message: at most 100 characters, never an error."""
    try:
        return json.dumps(value)[:100]
    except (RecursionError, ValueError, TypeError):
        return type(value).__name__


def field(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"{name} must be {what}, got {show(value)}", name)
    return value


def unicode_text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text; 400 naming the first lone surrogate (JSON lets
    ``"\\ud800"`` through; no tokenizer or UTF-8 encoder takes it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{param} holds a lone surrogate {value[e.start]!r} at character {e.start}: "
                   f"not valid Unicode text", param) from None
    return value


class RequestReader:
    """Reads the API's requests (:class:`~statebridge.node.http.api` has one): the key, the
    body under its limits, the sampling values and the prompts as token ids, for a node with
    these limits; long texts are tokenized in a small pool of its own (:meth:`close` stops
    it)."""

    def __init__(self, config: HttpConfig, tokenizer: TextTokenizer, *, model_name: str,
                 max_prompt_len: int, max_new_tokens: int, max_inflight: int) -> None:
        self.config, self.tok, self.model_name = config, tokenizer, model_name
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.max_chars = MAX_CHARS_PER_TOKEN * max_prompt_len
        self.max_inflight = max_inflight
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the tokenizer pool (queued work is dropped); one starts again if needed."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    # -- checks ---------------------------------------------------------------------------
    def check_key(self, request) -> None:
        if not self.config.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")

    async def body(self, request) -> tuple[dict, int]:
        """The request's JSON object and its size in bytes. Read under ``max_body_bytes``
        (413 from a larger ``Content-Length``, or as soon as more arrived: never buffered
        whole) and ``body_timeout`` (408); malformed or too deeply nested JSON is 400."""
        raw = await self.read_body(request)
        try:
            body = json.loads(raw or b"null")
        except RecursionError:
            raise bad("the body is nested too deeply to be a request") from None
        except ValueError as e:
            raise bad(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(400, f"the model {show(model)} is not served here; this "
                                f"server serves {self.model_name!r}", param="model",
                           code="model_not_found")
        return body, len(raw)

    async def read_body(self, request) -> bytes:
        cap = self.config.max_body_bytes

        def too_large(what: str) -> ApiError:
            return ApiError(413, f"the request body is {what}, more than the limit of {cap} "
                                 f"bytes (--max-body-bytes)", code="body_too_large")

        length = request.headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise bad(f"Content-Length {length[:40]!r} is not a number of bytes")
            if int(length) > cap:
                raise too_large(f"{int(length)} bytes")
        chunks: list[bytes] = []

        async def read() -> None:
            got = 0
            async for chunk in request.stream():
                got += len(chunk)
                if got > cap:
                    raise too_large(f"over {got} bytes")
                chunks.append(chunk)
        try:
            await asyncio.wait_for(read(), self.config.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.config.body_timeout} s", code="body_timeout") from None
        return b"".join(chunks)

    def sampling(self, body: dict, *, chat: bool) -> Sampling:
        for name, allowed in (("n", 1), ("best_of", 1)):
            value = field(body, name, (int,), 1, "an integer")
            if value != allowed:
                raise bad(f"{name}={value} is not supported (only {allowed})", name)
        if not chat and field(body, "echo", (bool,), False, "a boolean"):
            raise bad("echo=true is not supported", "echo")
        for name in ("presence_penalty", "frequency_penalty"):
            if field(body, name, (int, float), 0, "a number") != 0:
                raise bad(f"{name} is not supported", name)
        if body.get("logit_bias"):
            raise bad("logit_bias is not supported", "logit_bias")
        if chat and body.get("tools"):
            raise bad("tools are not supported", "tools")
        if not chat and body.get("suffix") is not None:
            raise bad("suffix is not supported", "suffix")
        name = "max_tokens"
        max_tokens = field(body, name, (int,), None, "a positive integer")
        if chat and max_tokens is None:
            name = "max_completion_tokens"
            max_tokens = field(body, name, (int,), None, "a positive integer")
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, self.max_new_tokens)
        if not 1 <= max_tokens <= self.max_new_tokens:
            raise bad(f"{name}={max_tokens} is not in [1, {self.max_new_tokens}] (the node's "
                       f"--max-new-tokens)", name)
        temperature = float(field(body, "temperature", (int, float), 1.0, "a number"))
        top_p = float(field(body, "top_p", (int, float), 1.0, "a number"))
        seed = field(body, "seed", (int,), None, "an integer")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        # The decode node's own check (every door's): the values as the sampler uses them.
        problem = sampling_problem(temperature, top_p, seed)
        if problem is not None:
            raise bad(problem[1], problem[0])
        stop = field(body, "stop", (str, list), [], "a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
            raise bad(f"stop must be a string or at most {MAX_STOP} strings", "stop")
        for s in stop:
            unicode_text(s, "stop")
        stream = field(body, "stream", (bool,), False, "a boolean")
        options = field(body, "stream_options", (dict,), {}, "an object")
        include_usage = field(options, "include_usage", (bool,), False, "a boolean")
        ignore_eos = field(body, "ignore_eos", (bool,), False, "a boolean")
        return Sampling(max_tokens, temperature, top_p, seed, tuple(stop), stream,
                         include_usage, ignore_eos, logprobs=self.logprobs(body, chat=chat),
                         return_token_ids=field(body, "return_token_ids", (bool,), False,
                                                 "a boolean"),
                         tokens_as_ids=field(body, "return_tokens_as_token_ids", (bool,),
                                              False, "a boolean"))

    @staticmethod
    def logprobs(body: dict, *, chat: bool) -> int:
        """How many top log-probabilities per token the request asks for (-1: none).
        Completions: ``logprobs`` (an integer); chat: ``logprobs: true`` and ``top_logprobs``
        (default 0: the sampled token's alone). At most :data:`MAX_LOGPROBS` (400 naming the
        value beyond it)."""
        if chat:
            wanted = field(body, "logprobs", (bool,), False, "a boolean")
            name = "top_logprobs"
            k = field(body, name, (int,), None, "an integer")
            if k is not None and not wanted:
                raise bad(f"top_logprobs={k} needs logprobs: true", name)
            if not wanted:
                return -1
            k = 0 if k is None else k
        else:
            name = "logprobs"
            k = field(body, name, (int,), None, "an integer")
            if k is None:
                return -1
        if not 0 <= k <= MAX_LOGPROBS:
            raise bad(f"{name}={k} is not in [0, {MAX_LOGPROBS}] (at most {MAX_LOGPROBS} "
                       f"top log-probabilities per token)", name)
        return k

    async def prompts(self, body: dict) -> list[list[int]]:
        """``prompt``: a string, a list of token ids, or a batch of either. Everything that
        can be refused without tokenizing is refused first: a batch larger than can ever be
        in flight, a text longer than ``MAX_CHARS_PER_TOKEN`` x ``--max-prompt-len``
        characters, a lone surrogate, an id outside the vocabulary."""
        prompt = body.get("prompt")
        what = "a string, a list of token ids, or a list of those"
        if isinstance(prompt, str):
            batch = [prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            batch = [prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, (str, list)) for p in prompt):
            batch = prompt
        else:
            raise bad(f"prompt must be {what}, got {show(prompt)}", "prompt")
        if len(batch) > self.max_inflight:
            raise bad(f"a batch of {len(batch)} prompts can never be served: at most "
                       f"{self.max_inflight} requests are in flight at once (send fewer per "
                       f"request)", "prompt", "too_many_prompts")
        out: list[list[int] | None] = []
        texts: list[tuple[int, str]] = []
        for p in batch:
            if isinstance(p, str):
                if len(p) > self.max_chars:
                    raise bad(f"the prompt has {len(p)} characters, more than the limit of "
                               f"{self.max_chars} ({MAX_CHARS_PER_TOKEN} per token of "
                               f"--max-prompt-len {self.max_prompt_len}): it cannot fit",
                               "prompt", "context_length_exceeded")
                texts.append((len(out), unicode_text(p, "prompt")))
                out.append(None)
            elif all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids = self.check_length(list(p), "prompt")
                if min(ids) < 0 or max(ids) >= self.tok.vocab_size:
                    outside = [t for t in ids if not 0 <= t < self.tok.vocab_size]
                    raise bad(f"token ids {outside[:8]} are outside the vocabulary of "
                               f"{self.tok.vocab_size}", "prompt")
                out.append(ids)
            else:
                raise bad(f"prompt must be {what}", "prompt")
        for (i, _), ids in zip(texts, await self.encode([t for _, t in texts])):
            out[i] = self.check_length(ids, "prompt")
        return out

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts``: short ones here, long ones in the tokenizer pool (the
        server's loop serves other connections meanwhile, and the node's loop runs: the
        batch encoder releases the interpreter lock)."""
        if not texts:
            return []
        if sum(map(len, texts)) <= INLINE_CHARS:
            return [self.tok.encode(t) for t in texts]
        return await self.offload(self.tok.encode_many, texts)

    async def offload(self, fn, *args):
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(
                TOKENIZE_THREADS, thread_name_prefix="statebridge-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_length(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad("the prompt is empty (it encodes to no token)", param)
        if len(ids) > self.max_prompt_len:
            raise bad(f"the prompt has {len(ids)} tokens, more than the limit of "
                       f"{self.max_prompt_len} (--max-prompt-len)", param,
                       "context_length_exceeded")
        return ids

    async def chat_prompt(self, body: dict, size: int) -> list[int]:
        """The messages rendered by the chat template and tokenized; in the tokenizer pool
        when the body is large (rendering is Python: it would hold up the server's loop)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages must be a non-empty list", "messages")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise bad("response_format other than text is not supported", "response_format")
        if size > INLINE_CHARS:
            return await self.offload(self._chat_ids, messages)
        return self._chat_ids(messages)

    def _chat_ids(self, messages: list) -> list[int]:
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        except NoChatTemplateError as e:
            raise bad(str(e), "messages", "no_chat_template") from None
        except InvalidRequestError as e:
            raise bad(str(e), "messages") from None
        if len(text) > self.max_chars:
            raise bad(f"the rendered messages have {len(text)} characters, more than the "
                       f"limit of {self.max_chars} ({MAX_CHARS_PER_TOKEN} per token of "
                       f"--max-prompt-len {self.max_prompt_len}): they cannot fit",
                       "messages", "context_length_exceeded")
        text = unicode_text(text, "messages")
        ids = self.tok.encode(text) if len(text) <= INLINE_CHARS else \
            self.tok.encode_many([text])[0]
        return self.check_length(ids, "messages")
