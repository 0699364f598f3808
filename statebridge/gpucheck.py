"""``statebridge check-gpu --out report.json``: the device check, one command, a few minutes on
one H100/H200, run from a repository checkout (it runs the repository's tests).

Parts, each a child process bounded in time (a part that fails, hangs or crashes is recorded
and the others still run):

=============  ==============================================================================
``kernels``    ``pytest -m cuda`` over tests/kernels and tests/connector: every kernel against
               its torch reference in fp32 and bf16 (varlen prefill, decode, the SSD scan,
               attention, the one-launch gather), no host syncs on the step path, a rank pool
               exported by one process and gathered by another
``runner``     ``pytest -m cuda`` over tests/models: the runner against transformers on CUDA
               (LFM2 hybrid, Granite hybrid, Mamba2)
``nodes``      ``statebridge demo --device cuda``: a prefill node (TP 1) and a decode node (TP 2,
               sharing the GPU) token-exact against a single-process run
``gather``     :mod:`statebridge.bench.device_gather`: the one-launch gather vs per-run
               ``cudaMemcpyAsync`` vs one device-to-device copy of the same bytes, LFM2-1.2B-
               and Mamba2-2.7B-sized requests
=============  ==============================================================================

The report (JSON) holds the device, the versions, and per part its status (``passed``,
``failed``, ``timeout``, ``error``), seconds, exit status, the tail of its output, and its
figures (test counts; the gather cells); a table is printed. Exit status 0 when every part
passed, 1 otherwise, 2 at once when no CUDA device is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["Part", "default_parts", "run_part", "assemble", "format_table", "main",
           "NO_DEVICE"]

NO_DEVICE = "no CUDA device visible"
#: The whole check's bound (seconds); each part gets at most its own bound and what is left.
TOTAL_SECONDS = 290.0
_TAIL_LINES = 40


@dataclass
class Part:
    """One part: ``argv`` run in ``cwd`` within ``seconds``; ``figures(part)`` reads what it
    wrote (``junit``: a pytest JUnit file; ``json``: a JSON file) after it ended."""

    name: str
    what: str
    argv: list[str]
    seconds: float
    cwd: str = "."
    output: str = ""
    kind: str = "command"                # "pytest" | "json" | "command"
    env: dict = field(default_factory=dict)


def repo_root() -> Path:
    """The checkout this package was imported from (its tests/ are next to the package)."""
    return Path(__file__).resolve().parent.parent


def default_parts(out_dir: str, python: str = sys.executable) -> list[Part]:
    root = str(repo_root())
    pytest = [python, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
    return [
        Part("kernels", "pytest -m cuda: kernels vs references (fp32, bf16), device pools",
             [*pytest, "tests/kernels", "tests/connector",
              f"--junitxml={out_dir}/kernels.xml"], 110.0, root,
             f"{out_dir}/kernels.xml", "pytest"),
        Part("runner", "pytest -m cuda: the runner vs transformers on CUDA",
             [*pytest, "tests/models", f"--junitxml={out_dir}/runner.xml"], 60.0, root,
             f"{out_dir}/runner.xml", "pytest"),
        Part("nodes", "prefill node TP 1 + decode node TP 2 on one GPU vs a single-process run",
             [python, "-m", "statebridge.cli", "demo", "--prefill-tp", "1", "--decode-tp", "2",
              "--device", "cuda", "--prompts", "4", "--max-new-tokens", "8"], 75.0, root),
        Part("gather", "same-host gather vs per-run cudaMemcpyAsync vs one D2D copy",
             [python, "-m", "statebridge.bench.device_gather", "--json",
              f"{out_dir}/gather.json"], 45.0, root, f"{out_dir}/gather.json", "json"),
    ]


def _junit(path: str) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_part(part: Part, seconds: float) -> dict:
    """Run ``part`` for at most ``seconds``; its record (see the module docstring)."""
    start = time.monotonic()
    record = {"name": part.name, "what": part.what, "argv": part.argv}
    try:
        proc = subprocess.run(part.argv, cwd=part.cwd, capture_output=True, text=True,
                              timeout=max(1.0, seconds), env={**os.environ, **part.env})
        rc, text, status = proc.returncode, proc.stdout + proc.stderr, None
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        text = (out.decode(errors="replace") if isinstance(out, bytes) else out)
        rc, status = None, "timeout"
    except OSError as e:
        rc, text, status = None, f"{type(e).__name__}: {e}", "error"
    record["seconds"] = round(time.monotonic() - start, 2)
    record["rc"] = rc
    record["tail"] = text.splitlines()[-_TAIL_LINES:]
    figures = None
    if part.output and os.path.exists(part.output):
        try:
            if part.kind == "pytest":
                figures = _junit(part.output)
            else:
                with open(part.output) as f:
                    figures = json.load(f)
        except (ET.ParseError, ValueError, OSError, AttributeError) as e:
            figures = {"error": f"cannot read {part.output}: {e}"}
    record["figures"] = figures
    if status is None:
        status = "passed" if rc == 0 else "failed"
        if part.kind == "pytest" and rc == 0 and figures and figures.get("passed", 0) == 0:
            status = "failed"                        # everything skipped: nothing was checked
    record["status"] = status
    return record


def assemble(records: list[dict], device: dict) -> dict:
    """The report: the device, every part's record, and whether all passed."""
    return {"device": device, "parts": records,
            "passed": bool(records) and all(r["status"] == "passed" for r in records)}


