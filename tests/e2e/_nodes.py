"""A prefill node and a decode node run as their commands (``python -m statebridge.cli``), for
tests that signal, kill and restart them as a supervisor would: the pair's processes, their
ranks, their listeners, their status and stats over the control ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.errors import StatebridgeError
from statebridge.net import free_port
from statebridge.node import messages as nm
from statebridge.node.client import Client
from statebridge.testing.sockets import (Listener, alive as _alive, descendants, is_rank,
                                         listening_sockets)

HOST = "127.0.0.1"


class NodeCommand:
    """One node's command line, started (and restarted, on the same ports) like a supervisor
    would; its output goes to ``log`` (appended across restarts)."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.args, self.log_path, self.env = name, args, log, env
        self.proc: subprocess.Popen | None = None
        self._log_start = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 240.0) -> None:
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "statebridge.cli", "-v",
                                          *self.args], stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.output()
            if " ready on " in text or " up on " in text:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"{self.name} did not start:\n{self.tail()}")

    def output(self) -> str:
        """What this run of the command printed so far."""
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_start)
            return f.read()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ranks(self) -> list[int]:
        """The node's rank processes (named ``sb-<role><rank>``: not the fork server or
        multiprocessing's resource tracker)."""
        return [pid for pid in descendants(self.pid) if is_rank(pid) and _alive(pid)]

    def processes(self) -> list[int]:
        return [self.pid, *descendants(self.pid)] if self.alive() else []

    def signal(self, sig: int, pid: int | None = None) -> None:
        os.kill(self.pid if pid is None else pid, sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL of its whole process group; its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)       # anything left of the group
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode


class Pair:
    """Prefill node (TP ``prefill_tp``) + decode node (TP ``decode_tp``, HTTP on) on HOST."""

    def __init__(self, model: str, root: Path, *, prefill_tp: int = 1, decode_tp: int = 2,
                 peer_timeout: float = 1.5, prefill_delay: float = 0.5,
                 extra_env: dict[str, str] | None = None) -> None:
        self.peer_timeout = peer_timeout
        self.prefill_port, self.decode_port, self.http_port = (free_port(HOST) for _ in range(3))
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(sys.path),
                   STATEBRIDGE_TEST_PREFILL_DELAY=str(prefill_delay),
                   STATEBRIDGE_HEARTBEAT_INTERVAL="0.2", STATEBRIDGE_HANDSHAKE_TIMEOUT="5",
                   **(extra_env or {}))
        common = ["--model", model, "--host", HOST, "--peer-timeout", str(peer_timeout),
                  "--num-pages", "8", "--kv-blocks", "64"]
        self.prefill = NodeCommand("prefill node", [
            "prefill", "--tp", str(prefill_tp), "--port", str(self.prefill_port), *common,
            "--rank-model", "tests.e2e._helpers:SlowPrefillModel"], root / "prefill.log", env)
        self.decode_args = ["decode", "--tp", str(decode_tp), "--port", str(self.decode_port),
                            "--prefill", f"{HOST}:{self.prefill_port}",
                            "--http-port", str(self.http_port), *common]
        self.decode = NodeCommand("decode node", self.decode_args, root / "decode.log", env)

    @property
    def prefill_address(self) -> str:
        return f"{HOST}:{self.prefill_port}"

    @property
    def decode_address(self) -> str:
        return f"{HOST}:{self.decode_port}"

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()

    def ensure(self) -> None:
        """Whatever node is not running is started again (a failed case leaves the pair
        whole for the next one)."""
        for node in (self.prefill, self.decode):
            if not node.alive():
                node.start()

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()

    def listeners(self) -> dict[int, list[Listener]]:
        """Every TCP socket listening in a process of either node, by pid."""
        out = {}
        for node in (self.prefill, self.decode):
            for pid in node.processes():
                try:
                    out[pid] = listening_sockets(pid)
                except ProcessLookupError:
                    pass
        return out

    def logs(self) -> str:
        return (f"--- prefill node ---\n{self.prefill.tail()}\n"
                f"--- decode node ---\n{self.decode.tail()}")


def query(address: str, message: m.Message, reply: type, timeout: float = 5.0):
    """One front-door query (StatusQuery, StatsQuery) to a node's control port."""
    sock = c.connect_dealer(zmq.Context.instance(), address)
    try:
        sock.send(m.encode(message))
        deadline = time.monotonic() + timeout
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            msg = m.decode(sock.recv())
            if isinstance(msg, reply):
                return msg
        raise AssertionError(f"no {reply.__name__} from {address} within {timeout} s")
    finally:
        sock.close(0)


def stats(address: str) -> nm.NodeStats:
    return query(address, nm.StatsQuery(client="test"), nm.NodeStats)


def status(address: str) -> nm.NodeStatus:
    return query(address, nm.StatusQuery(client="test"), nm.NodeStatus)


@dataclass
class Flight:
    """One request in flight from its own client thread: how it ended and when."""

    prompt: tuple[int, ...]
    new_tokens: int
    tokens: int = 0
    outcome: object = None                  # "ok" or the exception
    ended_at: float = 0.0
    decoding: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


def fly(address: str, prompts, new_tokens: int, timeout: float) -> list[Flight]:
    """Start one streaming request per prompt, each in its own thread and Client."""
    flights = [Flight(tuple(p), new_tokens) for p in prompts]

    def run(f: Flight) -> None:
        try:
            with Client(address, timeout=timeout) as client:
                for msg in client.stream(f.prompt, max_new_tokens=f.new_tokens):
                    f.tokens += len(msg.tokens)
                    if msg.tokens:
                        f.decoding.set()
            f.outcome = "ok"
        except Exception as e:  # noqa: BLE001 -- the test judges it
            f.outcome = e
        f.ended_at = time.monotonic()
    for f in flights:
        f.thread = threading.Thread(target=run, args=(f,), daemon=True)
        f.thread.start()
    return flights


def land(flights: list[Flight], timeout: float) -> None:
    for f in flights:
        f.thread.join(timeout)
        assert not f.thread.is_alive(), f"a request still in flight after {timeout} s"


def serve_again(address: str, since: float, timeout: float) -> float:
    """Seconds from ``since`` until a new request succeeds (retrying typed refusals)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            with Client(address, timeout=10) as client:
                if len(client.generate([5, 6, 7], max_new_tokens=2).tokens) == 2:
                    return time.monotonic() - since
        except StatebridgeError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{address} did not serve again within {timeout} s (last: {last!r})")
