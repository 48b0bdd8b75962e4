"""Importers to AbdomenAtlas layout A on tiny fixtures written here: nnU-Net, MSD, TotalSegmentator, DICOM.

Checks grids and affines kept, binary masks, class mapping (organ includes its lesion), resume after
a kill, quarantine with nothing half-written, the DICOM LPS->RAS affine against hand-computed
values, HU rescale, and that identifying DICOM values reach no output file and no log line.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/cohorts/test_importers.py -x -q
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from lightning_modules.commands.import_cohort import main as import_main
from lightning_modules.cohorts import importers
from lightning_modules.data.cohort import load_cohort
from lightning_modules.cohorts.importers import resumable_import
from lightning_modules.data.validation import validate_cohort

SHAPE = (12, 10, 8)
AFFINE = np.array(
    [
        [-0.8, 0.0, 0.0, 40.0],
        [0.0, -0.7, 0.0, 25.0],
        [0.0, 0.0, 2.5, -300.0],
        [0.0, 0.0, 0.0, 1.0],
    ]
)


def write_nifti(path: Path, data: np.ndarray, affine: np.ndarray = AFFINE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


def ct_volume(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1024, 1500, size=SHAPE).astype(np.int16)


def label_volume(seed: int, with_tumor: bool) -> np.ndarray:
    labels = np.zeros(SHAPE, dtype=np.uint8)
    labels[3:9, 2:8, 2:6] = 1
    if with_tumor:
        labels[5:7, 4:6, 3:5] = 2
    return labels


def read_case(out: Path, case_id: str) -> tuple[nib.Nifti1Image, dict[str, nib.Nifti1Image]]:
    ct = nib.load(str(out / case_id / "ct.nii.gz"))
    masks = {p.name[: -len(".nii.gz")]: nib.load(str(p)) for p in (out / case_id / "segmentations").glob("*.nii.gz")}
    return ct, masks


def make_nnunet(root: Path, n_cases: int = 2, labels: dict | None = None) -> Path:
    dataset = {
        "channel_names": {"0": "CT"},
        "labels": labels or {"background": 0, "pancreas": 1, "tumor": 2},
        "numTraining": n_cases,
        "file_ending": ".nii.gz",
        "name": "Dataset901_TinyPancreas",
    }
    root.mkdir(parents=True)
    (root / "dataset.json").write_text(json.dumps(dataset))
    for i in range(n_cases):
        write_nifti(root / "imagesTr" / f"tiny_{i:03d}_0000.nii.gz", ct_volume(i))
        write_nifti(root / "labelsTr" / f"tiny_{i:03d}.nii.gz", label_volume(i, with_tumor=i % 2 == 0))
    return root


def make_msd(root: Path) -> Path:
    dataset = {
        "name": "Pancreas",
        "modality": {"0": "CT"},
        "labels": {"0": "background", "1": "pancreas", "2": "cancer"},
        "training": [
            {"image": f"./imagesTr/pancreas_00{i}.nii.gz", "label": f"./labelsTr/pancreas_00{i}.nii.gz"} for i in (1, 2)
        ],
    }
    root.mkdir(parents=True)
    (root / "dataset.json").write_text(json.dumps(dataset))
    for i in (1, 2):
        write_nifti(root / "imagesTr" / f"pancreas_00{i}.nii.gz", ct_volume(i))
        write_nifti(root / "labelsTr" / f"pancreas_00{i}.nii.gz", label_volume(i, with_tumor=i == 1))
    return root


# ----------------------------------------------------------------------------------------------
# NIfTI sources


def test_nnunet_import_keeps_grid_and_maps_tumor_into_organ(tmp_path):
    src = make_nnunet(tmp_path / "Dataset901_TinyPancreas")
    out = tmp_path / "cohort"
    assert import_main(["nnunet", str(src), "--out", str(out)]) == 0

    assert validate_cohort(out) == []
    cohort = load_cohort(out)
    assert cohort.case_ids == ["tiny_000", "tiny_001"]
    for i, case_id in enumerate(cohort.case_ids):
        ct, masks = read_case(out, case_id)
        source_ct = nib.load(str(src / "imagesTr" / f"{case_id}_0000.nii.gz"))
        source_labels = np.asarray(nib.load(str(src / "labelsTr" / f"{case_id}.nii.gz")).dataobj)
        np.testing.assert_allclose(ct.affine, source_ct.affine, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(ct.dataobj), np.asarray(source_ct.dataobj))
        assert ct.get_data_dtype() == np.int16
        assert sorted(masks) == ["pancreas", "pancreatic_lesion"]
        for mask in masks.values():
            assert mask.get_data_dtype() == np.uint8 and mask.shape == ct.shape
            np.testing.assert_allclose(mask.affine, ct.affine, atol=1e-5)
        # AbdomenAtlas convention: the pancreas mask includes the tumor.
        np.testing.assert_array_equal(np.asarray(masks["pancreas"].dataobj), np.isin(source_labels, [1, 2]))
        np.testing.assert_array_equal(np.asarray(masks["pancreatic_lesion"].dataobj), source_labels == 2)
    rows = cohort.metadata.set_index("case_id")
    assert set(rows["cohort"]) == {"Dataset901_TinyPancreas"}
    assert set(rows["sex"]) == {"Unknown"} and set(rows["phase"]) == {"Unknown"} and rows["age"].isna().all()
    assert cohort.patient_id_missing is False and list(rows["patient_id"]) == ["tiny_000", "tiny_001"]
    assert cohort.resolve_tumor_labels().tolist() == [1, 0]
    assert pd.read_csv(out / "metadata.csv", dtype=str)["spacing"].iloc[0] == "0.8x0.7x2.5"


def test_msd_task07_labels_become_pancreas_and_lesion(tmp_path):
    src = make_msd(tmp_path / "Task07_Pancreas")
    out = tmp_path / "cohort"
    report = importers.import_source("msd", src, out)
    assert report.imported == ["pancreas_001", "pancreas_002"] and not report.quarantined
    labels = np.asarray(nib.load(str(src / "labelsTr" / "pancreas_001.nii.gz")).dataobj)
    _, masks = read_case(out, "pancreas_001")
    np.testing.assert_array_equal(np.asarray(masks["pancreas"].dataobj), labels > 0)
    np.testing.assert_array_equal(np.asarray(masks["pancreatic_lesion"].dataobj), labels == 2)
    assert load_cohort(out).metadata["cohort"].tolist() == ["Pancreas", "Pancreas"]


def test_unmapped_label_is_a_clear_error_and_class_map_fixes_it(tmp_path):
    src = make_nnunet(tmp_path / "Dataset902_Blob", n_cases=1, labels={"background": 0, "blob": 1, "spot": 2})
    with pytest.raises(importers.ImportSourceError, match=r"'blob'.*--class-map"):
        importers.import_source("nnunet", src, tmp_path / "out")
    class_map = tmp_path / "classes.csv"
    class_map.write_text("label,class\nblob,pancreas\n2,pancreas\n2,pancreatic_lesion\n")
    report = importers.import_source("nnunet", src, tmp_path / "out", class_map=str(class_map))
    assert report.imported == ["tiny_000"]
    labels = label_volume(0, with_tumor=True)
    _, masks = read_case(tmp_path / "out", "tiny_000")
    np.testing.assert_array_equal(np.asarray(masks["pancreas"].dataobj), labels > 0)


def test_class_map_formats_agree_and_reject_unknown_classes(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"7": "pancreas", "9": ["pancreas", "pancreatic_lesion"], "3": None}))
    (tmp_path / "m.yaml").write_text("7: pancreas\n9: [pancreas, pancreatic_lesion]\n3: null\n")
    (tmp_path / "m.csv").write_text("label,class\n7,pancreas\n9,pancreas\n9,pancreatic_lesion\n3,\n")
    maps = [importers.load_class_map(tmp_path / f"m.{ext}") for ext in ("json", "yaml", "csv")]
    assert all(m.by_value == maps[0].by_value for m in maps)
    assert maps[0].by_value == {7: ("pancreas",), 9: ("pancreas", "pancreatic_lesion"), 3: ()}
    (tmp_path / "bad.json").write_text(json.dumps({"2": "pancreatic_tumor"}))
    with pytest.raises(importers.ImportSourceError, match="pancreatic_tumor"):
        importers.load_class_map(tmp_path / "bad.json")


def test_totalsegmentator_multilabel_uses_v2_numbering(tmp_path):
    case = tmp_path / "ts" / "s0001"
    write_nifti(case / "ct.nii.gz", ct_volume(3))
    labels = np.zeros(SHAPE, dtype=np.uint8)
    labels[0:3] = 1  # spleen
    labels[3:5] = 4  # gallbladder
    labels[5:7] = 7  # pancreas
    labels[7:9] = 52  # aorta
    labels[9:11] = 63  # inferior_vena_cava
    labels[11] = 90  # a class outside the AbdomenAtlas set (not imported)
    write_nifti(case / "segmentations.nii.gz", labels)
    out = tmp_path / "cohort"
    report = importers.import_source("totalseg", case, out, cohort="ts-test")
    assert report.imported == ["s0001"]
    _, masks = read_case(out, "s0001")
    expected = {"spleen": 1, "gall_bladder": 4, "pancreas": 7, "aorta": 52, "postcava": 63}
    assert set(expected) <= set(masks)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(masks[name].dataobj), labels == value)
    # Classes of the v2 table absent from this scan are written as empty masks (none of that organ here).
    assert not np.asarray(masks["liver"].dataobj).any()
    # The v1 table reads value 7 as the aorta: the built-in choice matters.
    out_v1 = tmp_path / "cohort_v1"
    importers.import_source("totalseg", case, out_v1, class_map="totalseg-v1")
    _, masks_v1 = read_case(out_v1, "s0001")
    np.testing.assert_array_equal(np.asarray(masks_v1["aorta"].dataobj), labels == 7)


def test_totalsegmentator_per_class_folder_with_meta_csv(tmp_path):
    root = tmp_path / "ts"
    for i, case_id in enumerate(("s0001", "s0002")):
        write_nifti(root / case_id / "ct.nii.gz", ct_volume(i))
        organ = np.zeros(SHAPE, dtype=np.uint8)
        organ[2 + i : 6, 2:6, 2:6] = 1
        for name in ("liver", "pancreas", "inferior_vena_cava", "vertebrae_L1"):
            write_nifti(root / case_id / "segmentations" / f"{name}.nii.gz", organ)
    (root / "meta.csv").write_text(
        "image_id;age;gender;institute;study_type;split;manufacturer;scanner_model;kvp\n"
        "s0001;67;f;A;ct abdomen;train;Siemens;SOMATOM Force;120\n"
        "s0002;;m;B;ct thorax;test;;;\n"
    )
    out = tmp_path / "cohort"
    assert import_main(["totalseg", str(root), "--out", str(out), "--cohort", "TotalSegmentator"]) == 0
    assert validate_cohort(out, classes=["liver", "pancreas", "postcava"]) == []
    cohort = load_cohort(out)
    rows = cohort.metadata.set_index("case_id")
    assert rows.loc["s0001", "age"] == 67 and rows.loc["s0001", "sex"] == "F"
    assert np.isnan(rows.loc["s0002", "age"]) and rows.loc["s0002", "sex"] == "M"
    raw = pd.read_csv(out / "metadata.csv", dtype=str, keep_default_na=False).set_index("case_id")
    assert raw.loc["s0001", "scanner"] == "Siemens SOMATOM Force" and raw.loc["s0002", "scanner"] == ""
    assert "institute" not in raw.columns and "split" not in raw.columns
    assert cohort.case("s0001").available_classes() == ["liver", "pancreas", "postcava"]


def test_non_binary_per_class_mask_is_quarantined(tmp_path):
    case = tmp_path / "ts" / "s0001"
    write_nifti(case / "ct.nii.gz", ct_volume(0))
    write_nifti(case / "segmentations" / "liver.nii.gz", label_volume(0, with_tumor=True))
    report = importers.import_source("totalseg", case, tmp_path / "out")
    assert "expected a binary 0/1 mask" in report.quarantined["s0001"]
    assert not (tmp_path / "out" / "s0001").exists()


# ----------------------------------------------------------------------------------------------
# Quarantine and resume


def test_label_on_another_grid_is_quarantined_with_nothing_half_written(tmp_path):
    src = make_nnunet(tmp_path / "Dataset903_Shifted", n_cases=3)
    bad_label = src / "labelsTr" / "tiny_001.nii.gz"
    shifted = AFFINE.copy()
    shifted[0, 3] += 1.5
    write_nifti(bad_label, label_volume(1, with_tumor=False), shifted)
    out = tmp_path / "cohort"
    assert import_main(["nnunet", str(src), "--out", str(out)]) == 1

    quarantine = pd.read_csv(out / "quarantine.csv", dtype=str)
    assert quarantine["case_id"].tolist() == ["tiny_001"]
    assert str(bad_label) in quarantine["reason"].iloc[0] and "another grid" in quarantine["reason"].iloc[0]
    assert not (out / "tiny_001").exists()
    # No staging leftovers (the folder lock's files are the import's own, not case data).
    assert not [p for p in out.iterdir() if p.name.startswith(".") and not p.name.startswith(".lock")]
    assert load_cohort(out).case_ids == ["tiny_000", "tiny_002"]

    # Fixing the source and rerunning imports the case and empties the quarantine.
    write_nifti(bad_label, label_volume(1, with_tumor=False))
    report = importers.import_source("nnunet", src, out)
    assert report.imported == ["tiny_001"] and report.skipped == ["tiny_000", "tiny_002"]
    assert not (out / "quarantine.csv").exists()
    assert load_cohort(out).case_ids == ["tiny_000", "tiny_001", "tiny_002"]


def test_resume_after_a_kill_only_does_the_remainder(tmp_path, monkeypatch):
    src = make_nnunet(tmp_path / "Dataset904_Resume", n_cases=3)
    out = tmp_path / "cohort"
    real_write_case = resumable_import.write_case
    calls = []

    def killed_on_second_case(root, case_id, *args, **kwargs):
        calls.append(case_id)
        if len(calls) == 2:
            # What a kill inside write_case leaves: a hidden staging folder, then the process is gone.
            (Path(root) / f".{case_id}.abc123").mkdir()
            raise KeyboardInterrupt
        return real_write_case(root, case_id, *args, **kwargs)

    monkeypatch.setattr(resumable_import, "write_case", killed_on_second_case)
    with pytest.raises(KeyboardInterrupt):
        importers.import_source("nnunet", src, out)
    monkeypatch.setattr(resumable_import, "write_case", real_write_case)
    assert load_cohort(out).case_ids == ["tiny_000"]
    finished = [out / "tiny_000" / "ct.nii.gz", out / "tiny_000" / "segmentations" / "pancreas.nii.gz"]
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in finished]

    report = importers.import_source("nnunet", src, out)
    assert report.skipped == ["tiny_000"] and report.imported == ["tiny_001", "tiny_002"]
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in finished] == before
    # No staging leftovers (the folder lock's files are the import's own, not case data).
    assert not [p for p in out.iterdir() if p.name.startswith(".") and not p.name.startswith(".lock")]
    assert load_cohort(out).case_ids == ["tiny_000", "tiny_001", "tiny_002"]


def test_rows_of_other_imports_are_kept(tmp_path):
    out = tmp_path / "cohort"
    importers.import_source("msd", make_msd(tmp_path / "Task07_Pancreas"), out)
    importers.import_source("nnunet", make_nnunet(tmp_path / "Dataset905_Other", n_cases=1), out, cohort="other")
    cohort = load_cohort(out)
    assert cohort.case_ids == ["pancreas_001", "pancreas_002", "tiny_000"]
    assert cohort.row("tiny_000")["cohort"] == "other"


# ----------------------------------------------------------------------------------------------
# DICOM


def write_dicom_series(
    folder: Path,
    hu: np.ndarray,
    pixel_spacing: tuple[float, float],
    orientation: tuple[float, ...],
    first_position: tuple[float, float, float],
    step: tuple[float, float, float],
    tags: dict | None = None,
    slope: float = 2.0,
    intercept: float = -1024.0,
    file_order: list[int] | None = None,
    series_uid: str | None = None,
) -> list[Path]:
    """Write ``hu`` (indexed column, row, slice) as single-frame CT slices with pydicom."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    folder.mkdir(parents=True, exist_ok=True)
    series_uid = series_uid or generate_uid()
    study_uid = generate_uid()
    columns, rows, n_slices = hu.shape
    order = file_order or list(range(n_slices))
    paths = []
    for file_index, k in enumerate(order):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = CTImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID = CTImageStorage
        ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
        ds.StudyInstanceUID = study_uid
        ds.SeriesInstanceUID = series_uid
        ds.Modality = "CT"
        ds.InstanceNumber = file_index + 1
        ds.Rows, ds.Columns = rows, columns
        ds.PixelSpacing = [f"{pixel_spacing[0]:g}", f"{pixel_spacing[1]:g}"]
        ds.ImageOrientationPatient = [f"{v:g}" for v in orientation]
        ds.ImagePositionPatient = [f"{p + k * s:g}" for p, s in zip(first_position, step)]
        ds.SamplesPerPixel = 1
        ds.PhotometricInterpretation = "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.RescaleSlope, ds.RescaleIntercept = f"{slope:g}", f"{intercept:g}"
        stored = np.rint((hu[:, :, k].T - intercept) / slope).astype(np.uint16)
        ds.PixelData = stored.tobytes()
        for keyword, value in (tags or {}).items():
            setattr(ds, keyword, value)
        path = folder / f"IM{file_index:04d}"
        ds.save_as(str(path), enforce_file_format=True)
        paths.append(path)
    return paths


