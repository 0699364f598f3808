"""The OpenAI endpoints on the server's event loop: a request's choices, each a stream of the
decode node's token messages turned into text (stop strings, incremental detokenization),
log-probabilities and token ids, answered whole or as server-sent events; ``/v1/models``,
``/health`` and ``/metrics``; and :func:`build_app`, the Starlette app."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from statebridge.config import HttpConfig
from statebridge.errors import StatebridgeError
from statebridge.node import messages as nm
from statebridge.node.http.errors import ApiError, bad, node_error
from statebridge.node.http.link import NodeLink, NodeStream
from statebridge.node.http.metrics import Metrics
from statebridge.node.http.requests import RequestReader, Sampling
from statebridge.node.text import TextStream, TextTokenizer

log = logging.getLogger(__name__)

__all__ = ["build_app"]


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
                 max_inflight: int, metrics: "Metrics", max_model_len: int = 0) -> None:
        self.link, self.tok, self.config = link, tokenizer, config
        self.model_name, self.model_dir = model_name, model_dir
        #: Reads each request (key, body, sampling values, prompts) under the node's limits.
        self.reader = RequestReader(config, tokenizer, model_name=model_name,
                                    max_prompt_len=max_prompt_len,
                                    max_new_tokens=max_new_tokens, max_inflight=max_inflight)
        #: /v1/models' max_model_len: what the node serves (0: the two limits' sum).
        self.max_model_len = max_model_len or max_prompt_len + max_new_tokens
        self.max_inflight = max_inflight
        self.inflight = 0
        self.metrics = metrics
        self.created = int(time.time())

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
            self.reader.check_key(request)
            body, size = await self.reader.body(request)
            params = self.reader.sampling(body, chat=chat)
            prompts = [await self.reader.chat_prompt(body, size)] if chat else \
                await self.reader.prompts(body)
        except RecursionError:
            e = bad("the body is nested too deeply to be a request")
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
        choices = [_Choice(f"{rid}-{i}", i, ids, params, arrived, link=self.link,
                           text=self.tok.stream(params.stop, ignore_eos=params.ignore_eos),
                           metrics=self.metrics, timeout=self.config.node_timeout)
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
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(ch.cached_tokens
                                                               for ch in choices)}}

    # -- log-probabilities and token ids ------------------------------------------------------
    def token_text(self, token: int, params: Sampling) -> str:
        """A token as logprobs name it: its text (special tokens too), or ``"token_id:N"``
        (vLLM's ``return_tokens_as_token_ids``)."""
        return f"token_id:{token}" if params.tokens_as_ids else self.tok.token_text(token)

    def logprobs_body(self, entries: Sequence[_Logprob], params: Sampling, *,
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

    async def events(self, rid: str, chat: bool, choices: list["_Choice"], params: Sampling,
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
            self.reader.check_key(request)
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

    def __init__(self, request_id: str, index: int, prompt: list[int], params: Sampling,
                 arrived: float, *, link: NodeLink, text: TextStream, metrics: Metrics,
                 timeout: float) -> None:
        """``text``: the tokenizer's stream for ``params``; ``timeout``: how long to wait
        for each node message."""
        self.request_id, self.index, self.prompt = request_id, index, prompt
        self.params, self.arrived = params, arrived
        self.link, self.text, self.metrics, self.timeout = link, text, metrics, timeout
        self.stream: NodeStream | None = None
        self.finish: str | None = None
        self.out = ""
        self.tokens: list[int] = []                 # every id consumed (an EOS one included)
        self.logprobs: list[_Logprob] = []
        self._first: nm.GenerateTokens | None = None
        #: Prompt tokens the prefix cache served (the node's last message says).
        self.cached_tokens = 0
        self._first_at = 0.0
        self._last_token = 0.0

    async def start(self) -> None:
        p = self.params
        self.stream = self.link.open(nm.GenerateRequest(
            request_id=self.request_id, prompt=tuple(self.prompt), max_new_tokens=p.max_tokens,
            temperature=p.temperature, top_p=p.top_p, seed=p.seed, logprobs=p.logprobs))
        self._first = await self._next()

    async def _next(self) -> nm.GenerateTokens:
        msg = await self.stream.next(self.timeout)
        if msg.kind:
            raise node_error(msg.kind, msg.message)
        self.cached_tokens = msg.cached_tokens
        if msg.tokens:
            now = time.perf_counter()
            metrics = self.metrics
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
            self.metrics.finished(finish, prompt_tokens=len(self.prompt),
                                  tokens=self.text.tokens, arrived=self.arrived,
                                  first_token_at=self._first_at, now=time.perf_counter())
        return _Piece(delta, finish, tuple(consumed), tuple(logprobs))

    async def run(self) -> None:
        while self.finish is None:
            await self.step()

    def close(self, reason: str) -> None:
        if self.stream is not None:
            self.stream.close(reason)


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
               max_inflight=max_inflight, metrics=Metrics(), max_model_len=max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await link.start()
        try:
            yield
        finally:
            await link.close()
            api.reader.close()

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
