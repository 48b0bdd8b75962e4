"""Which cases a model was trained on, and the check that an evaluation never scores them
(docs/design.md "Split files").

A training run logs ``training_cases.csv`` (case id and patient id of every real training case).
``evaluate`` reads it back and refuses an evaluation set that holds a training case, or a case of a
training patient, unless the caller overrides it explicitly (the override is recorded in the run).

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


def log_training_cases(client, run_id: str, split: pd.DataFrame) -> None:
    """Log the training cases of a split table (columns case_id, patient_id, split) to a run."""
    train = split.loc[split["split"] == "train", ["case_id", "patient_id"]].astype(str)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / TRAINING_CASES_ARTIFACT
        train.sort_values("case_id").to_csv(path, index=False)
        client.log_artifact(run_id, str(path))


def training_cases(client, run_id: str, folder: str | Path) -> pd.DataFrame | None:
    """A training run's recorded training cases (case_id, patient_id), or None when it has none."""
    names = {item.path for item in client.list_artifacts(check_run_id(run_id))}
    if TRAINING_CASES_ARTIFACT not in names:
        return None
    path = client.download_artifacts(run_id, TRAINING_CASES_ARTIFACT, str(folder))
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
