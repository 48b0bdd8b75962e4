"""The study report and what a finished study publishes: readable run names, headline metrics on
the parent run, registry aliases on the right versions, a self-contained HTML report (also rebuilt by
``benchx report``), and "not available" for an item a study did not log."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tiny_study import finished_study  # noqa: F401  (fixture)


def test_runs_are_named_and_the_parent_carries_the_headline(finished_study):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "study-unet"
    steps = {k[len("step."):]: v for k, v in parent.data.tags.items() if k.startswith("step.")}
    names = {step: client.get_run(run_id).info.run_name for step, run_id in steps.items()}
    assert names["baseline"] == "train-unet-baseline" and names["augmented"] == "train-unet-synthx"
    assert names["evaluate_baseline"] == "evaluate-unet-baseline-test"
    # The arms are compared on the locked test cohort.
    assert names["evaluate_synthx"] == "evaluate-unet-synthx-locked" and names["sham"] == "train-unet-sham"
    assert names["evaluate_sham"] == "evaluate-unet-sham-locked"

    from synthx.report import headline

    with pytest.MonkeyPatch.context():
        path = client.download_artifacts(steps["compare"], "comparison/test_comparison.csv", str(settings.output_dir))
    comparison = pd.read_csv(path, keep_default_na=False, na_values=[""])
    expected = headline(comparison)
    metrics = parent.data.metrics
    for row in expected.itertuples(index=False):
        for variant in ("baseline", "synthx", "delta"):
            value = getattr(row, variant)
            key = f"{variant}/test/{row.metric}_worst/{row.attribute}"
            if value == value:  # defined
                assert metrics[key] == pytest.approx(value), key
    # The worst group is the minimum over the attribute's defined groups.
    from synthx.report import primary_point

    primary, _ = primary_point(comparison)
    phase = primary[(primary["attribute"] == "phase") & (primary["metric"] == "sensitivity") & (primary["positives"] > 0)]
    if phase["a"].notna().any():
        assert metrics["baseline/test/sensitivity_worst/phase"] == pytest.approx(phase["a"].min())


def test_aliases_point_at_the_study_versions(finished_study):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    tags = client.get_run(parent_id).data.tags
    assert client.get_model_version_by_alias("benchx-unet", "baseline").run_id == tags["step.baseline"]
    assert client.get_model_version_by_alias("benchx-unet", "synthx").run_id == tags["step.augmented"]
    assert client.get_model_version_by_alias("benchx-unet", f"{settings.experiment}-synthx").run_id == tags["step.augmented"]
    assert client.get_model_version_by_alias("synthx-generator", settings.experiment).run_id == tags["step.synthx_train"]
    evaluated = client.get_run(tags["step.evaluate_synthx"]).data.tags
    version = client.get_model_version_by_alias("benchx-unet", "synthx").version
    assert evaluated.get("model_version") == str(version) and evaluated.get("registered_model") == "benchx-unet"
    inputs = client.get_run(tags["step.evaluate_synthx"]).inputs.dataset_inputs
    contexts = {t.value for d in inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert {"evaluation-val", "evaluation-test"} <= contexts


def test_the_report_is_self_contained_and_rebuilt_by_benchx_report(finished_study, tmp_path):
    settings, uri, parent_id = finished_study
    from pathlib import Path

    written = Path(settings.output_dir) / "study_report.html"
    text = written.read_text()
    for title in ("Baseline vs SynthX (BenchX table 6)", "Forest plots per attribute", "Baseline subgroup table",
                  "Synthetic cohort", "Unfillable cells", "Examples per phase", "Leakage audit", "Recipes", "Versions"):
        assert title in text, title
    assert len(re.findall(r'src="data:image/png;base64,', text)) >= 3, "forest plots and the example grid are embedded"
    assert not re.search(r'src="(?!data:)', text), "no external resources"
    assert "not available" not in text, re.findall(r"not available[^<]*", text)

    from lightning_modules.cli import main

    out = tmp_path / "again.html"
    assert main(["report", "--run-id", parent_id, "--out", str(out), "--tracking-uri", uri]) == 0
    rebuilt = out.read_text()
    assert "Baseline vs SynthX" in rebuilt and rebuilt.count("data:image/png;base64,") == text.count("data:image/png;base64,")
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(parent_id, "report")}
    assert "report/study_report.html" in artifacts


def test_a_missing_item_is_reported_as_not_available(finished_study, tmp_path):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    # A copy of the parent that names no synthesis step and a compare run without its table.
    experiment = client.create_experiment("report-partial")  # not beside the study's runs in the UI
    tags = {k: v for k, v in client.get_run(parent_id).data.tags.items() if k.startswith("step.") and k != "step.synthesize"}
    empty = client.create_run(experiment, run_name="compare-empty").info.run_id
    tags["step.compare"] = empty
    partial = client.create_run(experiment, run_name="study-partial", tags=tags).info.run_id
    client.set_terminated(empty)
    client.set_terminated(partial)
    from synthx.report import build_report

    text = build_report(partial, uri, tmp_path / "partial.html", log=False).read_text()
    assert "not available: the study has no &#x27;synthesize&#x27; step" in text or "no 'synthesize' step" in text
    assert "comparison/test_comparison.csv" in text and "Baseline subgroup table" in text


def test_report_of_a_run_that_is_not_a_study_exits_2(finished_study, capsys):
    _, uri, parent_id = finished_study
    client = MlflowClient(uri)
    other = client.get_run(parent_id).data.tags["step.baseline"]
    from lightning_modules.cli import main

    assert main(["report", "--run-id", other, "--tracking-uri", uri, "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "names no study steps" in err and "parent run" in err and "Traceback" not in err


def test_versions_name_a_package_that_is_not_installed(monkeypatch):
    """A package the report lists but this environment lacks is shown as such, not silently left out."""
    import importlib.metadata as metadata
    from types import SimpleNamespace

    from synthx import report

    real_version = metadata.version

    def version(package):
        if package == "diffusers":
            raise metadata.PackageNotFoundError(package)
        return real_version(package)

    monkeypatch.setattr(metadata, "version", version)
    study = SimpleNamespace(parent=SimpleNamespace(data=SimpleNamespace(tags={"git_commit": "abc123"})), steps={})
    page = report.versions_html(study)
    assert re.search(r"diffusers \(report built with\)</td>\s*<td>not installed", page), page
    assert "torch (report built with)" in page and "abc123" in page
