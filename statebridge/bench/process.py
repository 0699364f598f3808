"""A node command run by a benchmark script: started with ``python -m``, its ``ready`` line
awaited on stdout (stderr to a log file), stopped with SIGTERM and, after 30 s, SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import time

__all__ = ["NodeProcess"]


class NodeProcess:
    """``python -m <argv>`` in ``log_path``'s folder (``python -m`` puts the working
    directory first on sys.path, before PYTHONPATH); the constructor returns once a stdout
    line contains ``ready``, or stops the process and raises SystemExit with what it printed."""

    def __init__(self, argv: list[str], env: dict, ready: str, log_path: str, *,
                 start_timeout: float = 300.0) -> None:
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], env=env,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=os.path.dirname(log_path))
        deadline, lines = time.monotonic() + start_timeout, []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if ready in line:
                return
        self.stop()
        raise SystemExit(f"{' '.join(argv[:2])} did not start: {''.join(lines)} "
                         f"(log: {log_path})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
