"""Segment CT scans with a trained model and write the masks on each scan's own grid (``benchx predict``).

The scan goes through the same preprocessing as training (orientation RAS, resampling, HU window,
foreground crop, padding), is segmented by sliding-window inference, and the label map is mapped
back through the inverse of every preprocessing step (MONAI ``Invertd``), so the written masks have
the CT's exact shape and affine. For each scan it writes ``<out>/<case_id>/prediction.nii.gz``
(integer labels in recipe class order) and ``<out>/<case_id>/segmentations/<class>.nii.gz``, and
reports the predicted tumor volume in mm^3, the scan-level score of
docs/explanation/detection-and-statistics.md "Scan-level detection". A file that cannot be read (e.g. a truncated ``.nii.gz``) or
that holds NaN or infinite voxels (which the network would turn into an empty mask, a silent
0 mm^3) is named, skipped and listed in the summary; the other scans are still predicted. Inputs
whose outputs would land in one folder (``x.nii.gz`` and ``x.nii``) and an ``--out`` that is a file
are refused before anything is written (:class:`PredictionInputError`).

Example::

    summary = predict_cases(module, recipe.data, input_cases(Path("data/example_ct")), Path("predictions"))
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

from lightning_modules.config.recipe import DataConfig
from lightning_modules.data.cohort import CT_FILE, atomic_save_nifti, load_cohort
from lightning_modules.data.datamodule import preprocessing
from lightning_modules.data.volume_checks import header_problem
from lightning_modules.models.segmentation_module import SegmentationModule
from lightning_modules.models.tumor_outputs import predicted_labels


class PredictionInputError(ValueError):
    """Inputs or an output folder that ``predict`` refuses before writing anything."""


CT_SUFFIXES = (".nii.gz", ".nii")


class UnusableScanError(ValueError):
    """A CT that cannot be predicted: its header (dimensions, declared size, geometry), its name or its
    voxels rule it out. The scan is skipped and named; the other scans are still predicted."""


class NonFiniteScanError(UnusableScanError):
    """A CT holding NaN or infinite voxels: its prediction would be meaningless, so it is not made."""


def non_finite_voxels(image: nib.Nifti1Image) -> int:
    """How many voxels of a CT are NaN or +-inf (0 for an integer CT without a scaling that makes them)."""
    slope, intercept = getattr(image.dataobj, "slope", 1.0), getattr(image.dataobj, "inter", 0.0)
    if image.get_data_dtype().kind in "iub" and np.isfinite(slope) and np.isfinite(intercept):
        return 0
    return int(np.count_nonzero(~np.isfinite(np.asanyarray(image.dataobj))))


def predict_scan(module: SegmentationModule, data: DataConfig, ct_path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Label map of one scan on its own grid, and that grid's affine (from the CT file); ``data``:
    the recipe's data section (preprocessing).

    Raises:
        UnusableScanError: the header declares no 3-D volume, more voxels than memory allows, or a
            singular affine (zero spacing); checked before any voxel is read.
        NonFiniteScanError: the CT holds NaN or infinite voxels (named with their count).
    """
    if Path(ct_path).name in CT_SUFFIXES:
        raise UnusableScanError(f"{ct_path}: the file name is only a suffix, it names no case "
                                "(rename it to <case>.nii.gz); no prediction is made")
    original = nib.load(str(ct_path))
    problem = header_problem(original, expect_3d=True)
    if problem:
        raise UnusableScanError(f"{ct_path}: {problem}; no prediction is made")
    bad = non_finite_voxels(original)
    if bad:
        total = int(np.prod(original.shape[:3]))
        raise NonFiniteScanError(
            f"{ct_path}: {bad} of {total} voxels are NaN or infinite; no prediction is made "
            "(replace them, e.g. by the air value -1024 HU, and predict again)"
        )
    transforms = Compose(preprocessing(data, with_label=False))
    item = transforms({"image": str(ct_path)})
    module.eval()
    with torch.no_grad():
        logits = module.predict_volume(item["image"][None].float())
    labels = predicted_labels(logits, module.output)[0].to(torch.uint8)
    # Invertd replays the image's recorded preprocessing backwards on the label map (nearest).
    item["pred"] = MetaTensor(labels[None].float(), meta=dict(item["image"].meta))  # the image's affine with it
    inverse = Invertd(keys="pred", transform=transforms, orig_keys="image", nearest_interp=True, to_tensor=True)
    restored = inverse(item)["pred"][0].numpy().round().astype(np.uint8)
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


