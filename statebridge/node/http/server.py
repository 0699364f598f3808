"""uvicorn serving the app in a thread of its own, with the two connection bounds uvicorn
lacks (a request head's deadline, a drained half-close after an early answer)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

from statebridge.config import HttpConfig
from statebridge.errors import StartupError
from statebridge.node.http.api import build_app
from statebridge.node.http.link import NodeLink
from statebridge.node.text import TextTokenizer

log = logging.getLogger(__name__)

__all__ = ["HttpServer", "LINGER_S"]

#: Seconds a connection refused before its body was read is drained before it is closed
#: (closing at once with unread bytes resets it, and the client may lose the answer).
LINGER_S = 2.0


def guarded_protocol(header_timeout: float) -> type:
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
                                ws="none", http=guarded_protocol(header_timeout))
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
