"""Output folders of runs: one process at a time, and resume only into the same run.

- :class:`RunFolderLock`: an exclusive lock held for a run's life (``benchx train``, and any command
  that writes a run folder: SynthX training, synthesis, the study, imports). A second process gets
  a one-line :class:`FolderLockedError` naming the holder's PID and host and the folder. A lock left
  by a dead process on this host is taken over, and the takeover is reported.
- :class:`RunRecord`: ``run.json`` in the folder records the MLflow run id and the recipe the run
  was started with (its fingerprint and flattened keys). :func:`check_same_recipe` refuses a rerun
  with another recipe and names the keys that differ.
- :func:`resume_checkpoint`: the newest readable checkpoint of a folder; a damaged ``last.ckpt``
  falls back to the previous good one (``last.previous.ckpt``, then ``best.ckpt``) or is refused.

Example::

    with RunFolderLock(folder, "benchx train") as lock:
        if lock.takeover_note:
            print(lock.takeover_note)
        ...  # the run writes into folder
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_modules.infrastructure.files import atomic_write_bytes

LOCK_FILE = ".lock"
RECORD_FILE = "run.json"
# Checkpoints a training folder may resume from, newest writer first (see trainer.AtomicCheckpointIO).
CHECKPOINT_NAMES = ("last.ckpt", "last.previous.ckpt", "best.ckpt")
# Recipe sections that do not change what is trained (where it is tracked), left out of the fingerprint.
UNTRACKED_SECTIONS = ("tracking", "profiles")


class RunFolderError(RuntimeError):
    """A run folder that cannot be used as asked (another recipe, a damaged checkpoint)."""


class FolderLockedError(RunFolderError):
    """Another live process holds the folder's lock."""


# ------------------------------------------------------------------------------------------------
# The lock


@dataclass
class LockHolder:
    pid: int
    host: str
    command: str
    since: str

    def describe(self) -> str:
        return f"process {self.pid} on {self.host} ({self.command}, since {self.since})"


