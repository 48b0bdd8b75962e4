"""Patient-disjoint train/val/test splits, written once and then only read (``docs/explanation/data.md "Split files"``).

A split file ``splits/<cohort>.csv`` has columns ``case_id,patient_id,split``. :func:`make_splits`
assigns whole patients (every scan of a patient lands in one split) and balances tumor x phase
strata across splits where the counts allow. Only real cases are split: synthetic cases are
training data by construction and never enter a split file. :func:`write_split` refuses to replace
an existing file unless forced (as nnU-Net's ``splits_final.json``), and :func:`load_split`, the one
split reader, fails hard on a patient in two splits, an unknown case, or a patient id that
disagrees with the cohort (the leakage audit reads with ``check=False``, since reporting those
problems is its job).

Run::

    benchx make-splits --root data/phantom --out splits/phantom.csv --seed 0 --val 0.1 --test 0.2
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from lightning_modules.data.cohort import load_cohort
from lightning_modules.data.problems import Problem
from lightning_modules.infrastructure.files import atomic_write_csv, file_sha256

if TYPE_CHECKING:
    from lightning_modules.data.cohort import Cohort

SPLITS = ("train", "val", "test")
SPLIT_COLUMNS = ("case_id", "patient_id", "split")
# val + test may exceed 1 by float rounding (0.7 + 0.3) and still mean "no training share".
FRACTION_TOLERANCE = 1e-9


class SplitError(ValueError):
    """A split that cannot be used; ``problems`` lists every reason (case, file, message)."""

    def __init__(self, problems: list[Problem], path: Path | str = ""):
        self.problems = list(problems)
        self.path = str(path)
        head = f"split {path}: " if path else "split: "
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}{len(self.problems)} problem(s):\n{lines}")


class SplitSettingError(ValueError):
    """Settings that cannot make a split: fractions out of range, too few patients, missing columns."""


class SplitExistsError(FileExistsError):
    """The split file exists: splits are written once and then only read."""


def _strata(metadata: pd.DataFrame) -> pd.Series:
    # -1 (tumor not recorded) stays its own stratum rather than being guessed.
    tumor = metadata["tumor"].astype(int).map({1: "tumor", 0: "no-tumor"}).fillna("tumor-unknown")
    return tumor + "|" + metadata["phase"].astype(str)


def make_splits(
    metadata: pd.DataFrame,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
) -> pd.DataFrame:
    """Assign whole patients to train/val/test, stratified by tumor x phase.

    The allocator is greedy and seeded (a variant of scikit-learn's ``StratifiedGroupKFold``,
    which only makes equal folds): patients are shuffled with ``seed``, ordered by number of scans
    (largest first, as in bin packing), and each goes to the split that least increases the
    chi-square distance between what the splits hold and their target shares of every tumor x
    phase stratum, of cases and of patients. Strata too small to share stay whole in the split
    that needs them most (train, for a single patient). Every split with a positive fraction gets
    at least one patient.

    Args:
        metadata: normalized cohort metadata with ``case_id``, ``patient_id``, ``tumor`` (0/1, or -1
            when unrecorded: its own stratum), ``phase`` and ``synthetic``. Synthetic rows are
            dropped: they are training-only data.
        seed: shuffling seed; the same table and seed give the same split.
        val_fraction: target share of cases in ``val``.
        test_fraction: target share of cases in ``test``; ``val + test`` may be 1 (no training
            share), for an external cohort that only evaluates a model trained elsewhere.

    Returns:
        ``case_id, patient_id, split`` for every real case, in the input order.

    Raises:
        SplitSettingError: fractions out of range, too few patients, missing columns, duplicate ids.
    """
    real = _real_cases(metadata, val_fraction, test_fraction)
    train_fraction = 1.0 - val_fraction - test_fraction
    # val + test == 1 (no training share: an external cohort) may leave a rounding residue.
    fractions = np.array([train_fraction if train_fraction > FRACTION_TOLERANCE else 0.0, val_fraction, test_fraction])
    patients = real["patient_id"].astype(str).to_numpy()
    patient_names = np.unique(patients)
    needed = int(np.count_nonzero(fractions > 0))
    if len(patient_names) < needed:
        raise SplitSettingError(f"{len(patient_names)} patient(s) cannot fill {needed} non-empty split(s)")
    patient_of_case = np.searchsorted(patient_names, patients)
    counts = _patient_counts(real, patient_of_case, len(patient_names))
    assignment = _allocate(counts, fractions, seed)
    _fill_empty_splits(assignment, counts, fractions)
    return pd.DataFrame(
        {
            "case_id": real["case_id"].astype(str),
            "patient_id": patients,
            "split": [SPLITS[s] for s in assignment[patient_of_case]],
        }
    )


def _real_cases(metadata: pd.DataFrame, val_fraction: float, test_fraction: float) -> pd.DataFrame:
    """The real (non-synthetic) rows to split, after checking columns, fractions and case ids."""
    missing = [c for c in ("case_id", "patient_id", "tumor", "phase") if c not in metadata.columns]
    if missing:
        raise SplitSettingError(f"metadata lacks column(s) {missing} needed to split")
    in_range = 0 <= val_fraction <= 1 and 0 <= test_fraction <= 1
    if not (in_range and val_fraction + test_fraction <= 1 + FRACTION_TOLERANCE):
        raise SplitSettingError(
            f"--val and --test must be shares in [0, 1] with val + test <= 1 (1: no training share, for an "
            f"external cohort), got val={val_fraction}, test={test_fraction}"
        )
    real = metadata
    if "synthetic" in metadata.columns:
        real = metadata[metadata["synthetic"].astype(int) == 0]
    real = real.reset_index(drop=True)
    duplicated = real.loc[real["case_id"].duplicated(), "case_id"].tolist()
    if duplicated:
        raise SplitSettingError(f"duplicate case id(s) in metadata: {duplicated}")
    return real


def _patient_counts(real: pd.DataFrame, patient_of_case: np.ndarray, n_patients: int) -> np.ndarray:
    """counts[p]: patient p's cases per stratum, then its total cases, then 1 (the patient itself)."""
    strata = _strata(real)
    stratum_names = sorted(strata.unique())
    stratum_index = strata.map({name: i for i, name in enumerate(stratum_names)}).to_numpy()
    counts = np.zeros((n_patients, len(stratum_names) + 2))
    np.add.at(counts, (patient_of_case, stratum_index), 1.0)
    counts[:, -2] = counts[:, :-2].sum(axis=1)
    counts[:, -1] = 1.0
    return counts


