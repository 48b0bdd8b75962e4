"""Segment CT scans with a trained model and write the masks on each scan's own grid (``benchx predict``).

The scan goes through the same preprocessing as training (orientation RAS, resampling, HU window,
foreground crop, padding), is segmented by sliding-window inference, and the label map is mapped
back through the inverse of every preprocessing step (MONAI ``Invertd``), so the written masks have
the CT's exact shape and affine. For each scan it writes ``<out>/<case_id>/prediction.nii.gz``
(integer labels in recipe class order) and ``<out>/<case_id>/segmentations/<class>.nii.gz``, and
reports the predicted tumor volume in mm^3, the scan-level score of
docs/design.md "Scan-level detection". A file that cannot be read (e.g. a truncated ``.nii.gz``) is named, skipped and listed
in the summary; the other scans are still predicted.

Example::

    summary = predict_cases(module, recipe, input_cases(Path("data/example_ct")), Path("predictions"))
    print(summary.skipped)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import nibabel as nib
import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, Invertd
from omegaconf import DictConfig

from lightning_modules.data.cohort import CT_FILE, atomic_save_nifti, load_cohort
from lightning_modules.data.datamodule import preprocessing
from lightning_modules.models.segmentation_module import SegmentationModule
from lightning_modules.models.tumor_outputs import predicted_labels


def predict_scan(module: SegmentationModule, recipe: DictConfig, ct_path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Label map of one scan on its own grid, and that grid's affine (from the CT file)."""
    transforms = Compose(preprocessing(recipe, with_label=False))
    item = transforms({"image": str(ct_path)})
    module.eval()
    with torch.no_grad():
        logits = module.predict_volume(item["image"][None].float())
    labels = predicted_labels(logits, module.output)[0].to(torch.uint8)
    # Invertd replays the image's recorded preprocessing backwards on the label map (nearest).
    item["pred"] = MetaTensor(labels[None].float(), meta=dict(item["image"].meta))  # the image's affine with it
    inverse = Invertd(keys="pred", transform=transforms, orig_keys="image", nearest_interp=True, to_tensor=True)
    restored = inverse(item)["pred"][0].numpy().round().astype(np.uint8)
    original = nib.load(str(ct_path))
    if restored.shape != original.shape[:3]:
        raise RuntimeError(f"{ct_path}: inverted prediction has shape {restored.shape}, the CT {original.shape[:3]}")
    return restored, original.affine


def write_prediction(out_dir: Path, labels: np.ndarray, affine: np.ndarray, classes: Sequence[str]) -> Path:
    """Write the label map and one binary mask per class, atomically, on the given affine."""
    out_dir = Path(out_dir)
    image = nib.Nifti1Image(labels.astype(np.uint8), affine)
    image.set_data_dtype(np.uint8)
    atomic_save_nifti(image, out_dir / "prediction.nii.gz")
    for index, name in enumerate(classes, start=1):
        mask = nib.Nifti1Image((labels == index).astype(np.uint8), affine)
        mask.set_data_dtype(np.uint8)
        atomic_save_nifti(mask, out_dir / "segmentations" / f"{name}.nii.gz")
    return out_dir / "prediction.nii.gz"


def input_cases(path: Path) -> list[tuple[str, Path]]:
    """(case id, CT path) pairs from a CT file, a cohort folder, or a folder of CT files."""
    path = Path(path)
    if path.is_file():
        name = path.name[: -len(".nii.gz")] if path.name.endswith(".nii.gz") else path.stem
        return [(name, path)]
    if (path / "metadata.csv").exists():
        cohort = load_cohort(path)
        return [(case.case_id, case.ct_path) for case in cohort.cases()]
    files = sorted(path.glob("*.nii.gz")) or sorted(path.glob(f"*/{CT_FILE}"))
    if not files:
        raise FileNotFoundError(f"{path}: no CT (a .nii.gz file, a cohort with metadata.csv, or a folder of them)")
    return [((f.parent.name if f.name == CT_FILE else f.name[: -len(".nii.gz")]), f) for f in files]


def unreadable_reason(ct_path: Path) -> str | None:
    """Why a CT file cannot be read as an image (None when nibabel reads all of its voxels)."""
    try:
        image = nib.load(str(ct_path))
        np.asarray(image.dataobj)
    except Exception as error:  # nibabel, gzip and zlib raise many types for a damaged file
        return f"{type(error).__name__}: {error}"
    return None


@dataclass
class PredictionSummary:
    """What a prediction run wrote and skipped.

    Attributes:
        written: (case id, output folder, predicted tumor volume in mm^3) per predicted scan.
        skipped: (CT path, reason) per file that could not be read.
    """

    written: list[tuple[str, Path, float]] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def predict_cases(
    module: SegmentationModule,
    recipe: DictConfig,
    cases: Sequence[tuple[str, Path]],
    out: Path,
    report: Callable[[str], None] = lambda line: None,
) -> PredictionSummary:
    """Predict every case and write its masks under ``out/<case id>``; unreadable files are skipped.

    A scan whose prediction fails is checked with :func:`unreadable_reason`: when the file itself
    cannot be read it is skipped (named, with the reason) and the next scan is predicted; any other
    error is raised, as it is a fault of the model or the code, not of that file.

    Args:
        module: the trained module.
        recipe: its recipe (preprocessing, classes).
        cases: (case id, CT path) pairs, e.g. from :func:`input_cases`.
        out: output folder.
        report: called with one line per scan written or skipped (e.g. ``print``).
    """
    summary = PredictionSummary()
    for case_id, ct_path in cases:
        try:
            labels, affine = predict_scan(module, recipe, ct_path)
        except Exception:
            reason = unreadable_reason(Path(ct_path))
            if reason is None:
                raise
            summary.skipped.append((Path(ct_path), reason))
            report(f"{case_id}: skipped, cannot read {ct_path}: {reason}")
            continue
        write_prediction(Path(out) / case_id, labels, affine, list(recipe.data.classes))
        voxel = float(abs(np.linalg.det(affine[:3, :3])))
        volume = int((labels == module.tumor_label).sum()) * voxel
        summary.written.append((case_id, Path(out) / case_id, volume))
        report(f"{case_id}: predicted {recipe.data.tumor_class} volume {volume:.1f} mm^3 -> {Path(out) / case_id}")
    return summary
