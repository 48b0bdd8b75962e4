"""Leakage audit: planted duplicates, patient overlap and synthetic canvases are found; clean data is not flagged.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/cohorts/test_audit.py -x -q
"""

from __future__ import annotations

import itertools
import math

import mlflow
import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch
from scipy.ndimage import gaussian_filter

from lightning_modules.cohorts.audit import (
    THRESHOLDS,
    audit,
    batched_shifted_ncc,
    canonical_sha256,
    check_split_leakage,
    header_leakage,
    shifted_ncc,
    volume_signatures,
)
from lightning_modules.commands.audit import main
from lightning_modules.tracking.audit import log_audit
from lightning_modules.data.cohort import load_cohort, write_case, write_metadata

SHAPE = (28, 28, 24)
AFFINE = np.diag([2.5, 2.5, 3.0, 1.0])


def abdomen(seed: int, shape=SHAPE) -> np.ndarray:
    """A CT-like volume in HU: air, a body ellipse placed at random, fat rim, organs of distinct HU."""
    rng = np.random.default_rng(seed)
    x, y, z = np.meshgrid(*[np.arange(s, dtype=float) for s in shape], indexing="ij")
    cx, cy = shape[0] / 2 + rng.uniform(-3, 3), shape[1] / 2 + rng.uniform(-3, 3)
    a, b = rng.uniform(0.33, 0.45) * shape[0], rng.uniform(0.25, 0.36) * shape[1]
    ct = np.full(shape, -1000.0)
    radius = ((x - cx) / a) ** 2 + ((y - cy) / b) ** 2
    ct[radius < 1] = -100
    ct[radius < 0.7] = 40
    for hu in (100, 110, 180, 180, 150, 60, 250):
        centre = np.array([cx + rng.uniform(-a, a) / 2, cy + rng.uniform(-b, b) / 2, rng.uniform(3, shape[2] - 3)])
        size = rng.uniform(2, 5, 3)
        inside = ((x - centre[0]) / size[0]) ** 2 + ((y - centre[1]) / size[1]) ** 2 + (
            (z - centre[2]) / size[2]
        ) ** 2 < 1
        ct[inside & (radius < 0.7)] = hu
    return gaussian_filter(ct, 1.0) + rng.normal(0, 10, shape)


def _masks(seed: int, tumor: bool, shape=SHAPE) -> dict[str, np.ndarray]:
    pancreas = np.zeros(shape, np.uint8)
    pancreas[10:16, 10:16, 8:14] = 1
    masks = {"pancreas": pancreas}
    if tumor:
        masks["pancreatic_lesion"] = np.zeros(shape, np.uint8)
        masks["pancreatic_lesion"][12:14, 12:14, 10:12] = 1
    return masks


def _save_as(root, case_id: str, ct: np.ndarray, affine: np.ndarray, dtype) -> None:
    """Write a case by hand with nibabel, with its own dtype and affine (another 'header')."""
    (root / case_id / "segmentations").mkdir(parents=True)
    image = nib.Nifti1Image(ct.astype(dtype), affine)
    image.header["descrip"] = b"re-exported copy"
    nib.save(image, root / case_id / "ct.nii.gz")
    for name, mask in _masks(0, False, ct.shape).items():
        nib.save(nib.Nifti1Image(mask, affine), root / case_id / "segmentations" / f"{name}.nii.gz")


