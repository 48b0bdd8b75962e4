"""NIfTI sources: TotalSegmentator folders, nnU-Net raw datasets and Medical Segmentation Decathlon tasks.

Each ``list_*`` function reads only the dataset's index (folder names, ``dataset.json``) and returns
:class:`~lightning_modules.cohorts.importers.source_cases.SourceCase` objects for
:func:`~lightning_modules.cohorts.importers.resumable_import.run_import`. Images keep their own grid and affine; a mask on
another grid is an error for that case (masks are never resampled).

Source layouts:

- TotalSegmentator: ``SRC/<case>/ct.nii.gz`` with either per-class files
  ``SRC/<case>/segmentations/<name>.nii.gz`` (the TotalSegmentator dataset and ``TotalSegmentator -o``)
  or one multilabel ``SRC/<case>/segmentations.nii.gz`` (``TotalSegmentator --ml``; values read with
  the built-in v2 table unless ``--class-map`` says otherwise). ``SRC`` may itself be one case
  folder. The dataset's ``SRC/meta.csv`` (``;``-separated) gives age, gender, manufacturer,
  scanner_model and kvp per ``image_id``.
- nnU-Net raw: ``SRC/dataset.json`` (``labels`` name -> value, ``channel_names``, ``file_ending``),
  ``SRC/imagesTr/<id>_0000<file_ending>`` and ``SRC/labelsTr/<id><file_ending>``.
- MSD: ``SRC/dataset.json`` (``labels`` value -> name, ``modality``, ``training`` image/label pairs).
  Task07_Pancreas's ``1 pancreas, 2 cancer`` becomes ``pancreas`` (1 or 2: the organ includes its
  tumor, AbdomenAtlas convention) and ``pancreatic_lesion`` (2).

Example::

    cases = list_msd("Task07_Pancreas")
    run_import(cases, "data/msd_pancreas")
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from lightning_modules.data.cohort import CT_FILE, SEGMENTATION_DIR
from lightning_modules.cohorts.importers.class_maps import (
    LESION_SYNONYMS,
    SOURCE_NAME_TO_ATLAS,
    ClassValues,
    UserClassMap,
    builtin_class_map,
    class_values_from_user_map,
    masks_from_label_volume,
    resolve_class_values,
)
from lightning_modules.cohorts.importers.source_cases import ImportCaseError, ImportSourceError, LoadedCase, SourceCase
from lightning_modules.cohorts.importers.volumes import load_nifti, require_same_grid, to_int16_hu

logger = logging.getLogger("lightning_modules.cohorts.importers")

TOTALSEGMENTATOR_MULTILABEL_FILE = "segmentations.nii.gz"
TOTALSEGMENTATOR_META_FILE = "meta.csv"
DATASET_JSON = "dataset.json"
NIFTI_ENDINGS = (".nii.gz", ".nii")


def _strip_nifti_ending(name: str) -> str:
    for ending in NIFTI_ENDINGS:
        if name.endswith(ending):
            return name[: -len(ending)]
    return name


def _read_ct(image_path: Path):
    image = load_nifti(image_path, "CT")
    return image, to_int16_hu(np.asarray(image.dataobj), image_path)


def load_image_and_label_volume(
    image_path: Path,
    label_path: Path,
    class_values: ClassValues,
    declared_values=None,
) -> LoadedCase:
    """One CT and its single-label volume, split into binary masks on the CT's grid."""
    image, ct = _read_ct(image_path)
    label_image = load_nifti(label_path, "label")
    require_same_grid(label_image, image, label_path, image_path)
    masks = masks_from_label_volume(np.asarray(label_image.dataobj), class_values, label_path, declared_values)
    return LoadedCase(ct=ct, affine=image.affine, masks=masks)


def load_image_and_class_files(image_path: Path, class_files: Mapping[str, list[Path]]) -> LoadedCase:
    """One CT and per-class binary files (several files may feed one AbdomenAtlas class)."""
    image, ct = _read_ct(image_path)
    masks = {}
    for name, files in class_files.items():
        mask = np.zeros(image.shape, dtype=bool)
        for path in files:
            mask_image = load_nifti(path, "mask")
            require_same_grid(mask_image, image, path, image_path)
            data = np.asarray(mask_image.dataobj)
            values = np.unique(data)
            if not set(values.tolist()) <= {0, 1}:
                raise ImportCaseError(f"{path}: mask has values {values[:8].tolist()}, expected a binary 0/1 mask")
            mask |= data > 0
        masks[name] = mask.astype(np.uint8)
    return LoadedCase(ct=ct, affine=image.affine, masks=masks)


def _missing(message: str) -> LoadedCase:
    raise ImportCaseError(message)


# ----------------------------------------------------------------------------------------------
# TotalSegmentator


