"""The audit run: the three layers over a cohort and its split, the report files, and MLflow logging.

:func:`audit` runs every layer and writes ``audit_findings.csv``, ``audit_thresholds.csv``,
``audit_best_matches.csv``, ``audit_header_importance.csv`` and ``audit_summary.md``;
:func:`check_split_leakage` is the fast path training uses (patients and duplicates, no classifier).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from lightning_modules.cohorts.audit.duplicates import (
    CATEGORIES,
    DEFAULT_THRESHOLD,
    MAX_CANDIDATES,
    THRESHOLDS,
    WITHIN_TRAIN,
    duplicate_findings,
    duplicate_pairs,
    threshold_table,
)
from lightning_modules.cohorts.audit.findings import Finding
from lightning_modules.cohorts.audit.header import HeaderLeakage, header_leakage
from lightning_modules.cohorts.audit.patients import audited_cases, generator_findings, patient_findings
from lightning_modules.cohorts.audit.volumes import CONFIRM_SIZE, SIGNATURE_SIZE, AuditedVolume, read_volumes
from lightning_modules.data.cohort import Cohort, load_cohort
from lightning_modules.data.splits import SPLITS, load_split, split_sha256


@dataclass(frozen=True)
class AuditSettings:
    """How the audit judges and reads.

    Args:
        threshold: NCC at or above which a pair is a near duplicate.
        thresholds: NCC values the counts are also reported for.
        lesion_class: the mask that defines an unrecorded tumor label.
        header_min_balanced_accuracy: balanced accuracy above which header cues are flagged.
        alpha: significance level of the header classifier's permutation test.
        seed: classifier and permutation seed.
        coarse_size / fine_size: edge of the screening and confirming grids.
        workers: reader threads (default: up to 4).
    """

    threshold: float = DEFAULT_THRESHOLD
    thresholds: Sequence[float] = THRESHOLDS
    lesion_class: str = "pancreatic_lesion"
    header_min_balanced_accuracy: float = 0.65
    alpha: float = 0.05
    seed: int = 0
    coarse_size: int = SIGNATURE_SIZE
    fine_size: int = CONFIRM_SIZE
    workers: int | None = None


@dataclass
class AuditReport:
    """Everything the audit found, the metrics it logs and the files it wrote."""

    findings: list[Finding]
    metrics: dict[str, float]
    threshold_counts: pd.DataFrame
    best_matches: pd.DataFrame
    header: HeaderLeakage
    summary: str
    files: dict[str, Path] = field(default_factory=dict)
    split_sha256: str = ""  # the audited split's hash ("" for a table given in memory)
    threshold: float = 0.0  # the similarity threshold the findings used

    @property
    def leaks(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "leak"]

    @property
    def leakage_found(self) -> bool:
        return bool(self.leaks)


# ----------------------------------------------------------------------------------------------
# Reading the cohort and its split once, and the two fast layers.


def _as_cohort(cohort: Cohort | Path | str) -> Cohort:
    return cohort if isinstance(cohort, Cohort) else load_cohort(cohort)


def _as_split(split: pd.DataFrame | Path | str) -> tuple[pd.DataFrame, str]:
    """The split table, read leniently (reporting its problems is the audit's job), and its sha256."""
    if isinstance(split, pd.DataFrame):
        return split.astype(str), ""
    return load_split(split, check=False), split_sha256(split)


@dataclass
class _Scan:
    """The audited cases (readable ones), their volumes, the duplicate pairs and the findings so far."""

    cohort: Cohort
    cases: pd.DataFrame
    volumes: list[AuditedVolume]
    pairs: pd.DataFrame
    best: pd.DataFrame
    findings: list[Finding]
    digest: str


def _scan(cohort, split, synthetic_cohorts, settings: AuditSettings, thresholds: Sequence[float]) -> _Scan:
    cohort = _as_cohort(cohort)
    synthetic_cohorts = [_as_cohort(c) for c in synthetic_cohorts]
    split_table, digest = _as_split(split)
    cases, findings = audited_cases(cohort, split_table, synthetic_cohorts)
    findings += patient_findings(cohort, cases)
    findings += generator_findings(synthetic_cohorts, split_table, digest)
    volumes = read_volumes(
        [cohort, *synthetic_cohorts], cases, settings.lesion_class, settings.coarse_size, settings.fine_size,
        settings.workers,
    )  # fmt: skip
    for volume in volumes:
        if volume.error:
            detail = f"{volume.error}; not compared (run benchx validate)"
            findings.append(Finding("duplicates", "unreadable", "warning", volume.case_id, detail=detail))
    readable = np.array([not v.error for v in volumes], dtype=bool)
    cases = cases[readable].reset_index(drop=True)
    volumes = [v for v in volumes if not v.error]
    lowest = min([settings.threshold, *thresholds])
    pairs, best, unconfirmed = duplicate_pairs(volumes, cases["split"], cases["synthetic"], lowest)
    if unconfirmed:
        detail = (
            f"{unconfirmed} screened pair(s) beyond the {MAX_CANDIDATES} most similar were not "
            "confirmed: the cohort is very homogeneous on the coarse grid"
        )
        findings.append(Finding("duplicates", "screen_truncated", "warning", detail=detail))
    findings += duplicate_findings(pairs, cases, settings.threshold)
    return _Scan(cohort, cases, volumes, pairs, best, findings, digest)


def check_split_leakage(
    cohort: Cohort | Path | str,
    split: pd.DataFrame | Path | str,
    threshold: float = DEFAULT_THRESHOLD,
    synthetic_cohorts: Sequence[Cohort | Path | str] = (),
    lesion_class: str = "pancreatic_lesion",
    workers: int | None = None,
) -> list[str]:
    """The patient and duplicate layers only (no classifier): one message per leak, empty when clean.

    Training calls this and refuses to start on a non-empty answer unless ``data.allow_leakage``.
    """
    settings = AuditSettings(threshold=threshold, lesion_class=lesion_class, workers=workers)
    scan = _scan(cohort, split, synthetic_cohorts, settings, (threshold,))
    return [str(f) for f in scan.findings if f.severity == "leak"]


# ----------------------------------------------------------------------------------------------
# The full audit.


def audit(
    cohort: Cohort | Path | str,
    split: pd.DataFrame | Path | str,
    out_dir: Path | str,
    settings: AuditSettings | None = None,
    synthetic_cohorts: Sequence[Cohort | Path | str] = (),
    **setting_values,
) -> AuditReport:
    """Run the three audit layers and write the findings and a summary (the audit workflow logs
    them to MLflow: :func:`lightning_modules.tracking.audit.log_audit`).

    Args:
        cohort: the cohort (or its folder).
        split: the split table or CSV; read leniently, since reporting its problems is the point.
        out_dir: where the report files are written (module docstring).
        settings: thresholds, seed and readers (:class:`AuditSettings`); single values may also be
            given as keywords (``threshold=0.99``), which replace those of ``settings``.
        synthetic_cohorts: SynthX output cohorts whose synthetic cases are training data to check.
    """
    settings = AuditSettings(**{**asdict(settings or AuditSettings()), **setting_values})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # 1. Patients and duplicates.
    scan = _scan(cohort, split, synthetic_cohorts, settings, settings.thresholds)
    # 2. Source / header cues, on the real cases.
    header = _header_layer(scan, settings)
    findings = scan.findings + _header_findings(header)
    # 3. Tables, metrics and the summary.
    table = threshold_table(scan.pairs, scan.cases, settings.thresholds)
    best_matches = _best_match_table(scan)
    metrics = _metrics(findings, scan.pairs, table, header, settings.threshold)
    summary = _summary(scan.cohort, scan.cases, findings, table, header, metrics, settings.threshold, scan.digest)
    # 4. Files.
    files = _write_files(out_dir, findings, table, best_matches, header, summary)
    return AuditReport(findings, metrics, table, best_matches, header, summary, files, scan.digest, settings.threshold)


def _header_layer(scan: _Scan, settings: AuditSettings) -> HeaderLeakage:
    real = (scan.cases["synthetic"] == 0).to_numpy()
    if not real.any():
        return HeaderLeakage(skipped="no real cases to audit")
    features = pd.DataFrame([v.features for v in scan.volumes], index=scan.cases.index)
    labels = pd.Series([v.tumor for v in scan.volumes], index=scan.cases.index)
    return header_leakage(
        features[real], labels[real], scan.cases.loc[real, "split"], settings.seed,
        settings.header_min_balanced_accuracy, settings.alpha,
    )  # fmt: skip


def _header_findings(header: HeaderLeakage) -> list[Finding]:
    if header.skipped:
        return [Finding("source", "header_classifier_skipped", "info", detail=header.skipped)]
    if not header.flagged:
        return []
    detail = (
        f"acquisition metadata alone predicts the tumor label on {header.evaluated_on}: "
        f"balanced accuracy {header.balanced_accuracy:.3f} (p={header.p_value:.4f}); "
        f"carried by {', '.join(header.carrying)}"
    )
    return [Finding("source", "header_predicts_label", "warning", value=header.balanced_accuracy, detail=detail)]


def _best_match_table(scan: _Scan) -> pd.DataFrame:
    i, best_j = scan.best["i"].to_numpy(int), scan.best["best_j"].to_numpy(int)
    case_ids, splits = scan.cases["case_id"].to_numpy(), scan.cases["split"].to_numpy()
    return pd.DataFrame({
        "case_id": case_ids[i],
        "split": splits[i],
        "best_train_case": case_ids[best_j],
        "coarse_ncc": scan.best["coarse_ncc"].to_numpy(float),
        "ncc": scan.best["ncc"].to_numpy(float),
    })  # fmt: skip


def _write_files(out_dir: Path, findings, table, best_matches, header, summary) -> dict[str, Path]:
    files = {
        "findings": out_dir / "audit_findings.csv",
        "thresholds": out_dir / "audit_thresholds.csv",
        "best_matches": out_dir / "audit_best_matches.csv",
        "header_importance": out_dir / "audit_header_importance.csv",
        "summary": out_dir / "audit_summary.md",
    }
    finding_columns = list(Finding.__dataclass_fields__)
    pd.DataFrame([asdict(f) for f in findings], columns=finding_columns).to_csv(files["findings"], index=False)
    table.to_csv(files["thresholds"], index=False)
    best_matches.to_csv(files["best_matches"], index=False)
    header.importances.to_csv(files["header_importance"], index=False)
    files["summary"].write_text(summary)
    return files


def _metrics(findings, pairs, table, header, threshold) -> dict[str, float]:
    within_train = pairs["category"] == WITHIN_TRAIN
    hit = (pairs["ncc"] >= threshold) | pairs["exact"]
    synthetic_leaks = [f for f in findings if f.kind.startswith("synthetic_") and f.severity == "leak"]
    metrics = {
        "audit/exact_duplicates": float((pairs["exact"] & ~within_train).sum()),
        "audit/near_duplicates": float((hit & ~within_train).sum()),
        "audit/within_train_duplicates": float((hit & within_train).sum()),
        "audit/within_train_same_patient": float(
            sum(f.layer == "duplicates" and f.severity == "info" for f in findings)
        ),
        "audit/patient_overlaps": float(sum(f.kind == "patient_overlap" for f in findings)),
        "audit/synthetic_source_leaks": float(len(synthetic_leaks)),
        "audit/leaks": float(sum(f.severity == "leak" for f in findings)),
        "audit/warnings": float(sum(f.severity == "warning" for f in findings)),
    }
    for values in table.to_dict("records"):
        for category in CATEGORIES:
            metrics[f"audit/near_duplicates/{category}/t{values['threshold']:g}"] = float(values[f"pairs:{category}"])
        for split in ("val", "test"):
            metrics[f"audit/leaked_cases/{split}/t{values['threshold']:g}"] = float(values[f"leaked_cases:{split}"])
    if not header.skipped:
        metrics["audit/header_balanced_accuracy"] = header.balanced_accuracy
        metrics["audit/header_p_value"] = header.p_value
    return metrics


def _summary(cohort, cases, findings, table, header, metrics, threshold, digest) -> str:
    counts = cases.groupby("split")["case_id"].count().reindex(list(SPLITS), fill_value=0)
    lines = [
        "# Leakage audit",
        "",
        f"- cohort: `{cohort.root}` ({len(cohort)} cases); split sha256: `{digest or 'in-memory table'}`",
        "- audited cases: "
        + ", ".join(f"{s} {n}" for s, n in counts.items())
        + f" (synthetic {int(cases['synthetic'].sum())})",
        f"- verdict: **{'LEAKAGE FOUND' if metrics['audit/leaks'] else 'no leakage found'}** "
        f"({int(metrics['audit/leaks'])} leak(s), {int(metrics['audit/warnings'])} warning(s))",
        "",
        "## 1. Duplicates",
        "",
        f"Exact duplicates across splits: {int(metrics['audit/exact_duplicates'])}; "
        f"near duplicates (NCC >= {threshold}) across splits: {int(metrics['audit/near_duplicates'])}; "
        f"within train: {int(metrics['audit/within_train_duplicates'])} "
        f"({int(metrics['audit/within_train_same_patient'])} of them two scans of one patient).",
        "",
        (
            table.to_markdown(index=False, floatfmt=".3g")
            if _has_tabulate()
            else "```\n" + table.to_string(index=False) + "\n```"
        ),
        "",
        "## 2. Patients",
        "",
    ]
    patient_lines = [f"- {f}" for f in findings if f.layer == "patients"]
    lines += patient_lines or ["- no patient in two splits; every synthetic canvas is a training case."]
    lines += ["", "## 3. Source / header cues", ""]
    if header.skipped:
        lines.append(f"- classifier not run: {header.skipped}")
    else:
        verdict = "WARNING: above chance" if header.flagged else "not distinguishable from chance at this threshold"
        lines.append(
            f"- gradient-boosted trees on acquisition metadata, fitted on {header.n_train} training cases, scored on "
            f"{header.n_eval} {header.evaluated_on} cases: balanced accuracy {header.balanced_accuracy:.3f}, "
            f"permutation p = {header.p_value:.4f} ({verdict})"
        )
        if header.flagged:
            lines.append(f"- features carrying it: {', '.join(header.carrying)}")
    leak_lines = [f"- {f}" for f in findings if f.layer == "duplicates"]
    if leak_lines:
        lines += ["", "## Duplicate pairs", "", *leak_lines]
    return "\n".join(lines) + "\n"


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401  (pandas' to_markdown needs it)
    except ImportError:
        return False
    return True
