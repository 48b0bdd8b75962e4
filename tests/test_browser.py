"""The MLflow UI in a real browser: after a tiny study, headless Chromium shows the study's parent run,
both training runs, the registered models, and the HTML report renders.

Starts ``mlflow server`` on 127.0.0.1 (one worker, no job execution) against the tiny study's store and
reads the rendered pages (iframes included) from headless Chromium over its DevTools protocol; screenshots
of each page are saved to ``$BENCHX_TEST_ARTIFACTS/browser`` (default: a new temporary folder; its path is printed)
for a person to look at, and kept by CI as artifacts. Needs Debian's ``chromium`` (installed by ``.ci/setup``); without it the test is skipped, loudly.

Run: .venv/bin/python -m pytest -q tests/test_browser.py
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parent / "synthx"))
from tiny_study import finished_study  # noqa: E402,F401  (fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("BENCHX_TEST_ARTIFACTS") or tempfile.mkdtemp(prefix="benchx-test-artifacts-")) / "browser"

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


class Chromium:
    """Headless Chromium driven over the DevTools protocol (aiohttp's websocket client).

    Pages are read in real time, frames included: a page counts as rendered once the text its test
    expects is in its DOM (the documents of its iframes pierced), then it is screenshotted. Chromium's
    ``--virtual-time-budget`` screenshots are not used: they caught MLflow's HTML artifact preview
    (an iframe of a blob URL) before it painted, blank, where a person's browser shows the report.
    """

    def __init__(self):
        self.port, self.profile = free_port(), tempfile.mkdtemp(prefix="chromium-profile-")
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000",
             f"--remote-debugging-port={self.port}", f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )

    def close(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)

    def render(self, url: str, name: str, expect: tuple[str, ...], timeout_s: float = 90.0,
               ready: Callable[[str], bool] | None = None, viewport: tuple[int, int] | None = None,
               probe: str | None = None) -> tuple[str, Path]:
        """Open ``url``; once every string of ``expect`` is in the page (frames included) and ``ready``
        (if given) accepts its DOM, or ``timeout_s`` passed, save ``<name>.png`` and ``<name>.txt`` under
        ARTIFACTS; return the page's flattened DOM and the PNG.

        ``ready`` is for pages that are still being parsed when their text first shows: a long report
        has its headings in the DOM before the images that follow them. ``viewport`` (width, height)
        sets the screen size; ``probe``, a JavaScript expression, is evaluated after rendering and its
        JSON value returned as the flattened DOM's first line.
        """
        return asyncio.run(self._render(url, name, expect, timeout_s, ready, viewport, probe))

    async def _render(self, url: str, name: str, expect: tuple[str, ...], timeout_s: float,
                      ready: Callable[[str], bool] | None, viewport: tuple[int, int] | None = None,
                      probe: str | None = None) -> tuple[str, Path]:
        import aiohttp

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        async with aiohttp.ClientSession() as session:
            deadline = time.time() + 60
            while True:
                try:
                    targets = await (await session.get(f"http://127.0.0.1:{self.port}/json")).json()
                    break
                except (aiohttp.ClientError, OSError):
                    if time.time() > deadline or self.process.poll() is not None:
                        raise RuntimeError("chromium's DevTools endpoint did not come up")
                    await asyncio.sleep(0.3)
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as socket_:
                counter = iter(range(1, 1_000_000))

                async def call(method: str, **params):
                    ident = next(counter)
                    await socket_.send_json({"id": ident, "method": method, "params": params})
                    while True:
                        message = await socket_.receive_json()
                        if message.get("id") == ident:
                            if "error" in message:
                                raise RuntimeError(f"{method}: {message['error']}")
                            return message["result"]

                await call("Page.enable")
                if viewport:
                    await call("Emulation.setDeviceMetricsOverride", width=viewport[0], height=viewport[1],
                               deviceScaleFactor=1, mobile=False)
                await call("Page.navigate", url=url)
                deadline, dom = time.time() + timeout_s, ""
                while True:
                    dom = _flatten((await call("DOM.getDocument", depth=-1, pierce=True))["root"])
                    # A sandboxed iframe (MLflow's HTML preview) renders in its own process: a target of its own.
                    for target in await (await session.get(f"http://127.0.0.1:{self.port}/json")).json():
                        if target["type"] == "iframe":
                            dom += "\n" + await _frame_dom(session, target["webSocketDebuggerUrl"])
                    if (all(text in dom for text in expect) and (ready is None or ready(dom))) or time.time() > deadline:
                        break
                    await asyncio.sleep(1.0)
                await asyncio.sleep(1.0)  # let the last layout paint
                shot = await call("Page.captureScreenshot", format="png")
                if probe:
                    value = await call("Runtime.evaluate", expression=f"JSON.stringify({probe})", returnByValue=True)
                    dom = value["result"].get("value", "null") + "\n" + dom
                if viewport:
                    await call("Emulation.clearDeviceMetricsOverride")
        png = ARTIFACTS / f"{name}.png"
        png.write_bytes(base64.b64decode(shot["data"]))
        (ARTIFACTS / f"{name}.txt").write_text(dom)
        return dom, png


async def _frame_dom(session, websocket_url: str) -> str:
    """The flattened DOM of an out-of-process frame's target."""
    async with session.ws_connect(websocket_url, max_msg_size=0) as socket_:
        await socket_.send_json({"id": 1, "method": "DOM.getDocument", "params": {"depth": -1, "pierce": True}})
        while True:
            message = await socket_.receive_json()
            if message.get("id") == 1:
                return _flatten(message["result"]["root"]) if "result" in message else ""


def _flatten(node: dict) -> str:
    """Tag names, attributes and text of a DevTools DOM node and everything under it, iframe documents included."""
    parts = [node.get("nodeName", ""), node.get("nodeValue", ""), " ".join(node.get("attributes", []))]
    for child in [*node.get("children", []), *([node["contentDocument"]] if "contentDocument" in node else [])]:
        parts.append(_flatten(child))
    return "\n".join(part for part in parts if part)


def dark_pixels(png: Path, box: tuple[float, float, float, float]) -> int:
    """Pixels darker than mid-grey inside ``box`` (left, top, right, bottom as fractions of the image)."""
    import numpy as np
    from PIL import Image

    image = np.asarray(Image.open(png).convert("L"))
    height, width = image.shape
    left, top, right, bottom = box
    return int((image[int(top * height):int(bottom * height), int(left * width):int(right * width)] < 128).sum())


@pytest.fixture
def chromium(capsys):
    browser = Chromium()
    try:
        yield browser
    finally:
        browser.close()
        with capsys.disabled():
            print(f"\nbrowser screenshots: {ARTIFACTS}")


def test_mlflow_ui_shows_the_study_runs_models_and_report(finished_study, mlflow_ui, chromium):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    experiment = parent.info.experiment_id
    tags = parent.data.tags

    runs_page, _ = chromium.render(f"{mlflow_ui}/#/experiments/{experiment}/runs", "experiment-runs", ("study-unet",))
    assert "study-unet" in runs_page, "the study's parent run is not listed"

    # The parent run's description is the verdict.
    page, _ = chromium.render(f"{mlflow_ui}/#/experiments/{experiment}/runs/{parent_id}", "parent-run",
                              ("Scarcity gap (arterial)",))
    assert "Scarcity gap (arterial)" in page, "the parent run's description does not show the verdict"

    for step, name in (("baseline", "baseline-train-unet"), ("augmented", "synthx-train-unet")):
        page, _ = chromium.render(f"{mlflow_ui}/#/experiments/{experiment}/runs/{tags[f'step.{step}']}", f"run-{name}", (name,))
        assert name in page, f"{name} does not render"

    models, _ = chromium.render(f"{mlflow_ui}/#/models", "registered-models", ("benchx-unet", "synthx-generator"))
    assert "benchx-unet" in models and "synthx-generator" in models
    # An alias tag's attributes: "... title <alias> data-component-id ..._modelversionaliastag.tsx_...".
    aliases = {f"{settings.experiment}-{arm}" for arm in ("baseline", "synthx")}
    tags = tuple(f"title {alias} data-component-id codegen_mlflow_app_src_model-registry_components_aliases_modelversionaliastag" for alias in aliases)
    model, _ = chromium.render(f"{mlflow_ui}/#/models/benchx-unet", "registered-model-benchx-unet", tags)
    shown = set(re.findall(r"title (\S+) data-component-id \S*modelversionaliastag", model))
    assert aliases <= shown, f"the aliases are not shown on the model page: {sorted(shown)}"

    # The report: the UI previews it in the parent run's artifact view (an iframe of a blob of the
    # file); the preview's document holds the report and paints (the preview area is not blank).
    expected = ("Arms compared (BenchX table 6)", "Forest plots per operating point")
    # The report's headings are in the DOM before the images after them are parsed: wait for the images.
    def figures(dom: str) -> bool:
        return dom.count("data:image/png;base64,") >= 3

    preview, shot = chromium.render(f"{mlflow_ui}/#/experiments/{experiment}/runs/{parent_id}/artifacts/report/study_report.html",
                                    "parent-report-artifact", expected, ready=figures)
    assert "mlflow-html-iframe" in preview and all(text in preview for text in expected), "the report's preview is empty"
    assert preview.count("data:image/png;base64,") >= 3
    # The preview pane (right of the artifact tree, below the file's path): the report's heading and tables.
    assert dark_pixels(shot, (0.30, 0.25, 0.70, 0.85)) > 2000, f"the report preview paints nothing: see {shot}"
    # And the file itself, opened in the browser.
    downloaded = Path(client.download_artifacts(parent_id, "report/study_report.html", str(ARTIFACTS)))
    # On a 1,280 x 800 screen: the verdict is in the first screen, and nothing is wider than the screen.
    probe = ("{verdict: document.querySelector('ul.verdict').getBoundingClientRect().bottom, "
             "height: window.innerHeight, width: document.documentElement.scrollWidth, screen: window.innerWidth}")
    report, shot = chromium.render(downloaded.resolve().as_uri(), "study-report", expected, ready=figures,
                                   viewport=(1280, 800), probe=probe)
    assert all(text in report for text in expected)
    assert report.count("data:image/png;base64,") >= 3 and "not available" not in report
    import json

    layout = json.loads(report.splitlines()[0])
    assert 0 < layout["verdict"] <= layout["height"], f"the verdict is not in the first screen: {layout}; see {shot}"
    assert layout["width"] <= layout["screen"] == 1280, f"the report is wider than a 1,280 px screen: {layout}; see {shot}"
    assert "Scarcity gap (arterial)" in report and "Primary endpoint" in report
