"""Versions of the primary endpoint: version 2 (the default) judges the subgroup's sensitivity at
specificity matched within the subgroup, version 1 (overall matched specificity) stays a secondary
row, studies logged before versions read back as version 1; and the subgroup's sensitivity,
specificity and AUC at the endpoint's thresholds come out together with their tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation"))  # test_detection_metrics' records

from test_detection_metrics import random_records  # noqa: E402

from lightning_modules.workflows.evaluate import EvaluatedRun, _compare_pair  # noqa: E402
from synthx.analysis.endpoint import PrimaryEndpoint, endpoint_rows, endpoint_summary, label_results  # noqa: E402

# The params a study logged before the endpoint had versions.
OLD_STUDY_PARAMS = {"endpoint.arm": "synthx", "endpoint.reference": "sham", "endpoint.metric": "sensitivity",
                    "endpoint.attribute": "phase", "endpoint.group": "arterial",
                    "endpoint.operating_point": "matched_specificity", "endpoint.score": "volume",
                    "endpoint.test_set": "locked", "seed": "0"}


def test_the_default_endpoint_is_version_2_at_specificity_matched_within_its_subgroup():
    endpoint = PrimaryEndpoint()
    assert (endpoint.version, endpoint.operating_point) == (2, "subgroup_matched_specificity")
    assert endpoint.subgroup == "phase:arterial"
    assert "at specificity matched within phase:arterial" in endpoint.describe()
    assert "[endpoint version 2]" in endpoint.describe()
    assert endpoint.params()["endpoint.version"] == "2"
    assert PrimaryEndpoint.from_params({**endpoint.params(), "other": "x"}) == endpoint
    (first,) = endpoint.earlier()
    assert first == PrimaryEndpoint.of_version(1)
    assert (first.version, first.operating_point, first.subgroup) == (1, "matched_specificity", "phase:arterial")


def test_a_study_logged_before_versions_reads_back_as_version_1_with_its_fields():
    old = PrimaryEndpoint.from_params(OLD_STUDY_PARAMS)
    assert old == PrimaryEndpoint.of_version(1) and old.version == 1 and old.earlier() == []
    other = PrimaryEndpoint.from_params({**OLD_STUDY_PARAMS, "endpoint.group": "venous", "endpoint.operating_point": "val_chosen"})
    assert (other.version, other.group, other.operating_point) == (1, "venous", "val_chosen")
    assert PrimaryEndpoint.from_params(PrimaryEndpoint.of_version(1).params()) == PrimaryEndpoint.of_version(1)
    with pytest.raises(ValueError, match="unknown endpoint version 7"):
        PrimaryEndpoint.from_params({**OLD_STUDY_PARAMS, "endpoint.version": "7"})


def _rows(point: str, thresholds: tuple[float, float], values: dict) -> list[dict]:
    rows = []
    for metric, (a, b, p, test) in values.items():
        rows.append({"run": "synthx", "operating_point": point, "attribute": "phase", "group": "arterial",
                     "metric": metric, "threshold_a": thresholds[0], "threshold_b": thresholds[1], "a": a, "b": b,
                     "delta": b - a, "ci_low": b - a - 0.1, "ci_high": b - a + 0.1, "p_value": p, "test": test,
                     "supported": True, "significant": p < 0.05})
    return rows


def test_endpoint_rows_give_sensitivity_specificity_and_auc_at_the_endpoints_thresholds():
    at_subgroup = _rows("subgroup_matched_specificity", (20.0, 32.5), {
        "auc": (0.72, 0.70, 0.8, "delong"), "f1": (0.5, 0.6, 0.3, "bootstrap+mcnemar"),
        "specificity": (0.467, 0.467, 1.0, "mcnemar_exact"), "sensitivity": (0.4, 0.6, 0.2, "mcnemar_exact")})
    overall = _rows("matched_specificity", (20.0, 175.0), {
        "sensitivity": (0.4, 0.3, 0.5, "mcnemar_exact"), "specificity": (0.467, 0.933, 0.016, "mcnemar_exact"),
        "auc": (0.724, 0.456, 0.028, "delong")})
    table = pd.DataFrame(at_subgroup + overall)
    rows = endpoint_rows(table, PrimaryEndpoint())
    assert rows["metric"].tolist() == ["sensitivity", "specificity", "auc"]
    assert set(rows["threshold_b"]) == {32.5}
    assert rows.set_index("metric").loc["auc", "p_value"] == 0.8
    version_1 = endpoint_rows(table, PrimaryEndpoint.of_version(1)).set_index("metric")
    assert version_1.loc["specificity", "p_value"] == 0.016 and version_1.loc["auc", "b"] == 0.456
    labelled = label_results(table, PrimaryEndpoint())
    primary = labelled[labelled["role"] == "primary"]
    assert primary[["operating_point", "metric"]].values.tolist() == [["subgroup_matched_specificity", "sensitivity"]]
    assert (labelled.loc[labelled["operating_point"] == "matched_specificity", "role"] == "secondary").all()
    text = endpoint_summary(labelled, PrimaryEndpoint())
    assert "at the same thresholds in phase:arterial (m 20 vs 32.5):" in text
    assert ("specificity: 46.7% -> 46.7%: +0.0 points, bootstrap 95% CI -10.0 to +10.0; exact McNemar test p = 1: "
            "not significant at 5%") in text
    assert "auc: 72.0% -> 70.0%: -2.0 points, bootstrap 95% CI -12.0 to +8.0; DeLong test p = 0.8" in text
    assert "Endpoint version 1, now secondary (sensitivity at matched specificity): 40.0% -> 30.0%" in text
    mixed = table.copy()
    mixed.loc[(mixed["metric"] == "auc") & (mixed["operating_point"] == "subgroup_matched_specificity"), "threshold_b"] = 9.0
    with pytest.raises(ValueError, match="several thresholds"):
        endpoint_rows(mixed, PrimaryEndpoint())


def test_a_comparison_at_the_endpoints_subgroup_holds_its_three_rows_and_the_version_1_row():
    test_records, val_a, val_b = random_records(150, 1), random_records(90, 2), random_records(90, 3)
    test_records["raw_volume_mm3"] = test_records["volume_mm3"] + 30.0
    sham = EvaluatedRun("a" * 32, "sham", test_records, val_a, {"fixed": 50.0, "val_chosen": 20.0})
    synthx = EvaluatedRun("b" * 32, "synthx", test_records.assign(volume_mm3=test_records["volume_mm3"] * 2), val_b,
                          {"fixed": 50.0, "val_chosen": 30.0})
    endpoint = PrimaryEndpoint()
    settings = {"n_resamples": 20, "confidence": 0.95, "score": "volume", "subgroup": ("phase", "arterial")}
    table = _compare_pair(sham, synthx, settings, [])
    rows = endpoint_rows(table, endpoint)
    assert rows["metric"].tolist() == ["sensitivity", "specificity", "auc"]
    assert rows["test"].tolist() == ["mcnemar_exact", "mcnemar_exact", "delong"]
    assert len(rows.drop_duplicates(["threshold_a", "threshold_b"])) == 1
    assert len(endpoint_rows(table, PrimaryEndpoint.of_version(1))) == 3
    assert (label_results(table, endpoint)["role"] == "primary").sum() == 1
    # Thresholds matched within another subgroup are not the endpoint's.
    venous = _compare_pair(sham, synthx, {**settings, "subgroup": ("phase", "venous")}, [])
    assert endpoint_rows(venous, endpoint).empty
    assert (label_results(venous, endpoint)["role"] == "primary").sum() == 0
