"""Names people read in place of the keys the tables carry: arms, attributes, groups, metrics and
operating points (``le20`` is shown as "20 or younger", ``val_chosen`` as "the validation-chosen
operating point"). A key without a label is shown as it is."""

from __future__ import annotations

ARMS = {"baseline": "baseline", "sham": "sham", "synthx": "SynthX", "copy_paste": "copy-paste", "phantom": "positive control"}
ATTRIBUTES = {"overall": "Overall", "age": "Age", "sex": "Sex", "race": "Race", "phase": "Phase",
              "tumor_size": "Tumor size", "tumor_location": "Tumor location", "cohort": "Site"}
GROUPS = {
    ("overall", "all"): "all scans",
    ("age", "le20"): "20 or younger", ("age", "20-40"): "21 to 40", ("age", "40-60"): "41 to 60",
    ("age", "60-80"): "61 to 80", ("age", "gt80"): "over 80",
    ("sex", "F"): "female", ("sex", "M"): "male",
    ("tumor_size", "small"): "20 mm or smaller", ("tumor_size", "large"): "over 20 mm",
}
METRICS = {"sensitivity": "Sensitivity", "specificity": "Specificity", "f1": "F1", "auc": "AUC",
           "auc_binary": "AUC (decision)", "n": "Scans", "n_patients": "Patients", "positives": "Tumor scans",
           "negatives": "Healthy scans"}
POINTS = {"val_chosen": "the validation-chosen operating point", "fixed": "BenchX's fixed m",
          "matched_specificity": "matched specificity",
          "subgroup_matched_specificity": "subgroup-matched specificity"}


def arm_label(arm: str) -> str:
    return ARMS.get(str(arm), str(arm))


def attribute_label(attribute: str) -> str:
    return ATTRIBUTES.get(str(attribute), str(attribute).replace("_", " ").capitalize())


def group_label(attribute: str, group: str) -> str:
    """A group as a person reads it: ``age <= 20``, ``female``, ``arterial`` (a phase stays a phase)."""
    return GROUPS.get((str(attribute), str(group)), str(group))


def metric_label(metric: str) -> str:
    return METRICS.get(str(metric), str(metric).replace("_", " ").capitalize())


def point_label(point: str) -> str:
    return POINTS.get(str(point), str(point).replace("_", " "))
