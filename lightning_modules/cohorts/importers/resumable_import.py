"""The import engine shared by every source format: resumable writes and quarantine.

A source module (``nifti``, ``dicom``) lists its cases as :class:`SourceCase` objects whose ``load``
reads one case into a :class:`LoadedCase` (CT in HU on its own grid, binary masks by AbdomenAtlas
class name, metadata it found). :func:`run_import` writes them into a cohort in layout A
(``docs/explanation/data.md "Cohorts on disk"``) with :func:`lightning_modules.data.cohort.write_case`, which assembles each case in
a hidden folder and renames it into place, so a case is complete or absent:

- a case already on disk whose files check out and that has a ``metadata.csv`` row is skipped, so a
  rerun after a kill only does the remainder;
- a case that fails is listed in ``<out>/quarantine.csv`` (case id, source, reason) and leaves
  nothing in the cohort; a later run retries it and drops it from the list once it imports;
- ``metadata.csv`` is rewritten atomically after every case, merging rows already there.

Example::

    report = run_import(cases, Path("data/msd_pancreas"))
    print(report.summary())
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import nibabel as nib
from tqdm.auto import tqdm
from nibabel.filebasedimages import ImageFileError

from lightning_modules.cohorts.importers.metadata_rows import _read_rows, _rows_table, build_row
from lightning_modules.cohorts.importers.source_cases import ImportCaseError, ImportSourceError, LoadedCase, SourceCase
from lightning_modules.cohorts.importers.volumes import same_grid, spacing_text
from lightning_modules.data.cohort import CT_FILE, METADATA_FILE, SEGMENTATION_DIR, write_case, write_metadata
from lightning_modules.data.validation import show_progress
from lightning_modules.infrastructure.files import atomic_write_csv
from lightning_modules.infrastructure.run_folder import LOCK_FILE, RunFolderLock

logger = logging.getLogger("lightning_modules.cohorts.importers")

QUARANTINE_FILE = "quarantine.csv"
QUARANTINE_COLUMNS = ("case_id", "source", "reason")


@dataclass
class ImportReport:
    """What one import run did."""

    out: Path
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        text = (
            f"{self.out}: {len(self.imported)} imported, {len(self.skipped)} already complete (skipped), "
            f"{len(self.quarantined)} quarantined"
        )
        if self.quarantined:
            text += f" (reasons in {self.out / QUARANTINE_FILE})"
        return text


def case_is_complete(out: Path, case_id: str, expected_classes: Iterable[str]) -> bool:
    """True when a case folder from an earlier run has its CT and every expected mask on the CT's grid.

    Headers only: write_case renames a case into place whole, so a folder that exists holds
    complete files; what can differ is a changed class map or a foreign folder of the same name.
    """
    case_dir = out / case_id
    try:
        ct = nib.load(str(case_dir / CT_FILE))
        for name in expected_classes:
            mask = nib.load(str(case_dir / SEGMENTATION_DIR / f"{name}.nii.gz"))
            if not same_grid(mask.shape, mask.affine, ct.shape, ct.affine):
                return False
    except (OSError, EOFError, ValueError, ImageFileError):
        return False
    return len(ct.shape) == 3


def _remove_staging_leftovers(out: Path, case_id: str) -> None:
    # A process killed inside write_case leaves its hidden staging folder behind.
    for leftover in out.glob(f".{case_id}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def _validate_case_ids(cases: Sequence[SourceCase]) -> None:
    seen: dict[str, str] = {}
    problems = []
    for case in cases:
        case_id = case.case_id
        if not case_id or "/" in case_id or "\\" in case_id or ".." in case_id or case_id.startswith("."):
            problems.append(f"{case.source}: unsafe case id {case.case_id!r}")
        elif case.case_id in seen:
            problems.append(f"{case.source}: case id {case.case_id!r} also comes from {seen[case.case_id]}")
        else:
            seen[case.case_id] = case.source
    if problems:
        raise ImportSourceError("case ids:\n  - " + "\n  - ".join(problems))


def run_import(
    cases: Sequence[SourceCase],
    out: Path | str,
    metadata_overrides: Mapping[str, Mapping[str, str]] | None = None,
) -> ImportReport:
    """Write every case into ``out`` (layout A), resumably; quarantine the ones that fail.

    A refused import (bad case ids, an unreadable existing ``metadata.csv``) raises before anything
    is written; a folder this run created is removed again when nothing was written into it.

    Args:
        cases: the source's cases (see the ``list_*`` functions of the source modules).
        out: the cohort root; an existing ``metadata.csv`` there is merged, not replaced.
        metadata_overrides: per-case values that replace what the source gives (``--metadata``).
    """
    out = Path(out)
    _validate_case_ids(cases)
    overrides = dict(metadata_overrides or {})
    unused = sorted(set(overrides) - {case.case_id for case in cases})
    if unused:
        logger.warning("metadata overrides for %d case id(s) not in this source are not used: %s", len(unused), unused[:10])
    created = not out.exists()
    report = ImportReport(out=out)
    try:
        # One import per cohort folder at a time (a second one is refused, naming this one).
        with RunFolderLock(out, "benchx import") as lock:
            if lock.takeover_note:
                logger.warning("%s", lock.takeover_note)
            state = _ImportState(out, _read_rows(out / METADATA_FILE), _read_rows(out / QUARANTINE_FILE))
            bar = tqdm(cases, desc="import", unit="case", disable=not show_progress(None))
            for index, case in enumerate(bar, start=1):
                _import_case(case, f"[{index}/{len(cases)}]", state, overrides.get(case.case_id, {}), report)
    finally:
        lock_files = {LOCK_FILE, f"{LOCK_FILE}.guard"}
        if created and out.is_dir() and all(path.name in lock_files for path in out.iterdir()):
            shutil.rmtree(out, ignore_errors=True)
    logger.info("%s", report.summary())
    return report


@dataclass
class _ImportState:
    """The cohort's metadata rows and quarantine entries, rewritten after every case."""

    out: Path
    rows: dict[str, dict[str, object]]
    quarantine: dict[str, dict[str, object]]

    def save(self) -> None:
        # Also rewritten when the last row was dropped (a stale case that now fails).
        if self.rows or (self.out / METADATA_FILE).exists():
            write_metadata(self.out, _rows_table(self.rows, ("case_id",)))
        path = self.out / QUARANTINE_FILE
        if self.quarantine:
            atomic_write_csv(_rows_table(self.quarantine, QUARANTINE_COLUMNS), path)
        elif path.exists():
            path.unlink()


