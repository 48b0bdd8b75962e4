"""Targeting arithmetic on hand-computed examples: need (validation deficit), min_positives, match (water filling),
explicit tables; match:test refused.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/synthx/test_synthx_targeting.py -x -q
"""

from __future__ import annotations

import pandas as pd
import pytest

from synthx.generation.cells import TARGET_COLUMNS, TargetingError, cell_grid
from synthx.generation.targeting import (
    parse_rule,
    plan_match,
    plan_need,
    requests_from_targets,
    resolve_targets,
)


def _case(case_id, sex, age, phase, tumor, split):
    return {"case_id": case_id, "patient_id": f"P{case_id}", "sex": sex, "age": age, "phase": phase, "tumor": tumor, "split": split}


@pytest.fixture
def cohort_with_split(tmp_path):
    """Metadata only (targeting reads no images): train positives F/60-80 venous x4, F/60-80 arterial x1,
    M/40-60 venous x2, plus cases that must not count (negatives, other splits, Unknowns)."""
    rows = (
        [_case(f"TV{i}", "F", 70, "venous", 1, "train") for i in range(4)]
        + [_case("TA0", "female", 65, "arterial", 1, "train")]
        + [_case(f"TM{i}", "M", 50, "portal venous", 1, "train") for i in range(2)]
        + [_case("TNEG", "F", 70, "non-contrast", 0, "train")]
        + [_case("TUS", "", 70, "venous", 1, "train")]  # unknown sex: no cell
        + [_case("TUA", "F", "", "venous", 1, "train")]  # unknown age: no cell
        + [_case("TUP", "F", 70, "", 1, "train")]  # unknown phase: no cell
        # test positives over F/60-80: non-contrast 1, arterial 1, venous 2
        + [_case("XN", "F", 61, "non-contrast", 1, "test"), _case("XA", "F", 79, "arterial", 1, "test")]
        + [_case(f"XV{i}", "F", 80, "venous", 1, "test") for i in range(2)]
        + [_case("VA", "M", 50, "arterial", 1, "val")]
        # healthy training scans (canvases) of the F/60-80 cells the match examples spend their budget on
        + [_case("HA", "F", 65, "arterial", 0, "train"), _case("HV", "F", 66, "venous", 0, "train")]
    )
    table = pd.DataFrame(rows)
    root = tmp_path / "cohort"
    root.mkdir()
    table.drop(columns=["split"]).to_csv(root / "metadata.csv", index=False)
    split_path = tmp_path / "split.csv"
    table[["case_id", "patient_id", "split"]].to_csv(split_path, index=False)
    return root, split_path


def _requested(targets, sex, band, phase):
    row = targets[(targets["sex"] == sex) & (targets["age_band"] == band) & (targets["phase"] == phase)]
    assert len(row) == 1
    return int(row["requested"].iloc[0]), int(row["real_positives"].iloc[0])


def test_grid_order_is_stable_whatever_the_argument_order():
    grid = cell_grid(sexes=["M", "F"], age_bands=["60-80", "le20"], phases=["venous", "non-contrast"])
    assert list(map(tuple, grid.to_numpy())) == [
        ("F", "le20", "non-contrast"), ("F", "le20", "venous"), ("F", "60-80", "non-contrast"), ("F", "60-80", "venous"),
        ("M", "le20", "non-contrast"), ("M", "le20", "venous"), ("M", "60-80", "non-contrast"), ("M", "60-80", "venous"),
    ]
    assert len(cell_grid()) == 2 * 5 * 4
    with pytest.raises(TargetingError, match="Unknown"):
        cell_grid(sexes=["F", "Unknown"])


def test_min_positives_by_hand(cohort_with_split):
    root, split = cohort_with_split
    targets = resolve_targets(root, split, "min_positives:3")
    assert list(targets.columns) == list(TARGET_COLUMNS)
    assert len(targets) == 40
    assert tuple(targets.iloc[0][["sex", "age_band", "phase"]]) == ("F", "le20", "non-contrast")
    assert _requested(targets, "F", "60-80", "venous") == (0, 4)  # already above k
    assert _requested(targets, "F", "60-80", "arterial") == (2, 1)
    assert _requested(targets, "M", "40-60", "venous") == (1, 2)
    assert _requested(targets, "F", "60-80", "non-contrast") == (3, 0)  # the train negative does not count
    assert _requested(targets, "M", "40-60", "arterial") == (3, 0)  # the val positive does not count
    # 37 empty cells x 3 + 2 + 1; Unknown-sex/age/phase positives formed no cell.
    assert targets["requested"].sum() == 37 * 3 + 2 + 1
    assert targets["real_positives"].sum() == 7


