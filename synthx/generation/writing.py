"""Writing the synthetic cohort: metadata, the settings manifest, completeness checks, quarantine, the MLflow summary.

A case is written with :func:`lightning_modules.data.cohort.write_case` (atomic) and then its row
into ``metadata.csv`` (rewritten atomically), so a kill leaves every case complete or absent. The
generation settings are kept in ``synthx_generation.json``; a rerun with other settings is
refused. A case that fails is kept aside under ``.quarantine/<case_id>.json`` (with its earlier,
incomplete folder, if any).

Example::

    check_manifest(out_root, settings)
    rows = read_existing_rows(out_root)
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from pathlib import Path
from typing import Mapping, Sequence

import nibabel as nib
import numpy as np
import pandas as pd

from lightning_modules.data.cohort import CT_FILE, METADATA_FILE, SEGMENTATION_DIR
from lightning_modules.data.metadata import STANDARD_COLUMNS
from lightning_modules.infrastructure.files import atomic_write_bytes
from lightning_modules.infrastructure.recording import RunRecorder
from synthx.generation.canvases import LESION_CLASS, ORGAN_CLASS, GenerationError, SynthesisRequest
from synthx.generation.cells import CELL_COLUMNS

MANIFEST_FILE = "synthx_generation.json"
QUARANTINE_DIR = ".quarantine"
# Settings that change what a case id produces: a rerun into the same folder must repeat them.
MANIFEST_KEYS = (
    "seed",
    "pipeline",
    "generator_run_id",
    "generator_split_sha256",
    "scheduler",
    "num_inference_steps",
    "guidance_scale",
    "size_classes",
    "erosion_mm",
    "cohort_root",
    "split_sha256",
    "copy_paste",
)


def metadata_table(rows: Mapping[str, dict]) -> pd.DataFrame:
    table = pd.DataFrame([rows[k] for k in sorted(rows)])
    ordered = [c for c in STANDARD_COLUMNS if c in table.columns]
    return table[ordered + [c for c in table.columns if c not in ordered]]


def read_existing_rows(out_root: Path) -> dict[str, dict]:
    path = out_root / METADATA_FILE
    if not path.exists():
        return {}
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    if "case_id" not in table.columns or "synthx_request" not in table.columns:
        raise GenerationError(f"{path} exists but was not written by SynthX generation (no case_id/synthx_request column)")
    real = table[table["synthetic"] != "1"] if "synthetic" in table.columns else table
    if len(real):
        raise GenerationError(f"{path}: case {real.iloc[0]['case_id']} is not synthetic; write synthetic cases to their own folder")
    return {row["case_id"]: row for row in table.to_dict("records")}


def case_is_complete(out_root: Path, case_id: str, row: Mapping, request: SynthesisRequest) -> bool:
    """A case counts as done when its metadata row matches the request and its files are all present and readable."""
    if str(row.get("synthx_request", "")) != request.key:
        return False
    folder = out_root / case_id
    ct_path = folder / CT_FILE
    lesion = folder / SEGMENTATION_DIR / f"{LESION_CLASS}.nii.gz"
    organ = folder / SEGMENTATION_DIR / f"{ORGAN_CLASS}.nii.gz"
    if not (ct_path.is_file() and lesion.is_file() and organ.is_file()):
        return False
    try:
        shape = nib.load(ct_path).shape
        return all(nib.load(p).shape == shape for p in (folder / SEGMENTATION_DIR).glob("*.nii.gz"))
    except Exception:  # an unreadable header means the case must be made again
        return False


def check_manifest(out_root: Path, settings: dict) -> None:
    path = out_root / MANIFEST_FILE
    if path.exists():
        previous = json.loads(path.read_text())
        changed = [k for k in MANIFEST_KEYS if previous.get(k) != settings.get(k)]
        if changed:
            details = "; ".join(f"{k}: {previous.get(k)!r} before, {settings.get(k)!r} now" for k in changed)
            raise GenerationError(
                f"{out_root} was generated with other settings ({details}); resume with the same settings or write to a new --out"
            )
        return
    atomic_write_bytes(path, json.dumps(settings, indent=2).encode())


def remove_stale_staging(out_root: Path) -> None:
    """Hidden staging folders a killed ``write_case`` left behind (``.SX<seed>_...``) hold nothing valid."""
    for path in out_root.glob(".SX*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def quarantine(out_root: Path, case_id: str, request: SynthesisRequest, error: BaseException) -> None:
    """Keep the error (and an earlier, incomplete folder of the case) under ``.quarantine``, out of the cohort."""
    folder = out_root / case_id
    if folder.exists():
        kept = out_root / QUARANTINE_DIR / f"{case_id}.incomplete"
        shutil.rmtree(kept, ignore_errors=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder, kept)
    record = {
        "case_id": case_id,
        "request": request.key,
        "error": f"{type(error).__name__}: {error}",
        "traceback": traceback.format_exception(type(error), error, error.__traceback__),
    }
    atomic_write_bytes(out_root / QUARANTINE_DIR / f"{case_id}.json", json.dumps(record, indent=2).encode())


def clear_quarantine(out_root: Path, case_id: str) -> None:
    path = out_root / QUARANTINE_DIR / f"{case_id}.json"
    if path.exists():
        path.unlink()


def per_cell_table(
    requests: Sequence[SynthesisRequest], status: Mapping[str, str], unfillable: pd.DataFrame, seed: int
) -> pd.DataFrame:
    """Requested, generated, skipped, failed, pending and unfillable cases per cell.

    Args:
        requests: the fillable requests.
        status: case id -> ``generated`` | ``skipped`` | ``failed`` (others are pending).
        unfillable: cells without a canvas (``sex, age_band, phase, requested``).
        seed: the generation seed (case ids depend on it).
    """
    counts = ("requested", "generated", "skipped", "failed", "pending", "unfillable")
    rows: dict[tuple[str, str, str], dict] = {}
    for request in requests:
        row = rows.setdefault(request.cell, dict(zip(CELL_COLUMNS, request.cell), **dict.fromkeys(counts, 0)))
        row["requested"] += 1
        row[status.get(request.case_id(seed), "pending")] += 1
    for cell in unfillable.to_dict("records"):
        key = tuple(cell[c] for c in CELL_COLUMNS)
        row = rows.setdefault(key, dict(zip(CELL_COLUMNS, key), **dict.fromkeys(counts, 0)))
        row["requested"] += int(cell["requested"])
        row["unfillable"] += int(cell["requested"])
    return pd.DataFrame(list(rows.values()), columns=[*CELL_COLUMNS, *counts])


def log_summary(recorder: RunRecorder, summary, rows: Mapping[str, dict]) -> None:
    """The generation run's tables (per cell, unfillable cells, metadata, failures), counts and lineage tags."""
    recorder.log_table(summary.per_cell, "synthx/per_cell.csv", ui=True)
    recorder.log_table(summary.unfillable, "synthx/unfillable.csv")
    if rows:
        recorder.log_table(metadata_table(rows), "synthx/metadata.csv")
    if summary.failed:
        recorder.log_dict(summary.failed, "synthx/failed.json")
    metrics = {
        "synthx/cases_requested": summary.requested,
        "synthx/cases_generated": len(summary.generated),
        "synthx/cases_skipped": len(summary.skipped),
        "synthx/cases_failed": len(summary.failed),
        "synthx/cases_pending": summary.not_reached,
        "synthx/cases_unfillable": summary.unfillable_cases,
        "synthx/cells_unfillable": len(summary.unfillable),
    }
    if np.isfinite(summary.seconds_per_case):
        metrics["synthx/seconds_per_case"] = summary.seconds_per_case
    recorder.log_metrics({key: float(value) for key, value in metrics.items()})
    recorder.set_tags({"generator_run_id": summary.generator_run_id})