def _allocate(counts: np.ndarray, fractions: np.ndarray, seed: int) -> np.ndarray:
    """The greedy chi-square allocation of :func:`make_splits`: a split index per patient."""
    targets = fractions[:, None] * counts.sum(axis=0)[None, :]
    # Chi-square weights: a deviation counts relative to its target, so rare strata and the small
    # val split weigh as much as common ones, and splits fill in proportion.
    weights = 1.0 / np.maximum(targets, 1e-9)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(counts))
    order = order[np.argsort(-counts[order, -2], kind="stable")]
    allocated = np.zeros_like(targets)
    assignment = np.full(len(counts), -1)
    for p in order:
        # Increase of sum(w * (allocated - target)^2) when patient p joins each split.
        increase = (weights * counts[p] * (2.0 * (allocated - targets) + counts[p])).sum(axis=1)
        increase[fractions == 0] = np.inf
        best_split = int(np.argmin(increase))
        assignment[p] = best_split
        allocated[best_split] += counts[p]
    return assignment


def _fill_empty_splits(assignment: np.ndarray, counts: np.ndarray, fractions: np.ndarray) -> None:
    """A tiny cohort can leave val or test empty; move the smallest patient of the most over-full split."""
    size_targets = fractions * counts[:, -2].sum()
    for s in np.flatnonzero(fractions > 0):
        if np.any(assignment == s):
            continue
        sizes = np.array([counts[assignment == t, -2].sum() for t in range(3)])
        surplus = sizes - size_targets
        surplus[[t for t in range(3) if np.count_nonzero(assignment == t) <= 1]] = -np.inf
        donor = int(np.argmax(surplus))
        members = np.flatnonzero(assignment == donor)
        assignment[members[np.argmin(counts[members, -2])]] = s


