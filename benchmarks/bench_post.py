"""What statebridge's Python adds to one UCX message: post_runs + handle vs raw ucxx calls.

One process, one Transport talking to another over shared memory, ``--rounds`` rounds of
``--messages`` messages of ``--bytes`` each (a receive and a send per message, progressed until
all complete). Reported: CPU microseconds per message side (one post and its completion), for

- ``statebridge``: ``Transport.post_runs`` of a RunTemplate, polled with
  ``TransferHandle.finished()``, settled by reading ``.error`` (what a rank does per request);
- ``raw_ucxx``: ``UCXEndpoint.tag_recv`` / ``tag_send`` on cached buffer views, polled with
  ``UCXRequest.completed`` (the floor: UCX's own work plus ucxx's bindings).

Both include UCX's work for the message (eager or rendezvous, shared memory), so the difference
is statebridge's per-message overhead. Prints a table and writes ``--json``.

    python benchmarks/bench_post.py --json benchmarks/results/post-overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def _statebridge(a, b, size: int, messages: int, rounds: int) -> float:
    send_t = a.template(np.array([[0, 0, size]]), "send")
    recv_t = b.template(np.array([[0, 0, size]]), "recv")
    stride = 2 * size

    def one(generation: int) -> None:
        handles = []
        for r in range(messages):
            handles.append(b.post_runs("recv", "a", generation, r, r * stride, recv_t))
            handles.append(a.post_runs("send", "b", generation, r, r * stride, send_t))
        while not all(h.finished() for h in handles):
            a.progress()
            b.progress()
        for h in handles:
            if h.error is not None:
                raise h.error

    for g in range(50):
        one(g + 1)
    c0 = time.process_time()
    for g in range(rounds):
        one(g + 1000)
    return (time.process_time() - c0) / rounds / messages / 2 * 1e6


def _raw(a, b, size: int, messages: int, rounds: int) -> float:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    ea, eb = a.endpoints.endpoint("b"), b.endpoints.endpoint("a")
    stride = 2 * size
    src = [Array(a.posting.page_mv[r * stride:r * stride + size]) for r in range(messages)]
    dst = [Array(b.posting.page_mv[r * stride:r * stride + size]) for r in range(messages)]
    Tag = ucx_api.UCXXTag

    def one(generation: int) -> None:
        reqs = []
        for r in range(messages):
            tag = (generation << 32) | (r << 24)
            reqs.append(eb.tag_recv(dst[r], Tag(tag)))
            reqs.append(ea.tag_send(src[r], Tag(tag)))
        while not all(q.completed for q in reqs):
            a._worker.progress()
            b._worker.progress()

    for g in range(50):
        one(g + 1 + (1 << 20))
    c0 = time.process_time()
    for g in range(rounds):
        one(g + (1 << 21))
    return (time.process_time() - c0) / rounds / messages / 2 * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, nargs="+", default=[4096, 20480, 1 << 20],
                   help="message sizes (default: eager, LFM2's ~20 KB rendezvous, 1 MiB)")
    p.add_argument("--messages", type=int, default=4, help="messages per round (default 4)")
    p.add_argument("--rounds", type=int, default=3000, help="timed rounds per size")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    from statebridge.connector.data import Transport, alloc_buffer, configure_ucx_env

    configure_ucx_env()
    need = 2 * max(a.bytes) * a.messages
    ta = Transport(alloc_buffer(need), name="a")
    tb = Transport(alloc_buffer(need), name="b")
    ta.connect("b", tb.address)
    tb.connect("a", ta.address)
    rows = []
    try:
        for size in a.bytes:
            rounds = max(20, min(a.rounds, int(a.rounds * 20480 / size)))
            sb = _statebridge(ta, tb, size, a.messages, rounds)
            raw = _raw(ta, tb, size, a.messages, rounds)
            rows.append({"bytes": size, "rounds": rounds, "messages": a.messages,
                         "statebridge_cpu_us_per_message_side": sb,
                         "raw_ucxx_cpu_us_per_message_side": raw,
                         "overhead_us": sb - raw})
            print(f"{size:>9} B  statebridge {sb:6.1f} us  raw ucxx {raw:6.1f} us  "
                  f"overhead {sb - raw:5.1f} us per message side", flush=True)
    finally:
        ta.close()
        tb.close()
    out = {"benchmark": "post_overhead", "python": platform.python_version(),
           "cpus": os.cpu_count(), "rows": rows}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
