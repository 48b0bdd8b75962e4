"""The services of ``scripts/services.sh`` are private to this machine and ask for a password:
every TCP port of PostgreSQL, the MLflow server, slurmctld and slurmd listens on loopback only
(munged has no TCP port at all), and PostgreSQL refuses a client without the password, with a
wrong one, and a local user other than ``postgres`` on its Unix socket.

Run: ``python -m pytest -q tests/services/test_service_security.py``
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from service_fixtures import services  # noqa: F401 (pytest fixture)


def _listening() -> list[tuple[str, int, set[int]]]:
    """(address, port, pids) of every listening TCP socket, from ``ss -ltnpH``."""
    output = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    sockets = []
    for line in output.splitlines():
        local = line.split()[3]
        address, _, port = local.rpartition(":")
        sockets.append((address.strip("[]").split("%")[0], int(port), {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return sockets


def _service_pids(folder: Path) -> dict[str, set[int]]:
    """The processes of each service, from the pid files in the services folder."""
    def first_line(path: Path) -> int:
        return int(path.read_text().split()[0])

    group = first_line(folder / "mlflow.pid")  # the server's process group (uvicorn/gunicorn and workers)
    mlflow = {int(p) for p in subprocess.run(["ps", "-o", "pid=", "-g", str(group)], capture_output=True,
                                             text=True).stdout.split()}
    return {
        "postgres": {first_line(folder / "pg" / "data" / "postmaster.pid")},
        "mlflow": mlflow,
        "slurmctld": {first_line(folder / "slurm" / "slurmctld.pid")},
        "slurmd": {first_line(folder / "slurm" / "slurmd.pid")},
        "munged": {first_line(folder / "munge" / "munged.pid")},
    }


def _loopback(address: str) -> bool:
    return address != "*" and ipaddress.ip_address(address).is_loopback


def test_every_service_listens_on_loopback_only(services):
    folder = Path(services["PGPASSFILE"]).parent
    conf = Path(services["SLURM_CONF"]).read_text()
    ports = {
        "postgres": urlsplit(services["BENCHX_POSTGRES_URL"]).port,
        "mlflow": urlsplit(services["MLFLOW_TRACKING_URI"]).port,
        "slurmctld": int(re.search(r"^SlurmctldPort=(\d+)", conf, re.M).group(1)),
        "slurmd": int(re.search(r"^SlurmdPort=(\d+)", conf, re.M).group(1)),
    }
    sockets = _listening()
    for service, port in ports.items():
        addresses = sorted({address for address, listened, _ in sockets if listened == port})
        assert addresses, f"{service}: nothing listens on port {port}"
        assert all(_loopback(address) for address in addresses), f"{service} listens on {addresses} (port {port})"
    # Every TCP socket any service process holds, on whatever port, is on loopback; munged has none.
    pids = _service_pids(folder)
    for service, members in pids.items():
        held = sorted({(address, port) for address, port, owners in sockets if owners & members})
        if service == "munged":
            assert held == [], f"munged listens on TCP {held}"
            continue
        assert held, f"{service}: no listening socket found for its processes {sorted(members)} (ss -ltnp)"
        assert all(_loopback(address) for address, _ in held), f"{service} listens on {held}"


def test_postgres_refuses_a_client_without_the_password(services, tmp_path):
    import psycopg

    url = urlsplit(services["BENCHX_POSTGRES_URL"])
    server = dict(host=url.hostname, port=url.port, user="postgres", dbname="postgres", connect_timeout=10)
    # With the password file the services wrote (as after `source env.sh`) a client gets in ...
    with psycopg.connect(**server, passfile=services["PGPASSFILE"]) as connection:
        assert connection.execute("SELECT current_user").fetchone() == ("postgres",)
        method = connection.execute("SHOW password_encryption").fetchone()[0]
    assert method == "scram-sha-256"
    # ... without it, or with a wrong password, it does not: no trust authentication is left.
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(**server, passfile=str(tmp_path / "no-such-file"))
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(**server, password="guessed", passfile=str(tmp_path / "no-such-file"))
    assert "PGPASSFILE" in Path(Path(services["PGPASSFILE"]).parent / "env.sh").read_text()
    assert os.stat(services["PGPASSFILE"]).st_mode & 0o077 == 0, "the password file is readable by others"
    # The Unix socket uses peer authentication: only the operating-system user postgres is postgres.
    if os.geteuid() != 0:
        pytest.fail("the services tests run as root (scripts/services.sh starts the test Slurm as root)")
    with pytest.raises(psycopg.OperationalError, match="[Pp]eer authentication failed"):
        psycopg.connect(host=str(Path(services["PGPASSFILE"]).parent / "pg"), port=url.port, user="postgres",
                        dbname="postgres", passfile=str(tmp_path / "no-such-file"))