def read_totalsegmentator_meta(path: Path) -> dict[str, dict[str, str]]:
    """Per-case metadata from the TotalSegmentator dataset's ``meta.csv`` (study variables only).

    Only age, gender (-> sex), manufacturer + scanner_model (-> scanner) and kvp are kept; the
    institute, split and pathology columns are not cohort metadata here.
    """
    if not path.is_file():
        return {}
    table = pd.read_csv(path, sep=None, engine="python", dtype=str, keep_default_na=False)
    if "image_id" not in table.columns:
        raise ImportSourceError(f"{path}: TotalSegmentator meta.csv needs an image_id column, has {list(table.columns)}")
    meta = {}
    for record in table.to_dict("records"):
        row = {}
        if record.get("age", "").strip():
            row["age"] = record["age"].strip()
        if record.get("gender", "").strip():
            row["sex"] = record["gender"].strip()
        scanner = " ".join(record.get(c, "").strip() for c in ("manufacturer", "scanner_model")).strip()
        if scanner:
            row["scanner"] = scanner
        if record.get("kvp", "").strip():
            row["kvp"] = record["kvp"].strip()
        meta[record["image_id"].strip()] = row
    return meta


def _class_files(folder: Path, user_map: UserClassMap | None) -> dict[str, list[Path]]:
    """AbdomenAtlas class -> per-class files; TotalSegmentator classes outside the atlas set are left out."""
    groups: dict[str, list[Path]] = {}
    left_out = []
    for path in sorted(folder.glob("*.nii*")):
        name = _strip_nifti_ending(path.name)
        key = name.lower()
        if user_map is not None and key in user_map.by_name:
            targets = user_map.by_name[key]
        elif key in SOURCE_NAME_TO_ATLAS:
            targets = (SOURCE_NAME_TO_ATLAS[key],)
        elif key in LESION_SYNONYMS:
            raise ImportSourceError(
                f"{path}: lesion file of no named organ; map it with --class-map, e.g. {{\"{name}\": \"pancreatic_lesion\"}}"
            )
        else:
            left_out.append(name)
            continue
        for target in targets:
            groups.setdefault(target, []).append(path)
    if left_out:
        logger.debug("%s: %d classes outside the AbdomenAtlas set not imported", folder, len(left_out))
    return dict(sorted(groups.items()))


def list_totalsegmentator(src: Path | str, cohort: str | None = None, class_map: UserClassMap | None = None) -> list[SourceCase]:
    """Cases of a TotalSegmentator-style folder (see the module docstring).

    Args:
        src: the dataset root (case folders) or one case folder.
        cohort: the cohort name written to metadata.csv (default: the folder name).
        class_map: for multilabel files, label value -> class (default: TotalSegmentator v2
            numbering); for per-class files, file name -> class on top of the built-in name table.
    """
    src = Path(src)
    if not src.is_dir():
        raise ImportSourceError(f"{src}: TotalSegmentator source folder does not exist")
    if (src / CT_FILE).is_file():
        folders = [src]
    else:
        folders = sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ImportSourceError(f"{src}: no case folders (expected <case>/ct.nii.gz)")
    meta = read_totalsegmentator_meta(src / TOTALSEGMENTATOR_META_FILE)
    cohort = cohort or src.name
    value_map = class_map if class_map is not None and class_map.by_value else builtin_class_map("totalseg-v2")
    multilabel_values = class_values_from_user_map(value_map)
    cases = []
    for folder in folders:
        case_id = folder.name
        ct_path = folder / CT_FILE
        per_class_dir = folder / SEGMENTATION_DIR
        multilabel = folder / TOTALSEGMENTATOR_MULTILABEL_FILE
        metadata = {"cohort": cohort, **meta.get(case_id, {})}
        if not ct_path.is_file():
            load = partial(_missing, f"{folder}: no {CT_FILE} in this case folder")
            expected: tuple[str, ...] = ()
        elif per_class_dir.is_dir():
            class_files = _class_files(per_class_dir, class_map)
            if not class_files:
                message = f"{per_class_dir}: no file of an AbdomenAtlas class (e.g. liver.nii.gz, pancreas.nii.gz)"
                load = partial(_missing, message)
            else:
                load = partial(load_image_and_class_files, ct_path, class_files)
            expected = tuple(class_files)
        elif multilabel.is_file():
            load = partial(load_image_and_label_volume, ct_path, multilabel, multilabel_values)
            expected = tuple(multilabel_values)
        else:
            load = partial(_missing, f"{folder}: neither {SEGMENTATION_DIR}/ nor {TOTALSEGMENTATOR_MULTILABEL_FILE}")
            expected = ()
        cases.append(SourceCase(case_id=case_id, source=str(folder), load=load, expected_classes=expected, metadata=metadata))
    return cases


# ----------------------------------------------------------------------------------------------
# nnU-Net raw and MSD


def _read_dataset_json(src: Path) -> tuple[Path, dict]:
    path = src / DATASET_JSON
    if not path.is_file():
        raise ImportSourceError(f"{path}: dataset.json is missing")
    try:
        dataset = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ImportSourceError(f"{path}: invalid JSON: {error}") from error
    if not isinstance(dataset.get("labels"), dict) or not dataset["labels"]:
        raise ImportSourceError(f"{path}: 'labels' must be a non-empty mapping")
    return path, dataset


