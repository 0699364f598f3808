"""``statebridge proxy``: the OpenAI API in front of `vllm serve` prefill and decode instances
that run :class:`~statebridge.vllm.StatebridgeConnector`.

Per request (``/v1/completions``, ``/v1/chat/completions``, streaming or not)::

    client -> proxy -> prefill instance   the same body with max_tokens 1, no stream, and
                                          kv_transfer_params {"do_remote_decode": true}
                    <- its kv_transfer_params (where the state is, what its cache now holds)
                    -> decode instance     the client's body + those kv_transfer_params
    client <- the decode instance's answer, streamed through unchanged

Routing: a prefill instance is chosen by :meth:`PrefixRouter.choose
<statebridge.connector.prefix_router.PrefixRouter.choose>` -- the one holding the longest
cached prefix of the prompt, balanced by the prompt tokens in flight there -- from what each
instance reported after its earlier prefills (the connector's ``cached_prefix_tokens``:
vLLM's prefix cache holds the prompt's full blocks). The prompt is tokenized with the
checkpoint's tokenizer (``--model``); without one, round robin. A decode instance is the one
with the fewest requests in flight. An instance's error comes back to the client as it came
(status and body); an unreachable instance is a 503 naming it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from statebridge.connector import messages as m
from statebridge.connector.prefix_router import NodePrefix, PrefixRouter
from statebridge.errors import ConfigError
from statebridge.state.prefix import PrefixHasher

log = logging.getLogger(__name__)

__all__ = ["Proxy", "make_app"]

#: Keys the proxy remembers per prefill instance before it forgets the oldest.
MAX_KEYS_PER_INSTANCE = 200_000


@dataclass
class _Instance:
    url: str
    in_flight: int = 0
    in_flight_tokens: int = 0


class Proxy:
    """Routing state of one proxy (its HTTP app is :func:`make_app`)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *,
                 model_dir: str | None = None, block_size: int = 32, routing: bool = True,
                 timeout_s: float = 600.0) -> None:
        if not prefill or not decode:
            raise ConfigError(f"the proxy needs at least one prefill and one decode instance, "
                              f"got prefill={list(prefill)} decode={list(decode)}")
        for url in (*prefill, *decode):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"instance URL {url!r} must start with http:// or https://")
        self.prefill = [_Instance(u.rstrip("/")) for u in prefill]
        self.decode = [_Instance(u.rstrip("/")) for u in decode]
        self.timeout_s = timeout_s
        self.tokenizer = None
        if model_dir is not None:
            from statebridge.node.text import TextTokenizer

            self.tokenizer = TextTokenizer.from_dir(model_dir)
        self.router = PrefixRouter(enabled=self.tokenizer is not None, routing=routing)
        self._hasher = PrefixHasher(b"vllm-proxy", block_size, stride=block_size)
        for inst in self.prefill:
            self.router.nodes[inst.url] = NodePrefix(self._hasher)
        self._seq = itertools.count()
        self._turn = itertools.count()
        self.counters = {"requests": 0, "routed_to_cached_prefix": 0, "errors": 0}

    # -- routing -----------------------------------------------------------------------------
    def tokens(self, path: str, body: dict) -> np.ndarray | None:
        """The prompt's token ids as the proxy hashes them (None: cannot tell; round robin)."""
        if self.tokenizer is None:
            return None
        try:
            if path.endswith("/chat/completions"):
                text = self.tokenizer.apply_chat_template(body.get("messages") or [])
                ids = self.tokenizer.encode(text)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                    ids = prompt
                elif isinstance(prompt, str):
                    ids = self.tokenizer.encode(prompt)
                else:
                    return None
            return np.asarray(ids, dtype=np.int64)
        except Exception:  # noqa: BLE001 -- the instance reports a bad prompt itself
            return None

    def pick_prefill(self, tokens: np.ndarray | None) -> tuple[_Instance, int]:
        turn = next(self._turn)
        if tokens is None or len(self.prefill) == 1 or not self.router.routing:
            return self.prefill[turn % len(self.prefill)], 0
        queued = {i.url: i.in_flight_tokens for i in self.prefill}
        index, hit = self.router.choose([i.url for i in self.prefill], tokens, queued, turn)
        if hit:
            self.counters["routed_to_cached_prefix"] += 1
        return self.prefill[index], hit

    def pick_decode(self) -> _Instance:
        turn = next(self._turn)
        n = len(self.decode)
        return min((self.decode[(turn + i) % n] for i in range(n)), key=lambda i: i.in_flight)

    def reported(self, inst: _Instance, tokens: np.ndarray | None, params: dict) -> None:
        """What the prefill instance said its cache holds of this prompt, into its index."""
        cached = params.get("cached_prefix_tokens")
        if tokens is None or not isinstance(cached, int) or cached < 1:
            return
        node = self.router.nodes[inst.url]
        prompt = self._hasher.prompt(tokens)
        bs = self._hasher.block_size
        added = [n for n in range(bs, min(cached, len(tokens)) + 1, bs)]
        keys = [prompt.key_at(n) for n in added]
        removed: list[bytes] = []
        overflow = len(node.keys) + len(keys) - MAX_KEYS_PER_INSTANCE
        if overflow > 0:
            removed = list(itertools.islice(iter(node.keys), overflow))
        self.router.announced(inst.url, m.PrefixAnnounce(
            node_id=inst.url, seq=next(self._seq), reset=False, added_keys=tuple(keys),
            added_tokens=tuple(added), removed_keys=tuple(removed)))


