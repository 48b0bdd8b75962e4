"""The real example CT round trip: download the pinned TotalSegmentator sdist from PyPI, import TS_EXAMPLE.

Needs the package registry (about 8 MB, a few seconds); the fetch happens once per module into a
temporary cache. Also checks the DICOM importer on the sdist's real DICOM series against the grid
TotalSegmentator's own conversion (dicom2nifti) gave its segmentation.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/cohorts/test_example_ct.py -x -q
"""

from __future__ import annotations

import gzip
import os
import subprocess
import time

import nibabel as nib
import numpy as np
import pytest

from lightning_modules.cohorts import example_ct
from lightning_modules.data.cohort import load_cohort
from lightning_modules.cohorts.importers import TOTALSEGMENTATOR_V2_LABELS, list_dicom, run_import
from lightning_modules.cohorts.importers.class_maps import SOURCE_NAME_TO_ATLAS
from lightning_modules.data.validation import validate_cohort


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("cohort")
    start = time.perf_counter()
    case_dir = example_ct.fetch_example(out, cache)
    seconds = time.perf_counter() - start
    sdist = cache / example_ct.SDIST_FILE
    print(f"fetch-example: {sdist.stat().st_size / 1e6:.1f} MB sdist, {seconds:.1f} s")
    return cache, out, case_dir


def test_example_case_is_a_valid_cohort_case(fetched):
    cache, out, case_dir = fetched
    assert case_dir == example_ct.example_case_dir(out) == out / example_ct.EXAMPLE_CASE_ID
    organs = sorted(SOURCE_NAME_TO_ATLAS[name] for name in TOTALSEGMENTATOR_V2_LABELS.values())
    assert validate_cohort(out, classes=organs) == []
    assert validate_cohort(out) == []  # the default task: pancreas required, lesion file absent = no lesion
    cohort = load_cohort(out)
    assert cohort.case_ids == [example_ct.EXAMPLE_CASE_ID]
    case = cohort.case(example_ct.EXAMPLE_CASE_ID)
    assert case.available_classes() == organs and "pancreatic_lesion" not in case.available_classes()
    row = cohort.row(example_ct.EXAMPLE_CASE_ID)
    assert row["cohort"] == example_ct.EXAMPLE_COHORT
    assert row["sex"] == "Unknown" and row["phase"] == "Unknown" and row["race"] == "Unknown" and np.isnan(row["age"])
    assert cohort.resolve_tumor_labels().tolist() == [0]
    for name in organs:
        assert np.asarray(nib.load(str(example_ct.example_mask_path(name, out))).dataobj).any(), name


def test_imported_files_keep_the_original_grid_affine_and_values(fetched):
    cache, out, _ = fetched
    source_ct = nib.load(str(example_ct.example_source_ct_path(cache)))
    source_seg = nib.load(str(example_ct.example_source_segmentation_path(cache)))
    ct = nib.load(str(example_ct.example_ct_path(out)))
    assert ct.shape == source_ct.shape == (122, 101, 30)
    np.testing.assert_array_equal(ct.affine, source_ct.affine)
    np.testing.assert_array_equal(np.asarray(ct.dataobj), np.asarray(source_ct.dataobj))
    labels = np.asarray(source_seg.dataobj)
    for value, name in TOTALSEGMENTATOR_V2_LABELS.items():
        mask = nib.load(str(example_ct.example_mask_path(SOURCE_NAME_TO_ATLAS[name], out)))
        np.testing.assert_array_equal(mask.affine, source_ct.affine)
        np.testing.assert_array_equal(np.asarray(mask.dataobj), labels == value)


def test_second_fetch_uses_the_cache_and_skips_the_case(fetched, monkeypatch):
    cache, out, _ = fetched
    watched = [example_ct.example_source_ct_path(cache), example_ct.example_ct_path(out)]
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in watched]

    def no_download(*args, **kwargs):
        raise AssertionError("the cache was not used: pip was called")

    monkeypatch.setattr(subprocess, "run", no_download)
    example_ct.fetch_example(out, cache)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in watched] == before


def test_corrupt_cached_file_is_re_extracted_and_a_wrong_hash_is_refused(fetched, monkeypatch, tmp_path):
    cache, _, _ = fetched
    segmentation = example_ct.example_source_segmentation_path(cache)
    member, (relative, digest) = list(example_ct.EXAMPLE_FILES.items())[1]
    assert example_ct.source_dir(cache) / relative == segmentation
    segmentation.write_bytes(b"not the file")
    example_ct.extract_files(example_ct.EXAMPLE_FILES, cache)
    assert example_ct.file_sha256(segmentation) == digest

    segmentation.unlink()
    monkeypatch.setitem(example_ct.EXAMPLE_FILES, member, (relative, "0" * 64))
    with pytest.raises(example_ct.ExampleFetchError, match=f"{member} has sha256 {digest}, expected 0{{64}}"):
        example_ct.extract_files(example_ct.EXAMPLE_FILES, cache)
    assert not segmentation.exists()


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    # Ignore pip's configuration files (local indexes, find-links) and point it at a closed port.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(example_ct.ExampleFetchError, match="could not download totalsegmentator==2.4.0"):
        example_ct.download_sdist(tmp_path)
    assert not (tmp_path / example_ct.SDIST_FILE).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pip-download.")]


def test_real_dicom_series_matches_totalsegmentator_geometry_and_stays_private(fetched, tmp_path):
    cache, _, _ = fetched
    series = example_ct.fetch_example_dicom(cache)
    cases = list_dicom(series, cohort="totalsegmentator-example-dicom")
    out = tmp_path / "dicom_cohort"
    report = run_import(cases, out)
    assert report.imported == ["example_ct_dicom"], report.quarantined
    ours = nib.load(str(out / "example_ct_dicom" / "ct.nii.gz"))
    reference = nib.load(str(example_ct.example_dicom_segmentation_path(cache)))
    # TotalSegmentator converted the series with dicom2nifti and flipped an axis; on the closest
    # canonical (RAS) grid both must be the same voxels at the same positions.
    ours_ras, reference_ras = nib.as_closest_canonical(ours), nib.as_closest_canonical(reference)
    assert ours_ras.shape == reference_ras.shape == (512, 512, 20)
    np.testing.assert_allclose(ours_ras.affine, reference_ras.affine, atol=1e-3)
    hu = np.asarray(ours_ras.dataobj)
    labels = np.asarray(reference_ras.dataobj)
    names = {name: value for value, name in TOTALSEGMENTATOR_V2_LABELS.items()}
    # Contrast-enhanced abdomen (ContrastBolusAgent APPLIED): soft-tissue organs and a bright aorta,
    # air at -1024 HU; a wrong rescale or a flipped axis would break these.
    assert 40 < hu[labels == names["liver"]].mean() < 200
    assert 40 < hu[labels == names["spleen"]].mean() < 200
    assert hu[labels == names["aorta"]].mean() > 120
    assert hu.min() == -1024
    metadata = (out / "metadata.csv").read_text()
    assert "SIEMENS Biograph40_mCT 4R" in metadata and ",Unknown," in metadata
    # The header carries an institution address and a station name; neither may reach the cohort.
    everything = b"".join(
        gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes() for p in out.rglob("*") if p.is_file()
    )
    for value in (b"Petersgraben", b"Basel", b"PETCT2", b"20221208"):
        assert value not in everything