@pytest.mark.parametrize(
    "budget, expected",
    [
        (0, [0, 0, 0]),
        (1, [1, 0, 0]),  # level T=4: only non-contrast is below its share
        (2, [2, 0, 0]),  # T=6: exact [1.5, 0.5, 0]; the tied remainder goes to the earlier cell
        (3, [2, 1, 0]),  # T=8 = C+B: exact match, venous already holds its share
        (11, [4, 3, 4]),  # T=16: final counts [4, 4, 8] are proportional to the test's [1, 1, 2]
    ],
)
def test_match_by_hand(cohort_with_split, tmp_path, budget, expected):
    root, split = cohort_with_split
    # Restrict the grid to F/60-80 so the arithmetic is the hand example c=[0,1,4], p=[1/4,1/4,1/2].
    table = tmp_path / "weights.csv"
    table.write_text("sex,age_band,phase,weight\nF,60-80,non-contrast,1\nF,60-80,arterial,1\nF,60-80,venous,2\n")
    targets = resolve_targets(
        root, split, f"match:{table}", budget=budget, sexes=["F"], age_bands=["60-80"], phases=["non-contrast", "arterial", "venous"]
    )
    assert targets["real_positives"].tolist() == [0, 1, 4]
    assert targets["requested"].tolist() == expected
    assert targets["requested"].sum() == budget


def test_match_keeps_cells_missing_from_the_target_at_zero():
    counts = cell_grid(sexes=["F"], age_bands=["le20"], phases=["arterial", "venous"]).assign(count=[0, 0])
    targets = plan_match(counts, [0, 3], budget=5)
    assert targets["requested"].tolist() == [0, 5]
    with pytest.raises(TargetingError, match="empty"):
        plan_match(counts, [0, 0], budget=5)


def test_match_needs_a_budget_and_a_nonempty_target(cohort_with_split):
    root, split = cohort_with_split
    with pytest.raises(TargetingError, match="budget"):
        resolve_targets(root, split, "match:uniform")
    with pytest.raises(TargetingError, match="val split has no positive"):
        resolve_targets(root, split, "match:val", budget=3, sexes=["F"])


def test_match_uniform_and_weight_table(cohort_with_split, tmp_path):
    root, split = cohort_with_split
    kwargs = dict(sexes=["F"], age_bands=["60-80"], phases=["non-contrast", "arterial", "venous"])
    uniform = resolve_targets(root, split, "match:uniform", budget=7, **kwargs)
    # c=[0,1,4], p=1/3 each: T=12 -> [4, 3, 0]
    assert uniform["requested"].tolist() == [4, 3, 0]
    table = tmp_path / "weights.csv"
    table.write_text("sex,age_band,phase,weight\nF,60-80,non-contrast,1\nF,60-80,arterial,0.5\n")
    weighted = resolve_targets(root, split, f"match:{table}", budget=5, **kwargs)
    # p=[2/3, 1/3, 0]: T=9 -> [6, 2, 0] exceeds B; kinks 0 then 3 -> T=(5+1)/1=6 -> [4, 1, 0]
    assert weighted["requested"].tolist() == [4, 1, 0]


def test_explicit_counts_from_csv_and_yaml(cohort_with_split, tmp_path):
    root, split = cohort_with_split
    csv = tmp_path / "counts.csv"
    csv.write_text("sex,age_band,phase,requested\nmale,20-40,plain,5\nF,60-80,pv,2\n")
    targets = resolve_targets(root, split, f"counts:{csv}")
    assert _requested(targets, "M", "20-40", "non-contrast") == (5, 0)
    assert _requested(targets, "F", "60-80", "venous") == (2, 4)
    assert targets["requested"].sum() == 7
    yaml_path = tmp_path / "counts.yaml"
    yaml_path.write_text("cells:\n  - {sex: F, age_band: le20, phase: arterial, requested: 4}\n")
    assert resolve_targets(root, split, str(yaml_path))["requested"].sum() == 4


@pytest.mark.parametrize(
    "content, message",
    [
        ("sex,age_band,phase,requested\nUnknown,20-40,venous,5\n", "Unknown never forms a cell"),
        ("sex,age_band,phase,requested\nF,20-40,venous,5\nF,20-40,venous,1\n", "listed twice"),
        ("sex,age_band,phase,requested\nF,20-40,venous,-1\n", "negative"),
        ("sex,age_band,phase,requested\nF,30,venous,1\n", "not a cell"),
        ("sex,age_band,phase,requested\nX,20-40,venous,1\n", "unknown sex"),
        ("sex,age_band,phase\nF,20-40,venous\n", "missing column"),
    ],
)
def test_explicit_counts_reject_bad_rows(cohort_with_split, tmp_path, content, message):
    root, split = cohort_with_split
    csv = tmp_path / "bad.csv"
    csv.write_text(content)
    with pytest.raises(TargetingError, match=message):
        resolve_targets(root, split, f"counts:{csv}")


