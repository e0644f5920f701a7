"""Run a point in a process of its own, so its memory peak is its own and a crash stays contained.

Processes come from a fork server that has already imported torch and the harness (but run no torch
op, so no thread pool or CUDA context is inherited): each point starts in milliseconds with a clean
heap and a fresh resident-set peak. A point whose process dies (the kernel's OOM killer, a segfault
in a kernel) comes back as a failed outcome; the sweep goes on.
"""
from __future__ import annotations

import multiprocessing
import signal
import traceback
from typing import Callable

_CONTEXT = multiprocessing.get_context("forkserver")
# harness.run.app: a child re-imports the main module (harness.run), cheap only if what it imports is here.
# torch._dynamo: initialising parameters on the meta device imports it (2 s), once per process otherwise.
_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "harness.measure.point", "harness.run.app"])


def _child(send, fn, arg) -> None:
    try:
        send.send(("ok", fn(arg)))
    except BaseException as error:  # noqa: BLE001 - everything goes back to the parent as a reason
        send.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc()))
    finally:
        send.close()


def run_isolated(fn: Callable[[object], dict], arg) -> dict:
    """fn(arg) in a fresh process. Returns its dict, or a failed outcome with the reason."""
    receive, send = _CONTEXT.Pipe(duplex=False)
    process = _CONTEXT.Process(target=_child, args=(send, fn, arg), daemon=True)
    process.start()
    send.close()  # only the child holds the sending end now: EOF means it died
    try:
        message = receive.recv()
    except EOFError:
        message = None
    process.join()
    if message is None:
        return {"status": "failed", "reason": _death_reason(process.exitcode)}
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