def make_audit_cohort(root, plant: bool = True):
    """12 unrelated real cases (8 train, 1 val, 3 test); with ``plant``, five leaks on top.

    Planted: T_EXACT (test) = voxels of R00 re-saved as float32 with another affine; T_SHIFT (test) =
    R01 shifted by one voxel plus noise, re-saved with another affine; V_NOISE (val) = R02 plus
    noise; T_PATIENT (test) an unrelated scan of R03's patient; SYN_TEST a synthetic case made from
    test canvas R10; SYN_TRAIN one made from training canvas R04 (allowed).
    """
    root.mkdir(parents=True)
    rows, split_rows = [], []
    volumes = {}
    for i in range(12):
        case_id = f"R{i:02d}"
        volumes[case_id] = abdomen(i)
        write_case(root, case_id, volumes[case_id], AFFINE, _masks(i, i % 3 == 0))
        split = "train" if i < 8 else ("val" if i == 8 else "test")
        rows.append({"case_id": case_id, "patient_id": f"P{i:02d}", "tumor": int(i % 3 == 0), "phase": "venous"})
        split_rows.append({"case_id": case_id, "patient_id": f"P{i:02d}", "split": split})
    if plant:
        rng = np.random.default_rng(123)
        other = np.diag([0.8, 0.8, 1.0, 1.0])
        other[:3, 3] = [-20.0, 15.0, 7.0]
        stored = np.asarray(nib.load(root / "R00" / "ct.nii.gz").dataobj)
        _save_as(root, "T_EXACT", stored.astype(np.float32), other, np.float32)
        shifted = np.roll(volumes["R01"], 1, axis=0) + rng.normal(0, 10, SHAPE)
        _save_as(root, "T_SHIFT", shifted, other, np.int16)
        _save_as(root, "V_NOISE", volumes["R02"] + rng.normal(0, 20, SHAPE), AFFINE, np.int16)
        write_case(root, "T_PATIENT", abdomen(50), AFFINE, _masks(50, False))
        write_case(root, "SYN_TEST", volumes["R10"], AFFINE, _masks(10, True))
        write_case(root, "SYN_TRAIN", volumes["R04"], AFFINE, _masks(4, True))
        for case_id, patient, split in [
            ("T_EXACT", "Q1", "test"),
            ("T_SHIFT", "Q2", "test"),
            ("V_NOISE", "Q3", "val"),
            ("T_PATIENT", "P03", "test"),
        ]:
            rows.append({"case_id": case_id, "patient_id": patient, "tumor": 0, "phase": "venous"})
            split_rows.append({"case_id": case_id, "patient_id": patient, "split": split})
        for case_id, source in [("SYN_TEST", "R10"), ("SYN_TRAIN", "R04")]:
            rows.append(
                {
                    "case_id": case_id,
                    "patient_id": case_id,
                    "tumor": 1,
                    "phase": "venous",
                    "synthetic": 1,
                    "source_case_id": source,
                }
            )
    write_metadata(root, pd.DataFrame(rows).fillna(""))
    split_path = root.parent / f"{root.name}_split.csv"
    pd.DataFrame(split_rows).to_csv(split_path, index=False)
    return root, split_path


def test_exact_hash_ignores_file_dtype_and_header():
    volume = np.round(abdomen(0))
    assert canonical_sha256(volume.astype(np.int16)) == canonical_sha256(volume.astype(np.float32))
    assert canonical_sha256(volume) != canonical_sha256(volume + 1)
    assert canonical_sha256(volume) != canonical_sha256(volume.reshape(SHAPE[0], SHAPE[2], SHAPE[1]))


def _reference_shifted_ncc(first: np.ndarray, second: np.ndarray, max_shift: int) -> float:
    """Brute force: Pearson correlation of the overlapping regions at every integer shift."""
    best = -1.0
    for shift in itertools.product(range(-max_shift, max_shift + 1), repeat=3):
        a = first[tuple(slice(max(d, 0), n + min(d, 0)) for d, n in zip(shift, first.shape))].astype(np.float64)
        b = second[tuple(slice(max(-d, 0), n + min(-d, 0)) for d, n in zip(shift, second.shape))].astype(np.float64)
        best = max(best, np.corrcoef(a.ravel(), b.ravel())[0, 1])
    return best


