"""Content signatures of scans, to recognize a model's training scans under new case and patient ids.

The audit's duplicate layer, kept small enough to travel with a model: per scan the canonical
sha256 of its voxels (identical voxels under any name, header, dtype or affine) and its 16^3
screening signature (:func:`lightning_modules.cohorts.audit.volumes.volume_signatures`, float16:
8 KiB a scan). Training records them for its training scans (an artifact of the run and the
checkpoint's provenance); evaluation computes them for the evaluated scans and refuses a scan that
has a training scan's voxels, or correlates with one at or above :data:`MATCH_THRESHOLD`. Without
the audit's 32^3 confirmation the threshold is stricter than the audit's 0.98: the screen's blur
raises correlations (two phases of one phantom patient reach 0.998, different patients stay below
0.97), and a re-saved or re-exported copy stays above 0.995.

Reading a CT costs far more than its signature, so signatures are cached per file (its resolved
path, size and modification time) in a folder the caller names.

Example::

    training = scan_signatures(cohort, train_ids, cache_dir=Path("outputs/.scan_signatures"))
    for match in duplicate_matches(scan_signatures(external, test_ids), training):
        print(match.case_id, "duplicates", match.training_case_id)
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from lightning_modules.cohorts.audit.volumes import CONFIRM_SIZE, SIGNATURE_SIZE, canonical_sha256, volume_signatures
from lightning_modules.data.cohort import Cohort, CohortError
from lightning_modules.data.validation import READ_ERRORS, read_volume
from lightning_modules.infrastructure.files import atomic_write_bytes

MATCH_THRESHOLD = 0.995
# Bumped when the signature changes, so cached files of another definition are not reused.
SIGNATURE_VERSION = 1


@dataclass
class ScanSignatures:
    """Per scan: its case id, the canonical sha256 of its voxels and its coarse signature (N x 4,096 float16)."""

    case_ids: list[str]
    sha256: list[str]
    coarse: np.ndarray

    def to_payload(self) -> dict:
        """Plain types and a tensor only, so a checkpoint holding it still loads with ``weights_only``."""
        return {"case_ids": list(self.case_ids), "sha256": list(self.sha256),
                "coarse": torch.as_tensor(self.coarse.astype(np.float16))}

    @classmethod
    def from_payload(cls, payload: dict) -> "ScanSignatures":
        coarse = payload["coarse"]
        coarse = coarse.numpy() if isinstance(coarse, torch.Tensor) else np.asarray(coarse)
        return cls([str(c) for c in payload["case_ids"]], [str(h) for h in payload["sha256"]], coarse.astype(np.float16))

    def to_npz(self) -> bytes:
        buffer = io.BytesIO()
        np.savez_compressed(buffer, case_ids=np.asarray(self.case_ids, dtype=str), sha256=np.asarray(self.sha256, dtype=str),
                            coarse=self.coarse.astype(np.float16))
        return buffer.getvalue()

    @classmethod
    def from_npz(cls, path: str | Path) -> "ScanSignatures":
        with np.load(path, allow_pickle=False) as data:
            return cls([str(c) for c in data["case_ids"]], [str(h) for h in data["sha256"]], data["coarse"].astype(np.float16))


@dataclass(frozen=True)
class ScanMatch:
    """An evaluated scan that duplicates a training scan: identical voxels, or coarse NCC >= the threshold."""

    case_id: str
    training_case_id: str
    ncc: float
    exact: bool

    def __str__(self) -> str:
        how = "identical voxels" if self.exact else f"NCC {self.ncc:.4f} of the {SIGNATURE_SIZE}^3 signatures"
        return f"case {self.case_id}: its scan duplicates training case {self.training_case_id} ({how})"


def _cache_key(path: Path) -> str:
    stat = path.stat()
    text = f"{SIGNATURE_VERSION}:{SIGNATURE_SIZE}:{CONFIRM_SIZE}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _one_scan(path: Path, cache_dir: Path | None) -> tuple[str, np.ndarray]:
    cached = cache_dir / f"{_cache_key(path)}.npz" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        with np.load(cached, allow_pickle=False) as data:
            return str(data["sha256"]), data["coarse"].astype(np.float16)
    _, data = read_volume(path)
    data = np.squeeze(data) if data.ndim > 3 else data
    if data.ndim != 3:
        raise ValueError(f"CT is not a 3D volume (shape {data.shape})")
    digest = canonical_sha256(data)
    # The audit's screening signature, computed as the audit does (from the 32^3 grid).
    coarse = volume_signatures(data, SIGNATURE_SIZE, CONFIRM_SIZE)[0].astype(np.float16)
    if cached is not None:
        buffer = io.BytesIO()
        np.savez(buffer, sha256=np.asarray(digest), coarse=coarse)
        atomic_write_bytes(cached, buffer.getvalue())
    return digest, coarse


def scan_signatures(cohort: Cohort, case_ids: Sequence[str], cache_dir: str | Path | None = None) -> ScanSignatures:
    """The signatures of a cohort's scans, read once per file and cached in ``cache_dir`` when given.

    Raises:
        CohortError: a CT that cannot be read (naming its case and file).
    """
    folder = Path(cache_dir) if cache_dir is not None else None
    hashes, rows, problems = [], [], []
    for case_id in case_ids:
        path = cohort.case(str(case_id)).ct_path
        try:
            digest, coarse = _one_scan(path, folder)
        except READ_ERRORS as error:
            problems.append(f"{case_id}: {path}: cannot read the CT for its scan signature ({error})")
            continue
        hashes.append(digest)
        rows.append(coarse)
    if problems:
        raise CohortError(problems, cohort.root)
    coarse = np.stack(rows) if rows else np.zeros((0, SIGNATURE_SIZE**3), np.float16)
    return ScanSignatures([str(c) for c in case_ids], hashes, coarse)


def duplicate_matches(evaluated: ScanSignatures, training: ScanSignatures, threshold: float = MATCH_THRESHOLD) -> list[ScanMatch]:
    """Each evaluated scan's best training match when it is a duplicate (identical voxels first, else
    the highest coarse NCC at or above ``threshold``); a scan under its own training case id is left
    to the case check."""
    if not evaluated.case_ids or not training.case_ids:
        return []
    by_hash: dict[str, str] = {}
    for case_id, digest in zip(training.case_ids, training.sha256):
        by_hash.setdefault(digest, case_id)
    ncc = evaluated.coarse.astype(np.float32) @ training.coarse.astype(np.float32).T
    matches = []
    for row, (case_id, digest) in enumerate(zip(evaluated.case_ids, evaluated.sha256)):
        same = by_hash.get(digest)
        best = int(ncc[row].argmax())
        if same is not None and same != case_id:
            matches.append(ScanMatch(case_id, same, 1.0, True))
        elif same is None and ncc[row, best] >= threshold and training.case_ids[best] != case_id:
            matches.append(ScanMatch(case_id, training.case_ids[best], float(ncc[row, best]), False))
    return matches
