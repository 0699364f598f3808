"""Compile every declared Triton kernel variant for NVIDIA GPUs, on any machine.

The CPU tests run the kernels under Triton's interpreter, which accepts code that Triton's
compiler rejects (for example a variable redefined with another block shape inside a runtime
branch). This compiles each variant :mod:`statebridge.kernels._launch` declares with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``; no GPU is needed
(Triton's wheel ships ``ptxas``)::

    python -m statebridge.kernels.compile_check --arch 90 80 --jobs 2 --json report.json

``--sample-arch 80`` compiles only the first variant of each launcher for that arch (the test
suite compiles every variant for sm_90, the H100/H200 it targets, and samples sm_80: the
variants of one launcher differ in dtypes and constexprs, which the sm_90 compile covers).

Exit status 0 when every variant compiled. It must run WITHOUT ``TRITON_INTERPRET=1`` (the
kernels must be real ``JITFunction`` objects when they are decorated); the parent process
starts one worker process per job with that variable removed. Set ``TRITON_CACHE_DIR`` to an
empty directory to compile for real rather than load a cached result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

__all__ = ["main", "compile_shard"]

def compile_shard(archs: list[int], shard: int, shards: int, only: list[str] | None = None,
                  sample_archs: list[int] | None = None) -> list[dict]:
    """Compile this shard's variants (in this process); one result row per (variant, arch).
    ``sample_archs``: archs compiled for the first variant of each launcher only.

    A variant's position in the stable enumeration decides its shard, so jobs split the work
    evenly without talking to each other."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset: interpreted kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import statebridge.kernels  # noqa: F401  (declares every launcher)
    from statebridge.kernels._launch import iter_variants, launchers

    kernels = {launcher.name: launcher.kernel for launcher in launchers()}
    rows = []
    variants = [v for v in iter_variants() if not only or v.launcher in only]
    first = {}
    for v in variants:
        first.setdefault(v.launcher, v.label)
    for i, variant in enumerate(variants):
        if i % shards != shard:
            continue
        sampled = [a for a in sample_archs or () if a not in archs and first[variant.launcher] == variant.label]
        for arch in [*archs, *sampled]:
            t0 = time.perf_counter()
            row = {"variant": variant.label, "launcher": variant.launcher, "arch": arch}
            try:
                src = ASTSource(
                    fn=kernels[variant.launcher], signature=dict(variant.signature), constexprs=dict(variant.constexprs)
                )
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
                row.update(ok=True, shared_bytes=compiled.metadata.shared)
            except Exception as exc:  # every compiler error is a finding to report, not to raise
                lines = [ln for ln in traceback.format_exception_only(type(exc), exc) if ln.strip()]
                row.update(ok=False, error="".join(lines)[-4000:])
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
    return rows


def _worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", nargs=2, type=int, metavar=("SHARD", "SHARDS"))
    p.add_argument("--arch", nargs="+", type=int)
    p.add_argument("--out")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--sample-arch", nargs="*", type=int, default=[])
    a = p.parse_args(argv)
    rows = compile_shard(a.arch, *a.worker, only=a.only, sample_archs=a.sample_arch)
    with open(a.out, "w") as f:
        json.dump(rows, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return _worker(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", type=int, default=[90, 80], help="compute capabilities, e.g. 90 80")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--json", default=None, help="write every result row here")
    p.add_argument("--only", nargs="+", default=None, metavar="LAUNCHER",
                   help="compile only these launchers' variants, e.g. causal_conv1d.fwd")
    p.add_argument("--sample-arch", nargs="+", type=int, default=[], metavar="ARCH",
                   help="also compile each launcher's first variant for these archs, e.g. 80")
    a = p.parse_args(argv)
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sb-compile-") as tmp:
        procs = []
        for shard in range(a.jobs):
            out = os.path.join(tmp, f"shard{shard}.json")
            cmd = [sys.executable, "-m", "statebridge.kernels.compile_check", "--worker", str(shard), str(a.jobs),
                   "--arch", *map(str, a.arch), "--out", out, *(["--only", *a.only] if a.only else []),
                   *(["--sample-arch", *map(str, a.sample_arch)] if a.sample_arch else [])]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out))
        rows, failed_workers = [], []
        for proc, out in procs:
            log, _ = proc.communicate()
            if proc.returncode != 0 or not os.path.exists(out):
                failed_workers.append(log.decode(errors="replace")[-4000:])
                continue
            with open(out) as f:
                rows.extend(json.load(f))
    wall = time.perf_counter() - t0
    bad = [r for r in rows if not r["ok"]]
    report = {"archs": a.arch, "sample_archs": a.sample_arch, "jobs": a.jobs, "wall_s": round(wall, 2), "compiled": len(rows) - len(bad),
              "failed": len(bad), "worker_errors": failed_workers, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    for r in bad:
        print(f"FAILED {r['variant']} sm_{r['arch']}:\n{r['error']}")
    for err in failed_workers:
        print(f"WORKER FAILED:\n{err}")
    print(f"{len(rows) - len(bad)} of {len(rows)} (variant, arch) compiles succeeded in {wall:.1f} s "
          f"with {a.jobs} jobs")
    return 0 if rows and not bad and not failed_workers else 1


if __name__ == "__main__":
    sys.exit(main())