def test_batched_shifted_ncc_agrees_with_brute_force():
    grids = [volume_signatures(abdomen(seed))[1] for seed in range(4)]
    shifted = np.roll(grids[0], (1, -1, 0), axis=(0, 1, 2))
    pairs = [(grids[0], grids[1]), (grids[2], grids[3]), (grids[0], shifted), (shifted, grids[0])]
    first = torch.as_tensor(np.stack([a for a, _ in pairs]).astype(np.float32))
    second = torch.as_tensor(np.stack([b for _, b in pairs]).astype(np.float32))
    for max_shift in (0, 1, 2):
        batched = batched_shifted_ncc(first, second, max_shift).numpy()
        reference = [_reference_shifted_ncc(a, b, max_shift) for a, b in pairs]
        np.testing.assert_allclose(batched, reference, atol=1e-3)


def test_signatures_tolerate_shift_and_noise_but_not_another_scan():
    base = abdomen(0)
    _, fine = volume_signatures(base)
    rng = np.random.default_rng(0)
    _, shifted = volume_signatures(np.roll(base, 1, axis=1) + rng.normal(0, 10, SHAPE))
    _, other = volume_signatures(abdomen(1))
    assert shifted_ncc(fine, fine) == pytest.approx(1.0, abs=1e-3)
    assert shifted_ncc(fine, shifted) > 0.98
    assert shifted_ncc(fine, other) < 0.95
    # Different shapes land on the same grid.
    coarse_big, _ = volume_signatures(abdomen(0, shape=(32, 30, 20)))
    assert coarse_big.shape == volume_signatures(base)[0].shape == (16**3,)


def test_planted_leaks_are_found(tmp_path, mlflow_uri):
    root, split = make_audit_cohort(tmp_path / "cohort")
    with mlflow.start_run() as run:
        report = audit(root, split, tmp_path / "audit", seed=0)
        log_audit(report)  # the audit workflow's logging, into the active run
    found = {(f.kind, f.case_id, f.other_case_id) for f in report.findings}
    assert ("exact_duplicate", "T_EXACT", "R00") in found
    assert ("near_duplicate", "T_SHIFT", "R01") in found
    assert ("near_duplicate", "V_NOISE", "R02") in found
    assert any(k == "patient_overlap" and a == "T_PATIENT" and b == "R03" for k, a, b in found)
    assert ("synthetic_source_in_eval", "SYN_TEST", "R10") in found
    # Unrelated scans and the synthetic case on its own training canvas are not flagged.
    duplicates = [f for f in report.findings if f.layer == "duplicates"]
    # The synthetic case painted on test canvas R10 is also a pixel-level twin of that test scan.
    assert {(f.case_id, f.other_case_id) for f in duplicates} == {
        ("T_EXACT", "R00"),
        ("T_SHIFT", "R01"),
        ("V_NOISE", "R02"),
        ("R10", "SYN_TEST"),
    }
    assert all("SYN_TRAIN" not in (f.case_id, f.other_case_id) for f in report.findings)
    assert all(f.severity == "leak" for f in duplicates)
    assert report.leakage_found

    assert report.metrics["audit/exact_duplicates"] == 2
    assert report.metrics["audit/near_duplicates"] == 4
    assert report.metrics["audit/patient_overlaps"] == 1
    assert report.metrics["audit/synthetic_source_leaks"] == 1
    counts = report.threshold_counts.set_index("threshold")
    assert list(counts.index) == list(THRESHOLDS)
    assert counts.loc[0.98, "leaked_cases:test"] == 3 and counts.loc[0.98, "leaked_cases:val"] == 1
    assert (counts["pairs:train-test"].diff().dropna() <= 0).all()  # fewer pairs at stricter thresholds
    best = report.best_matches.set_index("case_id")
    assert best.loc["T_EXACT", "best_train_case"] == "R00" and best.loc["T_EXACT", "ncc"] == pytest.approx(
        1.0, abs=1e-3
    )

    written = pd.read_csv(report.files["findings"])
    assert len(written) == len(report.findings)
    assert "LEAKAGE FOUND" in report.files["summary"].read_text()
    logged = mlflow.get_run(run.info.run_id)
    assert logged.data.metrics["audit/exact_duplicates"] == 2
    assert logged.data.metrics["audit/near_duplicates/train-test/t0.98"] == 3
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "audit")}
    assert "audit/audit_findings.csv" in artifacts and "audit/audit_summary.md" in artifacts

    messages = check_split_leakage(load_cohort(root), pd.read_csv(split, dtype=str, keep_default_na=False))
    assert len(messages) == len(report.leaks)
    assert any("T_EXACT" in m and "identical voxels" in m for m in messages)


