"""A tiny finished study (the settings of test_synthx_study.py), run once per test session and shared
by the report and browser tests: ``from tiny_study import finished_study``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_synthx_study import _study_settings  # noqa: E402

_CACHE: dict[str, object] = {}


@pytest.fixture
def finished_study(tiny_phantom, tmp_path_factory):
    """(settings, tracking uri, parent run id) of a finished tiny study (run once per session)."""
    if "study" not in _CACHE:
        from lightning_modules.recipe import load_recipe
        from synthx.workflows.study.run import run_study

        from conftest import RECIPES

        root, split = tiny_phantom
        tmp_path = tmp_path_factory.mktemp("tiny_study")
        settings = _study_settings(root, split, tmp_path)
        settings.synthx_recipe = str(RECIPES / "generator" / "synthx.yaml")
        run_study(settings)
        uri = load_recipe(RECIPES / "unet.yaml", settings.overrides).tracking.uri
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(settings.experiment)
        parent = client.search_runs([experiment.experiment_id], "tags.stage = 'study'")[0]
        _CACHE["study"] = (settings, uri, parent.info.run_id)
    return _CACHE["study"]
