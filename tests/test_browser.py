"""The MLflow UI in a real browser: after a tiny study, headless Chromium shows the study's parent run,
both training runs, the registered models, and the HTML report renders.

Starts ``mlflow server`` on 127.0.0.1 (one worker, no job execution) against the tiny study's store and
reads the rendered pages with ``chromium --headless=new --dump-dom``; screenshots of each page are saved
to ``$BENCHX_TEST_ARTIFACTS/browser`` (default ``outputs/test-artifacts/browser``) for a person to look
at. Needs Debian's ``chromium`` (installed by ``.ci/setup``); without it the test is skipped, loudly.

Run: .venv/bin/python -m pytest -q tests/test_browser.py
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import REPO_ROOT

sys.path.insert(0, str(Path(__file__).resolve().parent / "synthx"))
from tiny_study import finished_study  # noqa: E402,F401  (fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("BENCHX_TEST_ARTIFACTS", REPO_ROOT / "outputs" / "test-artifacts")) / "browser"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="BROWSER TEST NOT RUN: Debian's 'chromium' is not installed (bash .ci/setup installs it: apt-get install chromium)",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def mlflow_ui(finished_study, tmp_path):
    """Base URL of an MLflow server on the study's store; stopped (its process group) afterwards."""
    _, uri, _ = finished_study
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp_path / "mlflow-server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {(tmp_path / 'mlflow-server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def render(url: str, name: str, budget_ms: int = 20000) -> str:
    """The page's DOM after its scripts ran, and a screenshot ``<name>.png`` under ARTIFACTS."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    common = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000",
              f"--virtual-time-budget={budget_ms}"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    subprocess.run([*common, f"--screenshot={ARTIFACTS / (name + '.png')}", url], capture_output=True, timeout=180)
    (ARTIFACTS / f"{name}.html").write_text(dom)
    return dom


def test_mlflow_ui_shows_the_study_runs_models_and_report(finished_study, mlflow_ui):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    experiment = parent.info.experiment_id
    tags = parent.data.tags

    runs_page = render(f"{mlflow_ui}/#/experiments/{experiment}/runs", "experiment-runs")
    assert "study-unet" in runs_page, "the study's parent run is not listed"

    for step, name in (("baseline", "train-unet-baseline"), ("augmented", "train-unet-synthx")):
        page = render(f"{mlflow_ui}/#/experiments/{experiment}/runs/{tags[f'step.{step}']}", f"run-{name}")
        assert name in page, f"{name} does not render"

    models = render(f"{mlflow_ui}/#/models", "registered-models")
    assert "benchx-unet" in models and "synthx-generator" in models
    model = render(f"{mlflow_ui}/#/models/benchx-unet", "registered-model-benchx-unet")
    assert "baseline" in model and "synthx" in model, "the aliases are not shown on the model page"

    # The report: the UI previews it in the parent run's artifact view (an iframe of the file), and
    # the file itself renders in the browser with its tables and embedded figures.
    artifact_view = render(f"{mlflow_ui}/#/experiments/{experiment}/runs/{parent_id}/artifacts/report/study_report.html",
                           "parent-report-artifact")
    assert "study_report.html" in artifact_view and "mlflow-html-iframe" in artifact_view
    downloaded = Path(client.download_artifacts(parent_id, "report/study_report.html", str(ARTIFACTS)))
    report = render(downloaded.resolve().as_uri(), "study-report", budget_ms=3000)
    assert "Baseline vs SynthX (BenchX table 6)" in report and "Forest plots per attribute" in report
    assert report.count("data:image/png;base64,") >= 3 and "not available" not in report
