"""A rank process for the transport tests: owns one Transport and executes commands sent by the
test over a multiprocessing pipe (the control plane is not under test here).

The parent talks to it through :class:`Agent`: every call is bounded in time, a failure in the
child comes back as :class:`AgentError` with the child's traceback, and the child exits on its
own when the pipe closes or its lifetime runs out, so a broken test leaves no orphan behind.
Handles stay in the child and are named by integer ids. Between commands the agent keeps its
transport progressing, as a rank loop does (a send handle completes at its sender's progress).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import select
import signal
import time
import traceback
from typing import Any

import numpy as np

LIFETIME_S = 180.0


class AgentError(RuntimeError):
    """A command failed inside the agent process."""


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The deterministic bytes :meth:`Agent.fill` writes (tests compute expectations from it)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha256(data: np.ndarray | bytes) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


# -- child side -------------------------------------------------------------------------------

class _Server:
    def __init__(self, name: str) -> None:
        from statebridge.connector import data as tr

        tr.configure_ucx_env()
        self.tr = tr
        self.name = name
        self.transport = None
        self.buffer = None
        self.handles: dict[int, Any] = {}
        self.next_id = 0

    # Commands ------------------------------------------------------------------------------
    def open(self, nbytes: int, **kwargs) -> bytes:
        self.close()
        self.buffer = self.tr.alloc_buffer(nbytes)
        self.transport = self.tr.Transport(self.buffer, name=self.name, **kwargs)
        self.handles.clear()
        return self.transport.address

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = None

    def connect(self, peer_id: str, address: bytes) -> None:
        self.transport.connect(peer_id, address)

    def fill(self, offset: int, nbytes: int, seed: int) -> None:
        self.buffer.numpy()[offset:offset + nbytes] = pattern(seed, nbytes)

    def digest(self, offset: int, nbytes: int) -> str:
        return sha256(self.buffer.numpy()[offset:offset + nbytes])

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.buffer.numpy()[offset:offset + nbytes])

    def post(self, method: str, *args, **kwargs) -> int:
        handle = getattr(self.transport, method)(*args, **kwargs)
        self.next_id += 1
        self.handles[self.next_id] = handle
        return self.next_id

    def done(self, hid: int) -> bool:
        return self.handles[hid].done()

    def wait(self, hid: int, timeout: float) -> dict:
        """Wait; report the outcome (never raises for transfer errors) and when it happened."""
        h = self.handles[hid]
        start = time.monotonic()
        try:
            h.wait(timeout)
            error = None
        except Exception as e:  # noqa: BLE001 -- reported to the test
            error = e
        now = time.monotonic()
        out = {"ok": error is None, "at": now, "waited": now - start,
               "elapsed": h.elapsed, "done": h.done()}
        if error is not None:
            out.update(error=type(error).__name__, message=str(error),
                       peer=getattr(error, "peer", None), kind=getattr(error, "kind", None))
        return out

    def cancel(self, hid: int) -> None:
        self.handles[hid].cancel()

    def fail_peer(self, peer_id: str, reason: str) -> int:
        return self.transport.fail_peer(peer_id, reason)

    def discard_unexpected(self, generation: int, src_rank: int | None = None) -> int:
        return self.transport.discard_unexpected(generation, src_rank)

    def stats(self) -> dict:
        return self.transport.stats()

    def progress(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.transport.progress(min(0.01, max(0.0, end - time.monotonic())))


def _idle(conn, transport, deadline: float) -> bool:
    """Wait for the next command; like a rank loop, keep the transport progressing meanwhile
    (by sleeping on its file descriptor). True when a command is waiting."""
    if conn.poll(0):
        return True
    if transport is None or transport.closed:
        return conn.poll(min(1.0, max(0.0, deadline - time.monotonic())))
    if transport.arm():
        select.select([conn, transport.fileno()], [], [], 0.1)
    transport.progress()
    return conn.poll(0)


def _serve(conn, name: str) -> None:
    deadline = time.monotonic() + LIFETIME_S
    server = None
    try:
        server = _Server(name)
        conn.send(("ready", os.getpid()))
        while time.monotonic() < deadline:
            if not _idle(conn, server.transport, deadline):
                continue
            try:
                cmd, args, kwargs = conn.recv()
            except (EOFError, OSError):
                break
            if cmd == "exit":
                conn.send(("ok", None))
                break
            try:
                result = getattr(server, cmd)(*args, **kwargs)
                conn.send(("ok", result))
            except Exception:  # noqa: BLE001 -- goes back to the test
                conn.send(("error", traceback.format_exc()))
    finally:
        if server is not None:
            server.close()
        conn.close()


# -- parent side ------------------------------------------------------------------------------

class Agent:
    """Handle on one agent process (spawned, so it has its own UCX and torch)."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, name), name=f"agent-{name}",
                                   daemon=True)
        self.process.start()
        child.close()
        self.pid: int | None = None

    def ready(self, timeout: float = 60.0) -> "Agent":
        if not self.conn.poll(timeout):
            raise AgentError(f"agent {self.name} did not start within {timeout} s")
        _, self.pid = self.conn.recv()
        return self

    def call(self, cmd: str, *args, timeout: float = 20.0, **kwargs) -> Any:
        self.conn.send((cmd, args, kwargs))
        if not self.conn.poll(timeout):
            raise AgentError(f"agent {self.name}: {cmd} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise AgentError(f"agent {self.name}: {cmd} failed:\n{value}")
        return value

    def kill(self) -> float:
        """SIGKILL the process; returns the monotonic time of the kill."""
        t = time.monotonic()
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        return t

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=5)
            except (AgentError, OSError, EOFError, BrokenPipeError):
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


def start_agents(*names: str) -> list[Agent]:
    """Start agents in parallel (each pays the torch import once)."""
    agents = [Agent(n) for n in names]
    try:
        return [a.ready() for a in agents]
    except BaseException:
        for a in agents:
            a.stop()
        raise
