"""The real services of the scaling tests: PostgreSQL, the MLflow server on it, a single-node Slurm.

``.ci/run`` starts them once (``scripts/services.sh start``) and exports ``BENCHX_TEST_SERVICES``
(the folder whose ``env.sh`` holds their addresses); without it, the first test that needs them
starts them in a temporary folder (as root, with the Debian packages of ``.ci/setup``) and stops
them at the end. A service that cannot be started fails the test loudly: these tests never skip.

Tests import the fixtures: ``from service_fixtures import services, postgres_database``.
Run: ``python -m pytest -q tests/services``
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "services.sh"
NAMES = ("BENCHX_POSTGRES_URL", "BENCHX_OPTUNA_STORAGE", "MLFLOW_TRACKING_URI", "SLURM_CONF", "PGPASSFILE")


def read_env(folder: Path) -> dict[str, str]:
    """The ``export NAME=value`` lines of ``<folder>/env.sh``."""
    values = {}
    for line in (folder / "env.sh").read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = shlex.split(value)[0] if value else ""
    return values


@contextmanager
def _password_file(values: dict[str, str]):
    """PostgreSQL asks for its password: libpq (psycopg, psql) of this process and of the workers and
    jobs it starts finds it through PGPASSFILE, as after ``source FOLDER/env.sh``."""
    saved = os.environ.get("PGPASSFILE")
    os.environ["PGPASSFILE"] = values["PGPASSFILE"]
    try:
        yield values
    finally:
        if saved is None:
            os.environ.pop("PGPASSFILE", None)
        else:
            os.environ["PGPASSFILE"] = saved


@pytest.fixture(scope="session")
def services() -> dict[str, str]:
    """Addresses of the running services: BENCHX_POSTGRES_URL, MLFLOW_TRACKING_URI (the server), SLURM_CONF,
    PGPASSFILE (the PostgreSQL password, also set in this process's environment)."""
    given = os.environ.get("BENCHX_TEST_SERVICES")
    if given:
        values = read_env(Path(given))
        missing = [name for name in NAMES if not values.get(name)]
        if missing:
            pytest.fail(f"BENCHX_TEST_SERVICES={given}: env.sh lacks {', '.join(missing)} (scripts/services.sh start {given})")
        with _password_file(values):
            yield values
        return
    # Not under pytest's temporary folder: its parents are private, and PostgreSQL and munged run as
    # their own users, who must enter the folder.
    folder = Path(tempfile.mkdtemp(prefix="benchx-services-"))
    folder.chmod(0o755)
    environment = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    started = subprocess.run(["bash", str(SCRIPT), "start", str(folder)], env=environment, capture_output=True, text=True)
    try:
        if started.returncode != 0:
            pytest.fail(f"could not start the services (scripts/services.sh start; needs root and the Debian "
                        f"packages of .ci/setup):\n{started.stdout}\n{started.stderr}")
        with _password_file(read_env(folder)) as values:
            yield values
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], capture_output=True, text=True)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def postgres_database(services) -> str:
    """A new, empty PostgreSQL database for one test (SQLAlchemy URL with the psycopg 3 driver)."""
    import psycopg

    name = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{services['BENCHX_POSTGRES_URL']}/postgres", autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return f"{services['BENCHX_POSTGRES_URL'].replace('postgresql://', 'postgresql+psycopg://')}/{name}"