def format_table(report: dict) -> str:
    """One line per part (status, seconds, figures in brief), then the gather cells."""
    lines = [f"device: {report['device'].get('name', '?')}",
             f"{'part':<8} {'status':<8} {'seconds':>8}  detail"]
    for r in report["parts"]:
        f = r.get("figures") or {}
        if "passed" in f and "tests" in f:
            detail = (f"{f['passed']} passed, {f['failures'] + f['errors']} failed, "
                      f"{f['skipped']} skipped")
        elif "cells" in f:
            detail = f"{len(f['cells'])} cells (below)"
        else:
            detail = (r.get("tail") or [""])[-1][:80]
        lines.append(f"{r['name']:<8} {r['status']:<8} {r['seconds']:>8.1f}  {detail}")
    for r in report["parts"]:
        f = r.get("figures") or {}
        if "cells" in f:
            from statebridge.bench.device_gather import format_table as cells

            lines += ["", cells(f)]
    lines.append("")
    lines.append("device check passed" if report["passed"] else "device check FAILED")
    return "\n".join(lines)


def _device() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def main(out: str, *, parts: Sequence[str] | None = None, visible: Callable[[], int] | None = None,
         make_parts: Callable[[str], list[Part]] = default_parts, total: float = TOTAL_SECONDS,
         device: Callable[[], dict] = _device) -> int:
    """Run the check (``parts``: a subset by name), write ``out``, print the table."""
    from statebridge.devices import visible_gpus

    count = (visible or visible_gpus)()
    if count == 0:
        print(f"check-gpu: {NO_DEVICE} (torch sees no GPU); run it on a GPU machine",
              file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(out)) or "."
    chosen = [p for p in make_parts(out_dir) if not parts or p.name in parts]
    deadline = time.monotonic() + total
    records = []
    for part in chosen:
        left = deadline - time.monotonic()
        if left < 5:
            records.append({"name": part.name, "what": part.what, "argv": part.argv,
                            "status": "timeout", "seconds": 0.0, "rc": None, "figures": None,
                            "tail": [f"not started: the check's {total:.0f} s were spent"]})
            continue
        print(f"check-gpu: {part.name}: {part.what} (at most {min(part.seconds, left):.0f} s)",
              flush=True)
        records.append(run_part(part, min(part.seconds, left)))
    report = assemble(records, device())
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(format_table(report))
    return 0 if report["passed"] else 1
