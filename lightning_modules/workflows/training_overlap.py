"""What a model was trained on, recorded at training and checked at evaluation (docs/explanation/data.md "Split files").

At training (rank 0): :func:`training_provenance` gathers the training case and patient ids, the
split file's sha256, the cases the generator of any synthetic data learned from, and the content
signatures of the training scans (:mod:`lightning_modules.cohorts.audit.signatures`);
``benchx train`` puts it into every checkpoint (``RecordProvenance``) and logs the signatures as
the run's ``training_scan_signatures.npz`` (:func:`log_training_signatures`).

At evaluation: :func:`training_record` reads it back from the training run (its artifacts) and
falls back to the checkpoint's own provenance, so a checkpoint copied away from its run folder is
checked like ``--run-id``; :func:`overlap_problems` lists every evaluated case that is a training
case, a case of a training patient, a case the generator learned from, or a training scan under
another case id. A model whose training is unknown is evaluated with the check ``unavailable``
(``benchx compare`` refuses such an evaluation).

Example::

    record = training_record(client, run_id, checkpoint, folder)
    problems = overlap_problems(record, evaluated, lambda ids: scan_signatures(cohort, ids, cache))
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.cohorts.audit.signatures import ScanSignatures, duplicate_matches, scan_signatures
from lightning_modules.data.cohort import Cohort
from lightning_modules.data.synthetic_provenance import generator_training_cases
from lightning_modules.models.checkpoints import checkpoint_provenance
from lightning_modules.tracking.datasets import SYNTHETIC_COHORT_TAG
from lightning_modules.tracking.provenance import GENERATOR_CASES_ARTIFACT, generator_overlap, training_cases, training_overlap

SIGNATURES_ARTIFACT = "training_scan_signatures.npz"
SIGNATURE_CACHE = ".scan_signatures"


def signature_cache(output_dir: str | Path) -> Path:
    """Where scan signatures are cached: ``<tracking.output_dir>/.scan_signatures``."""
    return Path(output_dir) / SIGNATURE_CACHE


# ------------------------------------------------------------------------------------------------
# At training


def training_provenance(
    split: pd.DataFrame, cohort: Cohort, split_sha256: str, synthetic_root: str | Path | None, run_id: str,
    cache_dir: str | Path | None,
) -> tuple[dict, ScanSignatures]:
    """The checkpoint provenance of a training on ``split``'s training rows of ``cohort`` (see
    ``RecordProvenance``), and the training scans' signatures it holds."""
    train = split.loc[split["split"] == "train"].astype(str)
    case_ids = list(train["case_id"])
    patients = list(train["patient_id"]) if "patient_id" in train.columns else list(case_ids)
    signatures = scan_signatures(cohort, case_ids, cache_dir)
    generator = generator_training_cases(synthetic_root, cohort.metadata) if synthetic_root else None
    provenance = {
        "training_cases": case_ids,
        "patient_ids": patients,
        "split_sha256": split_sha256,
        "synthetic_cohort": str(synthetic_root or ""),
        "generator_cases": list(generator["case_id"]) if generator is not None else [],
        "generator_patient_ids": list(generator["patient_id"]) if generator is not None else [],
        "scan_signatures": signatures.to_payload(),
        "training_run_id": run_id,
    }
    return provenance, signatures


def log_training_signatures(client: MlflowClient, run_id: str, signatures: ScanSignatures) -> None:
    """Log the training scans' signatures as the run's :data:`SIGNATURES_ARTIFACT`."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / SIGNATURES_ARTIFACT
        path.write_bytes(signatures.to_npz())
        client.log_artifact(run_id, str(path))


# ------------------------------------------------------------------------------------------------
# At evaluation


@dataclass
class TrainingRecord:
    """What is known of a model's training: its cases (case_id, patient_id), the cases its synthetic
    data's generator learned from (None when unknown), whether it mixed in synthetic data, and its
    training scans' signatures (None when not recorded)."""

    source: str
    cases: pd.DataFrame
    generator: pd.DataFrame | None = None
    synthetic: bool = False
    signatures: ScanSignatures | None = None


def record_from_provenance(provenance: dict, source: str) -> TrainingRecord:
    """The training record a checkpoint carries (``RecordProvenance``)."""
    cases = pd.DataFrame({"case_id": provenance.get("training_cases", []),
                          "patient_id": provenance.get("patient_ids", [])}, dtype=str)
    synthetic = bool(provenance.get("synthetic_cohort"))
    generator = pd.DataFrame({"case_id": provenance.get("generator_cases", []),
                              "patient_id": provenance.get("generator_patient_ids", [])}, dtype=str) if synthetic else None
    payload = provenance.get("scan_signatures")
    signatures = ScanSignatures.from_payload(payload) if payload else None
    return TrainingRecord(source, cases, generator, synthetic, signatures)


def training_record(client: MlflowClient, training_run_id: str | None, checkpoint: str | Path | None,
                    folder: str | Path) -> TrainingRecord | None:
    """What the training run records (its artifacts), else what the checkpoint carries; None when neither says.

    A run that records its cases but not its scans' signatures takes them from the checkpoint when
    it carries them.
    """

    def from_checkpoint() -> TrainingRecord | None:
        # Read only when needed: it loads the whole checkpoint.
        if checkpoint is None or not Path(checkpoint).is_file():
            return None
        provenance = checkpoint_provenance(checkpoint)
        return record_from_provenance(provenance, f"checkpoint {Path(checkpoint).name}") if provenance else None

    if training_run_id is None:
        return from_checkpoint()
    cases = training_cases(client, training_run_id, folder)
    if cases is None:
        return from_checkpoint()
    generator = training_cases(client, training_run_id, folder, GENERATOR_CASES_ARTIFACT)
    synthetic = bool(client.get_run(training_run_id).data.tags.get(SYNTHETIC_COHORT_TAG))
    names = {item.path for item in client.list_artifacts(training_run_id)}
    if SIGNATURES_ARTIFACT in names:
        signatures = ScanSignatures.from_npz(client.download_artifacts(training_run_id, SIGNATURES_ARTIFACT, str(folder)))
    else:
        carried = from_checkpoint()
        signatures = carried.signatures if carried is not None else None
    return TrainingRecord(f"training run {training_run_id}", cases, generator, synthetic, signatures)


def overlap_problems(record: TrainingRecord, evaluated: pd.DataFrame,
                     signatures_of: Callable[[Sequence[str]], ScanSignatures] | None) -> list[str]:
    """One line per evaluated case that the model learned from: a training case or patient, a case the
    generator of its synthetic data learned from, or a training scan under another case id
    (``signatures_of`` computes the evaluated scans' signatures; None skips that check)."""
    problems = training_overlap(evaluated, record.cases)
    if record.generator is not None:
        problems += generator_overlap(evaluated, record.generator)
    if record.signatures is not None and signatures_of is not None:
        named = {line.split(":", 1)[0] for line in problems}
        ids = [str(case) for case in evaluated["case_id"]]
        problems += [str(match) for match in duplicate_matches(signatures_of(ids), record.signatures)
                     if f"case {match.case_id}" not in named]
    return problems


def partial_check_note(record: TrainingRecord) -> str | None:
    """What the check could not cover for this model (None when it covered everything)."""
    missing = []
    if record.synthetic and record.generator is None:
        missing.append(f"the generator's training cases are unknown (no {GENERATOR_CASES_ARTIFACT})")
    if record.signatures is None:
        missing.append(f"duplicate scans not checked (no {SIGNATURES_ARTIFACT})")
    return "; ".join(missing) or None