def test_clean_cohort_passes_and_cli_exit_codes(tmp_path, mlflow_uri, capsys):
    root, split = make_audit_cohort(tmp_path / "clean", plant=False)
    assert check_split_leakage(root, split) == []
    assert (
        main(
            [
                "--root",
                str(root),
                "--split",
                str(split),
                "--out",
                str(tmp_path / "a1"),
                "--tracking-uri",
                mlflow_uri,
                "--experiment",
                "audit-test",
            ]
        )
        == 0
    )
    assert "0 leak(s)" in capsys.readouterr().out
    experiment = mlflow.get_experiment_by_name("audit-test")
    runs = mlflow.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs["metrics.audit/leaks"].iloc[0] == 0

    leaky, leaky_split = make_audit_cohort(tmp_path / "leaky")
    assert main(["--root", str(leaky), "--split", str(leaky_split), "--out", str(tmp_path / "a2")]) == 1
    out = capsys.readouterr().out
    assert "[leak] duplicates/exact_duplicate: T_EXACT (test) ~ R00 (train)" in out


def test_within_train_copies_warn_and_repeat_scans_are_info(tmp_path):
    root, split = make_audit_cohort(tmp_path / "cohort", plant=False)
    stored = np.asarray(nib.load(root / "R05" / "ct.nii.gz").dataobj)
    _save_as(root, "COPY_OF_R05", stored, AFFINE, np.float32)  # another patient id, same voxels
    # A second scan of patient P06: the same anatomy with new noise, so similar but not identical.
    rescan = np.asarray(nib.load(root / "R06" / "ct.nii.gz").dataobj) + np.random.default_rng(1).normal(0, 15, SHAPE)
    _save_as(root, "R06_RESCAN", rescan, AFFINE, np.int16)
    metadata = pd.read_csv(root / "metadata.csv", dtype=str, keep_default_na=False)
    extra = pd.DataFrame({"case_id": ["COPY_OF_R05", "R06_RESCAN"], "patient_id": ["Q9", "P06"], "tumor": "0"})
    write_metadata(root, pd.concat([metadata, extra], ignore_index=True).fillna(""))
    table = pd.read_csv(split, dtype=str, keep_default_na=False)
    table = pd.concat([table, extra[["case_id", "patient_id"]].assign(split="train")], ignore_index=True)
    report = audit(root, table, tmp_path / "out")
    found = {(f.case_id, f.other_case_id): f for f in report.findings if f.layer == "duplicates"}
    assert set(found) == {("COPY_OF_R05", "R05"), ("R06_RESCAN", "R06")}
    assert (
        found[("COPY_OF_R05", "R05")].severity == "warning" and found[("COPY_OF_R05", "R05")].kind == "exact_duplicate"
    )
    assert found[("R06_RESCAN", "R06")].severity == "info" and found[("R06_RESCAN", "R06")].patient_id == "P06"
    assert not report.leakage_found
    assert report.metrics["audit/within_train_duplicates"] == 2
    assert report.metrics["audit/within_train_same_patient"] == 1


