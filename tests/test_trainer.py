"""Training failures a user can fix end in a short message with exit 2 and lose nothing: a full disk
while a checkpoint is written (no partial file left, the previous checkpoint kept), and a patch too
large for memory (the settings to lower are named)."""

from __future__ import annotations

import errno

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from mlflow.tracking import MlflowClient

from conftest import RECIPES, tiny_overrides
from lightning_modules.cli import EXIT_USAGE, main
from lightning_modules.trainer import AtomicCheckpointIO, CheckpointWriteError


def full_disk_after(limit: int):
    """A ``TorchCheckpointIO.save_checkpoint`` that writes ``limit`` bytes and then fails as a full disk does."""

    def save(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as file:
            file.write(b"\0" * limit)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    return save


def test_a_full_disk_leaves_no_partial_checkpoint_and_keeps_the_previous(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {}}, tmp_path / "last.ckpt")
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", full_disk_after(1000))
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*last.ckpt: no space left on device"):
        io.save_checkpoint({"global_step": 2, "state_dict": {}}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt")["global_step"] == 1
    # Any other failure is not dressed up as a full disk, and leaves no partial file either.
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", lambda *a, **k: (_ for _ in ()).throw(TypeError("bad")))
    with pytest.raises(TypeError, match="bad"):
        io.save_checkpoint({"global_step": 2}, tmp_path / "best.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_train_on_a_full_disk_exits_2_with_a_short_message_and_no_temporary_file(tiny_phantom, tmp_path, monkeypatch, capsys):
    root, split = tiny_phantom
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", full_disk_after(4096))
    out = tmp_path / "run"
    code = main(["train", "--recipe", str(RECIPES / "unet.yaml"), "--out", str(out), *tiny_overrides(root, split, tmp_path)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err[-2000:]
    assert "Traceback" not in err and "no space left on device" in err and "rerun the same command" in err
    assert not list(out.rglob("*.tmp")), "no partial checkpoint is left behind"


def test_a_patch_too_large_for_memory_names_the_settings_to_lower(tiny_phantom, tmp_path, monkeypatch, capsys):
    from lightning_modules.models.segmentation_module import SegmentationModule

    root, split = tiny_phantom

    def out_of_memory(self, batch, batch_idx):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(SegmentationModule, "training_step", out_of_memory)
    overrides = tiny_overrides(root, split, tmp_path)
    code = main(["train", "--recipe", str(RECIPES / "unet.yaml"), "--out", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err[-2000:]
    assert "Traceback" not in err
    assert "training ran out of memory (CUDA out of memory. Tried to allocate 20.00 GiB)" in err
    assert "lower data.patch_size, data.batch_size" in err and "data.patch_size=[16, 16, 16]" in err
    uri = next(o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri="))
    runs = MlflowClient(uri).search_runs([e.experiment_id for e in MlflowClient(uri).search_experiments()])
    assert runs and all(run.info.status != "RUNNING" for run in runs), "the run is ended, not left RUNNING"


def test_an_error_that_is_not_about_memory_passes_unchanged():
    from omegaconf import OmegaConf

    from lightning_modules.trainer import memory_advice

    recipe = OmegaConf.create({"data": {"patch_size": [8, 8, 8], "batch_size": 1, "samples_per_volume": 1},
                               "trainer": {"sw_batch_size": 1}})
    with pytest.raises(RuntimeError, match="shape mismatch"), memory_advice(recipe):
        raise RuntimeError("shape mismatch")
    with pytest.raises(MemoryError, match=r"lower data.patch_size.*now data.patch_size=\[8, 8, 8\]"), memory_advice(recipe):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
