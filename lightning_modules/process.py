"""The process around a run: the code version it runs (git) and the signals that stop it.

Kept apart from MLflow (:mod:`lightning_modules.tracking`): a command records the code version as a
tag and turns SIGTERM/SIGINT into :class:`Terminated`, so the run's tracking can end it KILLED and
the command can exit with the shell's code for that signal.

Example::

    with terminating_signals():
        work()            # SIGTERM here raises Terminated
    commit = git_commit()  # "<sha>" or "<sha>+dirty" or "unknown"
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path
from typing import Iterator


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