def test_rules_parse_and_errors_name_the_problem(cohort_with_split, tmp_path):
    assert parse_rule("min_positives:4") == ("min_positives", "4")
    assert parse_rule("match_val") == ("match", "val")
    assert parse_rule("need:12") == ("need", "12")
    assert parse_rule("table.csv") == ("counts", "table.csv")
    for rule in ("min_positives:-1", "min_positives:x", "median", "match:", "need:", "need:-3"):
        with pytest.raises(TargetingError):
            parse_rule(rule)
    root, _ = cohort_with_split
    bad_split = tmp_path / "bad_split.csv"
    bad_split.write_text("case_id,patient_id,split\nGHOST,P1,train\n")
    with pytest.raises(ValueError, match="GHOST"):
        resolve_targets(root, bad_split, "min_positives:1")
    bad_split.write_text("case_id,patient_id,split\nTV0,PTV0,holdout\n")
    with pytest.raises(ValueError, match="TV0.*holdout"):
        resolve_targets(root, bad_split, "min_positives:1")


def test_requests_expand_per_cell_indices():
    targets = cell_grid(sexes=["F"], age_bands=["le20"], phases=["arterial", "venous"]).assign(real_positives=0, requested=[2, 1])
    assert requests_from_targets(targets) == [
        {"sex": "F", "age_band": "le20", "phase": "arterial", "index": 0},
        {"sex": "F", "age_band": "le20", "phase": "arterial", "index": 1},
        {"sex": "F", "age_band": "le20", "phase": "venous", "index": 0},
    ]


def test_log_targets_round_trips_through_mlflow(cohort_with_split, mlflow_uri, tmp_path):
    import mlflow

    from synthx.generation.run import log_targets

    root, split = cohort_with_split
    targets = resolve_targets(root, split, "min_positives:2")
    client = mlflow.MlflowClient()
    with mlflow.start_run() as run:
        log_targets(client, run.info.run_id, targets)
    loaded = mlflow.load_table("synthx/targets.json", run_ids=[run.info.run_id])
    assert loaded[list(TARGET_COLUMNS)].to_dict("records") == targets.to_dict("records")
    twin = pd.read_csv(client.download_artifacts(run.info.run_id, "synthx/targets.csv", str(tmp_path)))
    assert twin[list(TARGET_COLUMNS)].to_dict("records") == targets.to_dict("records")
    assert mlflow.get_run(run.info.run_id).data.metrics["synthx/requested_total"] == targets["requested"].sum()


def test_match_test_is_refused_whatever_its_spelling(cohort_with_split):
    root, split = cohort_with_split
    for rule in ("match:test", "match_test", " match : test "):
        with pytest.raises(TargetingError, match="TEST split's labels"):
            resolve_targets(root, split, rule, budget=5)


@pytest.fixture
def need_cohort(tmp_path):
    """Canvases (healthy training scans) in F/60-80 venous+arterial and M/40-60 venous+arterial; validation
    positives with a known baseline outcome (see the hand computation in the test)."""
    rows = [
        _case("C1", "F", 70, "venous", 0, "train"), _case("C2", "F", 70, "arterial", 0, "train"),
        _case("C3", "M", 50, "arterial", 0, "train"), _case("C4", "M", 50, "venous", 0, "train"),
        _case("T1", "F", 70, "venous", 1, "train"), _case("X1", "F", 70, "arterial", 1, "test"),
    ]
    # (case, sex, age, phase, label, predicted volume mm^3): missed when the volume is <= 50.
    outcomes = [
        ("V1", "F", 70, "arterial", 1, 0.0), ("V2", "F", 70, "arterial", 1, 0.0), ("V3", "M", 50, "arterial", 1, 100.0),
        ("V4", "M", 50, "arterial", 1, 0.0), ("V5", "F", 70, "venous", 1, 100.0), ("V6", "F", 70, "venous", 1, 100.0),
        ("V7", "M", 50, "venous", 1, 100.0), ("V8", "M", 50, "venous", 1, 100.0), ("V9", "F", 70, "venous", 0, 0.0),
    ]
    rows += [_case(c, sex, age, phase, label, "val") for c, sex, age, phase, label, _ in outcomes]
    table = pd.DataFrame(rows)
    root = tmp_path / "cohort"
    root.mkdir()
    table.drop(columns=["split"]).to_csv(root / "metadata.csv", index=False)
    split_path = tmp_path / "split.csv"
    table[["case_id", "patient_id", "split"]].to_csv(split_path, index=False)
    records = pd.DataFrame(
        [{"case_id": c, "patient_id": f"P{c}", "label": label, "volume_mm3": volume, "sex": sex,
          "age_band": "60-80" if age == 70 else "40-60", "phase": phase} for c, sex, age, phase, label, volume in outcomes]
    )
    return root, split_path, records