def split_problems(table: pd.DataFrame, cohort: Cohort | None = None, path: Path | str = "") -> list[Problem]:
    """Every reason a split table cannot be used (empty list when it is sound).

    Checks columns, split values, duplicate and empty case ids, patients in two splits, and, with
    a cohort, case ids absent from it, patient ids that disagree with its metadata, and synthetic
    cases placed in val or test.
    """
    where = str(path) or "split"
    missing = [c for c in SPLIT_COLUMNS if c not in table.columns]
    if missing:
        return [Problem("<header>", where, f"required column(s) {missing} missing (need {list(SPLIT_COLUMNS)})")]
    problems: list[Problem] = []
    for row_number, (case_id, split) in enumerate(zip(table["case_id"], table["split"]), start=2):
        if case_id == "":
            problems.append(Problem(f"<row {row_number}>", where, "empty case id"))
        if split not in SPLITS:
            problems.append(
                Problem(case_id or f"<row {row_number}>", where, f"split {split!r} is not one of {list(SPLITS)}")
            )
    for case_id in table.loc[table["case_id"].duplicated() & (table["case_id"] != ""), "case_id"].unique():
        problems.append(Problem(case_id, where, "case id listed more than once"))

    patients = table["patient_id"].where(table["patient_id"] != "", table["case_id"])
    if cohort is not None:
        known = table["case_id"].map(lambda c: c in cohort)
        for case_id in table.loc[~known & (table["case_id"] != ""), "case_id"]:
            problems.append(Problem(case_id, where, f"case is not in cohort {cohort.root}"))
        cohort_patient = cohort.metadata.set_index("case_id")["patient_id"]
        synthetic = cohort.metadata.set_index("case_id")["synthetic"]
        for case_id, patient_id, split in zip(table["case_id"], table["patient_id"], table["split"]):
            if case_id not in cohort:
                continue
            recorded = str(cohort_patient[case_id])
            if patient_id != recorded:
                problems.append(
                    Problem(
                        case_id, where, f"patient_id {patient_id!r} disagrees with the cohort metadata ({recorded!r})"
                    )
                )
            if int(synthetic[case_id]) == 1 and split != "train":
                problems.append(
                    Problem(
                        case_id, where, f"synthetic case in split {split!r}: synthetic cases are training data only"
                    )
                )
        # The cohort's patient ids are authoritative for the disjointness check.
        patients = pd.Series(
            [str(cohort_patient[c]) if c in cohort else p for c, p in zip(table["case_id"], patients)],
            index=table.index,
        )
    for patient_id, splits in patient_overlaps(pd.DataFrame({"patient_id": patients, "split": table["split"]})).items():
        cases = table.loc[patients == patient_id, ["case_id", "split"]]
        listing = ", ".join(f"{c} ({s})" for c, s in zip(cases["case_id"], cases["split"]))
        problems.append(Problem(patient_id, where, f"patient in {len(splits)} splits {splits}: {listing}"))
    return problems


def patient_overlaps(table: pd.DataFrame) -> dict[str, list[str]]:
    """Patients whose cases fall in more than one split: ``{patient_id: sorted splits}``."""
    splits_per_patient = table.groupby("patient_id")["split"].agg(lambda s: sorted(set(s)))
    return {patient: splits for patient, splits in splits_per_patient.items() if len(splits) > 1}


