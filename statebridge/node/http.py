"""The decode node's OpenAI-compatible HTTP front door: text in and out, streaming, health and
Prometheus metrics.

::

    HTTP client --POST /v1/completions-------> HttpServer thread (uvicorn, Starlette, asyncio)
                --POST /v1/chat/completions-->   text -> token ids (the checkpoint's tokenizer)
                                                 NodeLink: DecodeNode.post (the loop's inbox)
                                                   --GenerateRequest / AbortRequest / StatsQuery-->
                                                 DecodeNode.serve (the node's loop thread)
                                                   <--GenerateTokens / NodeStats-- deliver():
                                                 call_soon_threadsafe, per-request queues
                <--JSON or SSE "data: ..."-----
    GET /v1/models, /health (200 once a prefill node is connected, else 503), /metrics

A stream sends one chunk per generated token, even when its text is empty (a special token,
part of a character, text held back for a possible stop string): the chunks add up to
``completion_tokens``. ``logprobs`` (completions: ``logprobs: k``; chat: ``logprobs: true``,
``top_logprobs: k``; ``k`` at most :data:`MAX_LOGPROBS`) come in OpenAI's shapes, computed by
the decode rank that samples; vLLM's ``return_token_ids`` and ``return_tokens_as_token_ids``
give the token ids.

The server runs in a thread of its own with its own event loop, in the decode node's process,
so nothing HTTP runs on the coordinator's loop thread (the split of vLLM's API server and
engine core). It hands the node the same front-door messages a zmq client sends, in process:
:meth:`~statebridge.node.decode_node.DecodeNode.post` puts them in the node loop's thread-safe
inbox, and the node answers through :meth:`NodeLink.deliver`, which moves them to this
server's event loop (one wake-up for all the messages of one loop iteration). No socket, no
serialization, and the node validates and serves an HTTP request exactly as a zmq one. A
request whose client disconnects, or whose text meets a stop string, is aborted at the node
(:class:`~statebridge.node.messages.AbortRequest`): its page and KV blocks free at once.

Limits come before work, and no request may hold up the node's loop thread, which shares
this process (and its interpreter lock) with the server: the body is read under
``max_body_bytes`` and ``body_timeout`` and never buffered whole; a request head must come
within ``header_timeout`` (:func:`_guarded_protocol`); a batch larger than can ever be in
flight, and a text longer than :data:`MAX_CHARS_PER_TOKEN` characters per token of the
prompt limit, are refused before anything is tokenized; long text is tokenized in a small
pool by the batch encoder, which releases the lock. What remains is the JSON parse of one
body, bounded by ``max_body_bytes``.

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (wrong field types, limits, malformed or too deeply nested JSON, lone surrogates, a
batch that can never fit, unknown model, no chat template), 401 for a missing or wrong API
key, 408 (a head or body too slow), 413 (a body over the limit), 429 (too many requests in
flight now, or the node is out of pages or blocks) and 503 (no prefill node connected, the
node does not answer or is closing) with ``Retry-After``, 500 when a decode step failed
(``internal``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import hmac
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from statebridge.config import HttpConfig
from statebridge.connector import messages as m
from statebridge.errors import (ClosedError, FailureKind, InvalidRequestError, ProtocolError,
                                StartupError, StatebridgeError)
from statebridge.models.sampling import MAX_LOGPROBS, sampling_problem
from statebridge.node import messages as nm
from statebridge.node.text import NoChatTemplateError, TextTokenizer

log = logging.getLogger(__name__)

__all__ = ["HttpServer", "build_app", "NodeLink"]

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
#: Seconds a connection refused before its body was read is drained before it is closed
#: (closing at once with unread bytes resets it, and the client may lose the answer).
LINGER_S = 2.0


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, outcome: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.retry_after = retry_after
        self.outcome = outcome or {400: "invalid_request", 401: "unauthorized",
                                   404: "invalid_request", 408: "timeout",
                                   413: "too_large", 429: "rate_limited"}.get(
            status, "unavailable" if status in (503, 504) else "error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self):
        from starlette.responses import JSONResponse

        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


#: A failed request's kind at the node -> (HTTP status, error type, Retry-After seconds).
_KIND_STATUS = {
    FailureKind.INVALID_REQUEST: (400, "invalid_request_error", None),
    FailureKind.NOT_READY: (503, "service_unavailable_error", 2.0),
    FailureKind.BUSY: (429, "rate_limit_error", 1.0),
    FailureKind.CACHE_FULL: (429, "rate_limit_error", 1.0),
    FailureKind.TIMEOUT: (504, "timeout_error", None),
    FailureKind.PEER_LOST: (503, "service_unavailable_error", 1.0),
    FailureKind.TRANSFER_ERROR: (503, "service_unavailable_error", 1.0),
    FailureKind.ABORTED: (503, "service_unavailable_error", 1.0),
    FailureKind.CLOSED: (503, "service_unavailable_error", 1.0),
    FailureKind.INTERNAL: (500, "server_error", None),
}


def _node_error(kind: str, message: str) -> ApiError:
    try:
        status, type_, retry = _KIND_STATUS[FailureKind.parse(kind)]
    except Exception:
        status, type_, retry = 503, "service_unavailable_error", 1.0
    return ApiError(status, message, type_, code=str(kind), retry_after=retry)


# -- the link to the decode node ---------------------------------------------------------------
class NodeLink:
    """The HTTP side's link to the decode node in this process: a front-door client of it.

    Messages go in through ``node.post(self, message)`` (any thread; the node's loop inbox).
    The node answers through :meth:`deliver` on its loop thread; the answers are moved to the
    server's event loop in one ``call_soon_threadsafe`` per batch and routed there: token
    messages to their request's queue by request id, NodeStats to the oldest stats query.
    ``node`` is anything with ``post(client, message)``, e.g. a
    :class:`~statebridge.node.decode_node.DecodeNode`."""

    def __init__(self, node, *, name: str = "decode node") -> None:
        self.node = node
        self.name = name
        self._streams: dict[str, asyncio.Queue] = {}
        self._queries: collections.deque[asyncio.Future] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Answers from the node's loop thread, waiting for the server's loop. Only the node's
        # loop thread appends; _drain clears _scheduled BEFORE it empties the deque, so an
        # answer appended after the drain started either is taken by it or schedules the next.
        self._inbox: collections.deque[m.Message] = collections.deque()
        self._scheduled = False
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox.clear()
        self._scheduled = self._closed = False

    async def close(self) -> None:
        """Abort at the node every request still open here; later answers are dropped."""
        self._closed = True
        for request_id, queue in self._streams.items():
            self.send(nm.AbortRequest(request_id=request_id, reason="HTTP server closing"))
            queue.put_nowait(self._closing(request_id))
        self._streams.clear()
        for waiter in self._queries:
            waiter.cancel()
        self._queries.clear()

    def send(self, message: m.Message) -> bool:
        """Hand ``message`` to the node now (never waits); False when the node is closed.
        Safe in a ``finally`` of a cancelled task."""
        try:
            self.node.post(self, message)
        except StatebridgeError as e:           # ClosedError: the node's loop is gone
            log.debug("%s: %s not delivered: %s", self.name, type(message).__name__, e)
            return False
        return True

    def deliver(self, message: m.Message) -> None:
        """The node's answer, on the node's loop thread (never blocks)."""
        if self._closed or self._loop is None:
            return
        self._inbox.append(message)
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:                    # the server's loop closed meanwhile
            self._closed = True

    def _drain(self) -> None:
        self._scheduled = False
        inbox = self._inbox
        while inbox:
            msg = inbox.popleft()
            if isinstance(msg, nm.GenerateTokens):
                queue = self._streams.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, (nm.NodeStats, m.Error)):
                while self._queries:
                    waiter = self._queries.popleft()
                    if waiter.done():
                        continue
                    if isinstance(msg, m.Error):
                        waiter.set_exception(ProtocolError(
                            f"{self.name}: {msg.kind}: {msg.message}"))
                    else:
                        waiter.set_result(msg)
                    break

    async def stats(self, timeout: float) -> nm.NodeStats:
        """The node's NodeStats; asyncio.TimeoutError when it does not answer in time,
        ClosedError when it is closed."""
        waiter = asyncio.get_running_loop().create_future()
        self._queries.append(waiter)
        if not self.send(nm.StatsQuery(client="http")):
            self._queries.remove(waiter)
            raise ClosedError(f"{self.name} is closed")
        return await asyncio.wait_for(waiter, timeout)

    def open(self, request: nm.GenerateRequest) -> "NodeStream":
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        if self._closed or not self.send(request):
            queue.put_nowait(self._closing(request.request_id))
        return NodeStream(self, request.request_id, queue)

    def _closing(self, request_id: str) -> nm.GenerateTokens:
        """The last message of a request that the node cannot answer any more."""
        return nm.GenerateTokens(request_id=request_id, tokens=(), done=True,
                                 kind=str(FailureKind.CLOSED), message=f"{self.name} is closed",
                                 ttft=0.0, transfer_seconds=0.0, transfer_bytes=0,
                                 recomputed=False)


class NodeStream:
    """One request's GenerateTokens messages; :meth:`close` aborts it at the node unless the
    node already said done."""

    def __init__(self, link: NodeLink, request_id: str, queue: asyncio.Queue) -> None:
        self.link, self.request_id, self.queue = link, request_id, queue
        self.done = False

    async def next(self, timeout: float) -> nm.GenerateTokens:
        try:
            # (Already there -- tokens come in steps, often ahead of the reader -- no task.)
            msg = self.queue.get_nowait() if not self.queue.empty() else \
                await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"{self.link.name} sent nothing for {timeout} s",
                           "service_unavailable_error", retry_after=1.0) from None
        if msg.done:
            self.done = True
        return msg

    def close(self, reason: str = "") -> None:
        self.link._streams.pop(self.request_id, None)
        if not self.done:
            self.done = True
            self.link.send(nm.AbortRequest(request_id=self.request_id, reason=reason))


# -- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sampling:
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


def _show(value: Any) -> str:
    """``value`` as JSON for an error message: at most 100 characters, never an error."""
    try:
        return json.dumps(value)[:100]
    except (RecursionError, ValueError, TypeError):
        return type(value).__name__


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(f"{name} must be {what}, got {_show(value)}", name)
    return value


def _text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text; 400 naming the first lone surrogate (JSON lets
    ``"\\ud800"`` through; no tokenizer or UTF-8 encoder takes it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"{param} holds a lone surrogate {value[e.start]!r} at character {e.start}: "
                   f"not valid Unicode text", param) from None
    return value


def _finite(logprob: float) -> float | None:
    """A log-probability as JSON can carry it: ``-inf`` (a token the model gives no
    probability) as -9999.0, as vLLM writes it; NaN (none computed) as null."""
    if logprob != logprob:
        return None
    return max(logprob, -9999.0)


def _quiet(future: "asyncio.Future") -> None:
    """Retrieve ``future``'s outcome once it is done, so a cancelled gather or a task that
    failed after its client left is never logged as "exception was never retrieved"."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


class _Api:
    """The endpoints, on the server's event loop."""

    def __init__(self, link: NodeLink, tokenizer: TextTokenizer, config: HttpConfig, *,
                 model_name: str, model_dir: str, max_prompt_len: int, max_new_tokens: int,
                 max_inflight: int, metrics: "_Metrics", max_model_len: int = 0) -> None:
        self.link, self.tok, self.config = link, tokenizer, config
        self.model_name, self.model_dir = model_name, model_dir
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        #: /v1/models' max_model_len: what the node serves (0: the two limits' sum).
        self.max_model_len = max_model_len or max_prompt_len + max_new_tokens
        self.max_chars = MAX_CHARS_PER_TOKEN * max_prompt_len
        self.max_inflight = max_inflight
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.inflight = 0
        self.metrics = metrics
        self.created = int(time.time())

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
            raise _bad("the body is nested too deeply to be a request") from None
        except ValueError as e:
            raise _bad(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(400, f"the model {_show(model)} is not served here; this "
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
                raise _bad(f"Content-Length {length[:40]!r} is not a number of bytes")
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

    def sampling(self, body: dict, *, chat: bool) -> _Sampling:
        for name, allowed in (("n", 1), ("best_of", 1)):
            value = _field(body, name, (int,), 1, "an integer")
            if value != allowed:
                raise _bad(f"{name}={value} is not supported (only {allowed})", name)
        if not chat and _field(body, "echo", (bool,), False, "a boolean"):
            raise _bad("echo=true is not supported", "echo")
        for name in ("presence_penalty", "frequency_penalty"):
            if _field(body, name, (int, float), 0, "a number") != 0:
                raise _bad(f"{name} is not supported", name)
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported", "logit_bias")
        if chat and body.get("tools"):
            raise _bad("tools are not supported", "tools")
        if not chat and body.get("suffix") is not None:
            raise _bad("suffix is not supported", "suffix")
        name = "max_tokens"
        max_tokens = _field(body, name, (int,), None, "a positive integer")
        if chat and max_tokens is None:
            name = "max_completion_tokens"
            max_tokens = _field(body, name, (int,), None, "a positive integer")
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, self.max_new_tokens)
        if not 1 <= max_tokens <= self.max_new_tokens:
            raise _bad(f"{name}={max_tokens} is not in [1, {self.max_new_tokens}] (the node's "
                       f"--max-new-tokens)", name)
        temperature = float(_field(body, "temperature", (int, float), 1.0, "a number"))
        top_p = float(_field(body, "top_p", (int, float), 1.0, "a number"))
        seed = _field(body, "seed", (int,), None, "an integer")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        # The decode node's own check (every door's): the values as the sampler uses them.
        problem = sampling_problem(temperature, top_p, seed)
        if problem is not None:
            raise _bad(problem[1], problem[0])
        stop = _field(body, "stop", (str, list), [], "a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
            raise _bad(f"stop must be a string or at most {MAX_STOP} strings", "stop")
        for s in stop:
            _text(s, "stop")
        stream = _field(body, "stream", (bool,), False, "a boolean")
        options = _field(body, "stream_options", (dict,), {}, "an object")
        include_usage = _field(options, "include_usage", (bool,), False, "a boolean")
        ignore_eos = _field(body, "ignore_eos", (bool,), False, "a boolean")
        return _Sampling(max_tokens, temperature, top_p, seed, tuple(stop), stream,
                         include_usage, ignore_eos, logprobs=self.logprobs(body, chat=chat),
                         return_token_ids=_field(body, "return_token_ids", (bool,), False,
                                                 "a boolean"),
                         tokens_as_ids=_field(body, "return_tokens_as_token_ids", (bool,),
                                              False, "a boolean"))

    @staticmethod
    def logprobs(body: dict, *, chat: bool) -> int:
        """How many top log-probabilities per token the request asks for (-1: none).
        Completions: ``logprobs`` (an integer); chat: ``logprobs: true`` and ``top_logprobs``
        (default 0: the sampled token's alone). At most :data:`MAX_LOGPROBS` (400 naming the
        value beyond it)."""
        if chat:
            wanted = _field(body, "logprobs", (bool,), False, "a boolean")
            name = "top_logprobs"
            k = _field(body, name, (int,), None, "an integer")
            if k is not None and not wanted:
                raise _bad(f"top_logprobs={k} needs logprobs: true", name)
            if not wanted:
                return -1
            k = 0 if k is None else k
        else:
            name = "logprobs"
            k = _field(body, name, (int,), None, "an integer")
            if k is None:
                return -1
        if not 0 <= k <= MAX_LOGPROBS:
            raise _bad(f"{name}={k} is not in [0, {MAX_LOGPROBS}] (at most {MAX_LOGPROBS} "
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
            raise _bad(f"prompt must be {what}, got {_show(prompt)}", "prompt")
        if len(batch) > self.max_inflight:
            raise _bad(f"a batch of {len(batch)} prompts can never be served: at most "
                       f"{self.max_inflight} requests are in flight at once (send fewer per "
                       f"request)", "prompt", "too_many_prompts")
        out: list[list[int] | None] = []
        texts: list[tuple[int, str]] = []
        for p in batch:
            if isinstance(p, str):
                if len(p) > self.max_chars:
                    raise _bad(f"the prompt has {len(p)} characters, more than the limit of "
                               f"{self.max_chars} ({MAX_CHARS_PER_TOKEN} per token of "
                               f"--max-prompt-len {self.max_prompt_len}): it cannot fit",
                               "prompt", "context_length_exceeded")
                texts.append((len(out), _text(p, "prompt")))
                out.append(None)
            elif all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids = self.check_length(list(p), "prompt")
                if min(ids) < 0 or max(ids) >= self.tok.vocab_size:
                    bad = [t for t in ids if not 0 <= t < self.tok.vocab_size]
                    raise _bad(f"token ids {bad[:8]} are outside the vocabulary of "
                               f"{self.tok.vocab_size}", "prompt")
                out.append(ids)
            else:
                raise _bad(f"prompt must be {what}", "prompt")
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
            raise _bad("the prompt is empty (it encodes to no token)", param)
        if len(ids) > self.max_prompt_len:
            raise _bad(f"the prompt has {len(ids)} tokens, more than the limit of "
                       f"{self.max_prompt_len} (--max-prompt-len)", param,
                       "context_length_exceeded")
        return ids

    async def chat_prompt(self, body: dict, size: int) -> list[int]:
        """The messages rendered by the chat template and tokenized; in the tokenizer pool
        when the body is large (rendering is Python: it would hold up the server's loop)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list", "messages")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise _bad("response_format other than text is not supported", "response_format")
        if size > INLINE_CHARS:
            return await self.offload(self._chat_ids, messages)
        return self._chat_ids(messages)

    def _chat_ids(self, messages: list) -> list[int]:
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        except NoChatTemplateError as e:
            raise _bad(str(e), "messages", "no_chat_template") from None
        except InvalidRequestError as e:
            raise _bad(str(e), "messages") from None
        if len(text) > self.max_chars:
            raise _bad(f"the rendered messages have {len(text)} characters, more than the "
                       f"limit of {self.max_chars} ({MAX_CHARS_PER_TOKEN} per token of "
                       f"--max-prompt-len {self.max_prompt_len}): they cannot fit",
                       "messages", "context_length_exceeded")
        text = _text(text, "messages")
        ids = self.tok.encode(text) if len(text) <= INLINE_CHARS else \
            self.tok.encode_many([text])[0]
        return self.check_length(ids, "messages")

    # -- generation -----------------------------------------------------------------------
    def admit(self, n: int) -> None:
        if self.inflight + n > self.max_inflight:
            raise ApiError(429, f"{self.inflight} requests in flight, the limit is "
                                f"{self.max_inflight}; retry later", "rate_limit_error",
                           code="too_many_requests", retry_after=1.0)
        self.inflight += n

    async def completion(self, request, chat: bool):
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, StreamingResponse

        endpoint = "chat_completions" if chat else "completions"
        arrived = time.perf_counter()
        try:
            self.check_key(request)
            body, size = await self.body(request)
            params = self.sampling(body, chat=chat)
            prompts = [await self.chat_prompt(body, size)] if chat else \
                await self.prompts(body)
        except RecursionError:
            e = _bad("the body is nested too deeply to be a request")
            self.metrics.request(endpoint, e.outcome)
            return e.response()
        except ApiError as e:
            self.metrics.request(endpoint, e.outcome)
            return e.response()
        except ClientDisconnect:
            log.debug("%s: the client disconnected while sending its request", endpoint)
            self.metrics.request(endpoint, "disconnected")
            return JSONResponse({}, status_code=499)
        try:
            self.admit(len(prompts))
        except ApiError as e:
            self.metrics.request(endpoint, e.outcome)
            return e.response()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = [_Choice(self, f"{rid}-{i}", i, ids, params, arrived)
                   for i, ids in enumerate(prompts)]
        released = False

        def release(outcome: str) -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= len(choices)
                for ch in choices:
                    ch.close("request finished" if outcome == "ok" else outcome)
                self.metrics.request(endpoint, outcome)
                if outcome == "disconnected":
                    log.debug("%s: the client disconnected; aborted at the node", rid)

        async def settle(work) -> "JSONResponse | None":
            """Await ``work`` until it is done or the client goes; an error response (the
            request released) or None to go on."""
            try:
                await _until_disconnect(request, work)
            except ApiError as e:
                release(e.outcome)
                return e.response()
            except _Disconnected:
                release("disconnected")
                return JSONResponse({}, status_code=499)
            except BaseException:
                release("disconnected")
                raise
            return None

        # The first message of every choice before answering: a refusal (400, 429, 503) gets
        # its status code even when streaming.
        first = [asyncio.ensure_future(ch.start()) for ch in choices]
        try:
            refused = await settle(_gather(first))
        finally:
            for f in first:
                f.cancel()
        if refused is not None:
            return refused
        if not params.stream:
            refused = await settle(_gather([asyncio.ensure_future(ch.run())
                                            for ch in choices]))
            if refused is not None:
                return refused
            release("ok")
            return JSONResponse(self.full_body(rid, chat, choices))
        return StreamingResponse(self.events(rid, chat, choices, params, release),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def usage(self, choices: Sequence["_Choice"]) -> dict:
        prompt = sum(len(ch.prompt) for ch in choices)
        completion = sum(ch.text.tokens for ch in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # -- log-probabilities and token ids ------------------------------------------------------
    def token_text(self, token: int, params: _Sampling) -> str:
        """A token as logprobs name it: its text (special tokens too), or ``"token_id:N"``
        (vLLM's ``return_tokens_as_token_ids``)."""
        return f"token_id:{token}" if params.tokens_as_ids else self.tok.token_text(token)

    def logprobs_body(self, entries: Sequence[_Logprob], params: _Sampling, *,
                      chat: bool) -> dict | None:
        """``entries`` in OpenAI's shape: chat's ``{"content": [{token, logprob, bytes,
        top_logprobs}]}``, or the completions API's ``{tokens, token_logprobs, top_logprobs,
        text_offset}`` (``top_logprobs``: the top tokens and the sampled one, as vLLM and
        OpenAI give up to ``logprobs + 1``). None when the request did not ask."""
        if params.logprobs < 0:
            return None
        name = functools.partial(self.token_text, params=params)
        if chat:
            def item(token: int, logprob: float) -> dict:
                text = name(token)
                return {"token": text, "logprob": _finite(logprob),
                        "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(e.token, e.logprob),
                                 "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tops = []
        for e in entries:
            top = {name(e.token): _finite(e.logprob)}
            for t, lp in e.top:
                top.setdefault(name(t), _finite(lp))
            tops.append(top)
        return {"tokens": [name(e.token) for e in entries],
                "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": [e.offset for e in entries]}

    def full_body(self, rid: str, chat: bool, choices: Sequence["_Choice"]) -> dict:
        params = choices[0].params
        out = []
        for ch in choices:
            choice = {"index": ch.index}
            if chat:
                choice["message"] = {"role": "assistant", "content": ch.out}
            else:
                choice["text"] = ch.out
            choice["logprobs"] = self.logprobs_body(ch.logprobs, params, chat=chat)
            choice["finish_reason"] = ch.finish
            if params.return_token_ids:
                if not chat:
                    choice["prompt_token_ids"] = list(ch.prompt)
                choice["token_ids"] = list(ch.tokens)
            out.append(choice)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": out,
                "usage": self.usage(choices)}
        if chat and params.return_token_ids:
            body["prompt_token_ids"] = list(choices[0].prompt)
        return body

    async def events(self, rid: str, chat: bool, choices: list["_Choice"], params: _Sampling,
                     release) -> AsyncIterator[str]:
        """The SSE stream: one chunk per generated token (its text may be empty: a special
        token, or part of a character or of a possible stop string held back), the last one
        with the finish reason; chat starts with a role chunk. With ``return_token_ids`` each
        chunk names its token ids and the first of a choice its prompt's (chat: the role
        chunk, at the top level, as vLLM does)."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        first = {ch.index: True for ch in choices}

        def chunk(ch: "_Choice", piece: _Piece | None) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name}
            if chat:
                delta = {"role": "assistant", "content": ""} if piece is None else (
                    {"content": piece.text} if piece.tokens or piece.text else {})
                choice = {"index": ch.index, "delta": delta}
            else:
                choice = {"index": ch.index, "text": piece.text}
            if piece is not None:
                choice["logprobs"] = self.logprobs_body(piece.logprobs, params, chat=chat)
                choice["finish_reason"] = piece.finish
            else:
                choice["logprobs"] = choice["finish_reason"] = None
            if params.return_token_ids:
                if first[ch.index]:
                    if chat:
                        body["prompt_token_ids"] = list(ch.prompt)
                    else:
                        choice["prompt_token_ids"] = list(ch.prompt)
                if piece is not None:
                    choice["token_ids"] = list(piece.tokens)
            first[ch.index] = False
            body["choices"] = [choice]
            if params.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        outcome = "disconnected"
        pending: dict[asyncio.Future, _Choice] = {}
        try:
            if chat:
                for ch in choices:
                    yield chunk(ch, None)
            if len(choices) == 1:         # (one prompt: its steps in turn, no task per token)
                ch, piece = choices[0], None
                while piece is None or piece.finish is None:
                    piece = await ch.step()
                    yield chunk(ch, piece)
            else:
                pending = {asyncio.ensure_future(ch.step()): ch for ch in choices}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    ch = pending.pop(future)
                    piece = future.result()
                    yield chunk(ch, piece)
                    if piece.finish is None:
                        pending[asyncio.ensure_future(ch.step())] = ch
            if params.include_usage:
                yield (f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': self.model_name, 'choices': [], 'usage': self.usage(choices)})}\n\n")
            outcome = "ok"
            yield "data: [DONE]\n\n"
        except ApiError as e:
            outcome = e.outcome
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for future in pending:
                _quiet(future)
                future.cancel()
            release(outcome)

    # -- the other endpoints ----------------------------------------------------------------
    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self.check_key(request)
        except ApiError as e:
            self.metrics.request("models", e.outcome)
            return e.response()
        self.metrics.request("models", "ok")
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "statebridge", "root": self.model_dir,
            "max_model_len": self.max_model_len}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        try:
            stats = await self.link.stats(5.0)
        except (asyncio.TimeoutError, StatebridgeError) as e:
            return ApiError(503, f"the decode node does not answer: {e or 'timeout'}",
                            "service_unavailable_error", retry_after=2.0).response()
        if not stats.ready:
            return ApiError(503, f"not serving: {stats.reason}", "service_unavailable_error",
                            code="not_ready", retry_after=2.0).response()
        return JSONResponse({"status": "ok", "node_id": stats.node_id,
                             "prefill_nodes": list(stats.prefill_nodes)})

    async def metrics_text(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        try:
            self.metrics.node = await self.link.stats(5.0)
        except (asyncio.TimeoutError, StatebridgeError):
            self.metrics.node = None
        self.metrics.inflight = self.inflight
        return Response(generate_latest(self.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


class _Disconnected(Exception):
    pass


def _gather(tasks: list) -> "asyncio.Future":
    """``asyncio.gather`` of ``tasks`` whose outcomes are all retrieved, whoever stops
    waiting first (no "never retrieved" noise once a client left or a sibling failed)."""
    for task in tasks:
        _quiet(task)
    gathered = asyncio.gather(*tasks)
    _quiet(gathered)
    return gathered


async def _until_disconnect(request, work):
    """Await ``work``; _Disconnected (``work`` cancelled) if the client goes away first."""
    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    work = asyncio.ensure_future(work)
    _quiet(work)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        raise _Disconnected()
    return work.result()


@dataclass(frozen=True)
class _Logprob:
    """One generated token's log-probability and its step's top tokens (``top``: (id,
    log-probability) pairs, most likely first); ``offset``: where its text starts in the
    choice's text."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int


@dataclass(frozen=True)
class _Piece:
    """What one node message added to a choice: the text delta, the finish reason once there
    is one, the token ids it consumed and, when asked for, their log-probabilities."""
    text: str
    finish: str | None
    tokens: tuple[int, ...] = ()
    logprobs: tuple[_Logprob, ...] = ()


class _Choice:
    """One prompt of a request: its node stream, its text, its token ids and log-probs."""

    def __init__(self, api: _Api, request_id: str, index: int, prompt: list[int],
                 params: _Sampling, arrived: float) -> None:
        self.api, self.request_id, self.index, self.prompt = api, request_id, index, prompt
        self.params, self.arrived = params, arrived
        self.text = api.tok.stream(params.stop, ignore_eos=params.ignore_eos)
        self.stream: NodeStream | None = None
        self.finish: str | None = None
        self.out = ""
        self.tokens: list[int] = []                 # every id consumed (an EOS one included)
        self.logprobs: list[_Logprob] = []
        self._first: nm.GenerateTokens | None = None
        self._first_at = 0.0
        self._last_token = 0.0

    async def start(self) -> None:
        p = self.params
        self.stream = self.api.link.open(nm.GenerateRequest(
            request_id=self.request_id, prompt=tuple(self.prompt), max_new_tokens=p.max_tokens,
            temperature=p.temperature, top_p=p.top_p, seed=p.seed, logprobs=p.logprobs))
        self._first = await self._next()

    async def _next(self) -> nm.GenerateTokens:
        msg = await self.stream.next(self.api.config.node_timeout)
        if msg.kind:
            raise _node_error(msg.kind, msg.message)
        if msg.tokens:
            now = time.perf_counter()
            metrics = self.api.metrics
            if not self._last_token:
                self._first_at = now
                metrics.ttft.observe(now - self.arrived)
            else:
                metrics.itl.observe(now - self._last_token)
            self._last_token = now
        return msg

    async def step(self) -> _Piece:
        """What the next node message adds (one message per generated token)."""
        if self.finish is not None:
            return _Piece("", self.finish)
        msg, self._first = (self._first, None) if self._first is not None else (
            await self._next(), None)
        delta, finish, consumed, logprobs = "", None, [], []
        asked = self.params.logprobs >= 0 and len(msg.logprobs) == len(msg.tokens)
        for i, token in enumerate(msg.tokens):
            offset = len(self.text.text)
            piece, finish = self.text.push((token,))
            delta += piece
            consumed.append(token)
            if asked:
                logprobs.append(_Logprob(token, msg.logprobs[i], tuple(zip(
                    msg.top_ids[i], msg.top_logprobs[i])) if i < len(msg.top_ids) else (),
                    offset))
            if finish is not None:
                break
        if finish is None and msg.done:
            delta += self.text.close()
            finish = "length"
        self.out += delta
        self.tokens += consumed
        self.logprobs += logprobs
        if finish is not None:
            self.finish = finish
            self.close("stop string" if finish == "stop" else "done")
            self.api.metrics.finished(self, time.perf_counter())
        return _Piece(delta, finish, tuple(consumed), tuple(logprobs))

    async def run(self) -> None:
        while self.finish is None:
            await self.step()

    def close(self, reason: str) -> None:
        if self.stream is not None:
            self.stream.close(reason)


# -- metrics -------------------------------------------------------------------------------------
#: Buckets of whole-request latencies (vLLM's request latency buckets, from 0.01 s).
_REQUEST_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480,
                    960, 1920)
#: Buckets of the time between two tokens of one request.
_TOKEN_BUCKETS = (.001, .0025, .005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5,
                  5, 10)


class _Metrics:
    """The server's Prometheus registry: its own (several servers in one process never
    collide). What the HTTP server sees of a request it measures itself (from the request's
    arrival here); what happened at the decode node, its prefill node and their ranks comes
    from the NodeStats fetched for each scrape (:class:`_NodeCollector`)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("statebridge_requests", "HTTP API requests by endpoint and "
                                "outcome", ("endpoint", "outcome"), registry=r)
        self.success = Counter("statebridge_request_success", "Generations that finished, by "
                               "finish reason", ("finished_reason",), registry=r)
        self.prompt_tokens = Counter("statebridge_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("statebridge_generation_tokens", "Tokens generated "
                                         "for finished requests", registry=r)
        self.ttft = Histogram("statebridge_time_to_first_token_seconds", "From the HTTP "
                              "request's arrival to its first token", registry=r, buckets=(
                                  .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5,
                                  7.5, 10, 20, 40, 80, 160, 640))
        self.itl = Histogram("statebridge_inter_token_latency_seconds", "Between two "
                             "consecutive tokens of one request", registry=r,
                             buckets=_TOKEN_BUCKETS)
        self.tpot = Histogram("statebridge_request_time_per_output_token_seconds", "Per "
                              "request: from its first token to its last, over the tokens "
                              "after the first", registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("statebridge_e2e_request_latency_seconds", "From the HTTP "
                             "request's arrival to its last token", registry=r,
                             buckets=_REQUEST_BUCKETS)
        self.decode_time = Histogram("statebridge_request_decode_time_seconds", "Per request: "
                                     "from its first token to its last", registry=r,
                                     buckets=_REQUEST_BUCKETS)
        self.node: nm.NodeStats | None = None
        self.inflight = 0
        r.register(_NodeCollector(self))

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def finished(self, choice: "_Choice", now: float) -> None:
        """``choice`` met its finish reason at ``now`` (perf_counter)."""
        tokens = choice.text.tokens
        self.prompt_tokens.inc(len(choice.prompt))
        self.generation_tokens.inc(tokens)
        self.success.labels(choice.finish).inc()
        self.e2e.observe(now - choice.arrived)
        if choice._first_at:
            self.decode_time.observe(now - choice._first_at)
            if tokens > 1:
                self.tpot.observe((now - choice._first_at) / (tokens - 1))


class _NodeCollector:
    def __init__(self, metrics: _Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.metrics.node
        yield GaugeMetricFamily("statebridge_http_requests_in_flight",
                                "HTTP generations in flight", value=self.metrics.inflight)
        yield GaugeMetricFamily("statebridge_node_up", "1 when the decode node answered this "
                                "scrape", value=0 if s is None else 1)
        if s is None:
            return
        for name, help_, value in (
                ("statebridge_node_ready", "1 once a prefill node is connected", int(s.ready)),
                ("statebridge_pages_used", "State pages in use (per rank)", s.pages_used),
                ("statebridge_pages_free", "State pages free (per rank)", s.pages_free),
                ("statebridge_kv_blocks_used", "KV blocks in use (per rank)", s.blocks_used),
                ("statebridge_kv_blocks_free", "KV blocks free (per rank)", s.blocks_free),
                ("statebridge_requests_running", "Requests decoding", s.running),
                ("statebridge_requests_waiting", "Requests waiting for a page or blocks",
                 s.waiting),
                ("statebridge_prefill_peers_connected", "Prefill nodes connected",
                 len(s.prefill_nodes))):
            yield GaugeMetricFamily(name, help_, value=value)
        yield CounterMetricFamily("statebridge_refused_peers", "Prefill peers whose handshake "
                                  "failed", value=s.refused_peers)
        yield CounterMetricFamily("statebridge_refused_clients", "Clients of the zmq front "
                                  "door refused by CURVE authentication", value=s.refused_clients)
        yield CounterMetricFamily("statebridge_node_aborted_requests", "Requests aborted at "
                                  "the decode node", value=s.aborted)
        memory = GaugeMetricFamily("statebridge_rank_memory_bytes", "Bytes a decode rank "
                                   "holds, by part: weights_private, weights_mapped (resident "
                                   "checkpoint pages), pages, kv_pool, total",
                                   labels=["rank", "part"])
        for r, parts in enumerate(zip(s.rank_weights_private, s.rank_weights_mapped,
                                      s.rank_pages_bytes, s.rank_kv_pool_bytes)):
            for part, value in zip(("weights_private", "weights_mapped", "pages", "kv_pool",
                                    "total"), (*parts, sum(parts))):
                memory.add_metric([str(r), part], value)
        yield memory
        yield CounterMetricFamily("statebridge_transfers_verified", "Decode-rank digests of "
                                  "landed transfers compared with the prefill node's "
                                  "(--verify-transfers)", value=s.transfers_verified)
        yield CounterMetricFamily("statebridge_transfer_checksum_mismatches", "Decode-rank "
                                  "digests of landed transfers that differed from the prefill "
                                  "node's: the request failed or was recomputed",
                                  value=s.transfer_mismatches)
        yield from _node_histograms(s)


def _node_histograms(s: nm.NodeStats):
    """The node's per-request histograms (:mod:`statebridge.node.metrics`) as Prometheus
    histograms (cumulative buckets)."""
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    from statebridge.node.metrics import HISTOGRAMS

    for name, counts, total in zip(s.histogram_names, s.histogram_counts, s.histogram_sums):
        known = HISTOGRAMS.get(name)
        if known is None or len(counts) != len(known[1]) + 1:
            continue                    # (a node of another version)
        help_, bounds = known
        cumulative, running = [], 0
        for bound, count in zip((*bounds, float("inf")), counts):
            running += count
            cumulative.append((floatToGoString(bound), running))
        yield HistogramMetricFamily(name, help_, buckets=cumulative, sum_value=total)


# -- the app and its server ----------------------------------------------------------------------
def build_app(link: NodeLink, tokenizer: TextTokenizer, config: HttpConfig, *, model_name: str,
              model_dir: str = "", max_prompt_len: int = 8192, max_new_tokens: int = 4096,
              max_inflight: int = 256, max_model_len: int = 0):
    """The Starlette app; the NodeLink starts and closes with it (lifespan)."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    api = _Api(link, tokenizer, config, model_name=model_name, model_dir=model_dir,
               max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
               max_inflight=max_inflight, metrics=_Metrics(), max_model_len=max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await link.start()
        try:
            yield
        finally:
            await link.close()
            if api.pool is not None:
                api.pool.shutdown(wait=False, cancel_futures=True)
                api.pool = None

    async def completions(request):
        return await api.completion(request, chat=False)

    async def chat(request):
        return await api.completion(request, chat=True)

    async def http_error(request, exc):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        "not_found_error" if exc.status_code == 404 else
                        "invalid_request_error").response()

    async def server_error(request, exc):
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                        "server_error").response()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error,
                                              Exception: server_error})
    app.state.api = api
    return app


