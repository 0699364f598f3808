"""A benchmark's worker process spoken to over a pipe: the driver sends ``(command, kwargs)``,
the worker answers ``("ok", value)`` or ``("error", text)``. Used by the NIXL reads
(:mod:`statebridge.bench._nixl`) and the copy limit (:mod:`statebridge.bench._copylimit`)."""

from __future__ import annotations

from typing import Callable

__all__ = ["PipeWorker", "WorkerGone"]


class WorkerGone(RuntimeError):
    """A worker is gone or did not answer in time (its late answer would be taken for the next
    one's): no further command should go to it."""


class PipeWorker:
    """One worker process running ``target(conn, *args)`` (a daemon, named ``name``);
    ``label`` names its kind in errors (e.g. ``"NIXL worker"``)."""

    def __init__(self, ctx, target: Callable, args: tuple, name: str, label: str) -> None:
        self.label = label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.proc.start()
        child.close()

    def send(self, cmd: str, **kw) -> None:
        self.conn.send((cmd, kw))

    def recv(self, timeout: float):
        """The answer to the last command: its value; :class:`WorkerGone` when the worker is
        silent for ``timeout`` seconds or gone, RuntimeError with the worker's error."""
        try:
            if not self.conn.poll(timeout):
                raise WorkerGone(f"{self.label} {self.proc.name} silent for {timeout} s")
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerGone(f"{self.label} {self.proc.name} is gone "
                             f"(exit code {self.proc.exitcode}): {e!r}") from None
        if status != "ok":
            raise RuntimeError(f"{self.label} {self.proc.name}: {value}")
        return value

    def call(self, cmd: str, timeout: float = 120.0, **kw):
        self.send(cmd, **kw)
        return self.recv(timeout)

    def ask_exit(self) -> None:
        """Tell the worker to exit (nothing when its pipe is already broken)."""
        try:
            self.send("exit")
        except (BrokenPipeError, OSError):
            pass

    def reap(self) -> None:
        """Wait for the worker to exit (killed after 5 s) and close the pipe."""
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)
        self.conn.close()

    def close(self) -> None:
        self.ask_exit()
        self.reap()