def test_missing_patient_ids_and_canvas_outside_split_are_reported(tmp_path):
    root = tmp_path / "nopatients"
    root.mkdir()
    rows = []
    for i in range(4):
        write_case(root, f"C{i}", abdomen(i), AFFINE, _masks(i, False))
        rows.append({"case_id": f"C{i}", "tumor": 0})
    write_case(root, "SYN", abdomen(9), AFFINE, _masks(9, True))
    rows.append({"case_id": "SYN", "tumor": 1, "synthetic": 1, "source_case_id": "ELSEWHERE"})
    write_metadata(root, pd.DataFrame(rows).fillna(""))
    split = pd.DataFrame(
        {
            "case_id": ["C0", "C1", "C2", "C3"],
            "patient_id": ["C0", "C1", "C2", "C3"],
            "split": ["train", "train", "val", "test"],
        }
    )
    report = audit(root, split, tmp_path / "out")
    kinds = {f.kind: f for f in report.findings}
    assert kinds["patient_id_missing"].severity == "warning"
    assert "each case is treated as its own patient" in kinds["patient_id_missing"].detail
    assert kinds["synthetic_source_outside_split"].other_case_id == "ELSEWHERE"
    assert kinds["header_classifier_skipped"].severity == "info"
    assert "classifier not run" in report.summary


def _header_table(n: int, seed: int, leaky: bool) -> tuple[pd.DataFrame, pd.Series, pd.Series]:
    rng = np.random.default_rng(seed)
    labels = pd.Series((rng.random(n) < 0.4).astype(int))
    spacing = (
        np.where(labels == 1, 0.8, 1.5) + rng.normal(0, 0.05, n)
        if leaky
        else rng.choice([0.8, 1.5], n) + rng.normal(0, 0.05, n)
    )
    features = pd.DataFrame(
        {
            "spacing_x": spacing,
            "spacing_y": spacing,
            "spacing_z": rng.choice([1.0, 2.5, 5.0], n),
            "shape_x": 512,
            "shape_y": 512,
            "shape_z": rng.integers(80, 300, n),
            "file_size": rng.integers(10**7, 4 * 10**7, n),
            "dtype": "int16",
            "scanner": rng.choice(["A", "B", "C"], n),
            "cohort": "site",
            "phase": rng.choice(["venous", "arterial"], n),
        }
    )
    splits = pd.Series(np.where(np.arange(n) < int(0.7 * n), "train", "test"))
    return features, labels, splits


def test_header_classifier_flags_spacing_cue_and_stays_near_chance_without_it():
    leaky = header_leakage(*_header_table(200, 0, leaky=True), seed=0)
    assert leaky.flagged and leaky.balanced_accuracy > 0.9 and leaky.p_value < 0.01
    assert leaky.carrying[0] in ("spacing_x", "spacing_y")
    assert set(leaky.carrying) <= {"spacing_x", "spacing_y"}
    null = header_leakage(*_header_table(200, 0, leaky=False), seed=0)
    assert not null.flagged
    assert abs(null.balanced_accuracy - 0.5) < 0.15 and null.p_value > 0.05
    assert not math.isnan(null.balanced_accuracy)


def test_header_cue_found_through_the_audit(tmp_path):
    """Tumor scans acquired at 0.8 mm, healthy ones at 1.5 mm: the audit warns and names spacing."""
    root = tmp_path / "sites"
    root.mkdir()
    rows, split_rows = [], []
    rng = np.random.default_rng(0)
    for i in range(40):
        tumor = i % 2
        spacing = (0.8 if tumor else 1.5) + rng.uniform(-0.05, 0.05)
        write_case(
            root,
            f"H{i:02d}",
            abdomen(100 + i, shape=(16, 16, 12)),
            np.diag([spacing, spacing, 2.0, 1.0]),
            _masks(i, bool(tumor), shape=(16, 16, 12)),
        )
        rows.append({"case_id": f"H{i:02d}", "patient_id": f"H{i:02d}", "tumor": tumor, "phase": "venous"})
        split_rows.append({"case_id": f"H{i:02d}", "patient_id": f"H{i:02d}", "split": "train" if i < 28 else "test"})
    write_metadata(root, pd.DataFrame(rows))
    report = audit(root, pd.DataFrame(split_rows), tmp_path / "out", threshold=0.999)
    warning = [f for f in report.findings if f.kind == "header_predicts_label"]
    assert len(warning) == 1 and warning[0].severity == "warning"
    assert "spacing" in warning[0].detail
    assert report.header.balanced_accuracy == pytest.approx(1.0)
    assert report.metrics["audit/header_balanced_accuracy"] == pytest.approx(1.0)
    assert "features carrying it: spacing" in report.summary


