"""tests/fixtures/make_reference_fixtures.py without the reference repositories: it refuses a checkout
that is not at the pinned commit, and its ``--check`` finds a perturbed fixture. A tiny stand-in for
MedNeXt at the reference's import path plays the reference (its own commit pinned for the test)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SCRIPT = FIXTURES / "make_reference_fixtures.py"
sys.path.insert(0, str(FIXTURES))
import make_reference_fixtures as script  # noqa: E402

STAND_IN = '''
import torch
from torch import nn


class MedNeXt(nn.Module):
    def __init__(self, in_channels, n_channels, n_classes, deep_supervision=False, **options):
        super().__init__()
        self.stem = nn.Conv3d(in_channels, n_channels, kernel_size=1)
        self.norm = nn.GroupNorm(1, n_channels)
        self.out_0 = nn.Conv3d(n_channels, n_classes, kernel_size=1)
        self.dummy_tensor = nn.Parameter(torch.tensor([1.0]))

    def forward(self, x):
        x = self.out_0(torch.relu(self.norm(self.stem(x))))
        return [x, x[..., ::2, ::2, ::2] * 2]
'''


def _git(path: Path, *args: str) -> str:
    command = ["git", "-C", str(path), "-c", "user.name=fixtures", "-c", "user.email=fixtures@example.org", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def _stand_in_checkout(path: Path) -> str:
    """A git checkout holding the stand-in at MedNeXt's import path; returns its commit."""
    package = path / "nnunet_mednext" / "network_architecture" / "mednextv1"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "MedNextV1.py").write_text(STAND_IN)
    (package / "blocks.py").write_text("")
    _git(path, "init", "-q")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "stand-in")
    return _git(path, "rev-parse", "HEAD")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    checkout = tmp_path / "MedNeXt"
    commit = _stand_in_checkout(checkout)
    pinned = script.REFERENCES["mednext"]
    monkeypatch.setitem(script.REFERENCES, "mednext", script.Reference(pinned.repository, commit, pinned.sources))
    return checkout


def test_a_checkout_at_another_commit_is_refused_with_a_short_message(tmp_path):
    checkout = tmp_path / "MedNeXt"
    head = _stand_in_checkout(checkout)
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--reference", f"mednext={checkout}", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=environment,
    )
    assert result.returncode == 2, result.stderr
    message = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert message == [
        f"error: --reference mednext={checkout}: checkout is at {head[:12]}, the fixtures need MIC-DKFZ/MedNeXt at "
        "0b78ed869fbd1cc2fd38754d2f8519f1b72d43ba"
    ]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_other_bad_references_end_in_exit_2(tmp_path, stand_in, capsys):
    out = ["--out", str(tmp_path / "out")]
    (tmp_path / "plain").mkdir()
    assert script.main(["--reference", f"mednext={tmp_path / 'plain'}", *out]) == 2
    assert "not a git checkout" in capsys.readouterr().err
    assert script.main(["--reference", f"unet={stand_in}", *out]) == 2
    assert "unknown reference 'unet'" in capsys.readouterr().err
    assert script.main(["--reference", f"mednext={stand_in}", "--fixture", "stunet", *out]) == 2
    assert "--fixture stunet needs --reference stunet=PATH" in capsys.readouterr().err
    assert script.main(["--reference", f"mednext={stand_in}", "--check", *out]) == 2
    assert "no such fixture to check" in capsys.readouterr().err
    source = stand_in / "nnunet_mednext" / "network_architecture" / "mednextv1" / "MedNextV1.py"
    source.write_text(source.read_text().replace("* 2", "* 3"))
    assert script.main(["--reference", f"mednext={stand_in}", *out]) == 2
    assert "reference files modified" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_made_fixture_has_the_documented_structure_and_check_finds_a_perturbed_copy(tmp_path, stand_in, capsys):
    made = tmp_path / "made"
    assert script.main(["--reference", f"mednext={stand_in}", "--out", str(made)]) == 0
    fixture = torch.load(made / "mednext_reference.pt", weights_only=True)
    assert list(fixture) == ["state_dict", "input", "outputs"]
    assert list(fixture["state_dict"]) == ["stem.weight", "stem.bias", "norm.weight", "norm.bias", "out_0.weight", "out_0.bias"]
    assert fixture["input"].shape == (1, 1, 16, 16, 32) and [o.shape[-1] for o in fixture["outputs"]] == [32, 16]
    # The documented seeding: the GroupNorm weights ~ N(1, 0.1) after building under seed 0.
    assert not torch.equal(fixture["state_dict"]["norm.weight"], torch.ones(2))
    assert "nnunet_mednext" not in sys.modules and str(stand_in.resolve()) not in sys.path  # the reference is forgotten
    capsys.readouterr()

    def check(folder: Path) -> tuple[int, str]:
        status = script.main(["--reference", f"mednext={stand_in}", "--out", str(folder), "--check"])
        return status, capsys.readouterr().out

    status, out = check(made)
    assert status == 0 and "matches the reference, bit-exact" in out

    def perturbed(name: str, change) -> Path:
        folder = tmp_path / name
        shutil.copytree(made, folder)
        copy = torch.load(folder / "mednext_reference.pt", weights_only=True)
        change(copy)
        torch.save(copy, folder / "mednext_reference.pt")
        return folder

    scale = max(1.0, float(fixture["outputs"][1].abs().max()))
    # Within the tolerance of test_reference_outputs.py (1e-5 of the output's scale): accepted.
    status, out = check(perturbed("close", lambda f: f["outputs"][1][0, 0, 0, 0].add_(2e-6 * scale)))
    assert status == 0 and "matches the reference, max |output difference|" in out
    status, out = check(perturbed("far", lambda f: f["outputs"][1][0, 0, 0, 0].add_(1e-4 * scale)))
    assert status == 1 and "mednext_reference.pt: differs from the reference" in out and "outputs[1]" in out
    status, out = check(perturbed("weights", lambda f: f["state_dict"]["stem.bias"].add_(1e-7)))
    assert status == 1 and "state_dict['stem.bias']: differs from the reference's" in out
    status, out = check(perturbed("input", lambda f: f["input"].mul_(-1)))
    assert status == 1 and "input: differs" in out


def test_vsmtrans_is_loaded_with_a_stand_in_timm_that_is_removed_afterwards(tmp_path):
    """vsmt.py imports DropPath from timm, then at once from MONAI: the stand-in serves MONAI's for both."""
    from monai.networks.layers import DropPath

    (tmp_path / "vsmt.py").write_text(
        "from timm.models.layers import DropPath as First\nfrom monai.networks.layers import DropPath\n"
    )
    def timm_modules() -> dict:
        return {name: module for name, module in sys.modules.items() if name == "timm" or name.startswith("timm.")}

    before = timm_modules()
    with script.reference_imports(tmp_path, script._timm_stand_in()):
        module = script.load_file(tmp_path / "vsmt.py", "vsmt_stand_in")
        assert module.First is DropPath and module.DropPath is DropPath
    assert timm_modules() == before
    assert str(tmp_path.resolve()) not in sys.path
