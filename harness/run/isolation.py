"""Run a group of points in a process of its own, so its memory peaks are its own and a crash stays contained.

Processes come from a fork server that has already imported torch and the harness (but run no torch
op, so no thread pool or CUDA context is inherited): each group starts in milliseconds with a clean
heap and a fresh resident-set peak. A group whose process dies (the kernel's OOM killer, a segfault
in a kernel) comes back as a failed outcome; the sweep goes on. A point interrupted by Ctrl-C (SIGINT
to the process group reaches the point's process too) is not a failure: it sends nothing, and the
runner raises PointInterrupted, which ends the sweep like a Ctrl-C of its own (harness.run.app). A
runner killed alone takes its group's process with it (harness.files.workers.end_with).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from multiprocessing import forkserver
from typing import Callable

from harness.files.workers import end_with

_CONTEXT = multiprocessing.get_context("forkserver")
# harness.run.app: a child re-imports the main module (harness.run), cheap only if what it imports is here.
# Not torch._dynamo (over a second to import): only a compile=inductor point needs it, and its
# compilation takes far longer than the import.
_CONTEXT.set_forkserver_preload(["torch", "harness.measure.decoding", "harness.run.app"])


class PointInterrupted(KeyboardInterrupt):
    """The point's process was interrupted (SIGINT): the sweep stops, no row is written for it."""


def _start_fork_server() -> None:
    """Start the fork server (once) with SIGINT ignored, which it inherits across exec while it imports
    torch: a Ctrl-C then reaches only the runner, not as an import traceback of the server's (which
    ignores SIGINT itself only once its imports are done). SIGINT is blocked meanwhile, so a Ctrl-C in
    these milliseconds stays pending (Linux never discards a blocked signal) and reaches the runner
    when its handler is back."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def stop_fork_server() -> None:
    """End the fork server now (on Ctrl-C): it ignores SIGINT, and while it still imports torch it
    would only notice seconds later that the runner is gone, holding the runner's stdout meanwhile."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # set only once this process started one
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _child(send, fn, arg, runner: int) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored since _start_fork_server
    # A runner killed alone (SIGKILL, or SIGINT to it and not its group) would otherwise leave the group
    # measuring on, holding the CPUs other runs time on, with nobody to hand its rows to; the fork server is no
    # help: every child holds its liveness pipe, so it outlives the runner too.
    end_with(runner)
    try:
        try:
            message = ("ok", fn(arg))
        except KeyboardInterrupt:
            message = ("interrupted",)
        except BaseException as error:  # noqa: BLE001 - everything goes back to the parent as a reason
            message = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
        try:
            send.send(message)
        except (OSError, KeyboardInterrupt):  # the runner is gone, or interrupted while we report
            pass
    finally:
        send.close()


def run_isolated(fn: Callable[[object], dict], arg) -> dict:
    """fn(arg) in a fresh process. Returns its dict, or a failed outcome with the reason."""
    _start_fork_server()
    receive, send = _CONTEXT.Pipe(duplex=False)
    process = _CONTEXT.Process(target=_child, args=(send, fn, arg, os.getpid()), daemon=True)
    process.start()
    send.close()  # only the child holds the sending end now: EOF means it died
    try:
        message = receive.recv()
    except EOFError:
        message = None
    process.join()
    if message is None:
        if process.exitcode == -signal.SIGINT:
            raise PointInterrupted()
        return {"status": "failed", "reason": _death_reason(process.exitcode)}
    if message[0] == "interrupted":
        raise PointInterrupted()
    if message[0] == "error":
        return {"status": "failed", "reason": message[1], "traceback": message[2]}
    return message[1]


def run_inline(fn: Callable[[object], dict], arg) -> dict:
    """fn(arg) in this process (isolate=false): faster, but memory peaks and crashes are shared."""
    try:
        return fn(arg)
    except Exception as error:  # noqa: BLE001
        return {"status": "failed", "reason": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (SIGKILL: usually the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"point process died from {name}{hint}"
    return f"point process exited with code {exitcode} without a result"
