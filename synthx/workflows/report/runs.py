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
from synthx.analysis.endpoint import label_results, PrimaryEndpoint
from synthx.analysis.quality import quality_report, QualityError
from synthx.painters import SYNTHX_PAINTER
from synthx.analysis.verdict import (arm_namer, ArmNamer, comparison_arms, decomposition_sentences, REFERENCE_ARM,
                            study_verdict, TREATMENT_ARM)


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

    def parent_csv(self, path: str) -> pd.DataFrame:
        """A table logged on the parent run itself (LookupError naming it when absent)."""
        run_id = self.parent.info.run_id
        try:
            local = self.client.download_artifacts(run_id, path, str(self.folder / run_id))
        except Exception as error:  # MLflow raises several types for a missing artifact
            raise LookupError(f"the study run {run_id} has no artifact {path}") from error
        return pd.read_csv(local, keep_default_na=False, na_values=[""])


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


def arm_values(rows: pd.DataFrame, column: str = "") -> dict[str, float]:
    """Each arm's own value in comparison rows of one subgroup and metric: a reference arm's from
    column ``a`` (``threshold_a`` with ``column="threshold"``), a compared arm's from ``b``, each arm
    from the first row that holds it as itself (a row of SynthX against sham holds sham's value in
    ``a``, never the baseline's)."""
    first, second = (f"{column}_a", f"{column}_b") if column else ("a", "b")
    references = rows["reference"].astype(str) if "reference" in rows.columns else pd.Series("baseline", index=rows.index)
    values: dict[str, float] = {}
    for reference, value in zip(references, rows[first]):
        values.setdefault(reference, float(value))
    for arm, value in zip(rows["run"].astype(str), rows[second]):
        values.setdefault(arm, float(value))
    return values