NEED_GRID = dict(sexes=["F", "M"], age_bands=["40-60", "60-80"], phases=["arterial", "venous"])


@pytest.mark.parametrize("budget, expected", [(18, [9, 4, 5, 0]), (10, [5, 2, 3, 0]), (0, [0, 0, 0, 0])])
def test_need_allocates_by_the_validation_deficit_to_cells_with_canvases(need_cohort, budget, expected):
    root, split, records = need_cohort
    # Miss rates on validation: arterial 3/4, venous 0/4; F 2/4, M 1/4; 60-80 2/4, 40-60 1/4; pooled 3/8 for each
    # attribute. Deficits above the pooled rate: arterial 3/8, F 1/8, 60-80 1/8, the rest 0 (other phases: no
    # validation positives, no measured deficit). Need = their sum: F/60-80/arterial 5/8, F/60-80/venous 2/8,
    # M/40-60/arterial 3/8, M/40-60/venous 0 (no subgroup of it falls behind); the other four cells of the grid
    # have no canvas and get nothing.
    targets = resolve_targets(root, split, f"need:{budget}", baseline_records=records, threshold=50.0, **NEED_GRID)
    by_cell = targets.set_index(["sex", "age_band", "phase"])
    fillable = [("F", "60-80", "arterial"), ("F", "60-80", "venous"), ("M", "40-60", "arterial"), ("M", "40-60", "venous")]
    assert [int(by_cell.loc[cell, "requested"]) for cell in fillable] == expected
    assert targets["requested"].sum() == budget
    assert by_cell.loc[("F", "40-60", "arterial"), "need"] == pytest.approx(0.5)  # in need, but no canvas
    assert by_cell.loc[("F", "40-60", "arterial"), "requested"] == 0 and by_cell.loc[("F", "40-60", "arterial"), "canvases"] == 0
    assert by_cell["unfillable"].sum() == 4 and not by_cell.loc[("F", "60-80", "arterial"), "unfillable"]
    assert by_cell.loc[("F", "60-80", "arterial"), "need"] == pytest.approx(5 / 8)
    assert by_cell.loc[("M", "40-60", "venous"), "need"] == 0
    # A prediction column (0/1) is the operating point itself: the same outcome, the same allocation.
    predicted = records.drop(columns=["volume_mm3"]).assign(prediction=(records["volume_mm3"] > 50).astype(int))
    again = resolve_targets(root, split, f"need:{budget}", baseline_records=predicted, **NEED_GRID)
    assert again["requested"].tolist() == targets["requested"].tolist()


def test_need_gives_each_lagging_subgroup_its_share_however_few_fillable_cells_it_has():
    """Two phases fall equally far behind; arterial has one cell with a canvas, non-contrast three.
    Each phase gets half the budget (allocating per cell gave non-contrast three quarters)."""
    from fractions import Fraction

    grid = pd.DataFrame(
        [{"sex": sex, "age_band": band, "phase": phase} for sex in ("F",) for band in ("20-40", "40-60", "60-80")
         for phase in ("arterial", "non-contrast", "venous")]
    )
    counts = grid.assign(count=0)
    canvases = grid.assign(count=[int(phase != "arterial" or band == "60-80") for band, phase in zip(grid["age_band"], grid["phase"])])
    half = Fraction(1, 2)
    deficits = [(Fraction(0), Fraction(0), half if phase in ("arterial", "non-contrast") else Fraction(0)) for phase in grid["phase"]]
    table = plan_need(counts, canvases, deficits, 12)
    by_phase = table.groupby("phase")["requested"].sum()
    assert by_phase["arterial"] == 6 and by_phase["non-contrast"] == 6 and by_phase["venous"] == 0
    assert table.loc[(table["phase"] == "arterial") & (table["age_band"] == "60-80"), "requested"].item() == 6
    assert table.loc[(table["phase"] == "arterial") & (table["age_band"] != "60-80"), "unfillable"].all()
    assert (table.loc[table["phase"] == "non-contrast", "requested"] == 2).all()