def _require_single_ct_channel(path: Path, channels) -> None:
    if not isinstance(channels, dict) or "0" not in {str(k) for k in channels}:
        raise ImportSourceError(f"{path}: channel_names/modality must name channel 0 (expected {{\"0\": \"CT\"}})")
    names = {str(k): str(v) for k, v in channels.items()}
    if names["0"].strip().lower() != "ct" or len(names) != 1:
        raise ImportSourceError(f"{path}: expected one CT channel, got {names} (only single-channel CT is imported)")


def list_nnunet(src: Path | str, cohort: str | None = None, class_map: UserClassMap | None = None) -> list[SourceCase]:
    """Cases of an nnU-Net v2 raw dataset (imagesTr/labelsTr); every declared label must map to a class.

    Args:
        src: the ``DatasetXXX_Name`` folder.
        cohort: the cohort name (default: dataset.json ``name``, else the folder name).
        class_map: label name or value -> AbdomenAtlas class, on top of the built-in name table.
    """
    src = Path(src)
    path, dataset = _read_dataset_json(src)
    _require_single_ct_channel(path, dataset.get("channel_names", dataset.get("modality")))
    ending = dataset.get("file_ending", ".nii.gz")
    if ending not in NIFTI_ENDINGS:
        raise ImportSourceError(f"{path}: file_ending {ending!r} is not supported (NIfTI only: .nii.gz, .nii)")
    labels = []
    declared: set[int] = set()
    for name, values in dataset["labels"].items():
        try:
            values = frozenset(int(v) for v in (values if isinstance(values, list) else [values]))
        except (TypeError, ValueError) as error:
            raise ImportSourceError(
                f"{path}: label {name!r} has value {values!r}, expected an integer or a list of them"
            ) from error
        declared |= values
        if str(name).lower() == "ignore":
            raise ImportSourceError(f"{path}: an 'ignore' label (partly annotated volumes) cannot become binary masks")
        if values == {0}:
            continue
        labels.append((str(name), values))
    class_values = resolve_class_values(labels, class_map, str(path), exclusive=True)
    images_dir, labels_dir = src / "imagesTr", src / "labelsTr"
    image_ids = {p.name[: -len(f"_0000{ending}")] for p in images_dir.glob(f"*_0000{ending}")}
    label_ids = {p.name[: -len(ending)] for p in labels_dir.glob(f"*{ending}") if not p.name.startswith(".")}
    if not image_ids and not label_ids:
        raise ImportSourceError(f"{src}: no imagesTr/*_0000{ending} files")
    cohort = cohort or str(dataset.get("name") or src.name)
    cases = []
    for case_id in sorted(image_ids | label_ids):
        image_path = images_dir / f"{case_id}_0000{ending}"
        label_path = labels_dir / f"{case_id}{ending}"
        if case_id not in label_ids:
            load = partial(_missing, f"{label_path}: label file is missing for image {image_path}")
        elif case_id not in image_ids:
            load = partial(_missing, f"{image_path}: image file is missing for label {label_path}")
        else:
            load = partial(load_image_and_label_volume, image_path, label_path, class_values, declared)
        cases.append(
            SourceCase(
                case_id=case_id,
                source=str(image_path),
                load=load,
                expected_classes=tuple(class_values),
                metadata={"cohort": cohort},
            )
        )
    return cases


def list_msd(src: Path | str, cohort: str | None = None, class_map: UserClassMap | None = None) -> list[SourceCase]:
    """Cases of a Medical Segmentation Decathlon task (dataset.json ``training`` pairs).

    Args:
        src: the ``TaskXX_Name`` folder.
        cohort: the cohort name (default: dataset.json ``name``, else the folder name).
        class_map: label name or value -> AbdomenAtlas class, on top of the built-in name table.
    """
    src = Path(src)
    path, dataset = _read_dataset_json(src)
    _require_single_ct_channel(path, dataset.get("modality", dataset.get("channel_names")))
    labels = []
    declared: set[int] = set()
    for value, name in dataset["labels"].items():
        try:
            value = int(value)
        except ValueError as error:
            raise ImportSourceError(f"{path}: MSD labels map values to names; key {value!r} is not a value") from error
        declared.add(value)
        if value != 0:
            labels.append((str(name), frozenset({value})))
    class_values = resolve_class_values(labels, class_map, str(path), exclusive=True)
    training = dataset.get("training")
    if not isinstance(training, list) or not training:
        raise ImportSourceError(f"{path}: 'training' must be a non-empty list of image/label pairs")
    cohort = cohort or str(dataset.get("name") or src.name)
    cases = []
    for i, pair in enumerate(training):
        if not isinstance(pair, dict) or "image" not in pair or "label" not in pair:
            raise ImportSourceError(f"{path}: training[{i}] is not an image/label pair")
        image_path = (src / pair["image"]).resolve()
        label_path = (src / pair["label"]).resolve()
        case_id = _strip_nifti_ending(Path(pair["image"]).name)
        load = partial(load_image_and_label_volume, image_path, label_path, class_values, declared)
        cases.append(
            SourceCase(
                case_id=case_id,
                source=str(image_path),
                load=load,
                expected_classes=tuple(class_values),
                metadata={"cohort": cohort},
            )
        )
    return cases
