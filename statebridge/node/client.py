"""The client of a decode node: ``Client(address).generate(prompt)``.

The one client of the node's zmq front door (other processes, other hosts). The HTTP API in
the node's own process needs no socket: it hands the same messages to
:meth:`~statebridge.node.decode_node.DecodeNode.post`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.errors import ProtocolError, TransferTimeoutError, error_for
from statebridge.node import messages as nm
from statebridge.security import CurveKeys

__all__ = ["Client", "Generation"]


@dataclass
class Generation:
    """A finished request: its tokens and what it cost. ``logprobs`` / ``top_logprobs``: when
    asked for (``logprobs=k``), each token's log-probability and its step's ``k`` most
    likely tokens as ``(token id, log-probability)`` pairs, most likely first."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    ttft: float = 0.0                 # seconds from arrival at the decode node to token 1
    transfer_seconds: float = 0.0     # the state transfer (submit -> every decode rank ready)
    transfer_bytes: int = 0
    recomputed: bool = False          # the decode node prefilled locally (recompute policy)
    seconds: float = 0.0              # wall time seen by the client
    cached_tokens: int = 0            # prompt tokens the prefill node's prefix cache served


class Client:
    """Talks to a decode node's front door over zmq. One outstanding call per Client object;
    use one Client per thread."""

    def __init__(self, address: str, *, timeout: float = 120.0,
                 keys: CurveKeys | None = None) -> None:
        """``keys``: the client's CURVE keys when the node requires them, e.g.
        ``CurveKeys.load(DIR, "client")``; a refused handshake raises AuthenticationError."""
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.Context.instance()
        self._sock, self._watch = c.dial_dealer(self._ctx, address, keys=keys)

    def status(self, timeout: float | None = None) -> nm.NodeStatus:
        """The node's answer to a status query: ``ready``, and ``reason`` when it is not."""
        timeout = self.timeout if timeout is None else timeout
        self._send(nm.StatusQuery(client="client"), timeout)
        deadline = time.monotonic() + timeout
        while c.poll_dealer(self._sock, self._watch, max(0.0, deadline - time.monotonic())):
            msg = m.decode(self._sock.recv())
            if isinstance(msg, nm.NodeStatus):
                return msg
        raise TransferTimeoutError(f"no status from decode node {self.address} within "
                                   f"{timeout} s (down, unreachable, or refusing us because "
                                   f"of authentication -- check the keys on both sides)")

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the decode node answers that it serves; TransferTimeoutError with its
        last reason otherwise."""
        deadline = time.monotonic() + timeout
        why = "no answer"
        while True:
            left = deadline - time.monotonic()
            try:
                status = self.status(max(0.05, min(1.0, left)))
                if status.ready:
                    return
                why = status.reason
            except TransferTimeoutError as e:
                why = str(e)
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(f"decode node {self.address} not ready within "
                                           f"{timeout} s: {why}")
            time.sleep(0.1)

    def stream(self, prompt: Sequence[int], *, max_new_tokens: int = 16,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               request_id: str | None = None,
               logprobs: int | None = None) -> Iterator[nm.GenerateTokens]:
        """Yield the node's GenerateTokens messages for one request, as they arrive.
        ``logprobs=k`` (0 to :data:`~statebridge.models.sampling.MAX_LOGPROBS`): each token
        comes with its log-probability and the ``k`` most likely tokens' (the model's raw
        distribution)."""
        request_id = request_id or uuid.uuid4().hex
        prompt = tuple(map(int, prompt))
        self._send(nm.GenerateRequest(
            request_id=request_id, prompt=prompt, max_new_tokens=int(max_new_tokens),
            temperature=float(temperature), top_p=float(top_p), seed=int(seed),
            logprobs=-1 if logprobs is None else int(logprobs)), self.timeout)
        while True:
            if not c.poll_dealer(self._sock, self._watch, self.timeout):
                raise TransferTimeoutError(f"no answer from {self.address} for "
                                           f"{self.timeout} s", request_id=request_id)
            msg = m.decode(self._sock.recv())
            if isinstance(msg, m.Error):
                raise ProtocolError(f"decode node refused the request: {msg.kind}: "
                                    f"{msg.message}")
            if not isinstance(msg, nm.GenerateTokens) or msg.request_id != request_id:
                continue
            if msg.kind:
                raise error_for(msg.kind, f"request {request_id}: {msg.message}",
                                request_id=request_id, peer=self.address)
            yield msg
            if msg.done:
                return

    def generate(self, prompt: Sequence[int], **kwargs) -> Generation:
        """Run one request to completion; typed errors as the node reports them."""
        start = time.perf_counter()
        out = Generation(request_id=kwargs.get("request_id") or uuid.uuid4().hex)
        kwargs["request_id"] = out.request_id
        for msg in self.stream(prompt, **kwargs):
            out.tokens.extend(msg.tokens)
            out.logprobs.extend(msg.logprobs)
            out.top_logprobs.extend(list(zip(ids, lps))
                                    for ids, lps in zip(msg.top_ids, msg.top_logprobs))
            out.ttft, out.transfer_seconds = msg.ttft, msg.transfer_seconds
            out.transfer_bytes, out.recomputed = msg.transfer_bytes, msg.recomputed
            out.cached_tokens = msg.cached_tokens
        out.seconds = time.perf_counter() - start
        return out

    def _send(self, message: m.Message, timeout: float) -> None:
        """Send without blocking forever: a refused handshake leaves no peer to queue to."""
        data = m.encode(message)
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not c.poll_dealer(self._sock, self._watch, left, zmq.POLLOUT):
                raise TransferTimeoutError(
                    f"cannot send to {self.address} for {timeout} s (no connection: down, "
                    f"unreachable, or refusing us because of authentication -- check the keys "
                    f"on both sides)")
            try:
                self._sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                # the connection went between the poll and the send (a refused CURVE
                # handshake drops it): poll again, which reports the refusal or times out
                time.sleep(0.01)

    def close(self) -> None:
        self._watch.close()
        self._sock.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
