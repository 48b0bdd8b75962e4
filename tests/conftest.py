"""Shared test setup: tiny settings, opt-in markers for slow and GPU tests, a temporary MLflow store.

The default suite is fast and offline (STYLE.md). ``--run-slow`` opts into tests marked ``slow``
(each over about a minute on a 2-core CPU), ``--run-gpu`` into those marked ``gpu``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "recipes"

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("TQDM_DISABLE", "1")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption("--run-gpu", action="store_true", help="run tests marked gpu (needs CUDA)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow test (over a minute on 2 CPU cores): opt in with --run-slow"))
        if "gpu" in item.keywords and not config.getoption("--run-gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device: opt in with --run-gpu"))


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch) -> str:
    """A throwaway SQLite MLflow store (artifacts under tmp_path), set as the tracking URI."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)
