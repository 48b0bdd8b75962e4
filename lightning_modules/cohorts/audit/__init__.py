"""Leakage audit of a cohort and its split: duplicates, patients, and source/header cues (a package).

Three layers, after the three-layer contamination framework (duplicate, patient and source-label
leakage) of the dataset-integrity audit of public brain-tumor MRI benchmarks (University of
Missouri et al.), whose near-duplicate count stays flat from NCC 0.98 to 0.995 on true duplicates:

1. Duplicates. Exact: sha256 of the voxel array cast to little-endian float32 (plus its shape), so
   a copy re-saved under another name, header, dtype or affine still matches. Near: Pearson
   correlation (normalized cross-correlation, NCC) of volumes clipped to the soft-tissue HU window
   and resized to a fixed grid. Every volume is read once; all pairs are screened as chunked
   matrix products of 16^3 signatures (N x 4,096), and candidates are confirmed on 32^3 copies,
   allowing a shift of one cell (a copy re-exported with an offset). Reported across splits
   (train-val, train-test, val-test) and within train, with counts for thresholds 0.95-0.995
   (the paper's flagged count stays flat from 0.98 to 0.995 when the pairs are true duplicates).
2. Patients. A patient in two splits; a metadata table without ``patient_id`` (each case is then
   its own patient, so scans of one person cannot be traced: the audit says so); synthetic cases
   made from a validation/test canvas or from a case outside the split; a synthetic cohort whose
   generator learned from a case that is not a training case of the split (naming the first), or
   whose generator's provenance is unknown.
3. Source/header. Gradient-boosted trees trained on acquisition metadata alone (spacing, shape,
   dtype, file size, scanner, cohort, phase) predict the tumor label on train and are scored on
   test by balanced accuracy. Well above chance (default > 0.65, and p < 0.05 by a label-permutation
   test) is a warning naming the features that carry it (permutation importance): a model could
   learn the site or protocol instead of the tumor.

Findings of severity ``leak`` (cross-split duplicates, patient overlap, synthetic canvases outside
train, a generator that learned from validation/test cases) make ``benchx audit`` exit 1; training refuses to start on them unless
``data.allow_leakage=true`` (:func:`check_split_leakage`, the fast path without the classifier).

Modules: ``volumes`` (one read per CT: hash, signatures, header features), ``duplicates`` (layer 1),
``signatures`` (the training scans' signatures a model carries, matched against the scans it is evaluated on),
``patients`` (layer 2), ``header`` (layer 3), ``findings`` (the finding type), ``report`` (the run,
its files and MLflow logging).

Run::

    benchx audit --root data/phantom --split splits/phantom.csv --out outputs/audit
    benchx audit --root data/phantom --split splits/phantom.csv --out outputs/audit \\
        --tracking-uri sqlite:///mlflow.db --experiment benchx-audit
"""

from __future__ import annotations

from lightning_modules.cohorts.audit.duplicates import (
    CATEGORIES,
    CROSS_SPLIT,
    DEFAULT_THRESHOLD,
    THRESHOLDS,
    WITHIN_TRAIN,
    batched_shifted_ncc,
    duplicate_findings,
    duplicate_pairs,
    shifted_ncc,
    threshold_table,
)
from lightning_modules.cohorts.audit.findings import Finding
from lightning_modules.cohorts.audit.header import HeaderLeakage, header_leakage
from lightning_modules.cohorts.audit.patients import audited_cases, patient_findings
from lightning_modules.cohorts.audit.report import AuditReport, AuditSettings, audit, check_split_leakage
from lightning_modules.cohorts.audit.signatures import ScanMatch, ScanSignatures, duplicate_matches, scan_signatures
from lightning_modules.cohorts.audit.volumes import AuditedVolume, canonical_sha256, volume_signatures

__all__ = [
    "CATEGORIES",
    "CROSS_SPLIT",
    "DEFAULT_THRESHOLD",
    "THRESHOLDS",
    "WITHIN_TRAIN",
    "AuditReport",
    "AuditSettings",
    "AuditedVolume",
    "Finding",
    "HeaderLeakage",
    "ScanMatch",
    "ScanSignatures",
    "audit",
    "audited_cases",
    "batched_shifted_ncc",
    "canonical_sha256",
    "check_split_leakage",
    "duplicate_findings",
    "duplicate_matches",
    "duplicate_pairs",
    "header_leakage",
    "patient_findings",
    "scan_signatures",
    "shifted_ncc",
    "threshold_table",
    "volume_signatures",
]