def case_name(path: Path, in_case_folder: bool = True) -> str:
    """A CT file's case id: ``x.nii.gz`` and ``x.nii`` are ``x``; ``<case>/ct.nii.gz`` is ``<case>``
    (``in_case_folder``)."""
    path = Path(path)
    if in_case_folder and path.name == CT_FILE:
        return path.parent.name
    for suffix in CT_SUFFIXES:
        if path.name.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def input_cases(path: Path) -> list[tuple[str, Path]]:
    """(case id, CT path) pairs from a CT file, a cohort folder, or a folder of CT files (``.nii.gz``,
    ``.nii``, or ``<case>/ct.nii.gz``).

    Raises:
        PredictionInputError: two inputs have the same case id (their outputs would share a folder).
    """
    path = Path(path)
    if path.is_file():
        # <case>/ct.nii.gz names its case by its folder, any other file by its own name.
        return [(case_name(path), path)]
    if (path / "metadata.csv").exists():
        cohort = load_cohort(path)
        return [(case.case_id, case.ct_path) for case in cohort.cases()]
    files = sorted({*path.glob("*.nii.gz"), *path.glob("*.nii")}) or sorted(path.glob(f"*/{CT_FILE}"))
    if not files:
        raise FileNotFoundError(f"{path}: no CT (a .nii.gz file, a cohort with metadata.csv, or a folder of them)")
    cases = [(case_name(f), f) for f in files]
    check_distinct_outputs(cases)
    return cases


def check_distinct_outputs(cases: Sequence[tuple[str, Path]]) -> None:
    """Refuse inputs whose output folders would coincide (same case id, or ids differing only in
    letter case, which are one folder on case-insensitive file systems)."""
    seen: dict[str, Path] = {}
    for case_id, ct_path in cases:
        if not case_id:
            continue  # a file named only '.nii.gz' is skipped with its own message by predict_cases
        key = case_id.casefold()
        if key in seen:
            raise PredictionInputError(
                f"{seen[key]} and {ct_path} would both be written to the output folder {case_id!r}: "
                "rename or move one of them and predict again (nothing was written)"
            )
        seen[key] = Path(ct_path)


