"""Two hosts for real: a prefill node and a decode node in two network namespaces joined by a
veth pair, the state moving over UCX TCP on that link. Cutting the link fails the requests in
flight with ``peer_lost`` within the liveness bound; the decode node serves on, re-dials the
prefill node, and once the link is back the tokens are again those of a single-process run.

Needs ``ip netns`` (root or CAP_NET_ADMIN): skipped, saying why, only where a namespace cannot
be created. UCX is pinned to TCP on the veth (``UCX_TLS=tcp``, ``UCX_NET_DEVICES``): left to
itself UCX would use shared memory, which works across network namespaces of one machine and
would bypass the link under test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

PEER_TIMEOUT = 1.0
BOUND = PEER_TIMEOUT * 3 + 5          # a cut link fails the requests it touched within this
PREFILL_DELAY = 0.8                   # seconds per prefill (SlowPrefillModel): work in flight
NEW_TOKENS = 5
PROMPTS = [[5], [7, 3], [11, 2, 9, 4, 1], [6, 6, 1, 8, 2, 3, 9, 4, 7], [1, 2, 3, 4]]
PORT = 47001                           # inside the namespaces: nothing else binds there

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


@dataclass
class Net:
    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    decode_dev: str
    prefill_ip: str = "10.77.1.1"
    decode_ip: str = "10.77.1.2"

    def link(self, state: str) -> None:
        """Cut (``down``) or restore (``up``) the link, on the prefill side."""
        _run("ip", "-n", self.prefill_ns, "link", "set", self.prefill_dev, state)

    def rx_bytes(self) -> int:
        out = _run("ip", "-j", "-s", "-n", self.decode_ns, "link", "show", "dev",
                   self.decode_dev)
        return int(json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"])


def _kill_namespace_processes(ns: str) -> None:
    out = _run("ip", "netns", "pids", ns, check=False)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def net():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: cannot create network namespaces")
    pid = os.getpid()
    n = Net(f"sb-p-{pid}", f"sb-d-{pid}", f"sbp{pid}", f"sbd{pid}")
    probe = _run("ip", "netns", "add", n.prefill_ns, check=False)
    if probe.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {probe.stderr.strip()}")
    try:
        _run("ip", "netns", "add", n.decode_ns)
        _run("ip", "-n", n.prefill_ns, "link", "add", n.prefill_dev, "type", "veth", "peer",
             "name", n.decode_dev, "netns", n.decode_ns)
        for ns, dev, ip in ((n.prefill_ns, n.prefill_dev, n.prefill_ip),
                            (n.decode_ns, n.decode_dev, n.decode_ip)):
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield n
    finally:
        for ns in (n.prefill_ns, n.decode_ns):
            _kill_namespace_processes(ns)
            _run("ip", "netns", "del", ns, check=False)
        assert not any(ns in _run("ip", "netns", "list").stdout
                       for ns in (n.prefill_ns, n.decode_ns))


class NsProcess:
    """A command inside a namespace, its output collected by a thread (never blocks a test)."""

    def __init__(self, ns: str, args: list[str], env: dict[str, str], name: str,
                 stdin: bool = False) -> None:
        self.name = name
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, *args], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"read-{name}")
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                found = predicate(self.lines)
                if found:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = "\n".join(self.lines[-40:])
                    raise AssertionError(f"{self.name}: {what} (exit {self.proc.poll()}):\n{tail}")
                self.changed.wait(min(left, 0.5))

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole process group (node and rank processes)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(5)
        return self.proc.returncode


# The client runs inside the decode namespace: one JSON job per stdin line, one JSON result per
# stdout line, each job on its own thread (so requests are in flight together).
DRIVER = r"""
import json, sys, threading
from statebridge.errors import TransferError
from statebridge.node.client import Client
lock = threading.Lock()
def say(obj):
    with lock:
        print(json.dumps(obj), flush=True)
def run(job):
    try:
        with Client(sys.argv[1], timeout=job["timeout"]) as client:
            g = client.generate(job["prompt"], max_new_tokens=job["new"])
        say({"id": job["id"], "kind": "", "tokens": g.tokens, "bytes": g.transfer_bytes})
    except TransferError as e:
        say({"id": job["id"], "kind": e.kind, "message": str(e)})
    except Exception as e:
        say({"id": job["id"], "kind": "unexpected", "message": f"{type(e).__name__}: {e}"})
print("driver ready", flush=True)
for line in sys.stdin:
    threading.Thread(target=run, args=(json.loads(line),)).start()
"""


class Driver:
    def __init__(self, ns: str, address: str, env: dict[str, str]) -> None:
        self.p = NsProcess(ns, [sys.executable, "-c", DRIVER, address], env, "client", True)
        self.p.wait_for(lambda lines: "driver ready" in lines, 120, "client did not start")
        self._ids = iter(range(1_000_000))

    def submit(self, prompt: list[int], timeout: float = 60.0) -> str:
        job = {"id": f"j{next(self._ids)}", "prompt": prompt, "new": NEW_TOKENS,
               "timeout": timeout}
        self.p.proc.stdin.write(json.dumps(job) + "\n")
        self.p.proc.stdin.flush()
        return job["id"]

    def result(self, job: str, timeout: float) -> tuple[dict, float]:
        """The job's result and the monotonic time it arrived."""
        def find(lines):
            for line in lines:
                if line.startswith("{") and json.loads(line)["id"] == job:
                    return json.loads(line), time.monotonic()
            return None
        return self.p.wait_for(find, timeout, f"no result for {job}")

    def generate_all(self, prompts, timeout: float = 90.0) -> list[dict]:
        jobs = [self.submit(p) for p in prompts]
        return [self.result(j, timeout)[0] for j in jobs]


