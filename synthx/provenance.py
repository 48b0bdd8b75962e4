"""Where a SynthX generator comes from, and the check that it may paint into the current split.

Training writes ``synthx_provenance.json`` into the saved pipeline folder (so it travels with the
pipeline, also as the MLflow artifact ``pipeline``): the real cases it learned from, the sha256 of
the split file it was trained on, its MLflow run and its condition dropout. Generation reads it
back and refuses a generator that learned from any case that is not a real TRAINING case of the
split in use, naming the first such case: a generator trained on another split or fold could
otherwise paint tumors it memorized from this split's validation or test patients into training
scans (docs/design.md "Synthetic data"). A generator trained on a different split file is accepted
only when every case it learned from is a training case here; without a case list the split
hashes must agree; a pipeline without a provenance file is refused.

Example::

    provenance = read_provenance("outputs/synthx/pipeline")
    check_provenance(provenance, split_table, split_sha256("splits/phantom.csv"))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

PROVENANCE_FILE = "synthx_provenance.json"


class ProvenanceError(ValueError):
    """A generator may not paint into this split; the message names the first offending case or the hash."""


@dataclass
class GeneratorProvenance:
    """What a saved generator learned from.

    Args:
        training_cases: the real cases whose tumors trained it.
        split_sha256: sha256 of the split file it was trained with.
        generator_run_id: its MLflow training run ("" when unknown).
        condition_dropout_all: probability that all conditions were nulled in training; classifier-free
            guidance (scale > 1) needs it above 0.
    """

    training_cases: list[str] = field(default_factory=list)
    split_sha256: str = ""
    generator_run_id: str = ""
    condition_dropout_all: float = 0.0

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / PROVENANCE_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def read_provenance(folder: str | Path) -> GeneratorProvenance | None:
    """The provenance saved with a pipeline folder, or None when the folder has none."""
    path = Path(folder) / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return GeneratorProvenance(**data)
    except (ValueError, TypeError) as error:
        raise ProvenanceError(f"{path}: not a SynthX provenance file: {error}") from error


def check_provenance(provenance: GeneratorProvenance | None, split: pd.DataFrame, split_sha256: str, source: str = "generator") -> None:
    """Refuse a generator that learned from anything but this split's real training cases.

    Args:
        provenance: from :func:`read_provenance` (None: unknown).
        split: the current split table (``case_id, split``).
        split_sha256: the current split file's sha256.
        source: the generator's name in messages (its folder or URI).

    Raises:
        ProvenanceError: naming the first training case of the generator outside this split's
            training set (and where it is instead), or the hash when no case list is known.
    """
    if provenance is None:
        raise ProvenanceError(
            f"{source} has no {PROVENANCE_FILE}: which cases it learned from is unknown, so it could paint "
            "validation or test tumors into training scans; retrain it with benchx synthx-train on this split"
        )
    if not provenance.training_cases:
        if provenance.split_sha256 != split_sha256:
            raise ProvenanceError(
                f"{source} was trained on split sha256 {provenance.split_sha256 or 'unknown'}, the current split is "
                f"{split_sha256}, and its training cases are not recorded"
            )
        return
    split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
    for case_id in provenance.training_cases:
        where = split_of.get(str(case_id))
        if where != "train":
            place = f"in the '{where}' split" if where else "not in the current split file"
            raise ProvenanceError(
                f"{source} learned from case {case_id}, which is {place}: a generator may only have seen this "
                f"split's training cases (trained on split sha256 {provenance.split_sha256 or 'unknown'}, current {split_sha256})"
            )