def test_need_spreads_the_budget_when_every_subgroup_misses_alike(need_cohort):
    root, split, records = need_cohort
    # Every validation positive missed: no subgroup is worse than its attribute's pooled rate (1 everywhere),
    # so the need falls back to the mean miss rate and the four fillable cells share the budget equally.
    alike = records.assign(volume_mm3=0.0)
    targets = resolve_targets(root, split, "need:8", baseline_records=alike, threshold=50.0, **NEED_GRID)
    fillable = targets[targets["canvases"] > 0]
    assert fillable["requested"].tolist() == [2, 2, 2, 2]
    assert (fillable["need"] == 1.0).all()


def test_need_reads_validation_records_only_and_needs_a_deficit(need_cohort):
    root, split, records = need_cohort
    with pytest.raises(TargetingError, match="validation records"):
        resolve_targets(root, split, "need:5", **NEED_GRID)
    leaked = pd.concat([records, records.iloc[[0]].assign(case_id="X1")], ignore_index=True)
    with pytest.raises(TargetingError, match="baseline record X1 is a test case"):
        resolve_targets(root, split, "need:5", baseline_records=leaked, threshold=50.0, **NEED_GRID)
    perfect = records.assign(volume_mm3=1000.0)
    with pytest.raises(TargetingError, match="no cell with a canvas has a validation deficit"):
        resolve_targets(root, split, "need:5", baseline_records=perfect, threshold=50.0, **NEED_GRID)
    with pytest.raises(TargetingError, match="no positive case"):
        resolve_targets(root, split, "need:5", baseline_records=records[records["label"] == 0], threshold=50.0, **NEED_GRID)


def test_match_spends_the_budget_only_on_cells_with_a_canvas(cohort_with_split):
    root, split = cohort_with_split
    # F/60-80 has canvases (TNEG, HA, HV); F/le20 has none, so its uniform share is left out and marked.
    targets = resolve_targets(root, split, "match:uniform", budget=7, sexes=["F"], age_bands=["le20", "60-80"],
                              phases=["non-contrast", "arterial", "venous"])
    assert targets["requested"].tolist() == [0, 0, 0, 4, 3, 0]
    assert targets["unfillable"].tolist() == [True, True, True, False, False, False]
    assert targets["canvases"].tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(TargetingError, match="no cell of the target distribution has a healthy training scan"):
        resolve_targets(root, split, "match:uniform", budget=3, sexes=["M"], age_bands=["le20"])


def test_need_applies_the_recipe_detection_threshold(need_cohort):
    """Records without a prediction are judged at the recipe's detection.threshold_mm3, not the schema's default."""
    from conftest import RECIPES
    from lightning_modules.config.recipe import DetectionConfig
    from lightning_modules.recipe import load_recipe
    from synthx.generation.targeting import validation_misses

    root, split, records = need_cohort
    strict = load_recipe(RECIPES / "unet.yaml", ["detection.threshold_mm3=150"])
    assert strict.detection.threshold_mm3 != DetectionConfig.threshold_mm3
    split_table = pd.read_csv(split)
    # Volumes are 0 or 100 mm^3: at the schema's m = 50 three of the eight positives are missed, at the recipe's 150 all.
    assert validation_misses(records, split_table)["missed"].sum() == 3
    assert validation_misses(records, split_table, detection=strict.detection)["missed"].sum() == 8
    assert validation_misses(records, split_table, threshold=50.0, detection=strict.detection)["missed"].sum() == 3
    # Every positive missed alike: the four fillable cells share the budget (test_need_spreads_the_budget_...).
    targets = resolve_targets(root, split, "need:8", baseline_records=records, detection=strict.detection, **NEED_GRID)
    assert targets[targets["canvases"] > 0]["requested"].tolist() == [2, 2, 2, 2]
    default = resolve_targets(root, split, "need:8", baseline_records=records, **NEED_GRID)
    assert default[default["canvases"] > 0]["requested"].tolist() != [2, 2, 2, 2]
    # The recipe's score applies too: a max_prob recipe reads the records' max_prob column.
    by_probability = load_recipe(RECIPES / "unet.yaml", ["detection.score=max_prob", "detection.threshold_mm3=0.5"])
    scored = records.assign(max_prob=[0.9] * 8 + [0.1])
    assert validation_misses(scored, split_table, detection=by_probability.detection)["missed"].sum() == 0
