"""Forked workers that end with the process that started them, and waits on them that end.

A tool forks a worker to do part of its work beside it (the loader's reader of a slice of row files,
harness.analysis.row_files; the report's plotting sections, harness.report.apart) and takes back one
result through a pipe. Three ways such a worker can outlive its parent, each closed here:
- the parent killed (SIGKILL, SIGTERM): a worker blocked writing its result (hundreds of MB) into a pipe
  that a forked sibling, or the worker itself, still holds open for reading waits forever. Each worker
  closes its own copy of the reading end and watches its parent's pidfd (`end_with`), ending itself once
  the parent is gone;
- the parent interrupted (Ctrl-C): the worker ignores SIGINT (the parent's business), and the parent,
  leaving, kills it and waits a bounded time for it;
- a worker that never answers (a lock held by a thread at the moment of the fork): the parent waits a
  bounded time (`patience`), kills it and does its share itself.

Forking is what makes a worker cheap (the parent's imports and table are there): Linux only; the
callers do the work in-process elsewhere. Imports nothing of the harness (the bottom layer).
"""
from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from typing import Any, Callable

# A worker's result is waited for at least this long, and at least PATIENCE_FACTOR times what this
# process took for its own share of the same work: on a machine other processes share, a worker's
# equal share can take several times this one's; past that it is taken as stuck.
PATIENCE_FLOOR_S = 120.0
PATIENCE_FACTOR = 10.0
JOIN_S = 5.0  # longest wait for a worker to exit once its result is in or it was killed


class WorkerLost(RuntimeError):
    """A worker sent no result: it died, raised, or outlasted the wait. The message says which."""


def patience(own_seconds: float) -> float:
    """Seconds to wait for a worker whose share of the work took this process `own_seconds`."""
    return max(PATIENCE_FLOOR_S, PATIENCE_FACTOR * own_seconds)


def end_with(parent: int, signum: int = signal.SIGTERM) -> None:
    """A daemon thread that sends this process `signum` once process `parent` has exited, however it went
    (a SIGKILL, a SIGINT sent to it alone): nothing then waits for this process's work, and a process
    that goes on holds the CPUs and memory others need."""
    try:
        handle = os.pidfd_open(parent)  # readable once the parent has exited (Linux 5.3)
    except (AttributeError, OSError):  # no pidfd here: look every second instead
        handle = None

    def watch():
        if handle is not None:
            select.select([handle], [], [])
        else:
            while _alive(parent):
                time.sleep(1.0)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number: ours is gone
        return False
    return True


class Forked:
    """`work(*args)` in a forked worker, its result taken back once with `result(timeout)`; used as a
    context manager, so that the worker is killed and waited for (bounded) however the caller leaves."""

    def __init__(self, work: Callable[..., Any], *args):
        context = multiprocessing.get_context("fork")  # the work is a closure over this process's state
        self._receive, send = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve, args=(self._receive, send, work, args, os.getpid()),
                                       daemon=True)
        self.process.start()
        send.close()  # the worker's end alone left open: its exit ends the pipe

    def result(self, timeout: float) -> Any:
        """The worker's return value; WorkerLost when it died or raised before sending one, or sent none
        within `timeout` seconds."""
        try:
            if not self._receive.poll(timeout):
                raise WorkerLost(f"no result within {timeout:.0f} s")
            outcome, value = self._receive.recv()
        except (EOFError, OSError):
            raise WorkerLost(f"the worker ended without a result (exit code {self._exit_code()})") from None
        if outcome != "ok":
            raise WorkerLost(value)
        return value

    def _exit_code(self):
        self.process.join(JOIN_S)
        return self.process.exitcode

    def close(self) -> None:
        """The worker gone: it exits by itself once its result is sent; killed if it has not by then."""
        self._receive.close()
        self.process.join(0.1 if self.process.exitcode is None else 0)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(JOIN_S)

    def __enter__(self) -> "Forked":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(receive, send, work: Callable[..., Any], args: tuple, parent: int) -> None:
    """In the worker: its result (or the first line of what it raised) sent back once."""
    receive.close()  # else this process would hold the pipe open for reading, and block forever writing to it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent answers it
    end_with(parent, signal.SIGKILL)  # SIGKILL: a write blocked in the pipe ends too, whatever Python does meanwhile
    try:
        try:
            message = ("ok", work(*args))
        except BaseException as error:  # noqa: BLE001 - everything goes back to the parent as a reason
            message = ("error", f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}")
        send.send(message)
    except OSError:  # the parent is gone
        pass
    finally:
        send.close()