def _import_case(
    case: SourceCase, progress: str, state: _ImportState, overrides: Mapping[str, str], report: ImportReport
) -> None:
    """Skip a complete case, or import it, or quarantine it with its reason; then save the state."""
    out = state.out
    if case.case_id in state.rows and case_is_complete(out, case.case_id, case.expected_classes):
        report.skipped.append(case.case_id)
        if state.quarantine.pop(case.case_id, None) is not None:
            state.save()
        return
    _remove_staging_leftovers(out, case.case_id)
    try:
        loaded, row = _load_and_write(case, out, overrides)
    except Exception as error:  # any failure of one case is reported and quarantined, the run goes on
        expected_error = isinstance(error, (ImportCaseError, ImportSourceError))
        reason = str(error) if expected_error else f"{type(error).__name__}: {error}"
        # A stale, incomplete folder of this case from an earlier run must not stay in the cohort.
        if (out / case.case_id).exists():
            shutil.rmtree(out / case.case_id, ignore_errors=True)
        state.rows.pop(case.case_id, None)
        state.quarantine[case.case_id] = {"case_id": case.case_id, "source": case.source, "reason": reason}
        report.quarantined[case.case_id] = reason
        logger.warning("%s %s quarantined: %s", progress, case.case_id, reason)
        state.save()
        return
    state.rows[case.case_id] = row
    state.quarantine.pop(case.case_id, None)
    report.imported.append(case.case_id)
    logger.info("%s %s imported (%s)", progress, case.case_id, ", ".join(sorted(loaded.masks)) or "image only")
    state.save()


def _load_and_write(case: SourceCase, out: Path, overrides: Mapping[str, str]) -> tuple[LoadedCase, dict]:
    loaded = case.load()
    metadata = {**case.metadata, **loaded.metadata, **overrides}
    row = build_row(case.case_id, metadata, case.source)
    row.setdefault("spacing", spacing_text(loaded.affine))
    missing = sorted(set(case.expected_classes) - set(loaded.masks))
    if missing:
        raise ImportCaseError(f"{case.case_id} ({case.source}): expected mask(s) {missing} were not produced")
    header = nib.Nifti1Header()
    header.set_xyzt_units("mm")
    write_case(out, case.case_id, loaded.ct, loaded.affine, loaded.masks, header=header)
    return loaded, row