def dicom_hu(shape=(6, 5, 4), seed=0) -> np.ndarray:
    # Even HU values so that slope 2 represents them exactly.
    return (np.random.default_rng(seed).integers(-512, 800, size=shape) * 2).astype(np.int16)


def test_dicom_axial_affine_matches_hand_computed_and_rescale_gives_hu(tmp_path):
    hu = dicom_hu()
    src = tmp_path / "dicom"
    # Files written in reverse slice order: sorting must follow the positions, not the file names.
    write_dicom_series(
        src / "case01",
        hu,
        pixel_spacing=(0.7, 0.8),
        orientation=(1, 0, 0, 0, 1, 0),
        first_position=(-100.0, -50.0, 20.0),
        step=(0.0, 0.0, 2.5),
        file_order=[3, 2, 1, 0],
    )
    out = tmp_path / "cohort"
    report = importers.import_source("dicom", src, out, cohort="site-a")
    assert report.imported == ["case01"], report.quarantined
    ct = nib.load(str(out / "case01" / "ct.nii.gz"))
    # Column index i moves along +x (LPS) by the column spacing 0.8, row index j along +y by 0.7,
    # slice index k along +z by 2.5; LPS -> RAS negates x and y.
    expected = np.array(
        [
            [-0.8, 0.0, 0.0, 100.0],
            [0.0, -0.7, 0.0, 50.0],
            [0.0, 0.0, 2.5, 20.0],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    np.testing.assert_allclose(ct.affine, expected, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ct.dataobj), hu)
    assert ct.get_data_dtype() == np.int16
    row = pd.read_csv(out / "metadata.csv", dtype=str, keep_default_na=False).iloc[0]
    assert row["spacing"] == "0.8x0.7x2.5" and row["phase"] == "Unknown" and row["patient_id"] == ""


def test_dicom_oblique_sagittal_affine(tmp_path):
    hu = dicom_hu(seed=1)
    src = tmp_path / "series"
    # Rows run anterior->posterior (+y LPS), columns run head->feet (-z): a sagittal stack
    # whose slices advance to the patient's left (+x) by 3 mm.
    write_dicom_series(
        src,
        hu,
        pixel_spacing=(1.5, 0.9),
        orientation=(0, 1, 0, 0, 0, -1),
        first_position=(-30.0, -80.0, 120.0),
        step=(3.0, 0.0, 0.0),
        file_order=[2, 0, 3, 1],
    )
    cases = importers.list_dicom(src, cohort="site-b")
    loaded = cases[0].load()
    # The slice normal is row x column = (0,1,0) x (0,0,-1) = (-1,0,0): slices are sorted along it,
    # so slice index k runs toward the patient's right, from the written slice at x = -21 mm.
    expected_lps = np.array(
        [
            [0.0, 0.0, -3.0, -21.0],
            [0.9, 0.0, 0.0, -80.0],
            [0.0, -1.5, 0.0, 120.0],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    np.testing.assert_allclose(loaded.affine, np.diag([-1, -1, 1, 1]) @ expected_lps, atol=1e-9)
    np.testing.assert_array_equal(loaded.ct, hu[:, :, ::-1])
    assert cases[0].case_id == "series"


def test_dicom_mixed_series_and_irregular_spacing_are_quarantined(tmp_path):
    hu = dicom_hu()
    src = tmp_path / "dicom"
    geometry = dict(pixel_spacing=(0.7, 0.7), orientation=(1, 0, 0, 0, 1, 0), first_position=(0.0, 0.0, 0.0))
    write_dicom_series(src / "mixed", hu, step=(0, 0, 2.0), **geometry)
    intruder = write_dicom_series(tmp_path / "other", hu[:, :, :1], step=(0, 0, 2.0), **geometry)[0]
    intruder.rename(src / "mixed" / "IM9999")
    gappy = write_dicom_series(src / "gappy", dicom_hu(shape=(6, 5, 6)), step=(0, 0, 2.0), **geometry)
    gappy[3].unlink()  # a missing slice: gaps 2, 2, 4, 2 mm
    write_dicom_series(src / "good", hu, step=(0, 0, 2.0), **geometry)

    out = tmp_path / "cohort"
    report = importers.import_source("dicom", src, out, cohort="site-c")
    assert report.imported == ["good"]
    assert validate_cohort(out, classes=[]) == []
    assert "IM9999" in report.quarantined["mixed"] and "mixed series" in report.quarantined["mixed"]
    reason = report.quarantined["gappy"]
    assert "inconsistent spacing" in reason and reason.startswith(str(src / "gappy" / "IM0004")) and "IM0002" in reason
    assert load_cohort(out).case_ids == ["good"]
    assert not (out / "mixed").exists() and not (out / "gappy").exists()


SENSITIVE = {
    "PatientName": "Doeanonymous^Janerandom",
    "PatientBirthDate": "19520314",
    "AccessionNumber": "ACC99887766",
    "InstitutionName": "St Elsewhere Memorial Hospital",
    "InstitutionAddress": "42 Wallaby Way Sydney",
    "PatientID": "MRN55501234",
    "StudyDate": "20230405",
    "StationName": "CTROOM7XYZ",
    "ReferringPhysicianName": "House^Gregory",
    "StudyDescription": "Janerandom followupqq",
    "SeriesDescription": "Doeanonymous seriesqq",
}


def _all_output_bytes(out: Path) -> bytes:
    blobs = []
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            blobs.append(gzip.decompress(data) if path.name.endswith(".gz") else data)
    return b"\n".join(blobs)


def test_dicom_privacy_nothing_identifying_reaches_outputs_or_logs(tmp_path, caplog, capsys):
    tags = {
        **SENSITIVE,
        "PatientSex": "F",
        "PatientAge": "054Y",
        "Manufacturer": "SIEMENS",
        "ManufacturerModelName": "SOMATOM Force",
        "KVP": "100",
        "ContrastBolusAgent": "Omnipaque 350",
    }
    src = tmp_path / "export"
    geometry = dict(pixel_spacing=(0.7, 0.7), orientation=(1, 0, 0, 0, 1, 0), first_position=(0.0, 0.0, 0.0), step=(0, 0, 2.0))
    write_dicom_series(src / "anon001", dicom_hu(), tags=tags, **geometry)
    write_dicom_series(src / "anon002", dicom_hu(seed=2), tags={**tags, "ContrastBolusAgent": "PORTAL VENOUS"}, **geometry)
    out = tmp_path / "cohort"
    salt = "a-secret-salt-for-tests"
    caplog.set_level("DEBUG")
    status = import_main(["dicom", str(src), "--out", str(out), "--cohort", "site-d", "--salt", salt, "-v"])
    assert status == 0

    rows = pd.read_csv(out / "metadata.csv", dtype=str, keep_default_na=False).set_index("case_id")
    assert list(rows.index) == ["anon001", "anon002"]
    assert set(rows["patient_id"]) == {importers.pseudonymous_patient_id("MRN55501234", salt)}
    assert importers.pseudonymous_patient_id("MRN55501234", "another salt") != rows["patient_id"].iloc[0]
    assert rows.loc["anon001", "sex"] == "F" and rows.loc["anon001", "age"] == "54"
    assert rows.loc["anon001", "scanner"] == "SIEMENS SOMATOM Force" and rows.loc["anon001", "kvp"] == "100"
    # An agent name is not a phase; only an explicit phase is taken.
    assert rows.loc["anon001", "phase"] == "Unknown" and rows.loc["anon002", "phase"] == "venous"

    header = nib.load(str(out / "anon001" / "ct.nii.gz")).header
    assert header["descrip"].item() == b"" and header["db_name"].item() == b"" and header["aux_file"].item() == b""
    captured = capsys.readouterr()
    everything = _all_output_bytes(out).decode("latin-1") + caplog.text + captured.out + captured.err
    assert "anon001 imported" in caplog.text
    for keyword, value in SENSITIVE.items():
        # Whole values and each word of five or more letters (short words such as "St" occur anywhere).
        for token in [value] + [t for t in value.replace("^", " ").split() if len(t) >= 5]:
            assert token not in everything, f"{keyword} value {token!r} leaked"


GEOMETRY = dict(pixel_spacing=(0.7, 0.7), orientation=(1, 0, 0, 0, 1, 0), first_position=(0.0, 0.0, 0.0), step=(0, 0, 2.0))


def test_dicom_folder_named_after_the_patient_is_refused_under_a_pseudonym(tmp_path, caplog):
    src = tmp_path / "export"
    named = {
        "MRN55501234": "PatientID",
        "janerandom_ct": "PatientName",
        "ct_ACC99887766": "AccessionNumber",
        "born_14.03.1952": "PatientBirthDate",
        "x_OTHER42x": "OtherPatientIDs",
    }
    for folder in named:
        write_dicom_series(src / folder, dicom_hu(), tags={**SENSITIVE, "OtherPatientIDs": "OTHER42"}, **GEOMETRY)
    out = tmp_path / "cohort"
    caplog.set_level("DEBUG")
    report = importers.import_source("dicom", src, out, cohort="site-d", salt="s3cret")
    assert len(report.quarantined) == len(named) and not report.imported
    assert all(case_id.startswith("DCM") for case_id in report.quarantined)
    reasons = "\n".join(report.quarantined.values())
    assert all(f"contains the series' {keyword}" in reasons for keyword in named.values())
    assert all("rename the folder" in reason for reason in report.quarantined.values())
    assert not (out / "metadata.csv").exists()
    # Nothing of a refused folder's name reaches quarantine.csv, the output tree or the log.
    written = (out / "quarantine.csv").read_text() + "\n".join(str(p) for p in out.rglob("*")) + caplog.text
    for folder in named:
        assert folder not in written and "janerandom" not in written.lower()
    # The pseudonym is stable for a salt: a rerun quarantines the same ids.
    again = importers.import_source("dicom", src, out, cohort="site-d", salt="s3cret")
    assert sorted(again.quarantined) == sorted(report.quarantined)


def test_dicom_folder_named_with_a_date_or_identifier_gets_a_pseudonym(tmp_path):
    src = tmp_path / "export"
    tags = {"PatientID": "P-7", "PatientBirthDate": "19600101"}
    for folder in ("case_19520314", "scan-2021-05-03", "record_1234567", "anon001"):
        write_dicom_series(src / folder, dicom_hu(), tags=tags, **GEOMETRY)
    out = tmp_path / "cohort"
    report = importers.import_source("dicom", src, out, cohort="site-f", salt="s3cret")
    assert not report.quarantined
    assert "anon001" in report.imported and len(report.imported) == 4
    pseudonyms = sorted(c for c in report.imported if c != "anon001")
    assert all(c.startswith("DCM") and len(c) == 15 for c in pseudonyms)
    assert pseudonyms == sorted(
        importers.folder_pseudonym(name, "s3cret") for name in ("case_19520314", "scan-2021-05-03", "record_1234567")
    )
    listing = (out / "metadata.csv").read_text() + "\n".join(str(p) for p in out.rglob("*"))
    for token in ("19520314", "2021-05-03", "1234567"):
        assert token not in listing
    assert importers.looks_like_date_or_identifier("03.05.2021") and not importers.looks_like_date_or_identifier("ct_v2")
    # A failing series in such a folder is quarantined under the pseudonym; its error names no path part.
    write_dicom_series(src / "broken_20200101", dicom_hu()[:, :, :1], tags=tags, **GEOMETRY)
    again = importers.import_source("dicom", src, out, cohort="site-f", salt="s3cret")
    [(case_id, reason)] = again.quarantined.items()
    assert case_id == importers.folder_pseudonym("broken_20200101", "s3cret") and "at least 2 slices" in reason
    assert "20200101" not in reason and "20200101" not in (out / "quarantine.csv").read_text()


def test_a_refused_import_leaves_no_output_folder(tmp_path):
    src = tmp_path / "export"
    # Two folders that map to one case id ("a_b"): the import is refused before anything is written.
    write_dicom_series(src / "a" / "b", dicom_hu(), **GEOMETRY)
    write_dicom_series(src / "a_b", dicom_hu(seed=1), **GEOMETRY)
    out = tmp_path / "cohort"
    with pytest.raises(importers.ImportSourceError, match="case id 'a_b' also comes from"):
        importers.import_source("dicom", src, out, cohort="site-g", salt="s3cret")
    assert not out.exists()
    assert import_main(["dicom", str(src), "--out", str(out), "--cohort", "site-g", "--salt", "s"]) == 2
    assert not out.exists()


def test_an_import_into_a_folder_another_process_holds_is_refused(tmp_path):
    from lightning_modules.infrastructure.run_folder import FolderLockedError, RunFolderLock

    src = tmp_path / "export"
    write_dicom_series(src / "scan_a", dicom_hu(), **GEOMETRY)
    out = tmp_path / "cohort"
    with RunFolderLock(out, "benchx import"):
        with pytest.raises(FolderLockedError, match=f"{out} is in use by process {os.getpid()}.*benchx import"):
            importers.import_source("dicom", src, out, cohort="site-h", salt="s3cret")
        assert not (out / "metadata.csv").exists()
    report = importers.import_source("dicom", src, out, cohort="site-h", salt="s3cret")
    assert len(report.imported) == 1 and not (out / ".lock").exists()


def test_dicom_patient_id_needs_a_salt_or_a_supplied_id(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCHX_PSEUDONYM_SALT", raising=False)
    src = tmp_path / "export"
    geometry = dict(pixel_spacing=(0.7, 0.7), orientation=(1, 0, 0, 0, 1, 0), first_position=(0.0, 0.0, 0.0), step=(0, 0, 2.0))
    write_dicom_series(src / "c1", dicom_hu(), tags={"PatientID": "MRN1"}, **geometry)
    write_dicom_series(src / "c2", dicom_hu(), tags={"PatientID": "MRN2"}, **geometry)
    ids = tmp_path / "ids.csv"
    ids.write_text("case_id,patient_id,phase\nc2,study-patient-7,arterial\n")
    out = tmp_path / "cohort"
    report = importers.import_source("dicom", src, out, cohort="site-e", metadata=str(ids))
    assert "--salt" in report.quarantined["c1"]
    assert report.imported == ["c2"]
    row = load_cohort(out).row("c2")
    assert row["patient_id"] == "study-patient-7" and row["phase"] == "arterial"


def test_cli_dispatch_has_import_command():
    from lightning_modules.cli import COMMANDS

    assert COMMANDS["import"][:2] == ("lightning_modules.commands.import_cohort", "main")


# The three attacks on folder and file names: a transliterated patient name, a birth date spelled
# with a month name, and a truncated slice whose file name holds the name and birth date.


def _imported_everything(out: Path, caplog, capsys) -> str:
    captured = capsys.readouterr()
    listing = "\n".join(str(p) for p in out.rglob("*"))
    return _all_output_bytes(out).decode("latin-1") + listing + caplog.text + captured.out + captured.err


@pytest.mark.parametrize(
    ("folder", "patient_name"),
    [
        ("Mueller_Juergen", "Müller^Jürgen"),
        ("MÜLLER-JÜRGEN", "Mueller^Juergen"),
        ("muller.jurgen", "Müller^Jürgen"),
        ("ct_strasse", "Straße^Anna"),
        ("Oestergaard Soeren", "Østergaard^Søren"),
    ],
)
def test_dicom_folder_with_a_transliterated_patient_name_is_refused(tmp_path, caplog, capsys, folder, patient_name):
    src = tmp_path / "export"
    write_dicom_series(src / folder, dicom_hu(), tags={"PatientName": patient_name, "PatientID": "X-1"}, **GEOMETRY)
    out = tmp_path / "cohort"
    caplog.set_level("DEBUG")
    status = import_main(["dicom", str(src), "--out", str(out), "--cohort", "site-t", "--salt", "s3cret", "-v"])
    assert status == 1  # quarantined, not imported
    quarantine = pd.read_csv(out / "quarantine.csv", dtype=str, keep_default_na=False)
    [reason] = quarantine["reason"]
    assert quarantine["case_id"].iloc[0] == importers.folder_pseudonym(folder, "s3cret")
    assert "contains the series' PatientName" in reason and "rename the folder" in reason
    everything = _imported_everything(out, caplog, capsys)
    assert folder not in everything and not (out / "metadata.csv").exists()
    for part in re.split(r"[^A-Za-zÀ-ÿ]+", folder):
        assert len(part) < 4 or part not in everything


@pytest.mark.parametrize(
    "folder",
    ["pt_14Mar1952", "pt_14-MAR-52", "March 14th 1952", "1952mar14", "born_19520314", "dob_1952-03-14",
     "dob_14.03.1952", "dob 03-14-1952", "x14031952", "id_520314", "id_140352", "d_14.3.52"],
)
def test_dicom_folder_with_the_birth_date_in_any_spelling_is_refused(tmp_path, caplog, folder):
    src = tmp_path / "export"
    write_dicom_series(src / folder, dicom_hu(), tags={"PatientBirthDate": "19520314"}, **GEOMETRY)
    out = tmp_path / "cohort"
    caplog.set_level("DEBUG")
    report = importers.import_source("dicom", src, out, cohort="site-b", salt="s3cret")
    assert not report.imported
    [(case_id, reason)] = report.quarantined.items()
    assert case_id == importers.folder_pseudonym(folder, "s3cret") and "PatientBirthDate" in reason
    written = (out / "quarantine.csv").read_text() + caplog.text
    assert folder not in written


@pytest.mark.parametrize("folder", ["scan_05Apr2023", "scan 5 April 2023", "ct_050423", "ct_2023_4_5", "Doe^Jane"])
def test_dicom_folder_with_the_study_date_or_a_person_name_gets_a_pseudonym(tmp_path, folder):
    src = tmp_path / "export"
    write_dicom_series(src / folder, dicom_hu(), tags={"StudyDate": "20230405"}, **GEOMETRY)
    out = tmp_path / "cohort"
    report = importers.import_source("dicom", src, out, cohort="site-s", salt="s3cret")
    assert report.imported == [importers.folder_pseudonym(folder, "s3cret")] and not report.quarantined
    assert folder not in (out / "metadata.csv").read_text()


def test_dicom_folder_without_a_readable_header_gets_a_pseudonym(tmp_path):
    src = tmp_path / "export" / "brown"
    src.mkdir(parents=True)
    (src / "IM0001").write_bytes(b"not dicom")
    out = tmp_path / "cohort"
    report = importers.import_source("dicom", src.parent, out, cohort="site-u", salt="s3cret")
    # Nothing to check the name against: in doubt, pseudonymized (and quarantined: no series).
    [(case_id, reason)] = report.quarantined.items()
    assert case_id == importers.folder_pseudonym("brown", "s3cret") and "brown" not in reason


def test_harmless_names_are_kept():
    header = {"PatientName": "Müller^Jürgen", "PatientID": "MRN55501234", "PatientBirthDate": "19520314",
              "StudyDate": "20230405"}
    for name in ("anon001", "case01", "scan_a", "ct_v2", "series", "IM0004", "site-b_017"):
        assert importers.name_is_harmless(name, header), name
    # No header to compare with: nothing is harmless.
    assert not importers.name_is_harmless("anon001", None)


@pytest.mark.parametrize("folder", ["anon003", "scan_2021-05-03"])
def test_a_truncated_slice_is_named_by_position_not_by_its_file_name(tmp_path, caplog, capsys, folder):
    tags = {"PatientName": "BROWN^BOB", "PatientBirthDate": "19600101", "PatientID": "MRN777"}
    src = tmp_path / "export"
    written = write_dicom_series(src / folder, dicom_hu(), tags=tags, **GEOMETRY)
    named = [path.rename(path.with_name(f"BROWN_BOB_19600101_{i:03d}.dcm")) for i, path in enumerate(written, start=1)]
    data = named[2].read_bytes()
    named[2].write_bytes(data[: len(data) - 20])  # the pixel data is cut short
    out = tmp_path / "cohort"
    caplog.set_level("DEBUG")
    status = import_main(["dicom", str(src), "--out", str(out), "--cohort", "site-v", "--salt", "s3cret", "-v"])
    assert status == 1
    quarantine = pd.read_csv(out / "quarantine.csv", dtype=str, keep_default_na=False)
    [reason] = quarantine["reason"]
    assert "file 3 of 4 (by name)" in reason and "cannot decode pixel data" in reason
    everything = _imported_everything(out, caplog, capsys)
    for token in ("BROWN", "19600101", ".dcm", "MRN777"):
        assert token not in everything, token
    if folder == "anon003":  # a harmless folder keeps its name; only the file names are hidden
        assert quarantine["case_id"].iloc[0] == "anon003" and reason.startswith(str(src / "anon003"))
    else:
        assert quarantine["case_id"].iloc[0] == importers.folder_pseudonym(folder, "s3cret") and folder not in everything


def test_dicom_series_geometry_agrees_with_simpleitk_on_an_oblique_series(tmp_path):
    """The importer's own geometry (slice order and RAS affine) against SimpleITK's reader (GDCM),
    on a series tilted 30 degrees about z and 20 about x, written in shuffled file order."""
    import SimpleITK as sitk  # installed by .ci/setup
    hu = dicom_hu(shape=(7, 6, 5), seed=3)
    a, b = np.deg2rad(30.0), np.deg2rad(20.0)
    rotation = np.array([[1, 0, 0], [0, np.cos(b), -np.sin(b)], [0, np.sin(b), np.cos(b)]]) @ np.array(
        [[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    row_cosines, column_cosines = rotation[:, 0], rotation[:, 1]
    normal = np.cross(row_cosines, column_cosines)
    src = tmp_path / "oblique"
    write_dicom_series(src, hu, pixel_spacing=(0.9, 0.75), orientation=(*row_cosines, *column_cosines),
                       first_position=(-40.0, 12.5, 80.0), step=tuple(2.0 * normal), file_order=[4, 1, 3, 0, 2])
    loaded = importers.list_dicom(src, cohort="site-c")[0].load()

    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(src)))
    image = reader.Execute()
    direction = np.array(image.GetDirection()).reshape(3, 3)
    reference_lps = np.eye(4)
    reference_lps[:3, :3] = direction * np.array(image.GetSpacing())
    reference_lps[:3, 3] = image.GetOrigin()
    reference_ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ reference_lps
    assert not np.allclose(np.abs(direction), np.eye(3), atol=0.1), "the series is oblique"
    # ImagePositionPatient is written with 6 significant digits ("%g"): agreement to 1e-3 mm.
    np.testing.assert_allclose(loaded.affine, reference_ras, atol=1e-3)
    reference = np.transpose(sitk.GetArrayFromImage(image), (2, 1, 0))  # (z, y, x) -> (column, row, slice)
    np.testing.assert_array_equal(loaded.ct, reference)
    np.testing.assert_array_equal(loaded.ct, hu)  # written in order along the normal
