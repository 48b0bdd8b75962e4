"""The declared Python range admits only interpreters that have what the project uses (enum.StrEnum, 3.11)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def test_requires_python_starts_where_strenum_exists():
    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    uses = [path for path in (ROOT / "lightning_modules").rglob("*.py") if "StrEnum" in path.read_text()]
    assert uses, "the schema's choices are StrEnums"
    assert not requires.contains("3.10.14") and requires.contains("3.11.0") and requires.contains("3.12.1")
    claims = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
              for match in re.finditer(r"[Pp]ython\s*(>=|≥)?\s*3\.10\b", path.read_text())]
    assert not claims, f"docs claim Python 3.10: {claims}"