def make_app(proxy: Proxy):
    """The Starlette app of ``proxy``."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(timeout=httpx.Timeout(proxy.timeout_s, connect=10.0))

    def error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
        proxy.counters["errors"] += 1
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status)

    async def forward(request: Request) -> Response:
        path = request.url.path
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the request body is not JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "invalid_request_error")
        proxy.counters["requests"] += 1
        tokens = proxy.tokens(path, body)
        prefill, _ = proxy.pick_prefill(tokens)
        first = dict(body, max_tokens=1, stream=False,
                     kv_transfer_params={"do_remote_decode": True})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        n_tokens = len(tokens) if tokens is not None else 0
        prefill.in_flight += 1
        prefill.in_flight_tokens += n_tokens
        try:
            resp = await client.post(prefill.url + path, json=first)
        except httpx.HTTPError as e:
            return error(503, f"prefill instance {prefill.url} unreachable: {e}")
        finally:
            prefill.in_flight -= 1
            prefill.in_flight_tokens -= n_tokens
        if resp.status_code != 200:
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        params = resp.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return error(502, f"prefill instance {prefill.url} returned no kv_transfer_params: "
                              f"is it started with a kv_producer StatebridgeConnector?")
        proxy.reported(prefill, tokens, params)
        second = dict(body, kv_transfer_params=params)
        decode = proxy.pick_decode()
        decode.in_flight += 1
        if not body.get("stream"):
            try:
                resp = await client.post(decode.url + path, json=second)
            except httpx.HTTPError as e:
                return error(503, f"decode instance {decode.url} unreachable: {e}")
            finally:
                decode.in_flight -= 1
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        try:
            upstream = await client.send(client.build_request("POST", decode.url + path,
                                                              json=second), stream=True)
        except httpx.HTTPError as e:
            decode.in_flight -= 1
            return error(503, f"decode instance {decode.url} unreachable: {e}")

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                decode.in_flight -= 1

        return StreamingResponse(chunks(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    async def models(request: Request) -> Response:
        try:
            resp = await client.get(proxy.decode[0].url + "/v1/models")
        except httpx.HTTPError as e:
            return error(503, f"decode instance {proxy.decode[0].url} unreachable: {e}")
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    async def health(request: Request) -> Response:
        missing = []
        for inst in (*proxy.prefill, *proxy.decode):
            try:
                ok = (await client.get(inst.url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                missing.append(inst.url)
        if missing:
            return JSONResponse({"status": "unavailable", "missing": missing}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        return JSONResponse({**proxy.counters,
                             "prefill": {i.url: {"in_flight": i.in_flight,
                                                 **proxy.router.node_stats(i.url)}
                                         for i in proxy.prefill},
                             "decode": {i.url: {"in_flight": i.in_flight}
                                        for i in proxy.decode}})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    routes = [Route("/v1/completions", forward, methods=["POST"]),
              Route("/v1/chat/completions", forward, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/stats", stats, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


def serve(proxy: Proxy, host: str, port: int) -> None:
    import uvicorn

    log.info("statebridge proxy on http://%s:%d: prefill %s, decode %s, routing %s", host, port,
             [i.url for i in proxy.prefill], [i.url for i in proxy.decode],
             "by cached prefix" if proxy.tokenizer is not None else "round robin")
    uvicorn.run(make_app(proxy), host=host, port=port, log_level="warning")


