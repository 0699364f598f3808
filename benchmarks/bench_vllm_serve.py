"""Two vLLM API servers on this host, prefill TP 1 -> decode TP 2 by default, with the
StatebridgeConnector: sequential requests, each the prefill instance (``do_remote_decode``,
``max_tokens=1``) and then the decode instance with the returned ``kv_transfer_params``.
Prints each request's two latencies and whether the decode answered, and the count of decode
requests over one second (how the TP-2 stall of docs/vllm.md, "Known problems", was measured
and shown gone: docs/measurements.md).

    STATEBRIDGE_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/bench_vllm_serve.py \
        --requests 8 --decode-tp 2 --decode-bind '0|1' --prefill-bind 0

(run from the main environment: the servers run in the vLLM venv, as in
tests/vllm/test_vllm_serve.py, whose launcher this uses; their logs stay in --workdir)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from statebridge.models.checkpoint import make_checkpoint  # noqa: E402
from statebridge.net import free_port  # noqa: E402
from tests.vllm.test_vllm_serve import _serve, _stop, _wait_healthy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--arch", default="lfm2-hybrid")
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--decode-bind", default="0|1")
    ap.add_argument("--prefill-bind", default="0")
    ap.add_argument("--side-port", type=int, default=6300)
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sb-vllm-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(make_checkpoint(args.arch, work / "ck", preset="vllm"))
    p_port, d_port = free_port(), free_port()
    logs = [open(work / f"{n}.log", "w+") for n in ("prefill", "decode")]
    procs = [_serve(model, p_port, 1, "kv_producer", args.side_port, args.prefill_bind, True,
                    logs[0]),
             _serve(model, d_port, args.decode_tp, "kv_consumer", args.side_port + 100,
                    args.decode_bind, False, logs[1])]
    slow = failed = 0
    try:
        for url in (f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"):
            _wait_healthy(url, procs, logs)
        for i in range(args.requests):
            prompt = f"Request {i}: once upon a time, in a land far away, there lived a bridge"
            body = dict(model=model, prompt=prompt, temperature=0)
            t0 = time.monotonic()
            r = httpx.post(f"http://127.0.0.1:{p_port}/v1/completions", timeout=120,
                           json=dict(body, max_tokens=1,
                                     kv_transfer_params={"do_remote_decode": True})).json()
            t1 = time.monotonic()
            d = httpx.post(f"http://127.0.0.1:{d_port}/v1/completions", timeout=120,
                           json=dict(body, max_tokens=4,
                                     kv_transfer_params=r["kv_transfer_params"]))
            t2 = time.monotonic()
            ok = d.status_code == 200
            failed += not ok
            slow += (t2 - t1) > 1.0
            print(f"{time.strftime('%H:%M:%S')} request {i}: prefill {t1 - t0:.2f} s, "
                  f"decode {t2 - t1:.2f} s, "
                  f"{'ok' if ok else f'HTTP {d.status_code}'}", flush=True)
    finally:
        _stop(procs)
    print(f"decode TP {args.decode_tp} (bind {args.decode_bind!r}), prefill bind "
          f"{args.prefill_bind!r}: {args.requests} requests, {failed} failed, {slow} over 1 s; "
          f"logs in {work}")


if __name__ == "__main__":
    main()