def arm_metric_table(comparison: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One metric per subgroup (rows) and arm (columns, :func:`arm_values`), with the subgroup's counts."""
    part = comparison[comparison["metric"] == metric]
    rows = []
    for (attribute, group), rows_ in part.groupby(["attribute", "group"], sort=False):
        first = rows_.iloc[0]
        rows.append({"attribute": attribute, "group": group, "positives": first["positives"],
                     "negatives": first["negatives"], **arm_values(rows_)})
    return pd.DataFrame(rows)


def headline(comparison: pd.DataFrame) -> pd.DataFrame:
    """Per attribute and metric: each arm's worst group and its value (columns ``<arm>_worst_group``
    and ``<arm>``), and ``delta``, SynthX's worst minus the baseline's, at the primary operating
    point (:func:`primary_point`). Each arm's values are its own (:func:`arm_values`)."""
    comparison, _ = primary_point(comparison)
    arms = comparison_arms(comparison)
    rows = []
    for metric in HEADLINE_METRICS:
        table = arm_metric_table(comparison, metric)
        if table.empty:
            continue
        worst = {arm: gaps(table[["attribute", "group", "positives", "negatives", arm]], arm) for arm in arms}
        for i, attribute in enumerate(worst[arms[0]]["attribute"]):
            row = {"attribute": attribute, "metric": metric}
            for arm in arms:
                row[f"{arm}_worst_group"] = worst[arm]["worst_group"].iloc[i]
                row[arm] = float(worst[arm]["worst"].iloc[i])
            row["delta"] = row.get(TREATMENT_ARM, math.nan) - row.get(REFERENCE_ARM, math.nan)
            rows.append(row)
    return pd.DataFrame(rows)


def headline_metrics(table: pd.DataFrame, stage: str = "test") -> dict[str, float]:
    """MLflow keys of the headline: ``<variant>/<stage>/<metric>_worst/<attribute>``, variant an arm
    (baseline, sham, synthx) or delta (docs/explanation/architecture.md "MLflow runs and keys")."""
    variants = [c for c in table.columns if c not in ("attribute", "metric") and not c.endswith("_worst_group")]
    metrics = {}
    for row in table.to_dict("records"):
        for variant in variants:
            value = float(row[variant])
            if not math.isnan(value):
                metrics[f"{variant}/{stage}/{row['metric']}_worst/{row['attribute']}"] = value
    return metrics


def log_headline(client: MlflowClient, parent_id: str, comparison: pd.DataFrame) -> dict[str, float]:
    metrics = headline_metrics(headline(comparison))
    for key, value in metrics.items():
        client.log_metric(parent_id, key, value)
    return metrics


def study_comparison(study: StudyRuns) -> pd.DataFrame:
    """The compare step's table with each row's role and family adjustment (``p_family``,
    ``significant_family``: :func:`synthx.analysis.endpoint.label_results` with the study's endpoint, as the
    study logged it in ``comparison/test_roles.csv``); LookupError when the study has none."""
    endpoint = PrimaryEndpoint.from_params(dict(study.parent.data.params))
    return label_results(study.csv("compare", COMPARISON_ARTIFACT), endpoint)


DECOMPOSITION_ARTIFACT = "synthx/decomposition.csv"


def study_decomposition(study: StudyRuns) -> pd.DataFrame:
    """The decomposition the study logged on its parent run (LookupError when it logged none)."""
    return study.parent_csv(DECOMPOSITION_ARTIFACT)


def verdict_lines(study: StudyRuns) -> list[str]:
    """The study's verdict sentences (:func:`synthx.analysis.verdict.study_verdict`), then the decomposition's
    (:func:`synthx.analysis.verdict.decomposition_sentences`) when the study logged one; LookupError without a comparison."""
    endpoint = PrimaryEndpoint.from_params(dict(study.parent.data.params))
    name_of = study_arm_namer(study)
    lines = study_verdict(study_comparison(study), PRIMARY_POINT, endpoint=endpoint, name_of=name_of)
    if not lines:
        raise LookupError("the comparison holds none of the designed subgroups")
    try:
        decomposition = study_decomposition(study)
    except LookupError:
        return lines
    return lines + decomposition_sentences(decomposition, name_of=name_of, point=endpoint.operating_point)


def study_painter(study: StudyRuns) -> str:
    """Who painted the study's synthetic tumors: the synthesis run's ``painter`` tag (or param); SynthX
    when the study recorded none."""
    if "synthesize" not in study.steps:
        return SYNTHX_PAINTER
    run = study.run("synthesize")
    return run.data.tags.get("painter") or run.data.params.get("painter") or SYNTHX_PAINTER


def study_arm_namer(study: StudyRuns) -> ArmNamer:
    """How the study's arms are named (:func:`synthx.analysis.verdict.arm_namer` of its painter)."""
    return arm_namer(study_painter(study))


BASELINE_SUBGROUP_TABLES = (("evaluation/test_val_chosen_subgroups.csv", PRIMARY_POINT, "operating_point/val_chosen"),
                            ("evaluation/test_subgroups.csv", "fixed", "test/threshold"))


def baseline_subgroups(study: StudyRuns) -> tuple[pd.DataFrame, str, float | None]:
    """The baseline's test subgroup table at the report's primary operating point (validation-chosen),
    else at the fixed m, with that point's name and its m (None when the run logged none): the one
    source of the baseline's plot and table."""
    for path, point, key in BASELINE_SUBGROUP_TABLES:
        try:
            table = study.csv("evaluate_baseline", path)
        except LookupError:
            continue
        return table, point, study.run("evaluate_baseline").data.metrics.get(key)
    raise LookupError("the baseline evaluation logged no test subgroup table")


def study_arms(study: StudyRuns) -> list[tuple[str, str]]:
    """(training step, arm) of every trained arm of the study, baseline first: the step's run tag
    ``variant`` names the arm (``augmented`` trains ``synthx``)."""
    arms = []
    for step in study.steps:
        if step.startswith(("evaluate", "synthx_train", "synthesize")) or step in ("data", "targeting", "compare"):
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
    """The synthetic cohort measured against the real training tumors (:func:`synthx.analysis.quality.quality_report`),
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
