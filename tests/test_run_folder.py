"""Run folders: the lock between processes, the recipe record that guards resume, checkpoint fallback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from conftest import RECIPES, REPO_ROOT
from lightning_modules.recipe import load_recipe
from lightning_modules.infrastructure.run_folder import (
    FolderLockedError,
    RunFolderError,
    RunFolderLock,
    RunRecord,
    check_same_recipe,
    read_lock,
    resume_checkpoint,
)

HOLD = """
import sys, time
from lightning_modules.infrastructure.run_folder import RunFolderLock
lock = RunFolderLock(sys.argv[1], "holder").acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_process_is_refused_and_a_dead_holder_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderLockedError) as refused:
            RunFolderLock(folder, "benchx train").acquire()
        message = str(refused.value)
        assert "\n" not in message
        assert str(folder) in message and f"process {holder.pid} on {socket.gethostname()}" in message and "holder" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunFolderLock(folder, "benchx train") as lock:
        assert lock.takeover_note and f"process {holder.pid}" in lock.takeover_note and "no longer running" in lock.takeover_note
        assert read_lock(lock.path).pid == os.getpid()
        with pytest.raises(FolderLockedError, match=f"process {os.getpid()}"):
            RunFolderLock(folder).acquire()
    assert not (folder / ".lock").exists(), "released on exit"
    with RunFolderLock(folder) as again:
        assert again.takeover_note is None


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".lock").write_text('{"pid": 1, "host": "node-7", "command": "benchx train", "since": "2026-01-01 00:00:00"}')
    with pytest.raises(FolderLockedError, match="process 1 on node-7"):
        RunFolderLock(folder).acquire()


def test_another_recipe_is_refused_with_the_keys_that_differ(tmp_path):
    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu"])
    record = RunRecord.for_recipe(recipe, "abc123", "sqlite:///m.db")
    record.write(tmp_path)
    assert RunRecord.read(tmp_path) == record
    check_same_recipe(tmp_path, record, load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "tracking.experiment=other"]))
    longer = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "trainer.max_steps=999", "optim.lr=0.5"])
    with pytest.raises(RunFolderError) as refused:
        check_same_recipe(tmp_path, record, longer)
    message = str(refused.value)
    assert "abc123" in message and "trainer.max_steps: " in message and "-> 999" in message and "optim.lr" in message
    assert "--fresh" in message and "--out" in message


def test_a_recipe_record_spells_enum_choices_as_text_so_folders_recorded_with_text_still_resume(tmp_path):
    from lightning_modules.infrastructure.run_folder import recipe_fingerprint, recipe_keys

    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "data.cache=disk", "synthx.mode=displace"])
    keys = recipe_keys(recipe)
    assert keys["data.cache"] == '"disk"' and keys["synthx.mode"] == '"displace"' and keys["optim.name"] == '"adamw"'
    # A record written when these settings were plain text: the same keys, the same fingerprint.
    from omegaconf import OmegaConf

    as_text = OmegaConf.create(OmegaConf.to_container(recipe, resolve=True, enum_to_str=True))
    assert recipe_keys(as_text) == keys and recipe_fingerprint(as_text) == recipe_fingerprint(recipe)
    record = RunRecord.for_recipe(as_text, "abc123", "sqlite:///m.db")
    record.write(tmp_path)
    check_same_recipe(tmp_path, RunRecord.read(tmp_path), recipe)


def _checkpoint(path, step):
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(64)}}, path)


def test_a_damaged_last_checkpoint_falls_back_or_is_refused(tmp_path):
    assert resume_checkpoint(tmp_path) == (None, [])
    _checkpoint(tmp_path / "last.previous.ckpt", 3)
    _checkpoint(tmp_path / "best.ckpt", 2)
    _checkpoint(tmp_path / "last.ckpt", 4)
    assert resume_checkpoint(tmp_path) == (tmp_path / "last.ckpt", [])
    data = (tmp_path / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(data[: len(data) // 2])
    path, notes = resume_checkpoint(tmp_path)
    assert path == tmp_path / "last.previous.ckpt"
    assert "last.ckpt is damaged" in notes[0] and "resuming from last.previous.ckpt at step 3" in notes[-1]
    for name in ("last.previous.ckpt", "best.ckpt"):
        (tmp_path / name).write_bytes(b"not a checkpoint")
    with pytest.raises(RunFolderError, match="No earlier good checkpoint.*--fresh"):
        resume_checkpoint(tmp_path)


def test_atomic_checkpoint_writes_keep_the_previous_last(tmp_path):
    from lightning_modules.trainer import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {}}, tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 2, "state_dict": {}}, tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 2, "state_dict": {}}, tmp_path / "best.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt", "last.ckpt", "last.previous.ckpt"]
    assert torch.load(tmp_path / "last.previous.ckpt")["global_step"] == 1
    assert torch.load(tmp_path / "last.ckpt")["global_step"] == 2
