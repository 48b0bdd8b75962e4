"""The one problem type of the data layer: which case, which file (and column), what is wrong.

Metadata normalization, cohort validation, split checks and the importers' checks all report
:class:`Problem` objects, so ``benchx validate`` lists every kind in one format and callers
collect them without converting between types.

Example::

    Problem("C001", "data/phantom/C001/ct.nii.gz", "unreadable or truncated NIfTI")
    Problem("C001", "metadata.csv", "unknown sex 'X'", column="sex")
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One problem: the case (or ``<header>``, ``<row N>``, ``<cohort>``), the file, what is wrong.

    Args:
        case_id: the case the problem belongs to, or a placeholder in angle brackets.
        file: the file (or folder) that shows it.
        message: what is wrong, in words a user can act on.
        column: for a table (``metadata.csv``, a split CSV), the column at fault.
    """

    case_id: str
    file: str
    message: str
    column: str = ""

    def __str__(self) -> str:
        where = f"{self.file}: column '{self.column}'" if self.column else self.file
        return f"{self.case_id}: {where}: {self.message}"
