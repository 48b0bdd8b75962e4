"""Reading a finished study back from MLflow: its parent run, its steps' runs and artifacts, the
comparison table, and the numbers the report derives from them (the worst group per attribute and
arm, the verdict sentences, the trained arms, the synthetic cohort's quality).

Example::

    study = load_study(parent_run_id, "sqlite:///mlflow.db", Path(folder))
    comparison = study_comparison(study)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.evaluation.subgroups import gaps
from synthx.endpoint import PrimaryEndpoint
from synthx.quality import quality_report, QualityError
from synthx.verdict import study_verdict


COMPARISON_ARTIFACT = "comparison/test_comparison.csv"
HEADLINE_METRICS = ("sensitivity", "f1")
STEP_TAG_PREFIX = "step."
PRIMARY_POINT = "val_chosen"


class ReportError(ValueError):
    """A run that is not a study's parent run (no ``step.*`` tags naming its child runs)."""


@dataclass
class StudyRuns:
    """The study's parent run and its child runs by step name, read from MLflow."""

    client: MlflowClient
    parent: object
    steps: dict[str, str]
    folder: Path
    _cache: dict = field(default_factory=dict)

    def run(self, step: str):
        if step not in self.steps:
            raise LookupError(f"the study has no '{step}' step")
        if step not in self._cache:
            self._cache[step] = self.client.get_run(self.steps[step])
        return self._cache[step]

    def artifact(self, step: str, path: str) -> Path:
        """Download one artifact of a step's run (LookupError naming it when absent)."""
        run_id = self.run(step).info.run_id
        try:
            return Path(self.client.download_artifacts(run_id, path, str(self.folder / run_id)))
        except Exception as error:  # MLflow raises several types for a missing artifact
            raise LookupError(f"run {run_id} ({step}) has no artifact {path}") from error

    def csv(self, step: str, path: str) -> pd.DataFrame:
        return pd.read_csv(self.artifact(step, path), keep_default_na=False, na_values=[""])


def load_study(run_id: str, uri: str, folder: Path) -> StudyRuns:
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(run_id)
    steps = {k[len(STEP_TAG_PREFIX):]: v for k, v in parent.data.tags.items() if k.startswith(STEP_TAG_PREFIX)}
    if not steps:
        raise ReportError(f"run {run_id} names no study steps (tags step.*): pass the study's parent run id")
    return StudyRuns(client, parent, steps, Path(folder))


# ------------------------------------------------------------------------------------------------
# Numbers


PRIMARY_POINT = "val_chosen"


def primary_point(comparison: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of one operating point: the validation-chosen one when compared, else the first
    (the headline and the forest plots use it; the table shows every point)."""
    if "operating_point" not in comparison.columns:
        return comparison, ""
    points = list(dict.fromkeys(comparison["operating_point"]))
    point = PRIMARY_POINT if PRIMARY_POINT in points else points[0]
    return comparison[comparison["operating_point"] == point], str(point)


def headline(comparison: pd.DataFrame) -> pd.DataFrame:
    """Per attribute and metric: the worst group's value for baseline and SynthX and their difference
    (at the primary operating point, :func:`primary_point`)."""
    comparison, _ = primary_point(comparison)
    rows = []
    columns = ["attribute", "group", "positives", "negatives"]
    for metric in HEADLINE_METRICS:
        part = comparison[comparison["metric"] == metric]
        baseline = gaps(part.rename(columns={"a": metric})[[*columns, metric]], metric)
        synthx = gaps(part.rename(columns={"b": metric})[[*columns, metric]], metric)
        for a, b in zip(baseline.itertuples(index=False), synthx.itertuples(index=False)):
            rows.append({"attribute": a.attribute, "metric": metric, "baseline_worst_group": a.worst_group,
                         "baseline": a.worst, "synthx_worst_group": b.worst_group, "synthx": b.worst,
                         "delta": b.worst - a.worst})
    return pd.DataFrame(rows)


def headline_metrics(table: pd.DataFrame, stage: str = "test") -> dict[str, float]:
    """MLflow keys of the headline: ``<variant>/<stage>/<metric>_worst/<attribute>``, variant baseline,
    synthx or delta (docs/design.md "MLflow runs and keys")."""
    metrics = {}
    for row in table.itertuples(index=False):
        for variant in ("baseline", "synthx", "delta"):
            value = float(getattr(row, variant))
            if not math.isnan(value):
                metrics[f"{variant}/{stage}/{row.metric}_worst/{row.attribute}"] = value
    return metrics


def log_headline(client: MlflowClient, parent_id: str, comparison: pd.DataFrame) -> dict[str, float]:
    metrics = headline_metrics(headline(comparison))
    for key, value in metrics.items():
        client.log_metric(parent_id, key, value)
    return metrics


def study_comparison(study: StudyRuns) -> pd.DataFrame:
    """The compare step's table (LookupError when the study has none)."""
    return study.csv("compare", COMPARISON_ARTIFACT)


def verdict_lines(study: StudyRuns) -> list[str]:
    """The study's verdict sentences (:func:`synthx.verdict.study_verdict`); LookupError without a comparison."""
    endpoint = PrimaryEndpoint.from_params(dict(study.parent.data.params))
    lines = study_verdict(study_comparison(study), PRIMARY_POINT, endpoint=endpoint)
    if not lines:
        raise LookupError("the comparison holds none of the designed subgroups")
    return lines


def study_arms(study: StudyRuns) -> list[tuple[str, str]]:
    """(training step, arm) of every trained arm of the study, baseline first: the step's run tag
    ``variant`` names the arm (``augmented`` trains ``synthx``)."""
    arms = []
    for step in study.steps:
        if step.startswith(("evaluate", "synthx_train")) or step in ("data", "targeting", "synthesize", "compare"):
            continue
        variant = study.run(step).data.tags.get("variant")
        if variant:
            arms.append((step, variant))
    return sorted(arms, key=lambda arm: arm[1] != "baseline")


def logged_table(path: Path) -> pd.DataFrame:
    """A table logged with ``log_table`` (JSON with columns and data)."""
    content = json.loads(Path(path).read_text())
    return pd.DataFrame(content["data"], columns=content["columns"])


def study_quality(study: StudyRuns):
    """The synthetic cohort measured against the real training tumors (:func:`synthx.quality.quality_report`),
    computed once per report."""
    if "quality" not in study._cache:

        outputs = json.loads(study.run("synthesize").data.tags.get("study_outputs", "{}"))
        synthetic = Path(outputs.get("cohort", ""))
        real = Path(study.run("evaluate_baseline").data.tags.get("eval_cohort", ""))
        split = study.run("baseline").data.params.get("data.split", "") if "baseline" in study.steps else ""
        for what, path in (("synthetic cohort", synthetic), ("real cohort", real), ("split", Path(split))):
            if not str(path) or not path.exists():
                raise LookupError(f"the {what} {path} is not on this machine")
        try:
            study._cache["quality"] = quality_report(real, split, synthetic)
        except QualityError as error:
            raise LookupError(str(error)) from error
    return study._cache["quality"]