def _read_split_csv(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise SplitError([Problem("<split>", str(path), "split file does not exist")], path)
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (ValueError, OSError) as error:
        raise SplitError([Problem("<split>", str(path), f"cannot read CSV: {error}")], path) from error
    return table.apply(lambda column: column.str.strip())


def load_split(path: Path | str, cohort: Cohort | None = None, check: bool = True) -> pd.DataFrame:
    """Read a split CSV: the one split reader of the project.

    Args:
        path: the split CSV (``case_id,patient_id,split``).
        cohort: when given (and ``check``), every case must be in it with the same patient id.
        check: raise :class:`SplitError` listing every problem (:func:`split_problems`). With
            ``False`` only ``case_id`` and ``split`` must be present; the table comes back as
            strings with every column, for tools whose job is to report the problems (the audit).
    """
    path = Path(path)
    table = _read_split_csv(path)
    if not check:
        missing = [c for c in ("case_id", "split") if c not in table.columns]
        if missing:
            raise SplitError([Problem("<header>", str(path), f"required column(s) {missing} missing")], path)
        return table
    problems = split_problems(table, cohort, path)
    if problems:
        raise SplitError(problems, path)
    return table[list(SPLIT_COLUMNS)].reset_index(drop=True)


def write_split(table: pd.DataFrame, path: Path | str, force: bool = False) -> Path:
    """Write a split once (atomically). An existing file is kept unless ``force``.

    Raises:
        SplitExistsError: the file exists and ``force`` is false.
        SplitError: the table is not a sound split (e.g. a patient in two splits).
    """
    path = Path(path)
    if path.exists() and not force:
        raise SplitExistsError(
            f"split {path} already exists; splits are written once and then only read "
            "(pass force=True / --force to replace it, which changes every result that used it)"
        )
    table = table[list(SPLIT_COLUMNS)].astype(str)
    problems = split_problems(table, None, path)
    if problems:
        raise SplitError(problems, path)
    atomic_write_csv(table, path)
    return path


def split_sha256(path: Path | str) -> str:
    """The sha256 of a split file, which identifies it in MLflow (``docs/explanation/data.md "Split files"``)."""
    return file_sha256(path)


def split_summary(table: pd.DataFrame, metadata: pd.DataFrame) -> pd.DataFrame:
    """Cases, patients, tumor positives and cases per phase for each split."""
    joined = table.merge(metadata[["case_id", "tumor", "phase"]], on="case_id", how="left")
    rows = []
    for split in SPLITS:
        part = joined[joined["split"] == split]
        row = {
            "split": split,
            "cases": len(part),
            "patients": part["patient_id"].nunique(),
            "positives": int((part["tumor"] == 1).sum()),
        }
        row.update({f"phase:{phase}": int(n) for phase, n in part["phase"].value_counts().sort_index().items()})
        rows.append(row)
    return pd.DataFrame(rows).fillna(0)


@dataclass(frozen=True)
class WrittenSplit:
    """A split written by :func:`write_cohort_split`, with what ``benchx make-splits`` reports."""

    path: Path
    table: pd.DataFrame
    summary: pd.DataFrame
    sha256: str
    synthetic_left_out: int


def write_cohort_split(
    root: Path | str,
    out: Path | str,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    tumor_class: str = "pancreatic_lesion",
    force: bool = False,
) -> WrittenSplit:
    """Split a cohort on disk and write the split once (what ``benchx make-splits`` runs).

    Strata use the label training will see: the ``tumor`` column, derived from ``tumor_class``'s
    mask where it is empty.

    Raises:
        CohortError: the cohort cannot be read.
        SplitSettingError / SplitExistsError / SplitError: see :func:`make_splits` and :func:`write_split`.
    """
    cohort = load_cohort(root)
    metadata = cohort.metadata.copy()
    metadata["tumor"] = cohort.resolve_tumor_labels(tumor_class).to_numpy()
    table = make_splits(metadata, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)
    path = write_split(table, out, force=force)
    skipped = int((metadata["synthetic"] == 1).sum())
    return WrittenSplit(path, table, split_summary(table, metadata), split_sha256(path), skipped)
