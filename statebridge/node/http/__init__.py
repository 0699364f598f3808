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
within ``header_timeout`` (:func:`guarded_protocol`); a batch larger than can ever be in
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

The package: :mod:`.requests` reads a request (key, body, sampling, prompt), :mod:`.api` runs
it (choices, text, log-probabilities, SSE) and builds the app, :mod:`.link` is the link to the
node, :mod:`.metrics` the Prometheus registry, :mod:`.server` the uvicorn thread, and
:mod:`.errors` the error shape.
"""

from statebridge.node.http.api import build_app
from statebridge.node.http.errors import ApiError
from statebridge.node.http.link import NodeLink, NodeStream
from statebridge.node.http.requests import (INLINE_CHARS, MAX_CHARS_PER_TOKEN, MAX_STOP,
                                            TOKENIZE_THREADS)
from statebridge.node.http.server import LINGER_S, HttpServer

__all__ = ["HttpServer", "build_app", "NodeLink", "NodeStream", "ApiError", "MAX_STOP",
           "MAX_CHARS_PER_TOKEN", "INLINE_CHARS", "TOKENIZE_THREADS", "LINGER_S"]
