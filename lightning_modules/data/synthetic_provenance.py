"""What a synthetic cohort's generator learned from, and the check that the cohort may be used with a split.

A generator that learned from a case paints what it memorized of that case into every canvas. So
a synthetic cohort carries its generator's provenance (``synthx_provenance.json``: the real cases
the generator learned from, the sha256 of the split file it was trained on, its MLflow run), and
wherever the cohort is used -- mixed into training, audited, behind a model being evaluated --
every case the generator learned from must be a real training case of the split in use; the first
one that is not is named (docs/explanation/synthx.md "Synthetic data"). Checking the canvases alone is not
enough: under a new split, canvases that are all training cases can come from a generator that
learned from that split's validation or test cases.

``benchx synthx-train`` writes the file beside the saved pipeline and ``benchx synthesize`` copies
it into the synthetic cohort. A painter that learns nothing (the phantom painter) records
``trained: false``. A generator without a case list is accepted only with the same split file
(same sha256); a synthetic cohort without the file is refused, since what its generator saw is
unknown. This module is the base package's reader and check; the generator package's provenance module raises
them as ``ProvenanceError`` for generation.

Example::

    problem = cohort_provenance_problem("data/synthetic", split_table, split_sha256("splits/phantom.csv"))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from lightning_modules.infrastructure.files import atomic_write_bytes

PROVENANCE_FILE = "synthx_provenance.json"


@dataclass
class GeneratorProvenance:
    """What a saved generator learned from.

    Args:
        training_cases: the real cases whose tumors trained it.
        split_sha256: sha256 of the split file it was trained with.
        generator_run_id: its MLflow training run ("" when unknown).
        condition_dropout_all: probability that all conditions were nulled in training; classifier-free
            guidance (scale > 1) needs it above 0.
        trained: False for a painter that learns from no case (the phantom painter).
    """

    training_cases: list[str] = field(default_factory=list)
    split_sha256: str = ""
    generator_run_id: str = ""
    condition_dropout_all: float = 0.0
    trained: bool = True

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / PROVENANCE_FILE
        atomic_write_bytes(path, (json.dumps(asdict(self), indent=2) + "\n").encode())
        return path


def read_provenance(folder: str | Path) -> GeneratorProvenance | None:
    """The provenance saved in a pipeline or synthetic cohort folder, or None when it has none.

    Raises:
        ValueError: the file is not a provenance file (names the file).
    """
    path = Path(folder) / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        provenance = GeneratorProvenance(**data)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: not a SynthX provenance file: {error}") from error
    provenance.training_cases = [str(case) for case in provenance.training_cases]
    return provenance


def provenance_problem(provenance: GeneratorProvenance, split: pd.DataFrame, split_sha256: str, source: str = "generator") -> str | None:
    """Why a generator may not be used with this split, naming its first offending case; None when it may.

    Args:
        provenance: what the generator learned from.
        split: the current split table (``case_id, split``).
        split_sha256: the current split file's sha256.
        source: the generator's name in the message (its folder, URI or the cohort it painted).
    """
    if not provenance.trained:
        return None
    if not provenance.training_cases:
        if provenance.split_sha256 != split_sha256:
            return (
                f"{source} was trained on split sha256 {provenance.split_sha256 or 'unknown'}, the current split is "
                f"{split_sha256 or 'unknown'}, and its training cases are not recorded"
            )
        return None
    split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
    outside = [case for case in provenance.training_cases if split_of.get(case) != "train"]
    if not outside:
        return None
    first = outside[0]
    where = split_of.get(first)
    place = f"in the '{where}' split" if where else "not in the current split file"
    more = f" ({len(outside) - 1} more of its {len(provenance.training_cases)} training cases are not training cases here)" if len(outside) > 1 else ""
    return (
        f"{source} learned from case {first}, which is {place}{more}: a generator may only have seen this "
        f"split's training cases (trained on split sha256 {provenance.split_sha256 or 'unknown'}, current {split_sha256 or 'unknown'})"
    )


def cohort_provenance_problem(root: str | Path, split: pd.DataFrame, split_sha256: str) -> str | None:
    """Why the synthetic cohort at ``root`` may not be used with this split (its generator's provenance
    missing, unreadable or naming a case outside this split's training set); None when it may."""
    try:
        provenance = read_provenance(root)
    except ValueError as error:
        return str(error)
    if provenance is None:
        return (
            f"synthetic cohort {root} has no {PROVENANCE_FILE}: which cases its generator learned from is unknown, so it "
            "could carry validation or test tumors into training; write it with benchx synthesize (a rerun with the "
            "same settings adds the file)"
        )
    name = f"generator run {provenance.generator_run_id}" if provenance.generator_run_id else "the generator"
    return provenance_problem(provenance, split, split_sha256, source=f"{name} of synthetic cohort {root}")


def generator_training_cases(root: str | Path, real_metadata: pd.DataFrame | None = None) -> pd.DataFrame:
    """The cases the generator of the synthetic cohort at ``root`` learned from (``case_id, patient_id``;
    the patient from ``real_metadata`` when it lists the case, else empty); no rows when unknown."""
    provenance = read_provenance(root)
    cases = provenance.training_cases if provenance is not None and provenance.trained else []
    patients = {}
    if real_metadata is not None and "patient_id" in real_metadata.columns:
        patients = dict(zip(real_metadata["case_id"].astype(str), real_metadata["patient_id"].astype(str)))
    return pd.DataFrame({"case_id": cases, "patient_id": [patients.get(case, "") for case in cases]}, dtype=str)
