"""Writing a phantom cohort in layout A (atomic, resumable, deterministic) and summarizing it."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Sequence

import pandas as pd
from threadpoolctl import threadpool_limits

from lightning_modules.data.cohort import CT_FILE, SEGMENTATION_DIR, write_case, write_metadata
from lightning_modules.data.metadata import PHASES, normalize_metadata
from lightning_modules.infrastructure.files import atomic_write_bytes
from lightning_modules.cohorts.phantom.plan import (
    CASE_ID_PREFIX,
    DEFAULT_CASES,
    ScanPlan,
    _check_count_and_seed,
    _check_shape_and_spacing,
    metadata_table,
    plan_phantom_cohort,
)
from lightning_modules.cohorts.phantom.render import render_scan
from lightning_modules.infrastructure.run_folder import LOCK_FILE, RunFolderLock

# Bump when the rendering changes, so a rerun into an older cohort refuses to mix the two.
PHANTOM_VERSION = 4
PARAMS_FILE = "phantom.json"


def _case_is_complete(case_dir: Path, plan: ScanPlan) -> bool:
    segmentation_dir = case_dir / SEGMENTATION_DIR
    if not (case_dir / CT_FILE).is_file() or not segmentation_dir.is_dir():
        return False
    present = {p.name for p in segmentation_dir.iterdir() if p.is_file()}
    return present == plan.expected_mask_files()


_CASE_FOLDER = re.compile(rf"^{CASE_ID_PREFIX}\d{{4,}}$")
# Below this many cases per worker, starting worker processes (about 2 s each) costs more than it saves.
_CASES_PER_WORKER = 16


def _check_workers(workers: int | None) -> None:
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be a positive integer or None (one per CPU), got {workers!r}")


def _worker_count(workers: int | None, n_cases: int) -> int:
    """Processes for ``n_cases``: ``workers`` (checked already), or one per available CPU with at least
    :data:`_CASES_PER_WORKER` cases each."""
    if workers is not None:
        return min(workers, max(n_cases, 1))
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(available, n_cases // _CASES_PER_WORKER))


def _render_and_write(out: Path, plan: ScanPlan, shape: tuple[int, ...], spacing: tuple[float, ...], seed: int) -> None:
    try:
        scan = render_scan(plan, shape, spacing, seed)
        write_case(out, plan.case_id, scan.ct, scan.affine, scan.masks)
    except Exception as error:  # in a worker process too: the message names the case
        raise RuntimeError(f"{plan.case_id}: rendering or writing the phantom case failed: {error}") from error


def _single_threaded() -> None:
    threadpool_limits(limits=1)


def _render_cases(out: Path, plans: list[ScanPlan], shape, spacing, seed: int, workers: int) -> None:
    """Render and write ``plans``, in ``workers`` processes when more than one.

    Each case draws from its own random streams and is written atomically to its own folder, so
    the files do not depend on the order or the number of workers. On an error the cases already
    written stay (a rerun keeps them) and the ones not started are cancelled.

    BLAS runs single-threaded: its threads cost more than they give on these small matrix products
    (64 cases at the main job's size on 2 cores: 15.6 s with BLAS threads, 13.4 s without, 9.8 s in
    two single-threaded workers), and with one thread the sums, so the files, do not depend on the
    machine's core count (with multi-threaded BLAS, 4 of 64 scans had one voxel 1 HU apart).
    """
    if workers <= 1:
        with threadpool_limits(limits=1):
            for plan in plans:
                _render_and_write(out, plan, shape, spacing, seed)
        return
    # Spawned, not forked: the caller may hold threads (torch, MLflow) that a fork would copy mid-state.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_single_threaded) as pool:
        futures = [pool.submit(_render_and_write, out, plan, shape, spacing, seed) for plan in plans]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def generate_phantom_cohort(
    out: str | Path,
    n_cases: int = DEFAULT_CASES,
    seed: int = 0,
    shape: Sequence[int] = (96, 96, 64),
    spacing: Sequence[float] = (2.5, 2.5, 3.0),
    overwrite: bool = False,
    workers: int | None = None,
) -> pd.DataFrame:
    """Write a phantom cohort in layout A and return its metadata table.

    Case folders are written atomically (:func:`lightning_modules.data.cohort.write_case`) and
    ``metadata.csv`` last. A rerun skips complete case folders, so an interrupted run resumes, and
    a larger ``n_cases`` extends a cohort; the result is byte-identical to a fresh run. The
    parameters are kept in ``phantom.json`` so a rerun with different ones is refused.

    Args:
        out: the cohort folder (created when missing; must be empty or hold a phantom cohort).
        n_cases: number of scans.
        seed: non-negative integer seed.
        shape: volume shape in voxels (x, y, z), each at least 16.
        spacing: voxel spacing in mm (x, y, z).
        overwrite: rewrite every case, replace a phantom cohort made with other parameters, and
            remove phantom case folders beyond ``n_cases``.
        workers: processes that render cases; None: one per available CPU, fewer for a small
            cohort (at least 16 cases each). The files are identical for any number.

    Returns:
        The metadata table as written; ``attrs["written"]`` and ``attrs["kept"]`` count the case
        folders rendered now and those kept from an earlier run.
    """
    _check_count_and_seed(n_cases, seed)
    _check_shape_and_spacing(shape, spacing)
    _check_workers(workers)
    shape = tuple(int(n) for n in shape)
    spacing = tuple(float(s) for s in spacing)
    out = Path(out)
    params = {"generator": __name__, "version": PHANTOM_VERSION, "seed": int(seed), "shape": list(shape),
              "spacing": list(spacing)}
    params_path = out / PARAMS_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(p.name not in (LOCK_FILE, f"{LOCK_FILE}.guard") for p in out.iterdir()):
        if not params_path.is_file():
            raise ValueError(
                f"{out}: folder is not empty and holds no {PARAMS_FILE}, so it is not a phantom cohort; "
                "refusing to write into it (choose an empty or new folder)"
            )
        try:
            existing = json.loads(params_path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{params_path}: unreadable phantom parameters ({error})") from error
        if existing != params and not overwrite:
            raise ValueError(
                f"{out}: holds a phantom cohort made with {existing}, not {params}; "
                "pass overwrite=True (--overwrite) to replace it"
            )
    # One writer per cohort folder (a second one is refused, naming this one).
    with RunFolderLock(out, "benchx phantom") as lock:
        if lock.takeover_note:
            print(lock.takeover_note)
        _remove_staging_leftovers(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(params_path, (json.dumps(params, indent=2) + "\n").encode())

        plans = plan_phantom_cohort(n_cases, seed)
        todo = [plan for plan in plans if overwrite or not _case_is_complete(out / plan.case_id, plan)]
        kept, written = len(plans) - len(todo), len(todo)
        _render_cases(out, todo, shape, spacing, seed, _worker_count(workers, len(todo)))
        if overwrite:
            wanted = {plan.case_id for plan in plans}
            for folder in out.iterdir():
                if folder.is_dir() and _CASE_FOLDER.match(folder.name) and folder.name not in wanted:
                    shutil.rmtree(folder)

        table = metadata_table(plans, shape, spacing)
        write_metadata(out, table)
    table.attrs["written"] = written
    table.attrs["kept"] = kept
    return table


def _remove_staging_leftovers(out: Path) -> None:
    """Hidden staging folders of cases (``.PH0001.<random>``) that a killed run left half written."""
    for path in out.iterdir():
        if path.is_dir() and path.name.startswith(".") and _CASE_FOLDER.match(path.name[1:].split(".")[0]):
            shutil.rmtree(path, ignore_errors=True)


def folder_size_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _counts(series: pd.Series, order: Sequence[str] = ()) -> str:
    counts = series.value_counts()
    keys = [k for k in order if k in counts.index] + sorted(k for k in counts.index if k not in order)
    return ", ".join(f"{key} {int(counts[key])}" for key in keys)


def summarize(table: pd.DataFrame) -> str:
    """A short text summary of a phantom metadata table: size, positives, subgroup counts."""
    normalized, _ = normalize_metadata(table.astype(object).where(table.notna(), ""))
    n = len(normalized)
    positives = int((normalized["tumor"] == 1).sum())
    small = int((table["tumor_diameter_mm"] <= 20).sum())
    patients = normalized["patient_id"].nunique()
    lines = [
        f"cases {n} from {patients} patients; pancreatic tumor positives {positives} ({100 * positives / n:.0f}%), "
        f"{small} small (<= 20 mm)",
        f"  phase:    {_counts(normalized['phase'], PHASES)}",
        f"  age band: {_counts(normalized['age_band'], ('le20', '20-40', '40-60', '60-80', 'gt80'))}",
        f"  sex:      {_counts(normalized['sex'], ('F', 'M'))}",
        f"  race:     {_counts(normalized['race'])}",
        f"  cohort:   {_counts(normalized['cohort'])}",
    ]
    return "\n".join(lines)

