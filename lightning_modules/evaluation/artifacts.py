"""What an evaluation leaves on its run: per-case records, subgroup tables, figures
(docs/explanation/architecture.md "MLflow runs and keys"), recorded through a
:class:`~lightning_modules.infrastructure.recording.RunRecorder`; the tracking adapter reads the
records back (:func:`lightning_modules.tracking.recorder.download_records`).

Artifacts of stage ``<stage>`` (``val``, ``test``; an operating point adds ``_<point>``, e.g.
``test_fixed``): ``evaluation/<stage>_records.csv``, ``evaluation/<stage>_subgroups.csv`` (+ the
same as a table for the UI, ``.json``) and ``evaluation/<stage>_subgroups.png``.

Example::

    log_evaluation_artifacts(recorder, "test", records, table)
"""

from __future__ import annotations

import pandas as pd

from lightning_modules.evaluation.bootstrap import evaluation_set_hash
from lightning_modules.evaluation.figures import close, subgroup_figure
from lightning_modules.infrastructure.recording import RunRecorder

RECORDS_ARTIFACT = "evaluation/{stage}_records.csv"
SUBGROUP_ARTIFACT = "evaluation/{stage}_subgroups.csv"
FIGURE_ARTIFACT = "evaluation/{stage}_subgroups.png"


def log_evaluation_artifacts(recorder: RunRecorder, stage: str, records: pd.DataFrame | None, table: pd.DataFrame) -> None:
    """Per-case records (when given, with the evaluated set's hash and size as tags), the subgroup
    table (CSV + the UI's table) and the subgroup figure.

    Args:
        recorder: the evaluation (or training) run's recorder.
        stage: the artifact prefix, e.g. ``test`` or ``test_fixed``.
        records: the stage's per-case records (None for an extra operating point of the same records).
        table: the subgroup table.
    """
    if records is not None:
        recorder.set_tags({f"{stage}_set_sha256": evaluation_set_hash(records["case_id"]),
                           f"{stage}_n_cases": str(len(records))})
        recorder.log_table(records, RECORDS_ARTIFACT.format(stage=stage))
    recorder.log_table(table, SUBGROUP_ARTIFACT.format(stage=stage), ui=True)
    figure = subgroup_figure(table, title=f"{stage}: sensitivity and F1 by subgroup")
    recorder.log_figure(figure, FIGURE_ARTIFACT.format(stage=stage))
    close(figure)
