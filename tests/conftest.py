"""Shared test setup: tiny settings, opt-in markers for slow and GPU tests, a temporary MLflow store.

The default suite is fast and needs no network, GPU or service it does not start itself.
``--run-slow`` opts into tests marked ``slow`` (each over about a minute on a 2-core CPU),
``--run-gpu`` into those marked ``gpu``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import lightning.pytorch  # noqa: F401  (see below)
import pytest

# Lightning adds a stderr handler to its loggers when first imported. Imported here, it writes to
# pytest's session-wide capture; first imported inside a test that uses ``capsys``, it would keep
# that test's stream, closed afterwards, and a later test's log line ("Seed set to 0") would print
# "--- Logging error ---" into what that test reads from stderr.

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


@pytest.fixture(autouse=True)
def isolated_mlflow_state():
    """Restore MLflow's process-wide state after each test: ``mlflow.set_tracking_uri`` and
    ``mlflow.set_experiment`` write MLFLOW_* environment variables and module globals that would
    otherwise point the next test (and its subprocesses) at a database that no longer exists."""
    import mlflow
    from mlflow.tracking import fluent

    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()
    fluent._active_experiment_id = None
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[key]
    os.environ.update(saved)
    mlflow.set_tracking_uri(saved.get("MLFLOW_TRACKING_URI") or None)
    if "MLFLOW_TRACKING_URI" not in saved:
        os.environ.pop("MLFLOW_TRACKING_URI", None)


_STORE_TEMPLATE: list[Path] = []


def new_sqlite_store(path: Path) -> str:
    """The ``sqlite:///`` URI of an empty MLflow store at ``path`` (left as it is when it exists).

    MLflow takes a new SQLite file through its whole schema history, about 3 s on 2 cores; the
    suite makes dozens of stores, so each is a copy of one store migrated once per session. The
    tests of a store's first use (tests/tracking/test_tracking.py) make theirs from nothing.
    """
    path = Path(path)
    if not path.exists():
        if not _STORE_TEMPLATE:
            from mlflow.tracking import MlflowClient

            folder = Path(tempfile.mkdtemp(prefix="benchx-mlflow-template-"))
            atexit.register(shutil.rmtree, folder, True)
            MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
            _STORE_TEMPLATE.append(folder / "mlflow.db")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_STORE_TEMPLATE[0], path)
    return f"sqlite:///{path}"


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch) -> str:
    """A throwaway SQLite MLflow store (artifacts under tmp_path), set as the tracking URI."""
    import mlflow

    uri = new_sqlite_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


# ------------------------------------------------------------------------------------------------
# A tiny phantom cohort + split shared by the training, evaluation, study and sweep tests.

TINY_SHAPE = (48, 48, 32)
TINY_CASES = 24


@pytest.fixture(scope="session")
def tiny_phantom(tmp_path_factory):
    """(cohort root, split path) of a 24-case phantom at 48x48x32, split by patient with seed 0."""
    from lightning_modules.data.cohort import load_cohort
    from lightning_modules.cohorts.phantom import generate_phantom_cohort
    from lightning_modules.data.splits import make_splits, write_split

    root = tmp_path_factory.mktemp("tiny_phantom")
    generate_phantom_cohort(root / "cohort", n_cases=TINY_CASES, seed=0, shape=TINY_SHAPE)
    split = root / "split.csv"
    write_split(make_splits(load_cohort(root / "cohort").metadata, seed=0, val_fraction=0.2, test_fraction=0.25), split)
    return root / "cohort", split


def tiny_overrides(root, split, tmp_path, steps: int = 2) -> list[str]:
    """Recipe overrides that make any backbone recipe train in seconds on the tiny phantom."""
    return [
        "profile=cpu",
        f"data.root={root}",
        f"data.split={split}",
        "data.patch_size=[16,16,16]",
        "data.samples_per_volume=1",
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        "trainer.checkpoint_every_n_steps=1",
        "trainer.log_every_n_steps=1",
        "trainer.sw_batch_size=16",
        "detection.bootstrap_resamples=50",
        f"tracking.uri={new_sqlite_store(tmp_path / 'mlflow.db')}",
        f"tracking.output_dir={tmp_path / 'outputs'}",
        "model.options.channels=[4,8,16,32]",
    ]
