"""A study's trained arms in the model registry: aliases scoped by experiment and a description
on each registered version naming its arm, study, recipe, data and operating point."""

from __future__ import annotations

from lightning_modules.tracking.operating_point import operating_point_description
from lightning_modules.tracking.pyfunc import set_aliases
from synthx.analysis.labels import arm_label
from synthx.workflows.report.runs import study_arms, StudyRuns


def model_version_description(study: StudyRuns, step: str, arm: str, experiment: str, version: str, uri: str) -> str:
    """A registered version's description: arm, study, recipe, data and the operating point the version
    applies (read back from the version itself, so the text states what a loaded model does)."""
    tags = study.run(step).data.tags
    params = study.run(step).data.params
    name, _, number = version.partition("/")
    recipe_m = params.get("detection.threshold_mm3")
    point = operating_point_description(name, number, uri, float(recipe_m) if recipe_m else None)
    data = params.get("data.root") or tags.get("eval_cohort") or "see the training run"
    return (f"{arm_label(arm)} arm of study {experiment} (parent run {study.parent.info.run_id}, "
            f"training run {study.steps[step]}). Recipe: {tags.get('recipe', 'not recorded')} (profile {tags.get('profile', '-')}), synthetic ratio "
            f"{tags.get('synthx_ratio', '0')}. Data: {data}, split sha256 {tags.get('split_sha256', 'not recorded')[:12]}. "
            f"Operating point: {point}.")


def publish_arms(study: StudyRuns, uri: str) -> dict[str, str]:
    """Set ``<experiment>-<arm>`` on each trained arm's registered version (``benchx-<backbone>``) and
    ``<experiment>`` on the generator's (``synthx-generator``), describe each version, and tag the
    parent run ``model.<arm>`` with what each alias points at. Returns arm -> ``name/version``."""
    parent_id = study.parent.info.run_id
    experiment = study.client.get_experiment(study.parent.info.experiment_id).name
    aliases = {}
    for step, variant in study_arms(study):
        # Scoped by experiment: one experiment's study never moves another's aliases.
        aliases[variant] = set_aliases(study.steps[step], uri, [f"{experiment}-{variant}"])
        if aliases[variant]:
            name, _, version = aliases[variant].partition("/")
            study.client.update_model_version(name, version, description=model_version_description(
                study, step, variant, experiment, aliases[variant], uri))
    if "synthx_train" in study.steps:
        aliases["generator"] = set_aliases(study.steps["synthx_train"], uri, [experiment], prefix="synthx-")
    for variant, target in aliases.items():
        if target:
            study.client.set_tag(parent_id, f"model.{variant}", target)
    return aliases
