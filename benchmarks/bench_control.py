"""CPU per control message: zmq (DEALER -> ROUTER over tcp, what nodes use between them) vs the
ranks' local channel (connector/local.py: a Unix socket the loop thread serves itself).

Two processes, the sender a rank-like DEALER, the receiver a coordinator-like ROUTER polling
and draining with statebridge's own control functions (``send_dealer`` / ``recv_router``).
``--gap`` paces the sender so the receiver sleeps between messages (the low-load case, every
message a wake-up); ``--gap 0`` sends back to back (the loaded case). CPU is process CPU time
(every thread, zmq's I/O threads included); the sender's figure has its own pacing loop (the
same loop without sends, measured first) subtracted.

    python benchmarks/bench_control.py --messages 3000 --gap 0.0005 0 --repeats 3 \\
        --json benchmarks/results/control-channel-2026-12-03.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.local import LocalDealer, LocalRouter

MAX_BYTES = 1 << 20


def _receiver(kind: str, n: int, q) -> None:
    if kind == "zmq":
        sock, port = c.bind_router(zmq.Context.instance(), "127.0.0.1", 0)
        sock.setsockopt(zmq.RCVHWM, 0)    # back to back: nothing dropped at the high-water mark
        address, fd = f"127.0.0.1:{port}", None
    else:
        sock = LocalRouter("bench", max_frame=c.frame_cap(MAX_BYTES))
        address, fd = sock.address, sock.fileno()
    poller = zmq.Poller()
    poller.register(sock if fd is None else fd, zmq.POLLIN)
    q.put(address)
    got, start = 0, None
    while got < n:
        poller.poll(2000)
        while (item := c.recv_router(sock, MAX_BYTES)) is not None:
            assert isinstance(item[1], m.Heartbeat), item
            if start is None:
                start = time.process_time()
            got += 1
    q.put(time.process_time() - start)
    sock.close(0)


def _pace(n: int, gap: float, send) -> float:
    start = time.process_time()
    for i in range(n):
        send(i)
        if gap:
            time.sleep(gap)
    return time.process_time() - start


def _sender(kind: str, address: str, n: int, gap: float, q) -> None:
    if kind == "zmq":
        sock = c.connect_dealer(zmq.Context.instance(), address)
        sock.setsockopt(zmq.SNDHWM, 0)
        time.sleep(0.3)                  # connected before the clock starts
    else:
        sock = LocalDealer(address, max_frame=c.frame_cap(MAX_BYTES))
    base = _pace(n, gap, lambda i: None)
    took = _pace(n, gap, lambda i: c.send_dealer(sock, m.Heartbeat(node_id="rank", seq=i)))
    if kind == "local":                  # whatever the kernel did not take yet
        while sock._conn.out:
            sock.recv_frames()
            time.sleep(0.001)
    q.put((took, base))
    time.sleep(0.5)
    sock.close(0)


def one(kind: str, n: int, gap: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    recv = ctx.Process(target=_receiver, args=(kind, n, q))
    recv.start()
    address = q.get(timeout=60)
    send = ctx.Process(target=_sender, args=(kind, address, n, gap, q))
    send.start()
    results = [q.get(timeout=120), q.get(timeout=120)]
    recv.join(30)
    send.join(30)
    recv_cpu = next(r for r in results if not isinstance(r, tuple))
    took, base = next(r for r in results if isinstance(r, tuple))
    return {"channel": kind, "gap_s": gap, "messages": n,
            "receiver_cpu_us_per_message": recv_cpu / n * 1e6,
            "sender_cpu_us_per_message": max(0.0, took - base) / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--gap", type=float, nargs="+", default=[0.0005, 0.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for rep in range(a.repeats):
        for gap in a.gap:
            for kind in ("zmq", "local"):            # alternated, so drift hits both
                row = one(kind, a.messages, gap)
                row["repeat"] = rep
                rows.append(row)
                print(f"{kind:5s} gap {gap * 1e6:6.0f} us: receiver "
                      f"{row['receiver_cpu_us_per_message']:6.1f} us, sender "
                      f"{row['sender_cpu_us_per_message']:6.1f} us CPU per message", flush=True)
    summary = []
    for gap in a.gap:
        med = {kind: {side: statistics.median(r[f"{side}_cpu_us_per_message"] for r in rows
                                              if r["channel"] == kind and r["gap_s"] == gap)
                      for side in ("receiver", "sender")} for kind in ("zmq", "local")}
        summary.append({"gap_s": gap, "median_us_per_message": med})
        print(f"median, gap {gap * 1e6:.0f} us: zmq {med['zmq']['receiver']:.1f} + "
              f"{med['zmq']['sender']:.1f}, local {med['local']['receiver']:.1f} + "
              f"{med['local']['sender']:.1f} us (receiver + sender)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": platform.platform(), "cores": mp.cpu_count(), "rows": rows,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
