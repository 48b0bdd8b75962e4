"""The process around a run: the code version it runs (git) and the signals that stop it.

Kept apart from MLflow (:mod:`lightning_modules.tracking`): a command records the code version as a
tag and turns SIGTERM/SIGINT into :class:`Terminated`, so the run's tracking can end it KILLED and
the command can exit with the shell's code for that signal (:func:`exit_on_signal` prints the one
line that says so). Worker processes a command starts (:func:`start_worker`) die with it, and are
stopped when it stops (:func:`stop_workers`).

Example::

    with terminating_signals():
        work()            # SIGTERM here raises Terminated
    commit = git_commit()  # "<sha>" or "<sha>+dirty" or "unknown"
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence


def git_commit(path: str | Path | None = None) -> str:
    """The code version: ``git rev-parse HEAD`` of the repository holding this package, '+dirty' if modified."""
    root = Path(path) if path else Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


class Terminated(BaseException):
    """SIGTERM or SIGINT arrived while a run was open (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's exit code for death by this signal (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + self.signum


# A signal arriving inside `deferred_signals()` is only recorded here, and raised at a safe point.
_SIGNALS: dict = {"deferred": False, "received": None}


def _on_signal(signum, frame) -> None:
    _SIGNALS["received"] = signum
    if not _SIGNALS["deferred"]:
        raise Terminated(signum)


@contextlib.contextmanager
def terminating_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into :class:`Terminated` inside the block (main thread only).

    Lightning adds its own SIGTERM handler during ``fit`` and calls this one after it, so a
    distributed run still forwards the signal to its other processes first.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    _SIGNALS["received"] = None
    for signum in previous:
        signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        _SIGNALS["received"] = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Inside the block a signal is only recorded; :func:`raise_if_signalled` raises it.

    Raising inside whatever the process was doing (an MLflow write, a collective of a distributed
    run) can leave it half done; training checks between batches instead.
    """
    _SIGNALS["deferred"] = True
    try:
        yield
    except BaseException as error:
        # Lightning stops on SIGTERM by its own exception (a SystemExit with code 0): say why.
        if _SIGNALS["received"] is not None and not isinstance(error, Terminated):
            raise Terminated(_SIGNALS["received"]) from error
        raise
    finally:
        _SIGNALS["deferred"] = False
    raise_if_signalled()


def raise_if_signalled() -> None:
    """Raise :class:`Terminated` for a signal recorded inside :func:`deferred_signals`."""
    if _SIGNALS["received"] is not None:
        raise Terminated(_SIGNALS["received"])


def stop_code(error: BaseException) -> int | None:
    """The exit code of a process stopped by ``error``: 128 + the signal for :class:`Terminated`, 130
    for a ``KeyboardInterrupt`` (Ctrl+C outside :func:`terminating_signals`); None for anything else."""
    if isinstance(error, Terminated):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return None


def stop_reason(error: BaseException) -> str:
    """``stopped by SIGTERM`` (or ``SIGINT`` for Ctrl+C) for a stop; the error's type otherwise."""
    if isinstance(error, Terminated):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return f"stopped by {signal.SIGINT.name}"
    return type(error).__name__


@contextlib.contextmanager
def exit_on_signal(command: str, advice: Callable[[], str]) -> Iterator[None]:
    """SIGTERM, SIGINT and Ctrl+C inside the block end the process with one line on stderr,
    ``<command>: stopped by SIGTERM; <advice()>``, and the shell's exit code (143, 130), not a traceback.

    ``advice`` is called when the stop arrives, so it can say what was in flight then.
    """
    with terminating_signals():
        try:
            yield
        except (Terminated, KeyboardInterrupt) as stopped:
            print(f"{command}: {stop_reason(stopped)}; {advice()}", file=sys.stderr, flush=True)
            raise SystemExit(stop_code(stopped)) from None


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Inside the block a SIGTERM/SIGINT handled by :func:`terminating_signals` is only recorded,
    so the cleanup that ends a stopped or failed process's runs is not cut short by a second signal."""
    deferred = _SIGNALS["deferred"]
    _SIGNALS["deferred"] = True
    try:
        yield
    finally:
        _SIGNALS["deferred"] = deferred


def rerun_command(program: str = "benchx") -> str | None:
    """The command line this process was started with, as ``benchx <arguments>``; None when the
    process is not the ``benchx`` command (a test, a notebook)."""
    first = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if first is None or not (first.name == program or first.parts[-2:] == ("lightning_modules", "cli.py")):
        return None
    return shlex.join([program, *sys.argv[1:]])


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def _die_with_parent(parent: int) -> None:
    """In a new child process (``preexec_fn``): ask Linux for SIGTERM when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def start_worker(args: Sequence[str], **popen: object) -> subprocess.Popen:
    """Start a worker process that gets SIGTERM when this process dies, even by SIGKILL (Linux).

    Elsewhere the worker starts without that request; :func:`stop_workers` still stops it when this
    process stops on a signal or an error.
    """
    if sys.platform.startswith("linux"):
        parent = os.getpid()
        popen["preexec_fn"] = lambda: _die_with_parent(parent)
    return subprocess.Popen(list(args), **popen)


def stop_workers(processes: Iterable[subprocess.Popen], grace_s: float = 60.0) -> list[int]:
    """SIGTERM each running worker, wait up to ``grace_s`` seconds for all to end their runs, then
    SIGKILL the rest; returns the exit codes (negative: killed by that signal)."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return [process.returncode for process in processes]