def _env(ucx_dev: str, peer_timeout: float = PEER_TIMEOUT) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, *sys.path]), PYTHONUNBUFFERED="1",
                UCX_TLS="tcp", UCX_NET_DEVICES=ucx_dev, UCX_WARN_UNUSED_ENV_VARS="n",
                STATEBRIDGE_PEER_TIMEOUT=str(peer_timeout), STATEBRIDGE_HEARTBEAT_INTERVAL="0.2",
                STATEBRIDGE_HANDSHAKE_TIMEOUT="3", STATEBRIDGE_TEST_PREFILL_DELAY=str(PREFILL_DELAY),
                STATEBRIDGE_LOG_LEVEL="INFO", OMP_NUM_THREADS="1")


@pytest.mark.timeout(240)
def test_cut_link_fails_in_flight_requests_then_decode_redials(net, tmp_path):
    from statebridge.models.checkpoint import make_checkpoint
    from statebridge.node.demo import reference_greedy

    model = str(tmp_path / "lfm2-tiny")
    make_checkpoint("lfm2", model, preset="tiny", seed=0)
    cli = [sys.executable, "-m", "statebridge.cli", "-v"]
    prefill = decode = driver = None
    try:
        prefill = NsProcess(net.prefill_ns, [
            *cli, "prefill", "--model", model, "--tp", "2", "--port", str(PORT),
            "--host", net.prefill_ip, "--rank-model", "tests.e2e._helpers:SlowPrefillModel"],
            # Both sides run a 1 s peer timeout: losing the peer behind the cut link must not
            # stall a prefill rank (endpoint closes do not wait for a flush that never ends).
            _env(net.prefill_dev), "prefill node")
        expected = reference_greedy(model, PROMPTS, NEW_TOKENS)     # while the node starts
        prefill.wait_for(lambda lines: any(" ready on " in x for x in lines), 180,
                         "prefill node did not start")
        decode = NsProcess(net.decode_ns, [
            *cli, "decode", "--model", model, "--tp", "1", "--port", str(PORT),
            "--prefill", f"{net.prefill_ip}:{PORT}"], _env(net.decode_dev), "decode node")
        driver = Driver(net.decode_ns, f"127.0.0.1:{PORT}", _env(net.decode_dev))
        decode.wait_for(lambda lines: any(" ready on " in x for x in lines), 180,
                        "decode node did not start")

        # 1. Served over the link, token for token the single-process run.
        rx_before = net.rx_bytes()
        results = driver.generate_all(PROMPTS)
        assert [r["kind"] for r in results] == [""] * len(PROMPTS), results
        assert [r["tokens"] for r in results] == expected
        moved = sum(r["bytes"] for r in results)
        assert moved > 0 and net.rx_bytes() - rx_before >= moved     # the state crossed the veth

        # 2. Cut the link with requests in flight, and send more just after the cut.
        in_flight = [driver.submit(p) for p in PROMPTS[1:4]]
        time.sleep(0.3)                                 # all in their (slow) prefill
        net.link("down")
        cut_at = time.monotonic()
        after_cut = [driver.submit(p) for p in PROMPTS[:2]]
        for job in in_flight + after_cut:
            result, at = driver.result(job, BOUND + 10)
            assert result["kind"] == "peer_lost", result
            assert at - cut_at < BOUND, f"{job} failed {at - cut_at:.1f} s after the cut"
        # The decode node serves on while the link is down: a new request fails at once.
        result, at = driver.result(driver.submit(PROMPTS[0]), BOUND)
        assert result["kind"] == "not_ready" and "no prefill server" in result["message"], result
        time.sleep(max(0.0, cut_at + 4.0 - time.monotonic()))     # re-dials fail meanwhile
        assert decode.proc.poll() is None and prefill.proc.poll() is None

        # 3. Link back: the decode node re-dials on its own; serving resumes within a bound.
        net.link("up")
        up_at = time.monotonic()
        while True:
            result, _ = driver.result(driver.submit(PROMPTS[0]), 60)
            if not result["kind"]:
                break
            assert result["kind"] in ("peer_lost", "not_ready"), result
            assert time.monotonic() - up_at < 30, "no request succeeded 30 s after link up"
            time.sleep(0.5)
        assert result["tokens"] == expected[0]
        results = driver.generate_all(PROMPTS)
        assert [r["tokens"] for r in results] == expected, results
        decode.wait_for(lambda lines: any("connected again" in x for x in lines), 10,
                        "decode node did not log the reconnect")
    finally:
        codes = {p.name: p.stop() for p in (driver and driver.p, decode, prefill) if p}
        for p in (prefill, decode):
            if p is not None:
                print(f"--- {p.name} ---\n" + "\n".join(p.lines[-300:]))
    assert codes.get("decode node") == 0 and codes.get("prefill node") == 0, codes