def _guarded_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol with the two bounds uvicorn does not have:

    - A connection must send a whole request head within ``header_timeout`` seconds of its
      opening or of its previous response; otherwise it gets 408 and is closed (a slow
      client that sends half a head and waits holds a socket that long at most).
    - A connection answered before its request body was read (413, 408, a refusal that
      needed no body) is half-closed after the answer, its input drained and dropped for
      at most :data:`LINGER_S`, then closed: closing at once with unread input resets the
      connection, and the client could lose the answer.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps({"error": {"message": f"no whole request head within {header_timeout} s",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "header_timeout"}}).encode()
    timed_out = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    class GuardedH11Protocol(H11Protocol):
        _lingering = False
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._lingering:
                super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.SEND_BODY:     # answered before the body came
                self._linger()
            else:
                self._await_head()

        def _await_head(self) -> None:
            self._stop_timer()
            self._head_timer = self.loop.call_later(header_timeout, self._head_late, self.cycle)

        def _stop_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self, cycle) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not cycle or \
                    self.conn.their_state is not h11.IDLE:
                return                                      # a request came meanwhile
            log.debug("HTTP connection from %s sent no whole request head within %s s: "
                      "closed with 408", self.client, header_timeout)
            self.transport.write(timed_out)
            self._linger()

        def _linger(self) -> None:
            self._lingering = True
            self._stop_timer()
            self._unset_keepalive_if_required()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.flow.resume_reading()
            self.loop.call_later(LINGER_S, self._close)

        def _close(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class HttpServer:
    """uvicorn serving :func:`build_app` in a daemon thread (its own event loop). ``close()``
    stops it (idempotent). ``header_timeout``: default the app's ``HttpConfig``'s."""

    def __init__(self, app, host: str, port: int, *, timeout: float = 30.0,
                 header_timeout: float | None = None) -> None:
        import uvicorn

        self.host = host
        if header_timeout is None:
            api = getattr(getattr(app, "state", None), "api", None)
            header_timeout = api.config.header_timeout if api is not None else \
                HttpConfig().header_timeout
        # log_config=None: the library configures no logging (the CLI does).
        config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=None,
                                access_log=False, lifespan="on", timeout_graceful_shutdown=2,
                                ws="none", http=_guarded_protocol(header_timeout))
        self._server = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="statebridge-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise StartupError(f"the HTTP server did not start on {host}:{port}"
                                   f"{f': {self._error}' if self._error else ' (port in use?)'}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        self._closed = False
        self.model_name, self.keyed = "", False

    def _run(self) -> None:
        try:
            self._server.run()
        except BaseException as e:       # uvicorn exits (SystemExit) when it cannot bind
            self._error = e

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @classmethod
    def for_node(cls, node, model_dir: str, config: HttpConfig) -> "HttpServer":
        """The HTTP front door of a :class:`~statebridge.node.decode_node.DecodeNode` in this
        process (its tokenizer, limits and keys)."""
        tokenizer = TextTokenizer.from_dir(model_dir)
        nc = node.node_config
        where = node.address if node.port else node.coordinator.node_id   # (zmq door off)
        link = NodeLink(node, name=f"decode node {where}")
        name = config.served_model_name or os.path.basename(os.path.normpath(model_dir))
        app = build_app(link, tokenizer, config, model_name=name,
                        model_dir=os.path.abspath(model_dir), max_prompt_len=nc.max_prompt_len,
                        max_new_tokens=nc.max_new_tokens, max_model_len=node.max_model_len,
                        max_inflight=config.max_inflight or 4 * nc.num_pages)
        server = cls(app, config.host or node.config.bind_host,
                     config.port if config.port is not None else 0)
        server.model_name, server.keyed = name, bool(config.api_key)
        log.info("HTTP API of %s on %s (model %r)", node.address, server.url, name)
        return server

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._server.should_exit = True
        self._thread.join(15)
