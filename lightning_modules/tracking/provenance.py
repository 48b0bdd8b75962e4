"""Which cases a model was trained on, and the check that an evaluation never scores them
(docs/explanation/data.md "Split files").

A training run logs ``training_cases.csv`` (case id and patient id of every real training case)
and, when it mixed in a synthetic cohort, ``generator_training_cases.csv`` (the cases the cohort's
generator learned from: a model trained on its output learned from them too). ``evaluate`` reads
both back and refuses an evaluation set that holds such a case, or a case of such a patient,
unless the caller overrides it explicitly (the override is recorded in the run).

Example::

    log_training_cases(client, run_id, split_table)                 # at training start
    problems = training_overlap(evaluated, training_cases(client, run_id, folder))
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd

from lightning_modules.tracking import check_run_id

TRAINING_CASES_ARTIFACT = "training_cases.csv"
GENERATOR_CASES_ARTIFACT = "generator_training_cases.csv"


def log_training_cases(client, run_id: str, split: pd.DataFrame) -> None:
    """Log the training cases of a split table (columns case_id, patient_id, split) to a run."""
    train = split.loc[split["split"] == "train", ["case_id", "patient_id"]].astype(str)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / TRAINING_CASES_ARTIFACT
        train.sort_values("case_id").to_csv(path, index=False)
        client.log_artifact(run_id, str(path))


def log_generator_training_cases(client, run_id: str, cases: pd.DataFrame) -> None:
    """Log the cases the generator of a mixed-in synthetic cohort learned from (case_id, patient_id)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / GENERATOR_CASES_ARTIFACT
        cases[["case_id", "patient_id"]].astype(str).sort_values("case_id").to_csv(path, index=False)
        client.log_artifact(run_id, str(path))


def training_cases(client, run_id: str, folder: str | Path, artifact: str = TRAINING_CASES_ARTIFACT) -> pd.DataFrame | None:
    """A training run's recorded training cases (case_id, patient_id), or None when it has none.
    ``artifact=GENERATOR_CASES_ARTIFACT``: the cases its synthetic data's generator learned from."""
    names = {item.path for item in client.list_artifacts(check_run_id(run_id))}
    if artifact not in names:
        return None
    path = client.download_artifacts(run_id, artifact, str(folder))
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def training_overlap(evaluated: pd.DataFrame, training: pd.DataFrame) -> list[str]:
    """One line per evaluated case that is a training case or belongs to a training patient.

    Args:
        evaluated: the evaluated cases (columns case_id, patient_id; e.g. the val and test rows of a split).
        training: the model's training cases (same columns).
    """
    train_cases = set(training["case_id"].astype(str).str.strip())
    train_patients = set(training["patient_id"].astype(str).str.strip())
    problems = []
    for case_id, patient_id in zip(evaluated["case_id"].astype(str).str.strip(), evaluated["patient_id"].astype(str).str.strip()):
        if case_id in train_cases:
            problems.append(f"case {case_id}: is one of the model's training cases")
        elif patient_id in train_patients:
            problems.append(f"case {case_id}: patient {patient_id} has training cases")
    return problems


def generator_overlap(evaluated: pd.DataFrame, generator: pd.DataFrame) -> list[str]:
    """One line per evaluated case that the generator of the model's synthetic training data learned
    from, or that belongs to a patient of such a case.

    Args:
        evaluated: the evaluated cases (columns case_id, patient_id).
        generator: the cases the generator learned from (same columns; patient may be empty).
    """
    cases = set(generator["case_id"].astype(str).str.strip())
    patients = {p: c for c, p in zip(generator["case_id"].astype(str).str.strip(), generator["patient_id"].astype(str).str.strip()) if p}
    problems = []
    for case_id, patient_id in zip(evaluated["case_id"].astype(str).str.strip(), evaluated["patient_id"].astype(str).str.strip()):
        if case_id in cases:
            problems.append(f"case {case_id}: the generator of the model's synthetic training data learned from it")
        elif patient_id in patients:
            problems.append(f"case {case_id}: patient {patient_id}: the generator of the model's synthetic training data "
                            f"learned from this patient's case {patients[patient_id]}")
    return problems
