"""What a source hands the import engine: each case as listed (:class:`SourceCase`) and as read
(:class:`LoadedCase`), and the errors of one case or of a whole source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np


class ImportCaseError(ValueError):
    """One case cannot be imported; the message names the case, the file and what is wrong."""


class ImportSourceError(ValueError):
    """The source as a whole cannot be imported (unreadable dataset.json, unmapped labels, ...)."""


@dataclass(frozen=True)
class LoadedCase:
    """One case read from its source: CT in HU (int16) with its affine, masks on the same grid."""

    ct: np.ndarray
    affine: np.ndarray
    masks: Mapping[str, np.ndarray]
    metadata: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceCase:
    """A case as listed by a source, before anything heavy is read.

    Args:
        case_id: the dataset's own case id (the folder name written in the cohort).
        source: where it comes from, for logs and ``quarantine.csv`` (a path, never header values).
        load: reads the case; raises :class:`ImportCaseError` (or any error) when it cannot.
        expected_classes: the masks the case will have, used to check a case left by an earlier run.
        metadata: metadata known from the listing (cohort, meta.csv values, ...).
    """

    case_id: str
    source: str
    load: Callable[[], LoadedCase]
    expected_classes: tuple[str, ...] = ()
    metadata: Mapping[str, object] = field(default_factory=dict)
