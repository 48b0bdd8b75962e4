"""Class maps: source labels (values or names) to AbdomenAtlas classes, and binary masks from a label volume.

The user's ``--class-map`` file (JSON, YAML or CSV ``label,class``), the built-in TotalSegmentator
tables, the source-name table, and the rule that a generic lesion label ("tumor", "cancer") is the
lesion class of the one organ the same dataset labels.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from lightning_modules.cohorts.importers.source_cases import ImportCaseError, ImportSourceError
from lightning_modules.data.cohort import LESION_CLASSES, ORGAN_CLASSES

# The AbdomenAtlas classes this framework knows (docs/explanation/data.md "Cohorts on disk"). A class map that targets
# anything else is rejected, so a typo ("pancreatic_tumor") cannot create a class nobody reads.
ATLAS_CLASSES = ORGAN_CLASSES + LESION_CLASSES

# TotalSegmentator's label values for the classes used here, read from the class_map in
# totalsegmentator/map_to_binary.py ("total" task for v2, "total_v1" for v1) of the 2.4.0 release.
TOTALSEGMENTATOR_V2_LABELS = {
    1: "spleen",
    2: "kidney_right",
    3: "kidney_left",
    4: "gallbladder",
    5: "liver",
    6: "stomach",
    7: "pancreas",
    52: "aorta",
    63: "inferior_vena_cava",
}
TOTALSEGMENTATOR_V1_LABELS = {
    1: "spleen",
    2: "kidney_right",
    3: "kidney_left",
    4: "gallbladder",
    5: "liver",
    6: "stomach",
    7: "aorta",
    8: "inferior_vena_cava",
    10: "pancreas",
}
BUILTIN_LABEL_TABLES = {"totalseg-v2": TOTALSEGMENTATOR_V2_LABELS, "totalseg-v1": TOTALSEGMENTATOR_V1_LABELS}

# Source class names (TotalSegmentator, nnU-Net / MSD dataset.json) -> AbdomenAtlas names.
SOURCE_NAME_TO_ATLAS = {
    **{name: name for name in ATLAS_CLASSES},
    "gallbladder": "gall_bladder",
    "inferior_vena_cava": "postcava",
    "ivc": "postcava",
}
# Generic lesion names (MSD "cancer", nnU-Net "tumor") become the lesion class of the one organ
# the same dataset labels; with no such organ, or several, the user must say which in a class map.
LESION_SYNONYMS = frozenset({"tumor", "tumour", "tumors", "tumours", "cancer", "lesion", "lesions", "mass"})
LESION_OF_ORGAN = {"pancreas": "pancreatic_lesion", "liver": "liver_lesion"}

ClassValues = dict[str, frozenset[int]]


@dataclass(frozen=True)
class UserClassMap:
    """A user's class map: label value -> AbdomenAtlas classes, and source name -> classes.

    An empty target list means "deliberately not imported".
    """

    by_value: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    by_name: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    path: str = ""


def _targets(raw, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = raw if isinstance(raw, (list, tuple)) else str(raw).replace(";", ",").split(",")
    targets = tuple(str(item).strip() for item in items if str(item).strip())
    unknown = [t for t in targets if t not in ATLAS_CLASSES]
    if unknown:
        raise ImportSourceError(
            f"{where}: unknown AbdomenAtlas class(es) {unknown}; known: {', '.join(ATLAS_CLASSES)}"
        )
    return targets


def load_class_map(path: Path | str) -> UserClassMap:
    """Read a class map from JSON, YAML or CSV.

    Keys are label values (``"2"``) for multilabel volumes or source class names (``"cancer"``,
    ``"gallbladder"``) for dataset.json labels and per-class files. Values are an AbdomenAtlas class
    name, a list of them (``[pancreas, pancreatic_lesion]``) or empty/null to leave a label out. A
    CSV has the header ``label,class`` and may repeat a label to give it several classes.

    Args:
        path: the class map file (``.json``, ``.yaml``/``.yml`` or ``.csv``).
    """
    path = Path(path)
    if not path.is_file():
        raise ImportSourceError(f"class map {path}: file does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            raw = json.loads(path.read_text())
        elif suffix in {".yaml", ".yml"}:
            import yaml

            raw = yaml.safe_load(path.read_text())
        elif suffix == ".csv":
            table = pd.read_csv(path, dtype=str, keep_default_na=False)
            if list(table.columns) != ["label", "class"]:
                raise ImportSourceError(f"class map {path}: CSV header must be 'label,class', got {list(table.columns)}")
            raw = {}
            for label, target in zip(table["label"], table["class"]):
                raw.setdefault(label.strip(), [])
                if target.strip():
                    raw[label.strip()].append(target.strip())
        else:
            raise ImportSourceError(f"class map {path}: unsupported extension {suffix!r} (use .json, .yaml or .csv)")
    except (json.JSONDecodeError, ValueError) as error:
        if isinstance(error, ImportSourceError):
            raise
        raise ImportSourceError(f"class map {path}: cannot parse: {error}") from error
    if not isinstance(raw, dict) or not raw:
        raise ImportSourceError(f"class map {path}: expected a non-empty mapping of label -> class")
    by_value: dict[int, tuple[str, ...]] = {}
    by_name: dict[str, tuple[str, ...]] = {}
    for key, value in raw.items():
        key_text = str(key).strip()
        targets = _targets(value, f"class map {path}, label {key_text!r}")
        if re.fullmatch(r"\d+", key_text):
            if int(key_text) == 0 and targets:
                raise ImportSourceError(f"class map {path}: label 0 is background and cannot map to {targets}")
            by_value[int(key_text)] = targets
        else:
            by_name[key_text.lower()] = targets
    return UserClassMap(by_value=by_value, by_name=by_name, path=str(path))


def builtin_class_map(name: str) -> UserClassMap:
    """A built-in label table (``totalseg-v2``, ``totalseg-v1``) as a class map."""
    if name not in BUILTIN_LABEL_TABLES:
        raise ImportSourceError(f"unknown built-in class map {name!r}; known: {', '.join(BUILTIN_LABEL_TABLES)}")
    table = BUILTIN_LABEL_TABLES[name]
    return UserClassMap(by_value={value: (SOURCE_NAME_TO_ATLAS[src],) for value, src in table.items()}, path=name)


def class_map_from_argument(argument: str | None, default: str | None = None) -> UserClassMap | None:
    """``--class-map``: a file, or the name of a built-in table; ``default`` when not given."""
    if argument is None:
        return builtin_class_map(default) if default else None
    if argument in BUILTIN_LABEL_TABLES:
        return builtin_class_map(argument)
    return load_class_map(argument)


def resolve_class_values(
    labels: Sequence[tuple[str, frozenset[int]]],
    user_map: UserClassMap | None,
    where: str,
    exclusive: bool = True,
) -> ClassValues:
    """AbdomenAtlas class -> label values, from a source's declared labels.

    Args:
        labels: (source name, label values) for each non-background label a source declares
            (nnU-Net region labels have several values).
        user_map: the user's class map; it wins over the built-in name table.
        where: the file that declared the labels, for error messages.
        exclusive: True for single-label volumes, where a lesion voxel carries only the lesion value:
            the organ then gets the lesion's values too, because AbdomenAtlas organ masks include
            their tumors (the pancreas mask covers the pancreatic lesion).

    Raises:
        ImportSourceError: listing every label that maps to no class, with how to map it.
    """
    mapped: list[tuple[str, tuple[str, ...], frozenset[int]]] = []
    pending_lesions: list[tuple[str, frozenset[int]]] = []
    unmapped: list[str] = []
    for name, values in labels:
        key = name.strip().lower()
        if user_map is not None and key in user_map.by_name:
            mapped.append((name, user_map.by_name[key], values))
        elif user_map is not None and len(values) == 1 and next(iter(values)) in user_map.by_value:
            mapped.append((name, user_map.by_value[next(iter(values))], values))
        elif key in SOURCE_NAME_TO_ATLAS:
            mapped.append((name, (SOURCE_NAME_TO_ATLAS[key],), values))
        elif key in LESION_SYNONYMS:
            pending_lesions.append((name, values))
        else:
            unmapped.append(f"{name!r} (value {sorted(values)})")
    organs_with_lesion_class = sorted({t for _, targets, _ in mapped for t in targets if t in LESION_OF_ORGAN})
    for name, values in pending_lesions:
        if len(organs_with_lesion_class) == 1:
            mapped.append((name, (LESION_OF_ORGAN[organs_with_lesion_class[0]],), values))
        else:
            unmapped.append(f"{name!r} (value {sorted(values)}: lesion of which organ?)")
    if unmapped:
        raise ImportSourceError(
            f"{where}: label(s) {', '.join(unmapped)} map to no AbdomenAtlas class. Give --class-map FILE, e.g. "
            '{"2": ["pancreas", "pancreatic_lesion"]} or {"tumor": "pancreatic_lesion"}; map a label to [] to leave it out.'
        )
    class_values: dict[str, set[int]] = {}
    for _, targets, values in mapped:
        for target in targets:
            class_values.setdefault(target, set()).update(values)
    if exclusive:
        for organ, lesion in LESION_OF_ORGAN.items():
            if organ in class_values and lesion in class_values:
                class_values[organ] |= class_values[lesion]
    return {name: frozenset(values) for name, values in sorted(class_values.items())}


def class_values_from_user_map(user_map: UserClassMap, exclusive: bool = True) -> ClassValues:
    """Class values for a multilabel volume described only by a value-keyed class map."""
    labels = [(f"label {value}", frozenset({value})) for value in sorted(user_map.by_value)]
    if user_map.by_name and not user_map.by_value:
        raise ImportSourceError(
            f"class map {user_map.path}: a multilabel volume needs label values as keys (e.g. \"7\": pancreas)"
        )
    return resolve_class_values(labels, user_map, f"class map {user_map.path}", exclusive=exclusive)


def masks_from_label_volume(
    labels: np.ndarray,
    class_values: ClassValues,
    path: Path,
    declared_values: Iterable[int] | None = None,
) -> dict[str, np.ndarray]:
    """Binary masks (uint8) per class from one label volume.

    Args:
        labels: the label volume.
        class_values: AbdomenAtlas class -> label values (see :func:`resolve_class_values`).
        path: the label file, for error messages.
        declared_values: every value the dataset declares; a voxel value outside them is an error.
            None for sources whose other labels are simply not imported (TotalSegmentator's 117).
    """
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or not np.array_equal(labels, np.round(labels)):
            raise ImportCaseError(f"{path}: label volume has non-integer values (not a label map)")
    labels = labels.astype(np.int64, copy=False)
    if declared_values is not None:
        present = set(np.unique(labels).tolist())
        undeclared = sorted(present - set(declared_values) - {0})
        if undeclared:
            raise ImportCaseError(f"{path}: label value(s) {undeclared} are not declared in the dataset's labels")
    return {name: np.isin(labels, sorted(values)).astype(np.uint8) for name, values in class_values.items()}