def test_scan_signatures_find_renamed_copies_of_training_scans_and_are_cached(tmp_path, monkeypatch):
    """A model's training scans are recognized under other case ids: identical voxels (re-saved as
    float32 under another affine) and the same scan with noise; unrelated scans and another scan of a
    training patient are not duplicates. Signatures are cached per file and read again when it changes."""
    from lightning_modules.cohorts.audit import signatures as signatures_module
    from lightning_modules.cohorts.audit.signatures import ScanSignatures, duplicate_matches, scan_signatures
    from lightning_modules.data.cohort import CohortError

    root = tmp_path / "cohort"
    make_audit_cohort(root)
    cohort = load_cohort(root)
    cache = tmp_path / "cache"
    training = scan_signatures(cohort, [f"R{i:02d}" for i in range(8)], cache)
    evaluated_ids = ["R08", "R09", "R10", "R11", "T_EXACT", "V_NOISE", "T_PATIENT"]
    evaluated = scan_signatures(cohort, evaluated_ids, cache)
    matches = duplicate_matches(evaluated, training)
    assert [(m.case_id, m.training_case_id, m.exact) for m in matches] == [("T_EXACT", "R00", True), ("V_NOISE", "R02", False)]
    assert str(matches[0]) == "case T_EXACT: its scan duplicates training case R00 (identical voxels)"
    # The audit's own screening signature and exact hash, not a look-alike.
    stored = np.asarray(nib.load(root / "R00" / "ct.nii.gz").dataobj)
    assert np.array_equal(training.coarse[0], volume_signatures(stored)[0].astype(np.float16))
    assert training.sha256[0] == canonical_sha256(stored)
    assert matches[1].ncc >= 0.995 and "NCC 0.99" in str(matches[1])
    # A training case evaluated under its own id is the case check's to report, not a duplicate.
    assert duplicate_matches(scan_signatures(cohort, ["R03"], cache), training) == []
    # What a checkpoint and a run artifact hold reads back the same.
    for copy in (ScanSignatures.from_payload(training.to_payload()), ScanSignatures.from_npz(_bytes_file(tmp_path, training.to_npz()))):
        assert copy.case_ids == training.case_ids and copy.sha256 == training.sha256
        assert np.array_equal(copy.coarse, training.coarse)
    # Cached: the second time no CT is read; a rewritten file is read again.
    assert len(list(cache.glob("*.npz"))) == 8 + len(evaluated_ids)

    def unread(path):
        raise AssertionError(f"{path} read although cached")

    monkeypatch.setattr(signatures_module, "read_volume", unread)
    again = scan_signatures(cohort, evaluated_ids, cache)
    assert again.sha256 == evaluated.sha256 and np.array_equal(again.coarse, evaluated.coarse)
    monkeypatch.undo()
    path = root / "R09" / "ct.nii.gz"
    stored = nib.load(path)
    nib.save(nib.Nifti1Image(np.asarray(stored.dataobj) + 7, stored.affine), path)
    assert scan_signatures(cohort, ["R09"], cache).sha256 != [evaluated.sha256[1]]
    # An unreadable CT is named with its case and file.
    (root / "R10" / "ct.nii.gz").write_bytes(b"not a nifti")
    with pytest.raises(CohortError, match=r"R10: .*R10/ct\.nii\.gz: cannot read the CT"):
        scan_signatures(cohort, ["R10"], cache)


def _bytes_file(folder, data: bytes):
    path = folder / "signatures.npz"
    path.write_bytes(data)
    return path
