"""Where a SynthX generator comes from, and the check that it may paint into the current split.

Training writes ``synthx_provenance.json`` into the saved pipeline folder (so it travels with the
pipeline, also as the MLflow artifact ``pipeline``): the real cases it learned from, the sha256 of
the split file it was trained on, its MLflow run and its condition dropout. Generation reads it
back and refuses a generator that learned from any case that is not a real TRAINING case of the
split in use, naming the first such case: a generator trained on another split or fold could
otherwise paint tumors it memorized from this split's validation or test patients into training
scans (docs/explanation/synthx.md "Synthetic data"). A generator trained on a different split file is accepted
only when every case it learned from is a training case here; without a case list the split
hashes must agree; a pipeline without a provenance file is refused. Generation copies the file
into the synthetic cohort, where mixing, the audit and evaluation check it again against the split
they use (the format and that check live in :mod:`lightning_modules.data.synthetic_provenance`,
since the base package never imports synthx).

Example::

    provenance = read_provenance("outputs/synthx/pipeline")
    check_provenance(provenance, split_table, split_sha256("splits/phantom.csv"))
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from lightning_modules.data import synthetic_provenance
from lightning_modules.data.synthetic_provenance import PROVENANCE_FILE, GeneratorProvenance, provenance_problem


class ProvenanceError(ValueError):
    """A generator may not paint into this split; the message names the first offending case or the hash."""


def read_provenance(folder: str | Path) -> GeneratorProvenance | None:
    """The provenance saved with a pipeline folder, or None when the folder has none."""
    try:
        return synthetic_provenance.read_provenance(folder)
    except ValueError as error:
        raise ProvenanceError(str(error)) from error


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
    problem = provenance_problem(provenance, split, split_sha256, source)
    if problem:
        raise ProvenanceError(problem)


__all__ = ["PROVENANCE_FILE", "GeneratorProvenance", "ProvenanceError", "check_provenance", "read_provenance"]
