"""The study report: what a finished study publishes, and the pages built from its runs.

- :mod:`~synthx.workflows.report.runs`: reading the study's runs, artifacts and comparison back
  from MLflow, and the numbers derived from them;
- :mod:`~synthx.workflows.report.html_page` (with :mod:`~synthx.workflows.report.figures` and
  :mod:`~synthx.workflows.report.formatting`): the self-contained HTML report;
- :mod:`~synthx.workflows.report.markdown_page`: the Markdown results page and the README block;
- :mod:`~synthx.workflows.report.registry`: aliases and descriptions in the model registry.

:func:`publish_study` is what the study calls when it finishes: headline metrics on the parent run
(so the experiment table sorts studies by them), the verdict as its description, registry aliases
scoped by experiment with a description on each version, and the report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from synthx.workflows.report.html_page import build_report
from synthx.workflows.report.registry import publish_arms
from synthx.workflows.report.runs import load_study, log_headline, study_comparison, verdict_lines

NOTE_TAG = "mlflow.note.content"


def publish_study(uri: str, parent_id: str, output_dir: str | Path) -> Path:
    """What a finished study publishes on its parent run: registry aliases ``<experiment>-<arm>`` on
    ``benchx-<backbone>`` (scoped by experiment) and ``<experiment>`` on ``synthx-generator``, a
    description on each version, the headline metrics, the verdict as the run's description, and
    the HTML report (also written to ``output_dir``)."""
    with tempfile.TemporaryDirectory() as folder:
        study = load_study(parent_id, uri, Path(folder))
        publish_arms(study, uri)
        try:
            log_headline(study.client, parent_id, study_comparison(study))
            # The parent run's description in the MLflow UI: the verdict.
            study.client.set_tag(parent_id, NOTE_TAG, "\n\n".join(verdict_lines(study)))
        except LookupError as error:
            print(f"[study] headline metrics and verdict not logged: {error}")
    return build_report(parent_id, uri, Path(output_dir) / "study_report.html")
