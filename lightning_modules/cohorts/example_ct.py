"""The real example CT: TotalSegmentator's test scan, fetched from PyPI and imported as case ``TS_EXAMPLE``.

The ``totalsegmentator`` source distribution (pinned to 2.4.0, the smallest recent sdist that
carries them: 8.2 MB) ships real abdominal CT in ``tests/reference_files``. ``benchx fetch-example``
downloads that sdist with pip from the package registry, checks its sha256, extracts only the files
below (each checked against its sha256) and imports them with the TotalSegmentator importer into
layout A as case ``TS_EXAMPLE`` of cohort ``totalsegmentator-example``:

- CT: ``example_ct_sm.nii.gz`` (122 x 101 x 30 voxels, 3 mm isotropic, RAS), the scan that
  TotalSegmentator's own tests segment. Its ``example_ct.nii.gz`` (112 slices) is *not* used: the
  shipped segmentation lies on the 30-slice grid, and masks are never resampled.
- Masks: ``example_seg.nii.gz``, TotalSegmentator's multilabel output on that scan (v2 "total"
  numbering): a model's prediction, not a manual reference. The nine AbdomenAtlas organs are
  imported (liver, pancreas, spleen, stomach, kidneys, aorta, postcava, gall_bladder).
- It has organ labels but no pancreatic lesion, and TotalSegmentator does not annotate lesions:
  under the cohort convention (``docs/explanation/data.md "Cohorts on disk"``) the missing ``pancreatic_lesion`` file reads as "no lesion", so the case
  counts as tumor-negative by the cohort convention, not by a finding. Demographics and phase are
  Unknown (the sdist records none).

``--dicom`` also extracts the sdist's real DICOM series (20 JPEG 2000 slices, 512 x 512, Siemens
Biograph40 mCT) and TotalSegmentator's segmentation of it, the reference for checking the DICOM
importer's geometry. Files are cached (default ``~/.cache/benchx``, or ``$BENCHX_CACHE``): nothing
is downloaded when the extracted files are present with the right sha256.

Run::

    benchx fetch-example --out data/example_ct
    benchx fetch-example --out data/example_ct --dicom --cache /tmp/benchx-cache
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from lightning_modules.cohorts.importers.nifti import TOTALSEGMENTATOR_MULTILABEL_FILE, list_totalsegmentator
from lightning_modules.cohorts.importers.resumable_import import run_import
from lightning_modules.data.cohort import CT_FILE, SEGMENTATION_DIR
from lightning_modules.infrastructure.files import atomic_write_bytes, file_sha256

logger = logging.getLogger(__name__)

EXAMPLE_CASE_ID = "TS_EXAMPLE"
EXAMPLE_COHORT = "totalsegmentator-example"
DEFAULT_OUT = Path("data/example_ct")
CACHE_ENVIRONMENT_VARIABLE = "BENCHX_CACHE"

TOTALSEGMENTATOR_VERSION = "2.4.0"
SDIST_FILE = f"TotalSegmentator-{TOTALSEGMENTATOR_VERSION}.tar.gz"
SDIST_SHA256 = "1274bb64e483db7b144bcab6f59adea0704d7423303c1ee23b42a40e8be81eb6"
_REFERENCE_FILES = f"TotalSegmentator-{TOTALSEGMENTATOR_VERSION}/tests/reference_files"

# sdist member -> (path under the extracted source folder, sha256). The CT and its segmentation are
# laid out as a TotalSegmentator case folder so the ordinary importer reads them.
EXAMPLE_FILES = {
    f"{_REFERENCE_FILES}/example_ct_sm.nii.gz": (
        f"{EXAMPLE_CASE_ID}/{CT_FILE}",
        "e50c00b2914e2cac0aaee8e7f3b5f57d44d9f21bfd5c0577271c54c0cb49e9fb",
    ),
    f"{_REFERENCE_FILES}/example_seg.nii.gz": (
        f"{EXAMPLE_CASE_ID}/{TOTALSEGMENTATOR_MULTILABEL_FILE}",
        "f93d765ed6c88b3d398088ddf190873f38ed8636c09ad036c36d4858f2920462",
    ),
}
_DICOM_SHA256 = {
    "16573": "4c5633409fa4d3edf6871e5684e9e1b10325b4d0949997582f43b23a684d0dc4",
    "16574": "9148f91127145497f4d6c6f0780f9452504cd7fe5088ec8f2bf2b21800c731ff",
    "16575": "3edaccec892e0821440cbefe3d5465923bb5146c316cbaf58f578d962f120484",
    "16576": "9b68685f0c5f9bfcfc2c397f4fadf431da288d7422ca72e7d9031d4e039418cd",
    "16577": "c8d2c0dc05e414d47d3652c658d8fecc20c3cf7ce106c10d84ad033d39700bcc",
    "16578": "0ee2c1d58e06cedd91483ca35c04da3c26fea0dbe88aaf1eaa950b57f38357d6",
    "16579": "c76cf0818d4215b92883d109b8a0b62ae0a4d81637eed98738f9c62b6f49bb72",
    "16580": "106e20514fd3ca66895e14dbfba96c01c1195e4ed890c035d4368dd71f3ee116",
    "16581": "5804e6c4a50f4d5b20040ac82a1c6d79cba5f7267d71f10b0a1b49eda1bc13ff",
    "16582": "bef219a16b22949224de4581a2d288863b2585d29556ac24021f03307378cb39",
    "16583": "9de5a49e880417d5330fe299115fdb95831a98234216a31c5c0e9a0be9a6dcd3",
    "16584": "fa00c8d81ec8aa0d0cfc4e05343782c3a75a4c60df8cccf9ff5db42ac454e61d",
    "16585": "ebba0900b0f728db0c94c769db3e5ca38a0cd916386a727541eb3e56350770e5",
    "16586": "f084ec95cfba25efb7cbe86e8b4966b051904037e8385f58fe398c5475693b89",
    "16587": "20a9b88a30ea8a824ac65cb19c1ebf80964b41ff476497706ff2a286e5f27a25",
    "16588": "2a515d3b60f3ff733aac1fc5414206c331e3ed2ccef8c2e0c30b844c538e3ed8",
    "16589": "5880669f1bc36b09cad4bdf487992ec415da0afa014e927efc282e612f467574",
    "16590": "7af4dd5b5766a87368939116b91f90d989820e7b2237fb9bcd10d47db0960875",
    "16591": "671306f4462ae881976c18c6a2d8a1567279fb0166ef0e9e8a41271fac9c1cbb",
    "16592": "fdb76ad5272f074e07cc81509604fd163f2f8a9903d34b16ba6f078250373c51",
}
# The slices keep the sdist's numbering only (their original names embed the scanner's UIDs).
EXAMPLE_DICOM_FILES = {
    f"{_REFERENCE_FILES}/example_ct_dicom/CT.1.3.12.2.1107.5.1.4.60064.300000221208081134280000{number}": (
        f"example_ct_dicom/slice_{number}.dcm",
        digest,
    )
    for number, digest in _DICOM_SHA256.items()
}
EXAMPLE_DICOM_FILES[f"{_REFERENCE_FILES}/example_seg_dicom.nii.gz"] = (
    "example_seg_dicom.nii.gz",
    "8329793f9048088d6cef0fc45c76eb75bcfc4e9c3befa58257469276751c3ce6",
)

PIP_TIMEOUT_S = 600


class ExampleFetchError(RuntimeError):
    """The example could not be fetched or failed its checksum; the message says which and why."""


def default_cache_dir() -> Path:
    """``$BENCHX_CACHE`` if set, else ``~/.cache/benchx``."""
    return Path(os.environ.get(CACHE_ENVIRONMENT_VARIABLE) or Path.home() / ".cache" / "benchx")


def source_dir(cache: Path | str | None = None) -> Path:
    """Where the checked files extracted from the sdist live."""
    return Path(cache or default_cache_dir()) / f"totalsegmentator-{TOTALSEGMENTATOR_VERSION}"


def example_case_dir(out: Path | str = DEFAULT_OUT) -> Path:
    """The imported case folder in the cohort (layout A)."""
    return Path(out) / EXAMPLE_CASE_ID


def example_ct_path(out: Path | str = DEFAULT_OUT) -> Path:
    """The imported CT (int16 HU, the scan's own grid and affine)."""
    return example_case_dir(out) / CT_FILE


def example_mask_path(class_name: str, out: Path | str = DEFAULT_OUT) -> Path:
    """An imported organ mask, e.g. ``example_mask_path("pancreas")``."""
    return example_case_dir(out) / SEGMENTATION_DIR / f"{class_name}.nii.gz"


def example_source_ct_path(cache: Path | str | None = None) -> Path:
    """The CT exactly as extracted from the sdist (for checks against the original)."""
    return source_dir(cache) / EXAMPLE_CASE_ID / CT_FILE


def example_source_segmentation_path(cache: Path | str | None = None) -> Path:
    """TotalSegmentator's multilabel segmentation exactly as extracted from the sdist."""
    return source_dir(cache) / EXAMPLE_CASE_ID / TOTALSEGMENTATOR_MULTILABEL_FILE


def example_dicom_dir(cache: Path | str | None = None) -> Path:
    """The real DICOM series (after :func:`fetch_example_dicom`)."""
    return source_dir(cache) / "example_ct_dicom"


def example_dicom_segmentation_path(cache: Path | str | None = None) -> Path:
    """TotalSegmentator's segmentation of the DICOM series (its grid is the reference geometry)."""
    return source_dir(cache) / "example_seg_dicom.nii.gz"


def _has_sha256(path: Path, expected: str) -> bool:
    return path.is_file() and file_sha256(path) == expected


def download_sdist(cache: Path | str | None = None) -> Path:
    """The pinned sdist in the cache, downloaded with pip when absent or corrupt; sha256 checked.

    Raises:
        ExampleFetchError: pip failed (no network, registry unreachable) or the hash is wrong.
    """
    cache = Path(cache or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / SDIST_FILE
    if _has_sha256(target, SDIST_SHA256):
        return target
    with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-download.") as scratch:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"totalsegmentator=={TOTALSEGMENTATOR_VERSION}", "-d", scratch,
        ]  # fmt: skip
        logger.info("downloading %s from the package registry", SDIST_FILE)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise ExampleFetchError(
                f"pip download of totalsegmentator=={TOTALSEGMENTATOR_VERSION} timed out after {PIP_TIMEOUT_S} s"
            ) from error
        downloaded = [p for p in Path(scratch).iterdir() if p.name.lower() == SDIST_FILE.lower()]
        if result.returncode != 0 or not downloaded:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
            raise ExampleFetchError(
                f"could not download totalsegmentator=={TOTALSEGMENTATOR_VERSION} (sdist) with pip from the package "
                f"registry; is the network or the index reachable? pip said:\n{tail}"
            )
        actual = file_sha256(downloaded[0])
        if actual != SDIST_SHA256:
            raise ExampleFetchError(
                f"{SDIST_FILE}: sha256 {actual} does not match the pinned {SDIST_SHA256}; refusing to use it"
            )
        os.replace(downloaded[0], target)
    return target


def extract_files(files: dict[str, tuple[str, str]], cache: Path | str | None = None) -> Path:
    """Extract sdist members to the source folder, each checked against its sha256; cached files are kept.

    Args:
        files: sdist member -> (relative target path, sha256), e.g. :data:`EXAMPLE_FILES`.
        cache: the cache folder.

    Raises:
        ExampleFetchError: a member is missing from the sdist or its content has another sha256.
    """
    root = source_dir(cache)
    missing = {member: spec for member, spec in files.items() if not _has_sha256(root / spec[0], spec[1])}
    if not missing:
        return root
    sdist = download_sdist(cache)
    with tarfile.open(sdist, "r:gz") as archive:
        for member, (relative, expected) in missing.items():
            try:
                handle = archive.extractfile(member)
            except KeyError:
                handle = None
            if handle is None:
                raise ExampleFetchError(f"{sdist}: member {member} is missing")
            data = handle.read()
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise ExampleFetchError(f"{sdist}: {member} has sha256 {actual}, expected {expected}")
            atomic_write_bytes(root / relative, data)
    return root


def fetch_example(out: Path | str = DEFAULT_OUT, cache: Path | str | None = None) -> Path:
    """Fetch (or reuse) the example and import it into ``out`` as case ``TS_EXAMPLE``; return its folder.

    Raises:
        ExampleFetchError: download, checksum or import failed.
    """
    extract_files(EXAMPLE_FILES, cache)
    cases = list_totalsegmentator(source_dir(cache) / EXAMPLE_CASE_ID, cohort=EXAMPLE_COHORT)
    report = run_import(cases, out)
    if report.quarantined:
        raise ExampleFetchError(f"importing {EXAMPLE_CASE_ID} failed: {report.quarantined[EXAMPLE_CASE_ID]}")
    return example_case_dir(out)


def fetch_example_dicom(cache: Path | str | None = None) -> Path:
    """Extract the sdist's real DICOM series and its TotalSegmentator segmentation; return the series folder."""
    extract_files(EXAMPLE_DICOM_FILES, cache)
    return example_dicom_dir(cache)
