"""A cohort on disk in AbdomenAtlas layout: reading both layouts, writing layout A.

See ``docs/explanation/data.md "Cohorts on disk"``.

Layout A (AbdomenAtlas 1.x): ``<root>/<case_id>/ct.nii.gz`` and ``<root>/<case_id>/segmentations/<class>.nii.gz``.
Layout B (2.0 / 3.0): ``<root>/{ct|image_only}/<case_id>/ct.nii.gz`` and
``<root>/{label|mask_only}/<case_id>/segmentations/<class>.nii.gz``.

Writes are atomic (temporary file in the same folder, then ``os.replace``), so an interrupted
generator or importer never leaves a half-written case behind.

Example::

    cohort = load_cohort("data/phantom")
    case = cohort.case("PH0001")
    ct = nib.load(case.ct_path)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import nibabel as nib
import numpy as np
import pandas as pd

from lightning_modules.data.metadata import METADATA_FILE, MetadataReadError, normalize_metadata, read_metadata_csv
from lightning_modules.data.problems import Problem
from lightning_modules.infrastructure.files import atomic_target, atomic_write_csv, publish_mode

# The AbdomenAtlas organ classes this framework knows (docs/explanation/data.md "Cohorts on disk").
ORGAN_CLASSES = (
    "aorta",
    "gall_bladder",
    "kidney_left",
    "kidney_right",
    "liver",
    "pancreas",
    "postcava",
    "spleen",
    "stomach",
)
LESION_CLASSES = (
    "pancreatic_lesion",
    "liver_lesion",
    "kidney_lesion",
    "colon_lesion",
    "esophagus_tumor",
    "endometrioma_tumor",
)
CT_FILE = "ct.nii.gz"
SEGMENTATION_DIR = "segmentations"
_LAYOUT_B_IMAGE_DIRS = ("ct", "image_only")
_LAYOUT_B_LABEL_DIRS = ("label", "mask_only")


class CohortError(ValueError):
    """A cohort cannot be read; the message lists every problem found."""

    def __init__(self, problems: list, root: Path | str = ""):
        self.problems = list(problems)
        head = f"cohort {root}: " if root else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}{len(self.problems)} problem(s):\n{lines}")


def is_lesion_class(name: str) -> bool:
    """True for lesion/tumor classes: a missing file for one of them means 'no lesion'."""
    return name in LESION_CLASSES or name.endswith(("_lesion", "_tumor"))


@dataclass(frozen=True)
class Case:
    """One scan of a cohort: its files and its normalized metadata row."""

    case_id: str
    ct_path: Path
    segmentation_dir: Path
    metadata: Mapping[str, object] = field(default_factory=dict)

    def mask_path(self, class_name: str) -> Path:
        return self.segmentation_dir / f"{class_name}.nii.gz"

    def tumor_label(self, lesion_class: str = "pancreatic_lesion") -> int:
        """The scan-level tumor label: the ``tumor`` column, or (when not recorded, -1) whether the
        lesion mask has any non-zero voxel (a missing lesion file means no lesion)."""
        value = int(self.metadata.get("tumor", -1))
        if value >= 0:
            return value
        path = self.mask_path(lesion_class)
        return int(path.exists() and bool(np.asarray(nib.load(path).dataobj).any()))

    def available_classes(self) -> list[str]:
        if not self.segmentation_dir.is_dir():
            return []
        return sorted(p.name[: -len(".nii.gz")] for p in self.segmentation_dir.glob("*.nii.gz"))


class Cohort:
    """A cohort root with its normalized metadata table.

    Args:
        root: the cohort folder (layout A or B) holding ``metadata.csv``.
        metadata: the normalized table (see :func:`lightning_modules.data.metadata.normalize_metadata`).
        layout: ``"A"`` or ``"B"``.
        image_dir / label_dir: for layout B, the folder names used (``ct``/``image_only``, ``label``/``mask_only``).
        problems: metadata problems found while reading (kept so ``validate`` can list them all).
    """

    def __init__(
        self,
        root: Path,
        metadata: pd.DataFrame,
        layout: str,
        image_dir: str = "",
        label_dir: str = "",
        problems: list[Problem] | None = None,
    ):
        self.root = Path(root)
        self.metadata = metadata
        self.layout = layout
        self.image_dir = image_dir
        self.label_dir = label_dir
        self.problems = list(problems or [])
        self._index = {case_id: i for i, case_id in enumerate(metadata["case_id"])}

    def __len__(self) -> int:
        return len(self.metadata)

    def __contains__(self, case_id: str) -> bool:
        return case_id in self._index

    @property
    def case_ids(self) -> list[str]:
        return list(self.metadata["case_id"])

    @property
    def patient_id_missing(self) -> bool:
        return bool(self.metadata.attrs.get("patient_id_missing", False))

    def case_dir(self, case_id: str) -> Path:
        if self.layout == "A":
            return self.root / case_id
        return self.root / self.image_dir / case_id

    def case(self, case_id: str) -> Case:
        if case_id not in self._index:
            raise KeyError(f"case {case_id!r} is not in cohort {self.root} ({METADATA_FILE})")
        row = self.metadata.iloc[self._index[case_id]].to_dict()
        if self.layout == "A":
            ct_path = self.root / case_id / CT_FILE
            seg_dir = self.root / case_id / SEGMENTATION_DIR
        else:
            ct_path = self.root / self.image_dir / case_id / CT_FILE
            seg_dir = self.root / self.label_dir / case_id / SEGMENTATION_DIR
        return Case(case_id=case_id, ct_path=ct_path, segmentation_dir=seg_dir, metadata=row)

    def cases(self) -> Iterator[Case]:
        for case_id in self.case_ids:
            yield self.case(case_id)

    def row(self, case_id: str) -> dict:
        return self.metadata.iloc[self._index[case_id]].to_dict()

    def subset(self, case_ids) -> pd.DataFrame:
        """Metadata rows for the given case ids, in that order."""
        return self.metadata.set_index("case_id").loc[list(case_ids)].reset_index()

    def resolve_tumor_labels(self, lesion_class: str = "pancreatic_lesion") -> pd.Series:
        """Scan-level tumor labels, derived from the lesion mask where ``tumor`` was not recorded (-1)."""
        labels = [case.tumor_label(lesion_class) for case in self.cases()]
        return pd.Series(labels, index=self.metadata["case_id"], name="tumor")


def detect_layout(root: Path) -> tuple[str, str, str]:
    """Return (layout, image_dir, label_dir) for a cohort root."""
    root = Path(root)
    for image_dir in _LAYOUT_B_IMAGE_DIRS:
        for label_dir in _LAYOUT_B_LABEL_DIRS:
            if (root / image_dir).is_dir() and (root / label_dir).is_dir():
                return "B", image_dir, label_dir
    return "A", "", ""


def read_metadata(root: Path) -> tuple[pd.DataFrame, list[Problem]]:
    """The normalized metadata table of a cohort and its problems (:func:`read_metadata_csv` reads it).

    Raises:
        CohortError: the file is missing, empty, ragged or not UTF-8.
    """
    path = Path(root) / METADATA_FILE
    if not path.exists():
        raise CohortError([Problem("<cohort>", str(path), "metadata file is missing")], root)
    try:
        raw = read_metadata_csv(path)
    except MetadataReadError as error:
        raise CohortError([error.problem], root) from error
    return normalize_metadata(raw)


def load_cohort(root: Path | str, strict: bool = True) -> Cohort:
    """Read a cohort (layout A or B) and its metadata.

    Args:
        root: the cohort folder.
        strict: raise :class:`CohortError` listing every metadata problem; with ``False`` the
            problems are kept on ``cohort.problems`` (what ``validate`` uses).
    """
    root = Path(root)
    if not root.is_dir():
        raise CohortError([Problem("<cohort>", str(root), "cohort folder does not exist")], root)
    metadata, problems = read_metadata(root)
    if strict and problems:
        raise CohortError(problems, root)
    layout, image_dir, label_dir = detect_layout(root)
    if not strict:
        # Keep only rows whose case id can address a folder, so that file checks can still run.
        metadata = metadata[(metadata["case_id"] != "") & ~metadata["case_id"].duplicated()].reset_index(drop=True)
    return Cohort(root, metadata, layout, image_dir, label_dir, problems)


# ----------------------------------------------------------------------------------------------
# Writing (layout A), atomically.


def atomic_save_nifti(image: nib.Nifti1Image, path: Path) -> None:
    """Save a NIfTI image via a temporary file and rename, so readers never see a partial file."""
    with atomic_target(path, suffix=".nii.gz") as tmp:
        nib.save(image, tmp)


def write_case(
    root: Path,
    case_id: str,
    ct: np.ndarray,
    affine: np.ndarray,
    masks: Mapping[str, np.ndarray],
    header: nib.Nifti1Header | None = None,
) -> Path:
    """Write one case in layout A: CT as int16 HU, each mask as uint8, all on the CT's grid and affine.

    The case folder is assembled in a hidden temporary folder and renamed into place, so a case is
    either complete or absent.
    """
    root = Path(root)
    final = root / case_id
    if "/" in case_id or "\\" in case_id or ".." in case_id or case_id in {"", "."}:
        raise ValueError(f"unsafe case id {case_id!r}")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{case_id}."))
    publish_mode(staging, directory=True)
    try:
        ct_image = nib.Nifti1Image(np.asarray(ct).astype(np.int16), affine, header)
        ct_image.set_data_dtype(np.int16)
        nib.save(ct_image, staging / CT_FILE)
        (staging / SEGMENTATION_DIR).mkdir()
        for name, mask in masks.items():
            mask = np.asarray(mask)
            if mask.shape != np.asarray(ct).shape:
                raise ValueError(f"{case_id}: mask {name} has shape {mask.shape}, CT has {np.asarray(ct).shape}")
            image = nib.Nifti1Image(mask.astype(np.uint8), affine)
            image.set_data_dtype(np.uint8)
            nib.save(image, staging / SEGMENTATION_DIR / f"{name}.nii.gz")
        if final.exists():
            backup = Path(tempfile.mkdtemp(dir=root, prefix=f".{case_id}.old."))
            os.replace(final, backup / "case")
            os.replace(staging, final)
            _rmtree(backup)
        else:
            os.replace(staging, final)
    except BaseException:
        _rmtree(staging)
        raise
    return final


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def write_metadata(root: Path, table: pd.DataFrame) -> Path:
    path = Path(root) / METADATA_FILE
    atomic_write_csv(table, path)
    return path