class RunFolderLock:
    """An exclusive lock on a run folder, held from ``acquire`` (or ``with``) until ``release``.

    The lock is the file ``<folder>/.lock`` holding the holder's PID, host and command; it is
    created atomically (a hard link), and the check-and-take of a stale lock is serialized by an
    ``flock`` on ``.lock.guard``. A lock held on another host is never taken over (its process cannot
    be checked from here): remove the file by hand if that host is gone.

    Args:
        folder: the run folder (created if missing).
        command: what holds the lock, for the message a second process gets.
    """

    def __init__(self, folder: str | Path, command: str = "benchx"):
        self.folder = Path(folder)
        self.command = command
        self.takeover_note: str | None = None
        self._held = False

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> "RunFolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        me = LockHolder(os.getpid(), socket.gethostname(), self.command, time.strftime("%Y-%m-%d %H:%M:%S"))
        with open(self.folder / f"{LOCK_FILE}.guard", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            holder = read_lock(self.path)
            if holder is not None:
                if holder.host != me.host or pid_alive(holder.pid):
                    raise FolderLockedError(
                        f"{self.folder} is in use by {holder.describe()}; wait for it to end or write to another folder"
                    )
                self.takeover_note = (
                    f"{self.folder}: took over the lock of process {holder.pid} on {holder.host}, which is no longer running"
                )
            temporary = self.folder / f"{LOCK_FILE}.{me.pid}.tmp"
            temporary.write_text(json.dumps(asdict(me)))
            os.replace(temporary, self.path)
        self._held = True
        return self

    def release(self) -> None:
        if not self._held:
            return
        holder = read_lock(self.path)
        if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._held = False

    def __enter__(self) -> "RunFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_lock(path: Path) -> LockHolder | None:
    """The holder recorded in a lock file, or None when there is none (or it is unreadable)."""
    try:
        return LockHolder(**json.loads(Path(path).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """True while a process with this id runs on this host (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------------------
# The record of the run a folder belongs to


def recipe_keys(recipe: DictConfig) -> dict[str, str]:
    """The resolved recipe as flat ``dotted.key -> value`` strings, without the untracked sections."""
    container = OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)
    for section in UNTRACKED_SECTIONS:
        container.pop(section, None)
    return _flatten(container)


def content_key(payload) -> str:
    """A short hash of JSON-like content (keys sorted, other values as text): same content -> same folder."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:10]


def recipe_fingerprint(recipe: DictConfig) -> str:
    """A short hash of the resolved recipe (without tracking settings): same recipe -> same folder."""
    container = OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)
    for section in UNTRACKED_SECTIONS:
        container.pop(section, None)
    return content_key(container)


def _flatten(mapping: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value, sort_keys=True)
    return flat


@dataclass
class RunRecord:
    """What ``run.json`` holds: the MLflow run a folder belongs to and the recipe it was started with."""

    run_id: str
    tracking_uri: str
    fingerprint: str
    recipe: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_recipe(cls, recipe: DictConfig, run_id: str, tracking_uri: str) -> "RunRecord":
        return cls(run_id, tracking_uri, recipe_fingerprint(recipe), recipe_keys(recipe))

    @classmethod
    def read(cls, folder: str | Path) -> "RunRecord | None":
        path = Path(folder) / RECORD_FILE
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as error:
            raise RunFolderError(f"{path} is damaged ({error}); start a new run with --fresh or another --out") from error

    def write(self, folder: str | Path) -> None:
        atomic_write_bytes(Path(folder) / RECORD_FILE, json.dumps(asdict(self), indent=1, sort_keys=True).encode())


def recipe_differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """``key: recorded -> current`` for every key whose value differs (or exists in one only)."""
    missing = "(absent)"
    keys = sorted(set(recorded) | set(current))
    return [
        f"{key}: {recorded.get(key, missing)} -> {current.get(key, missing)}"
        for key in keys
        if recorded.get(key, missing) != current.get(key, missing)
    ]


def check_same_recipe(folder: str | Path, record: RunRecord, recipe: DictConfig) -> None:
    """Refuse to resume a folder's run with another recipe, naming the keys that differ.

    Every key counts, ``trainer.max_steps`` included: the learning-rate schedule is defined over
    ``max_steps`` and MLflow keeps a run's parameters fixed, so a longer training is a new run.
    """
    if record.fingerprint == recipe_fingerprint(recipe):
        return
    differences = recipe_differences(record.recipe, recipe_keys(recipe))
    shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
    raise RunFolderError(
        f"{folder} holds run {record.run_id}, started with another recipe ({shown}). "
        "To start a new run, write to another folder (--out, or no --out: each recipe gets its own) "
        "or pass --fresh to replace this one"
    )


# ------------------------------------------------------------------------------------------------
# Checkpoints to resume from


def checkpoint_step(path: str | Path) -> int:
    """The ``global_step`` of a readable Lightning checkpoint; raises on a damaged file."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(state, dict) or "global_step" not in state or "state_dict" not in state:
        raise ValueError("not a Lightning checkpoint (no global_step/state_dict)")
    return int(state["global_step"])


def resume_checkpoint(checkpoint_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest readable checkpoint of a folder, and a note for each damaged one passed over.

    Returns:
        ``(None, [])`` when the folder has no checkpoint at all.

    Raises:
        RunFolderError: when checkpoints exist but none can be read.
    """
    found = [Path(checkpoint_dir) / name for name in CHECKPOINT_NAMES if (Path(checkpoint_dir) / name).exists()]
    readable, notes = [], []
    for path in found:
        try:
            readable.append((checkpoint_step(path), path))
        except Exception as error:  # torch raises several types for truncated or foreign files
            notes.append(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
    if found and not readable:
        raise RunFolderError(
            "; ".join(notes) + ". No earlier good checkpoint to resume from: start a new run with --fresh"
        )
    if not readable:
        return None, notes
    step, path = max(readable, key=lambda item: item[0])
    if notes:
        notes.append(f"resuming from {path.name} at step {step}")
    return path, notes