def check_output_folder(out: Path) -> None:
    """The output must be a folder or not exist yet."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PredictionInputError(f"--out {out} is an existing file: name a folder for the predictions")


def unreadable_reason(ct_path: Path) -> str | None:
    """Why a CT file cannot be read as an image (None when nibabel reads all of its voxels)."""
    try:
        image = nib.load(str(ct_path))
        np.asarray(image.dataobj)
    except Exception as error:  # nibabel, gzip and zlib raise many types for a damaged file
        return f"{type(error).__name__}: {error}"
    return None


SUMMARY_FILE = "predictions.csv"
SUMMARY_COLUMNS = ["case_id", "ct_path", "score", "threshold_mm3", "decision", "error"]
POSITIVE, NEGATIVE = "tumor", "no tumor"


@dataclass
class PredictionSummary:
    """What a prediction run wrote and skipped, and the per-case table it wrote (``<out>/predictions.csv``).

    Attributes:
        written: (case id, output folder, predicted tumor volume in mm^3) per predicted scan.
        skipped: (CT path, reason) per file that could not be read or holds non-finite voxels.
        rows: one row per case, in :data:`SUMMARY_COLUMNS`: the score (predicted tumor volume, mm^3),
            the threshold m applied, the decision (``tumor`` when the score exceeds m, else
            ``no tumor``; empty for a skipped file) and the error of a skipped file.
    """

    written: list[tuple[str, Path, float]] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def decision(score: float, threshold_mm3: float) -> str:
    """docs/explanation/detection-and-statistics.md "Scan-level detection": positive when the predicted tumor volume exceeds m."""
    return POSITIVE if score > threshold_mm3 else NEGATIVE


def write_summary(summary: PredictionSummary, out: Path) -> Path:
    """Write the per-case table atomically (rewritten after every case, so a stopped run keeps its rows)."""
    import pandas as pd

    from lightning_modules.infrastructure.files import atomic_write_csv

    path = Path(out) / SUMMARY_FILE
    atomic_write_csv(pd.DataFrame(summary.rows, columns=SUMMARY_COLUMNS), path)
    return path


def predict_cases(
    module: SegmentationModule,
    data: DataConfig,
    cases: Sequence[tuple[str, Path]],
    out: Path,
    report: Callable[[str], None] = lambda line: None,
    threshold_mm3: float | None = None,
) -> PredictionSummary:
    """Predict every case and write its masks under ``out/<case id>``; unreadable files are skipped.

    A scan whose prediction fails is checked with :func:`unreadable_reason`: when the file itself
    cannot be read, or holds NaN or infinite voxels, it is skipped (named, with the reason) and the
    next scan is predicted; any other error is raised, as it is a fault of the model or the code,
    not of that file. Colliding outputs and an output that is a file are refused first.

    Args:
        module: the trained module.
        data: its recipe's data section (preprocessing, classes).
        cases: (case id, CT path) pairs, e.g. from :func:`input_cases`.
        out: output folder.
        report: called with one line per scan written or skipped (e.g. ``print``).
        threshold_mm3: the operating point m of the decisions (``benchx predict`` passes the one the
            model applies); None leaves the decision column empty.
    """
    check_output_folder(out)
    check_distinct_outputs(cases)
    summary = PredictionSummary()
    threshold = "" if threshold_mm3 is None else float(threshold_mm3)

    def skip(case_id: str, ct_path: Path, reason: str, line: str) -> None:
        summary.skipped.append((Path(ct_path), reason))
        summary.rows.append({"case_id": case_id, "ct_path": str(ct_path), "score": "", "threshold_mm3": threshold,
                             "decision": "", "error": reason})
        report(line)
        write_summary(summary, out)

    for case_id, ct_path in cases:
        try:
            labels, affine = predict_scan(module, data, ct_path)
        except UnusableScanError as error:
            skip(case_id, ct_path, str(error).removeprefix(f"{ct_path}: "), f"{case_id or ct_path}: skipped, {error}")
            continue
        except Exception:
            reason = unreadable_reason(Path(ct_path))
            if reason is None:
                raise
            skip(case_id, ct_path, reason, f"{case_id or ct_path}: skipped, cannot read {ct_path}: {reason}")
            continue
        write_prediction(Path(out) / case_id, labels, affine, list(data.classes))
        voxel = float(abs(np.linalg.det(affine[:3, :3])))
        volume = int((labels == module.tumor_label).sum()) * voxel
        summary.written.append((case_id, Path(out) / case_id, volume))
        verdict = "" if threshold == "" else decision(volume, threshold)
        summary.rows.append({"case_id": case_id, "ct_path": str(ct_path), "score": volume, "threshold_mm3": threshold,
                             "decision": verdict, "error": ""})
        write_summary(summary, out)
        said = "" if threshold == "" else f", m = {threshold:g} mm^3: {verdict}"
        report(f"{case_id}: predicted {data.tumor_class} volume {volume:.1f} mm^3{said} -> {Path(out) / case_id}")
    return summary
