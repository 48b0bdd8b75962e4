"""What a library may record on a run, without knowing where it goes: :class:`RunRecorder`.

Libraries (the evaluation callback and its artifacts, SynthX's cohort writer) take a recorder bound
to one run and record tags, metrics, tables, texts and figures on it by artifact path; the tracking
adapter implements it on MLflow (:class:`lightning_modules.tracking.recorder.MlflowRunRecorder`),
and a test may hand in any object with these methods.

Example::

    def log_summary(recorder: RunRecorder, table):
        recorder.log_table(table, "synthx/per_cell.csv", ui=True)
        recorder.log_metrics({"synthx/cases": float(len(table))})
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol


class RunRecorder(Protocol):
    """One run's recording interface."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run (values as text)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Log metrics at ``step``."""

    def log_table(self, table: Any, path: str, ui: bool = False) -> None:
        """A pandas table as CSV at ``path``; with ``ui`` also as the tracking UI's table view beside it
        (same name, ``.json``)."""

    def log_text(self, text: str, path: str) -> None:
        """A text artifact at ``path``."""

    def log_dict(self, data: Any, path: str) -> None:
        """A JSON (``.json``) or YAML (``.yaml``) artifact at ``path``."""

    def log_figure(self, figure: Any, path: str) -> None:
        """A matplotlib figure as an image artifact at ``path``."""


__all__ = ["RunRecorder"]
