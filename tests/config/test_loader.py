"""The layered loader on its own schema (as SynthX uses it): layer order, profiles, struct mode, errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from lightning_modules.config.loader import RecipeError, load_config


@dataclass
class Section:
    size: int = 1
    name: str = "a"


@dataclass
class Schema:
    name: str = "x"
    profile: str = "full"
    section: Section = field(default_factory=Section)
    profiles: dict[str, Any] = field(default_factory=dict)


def write(path, text):
    path.write_text(text)
    return path


def test_layers_apply_in_order_base_file_profile_command_line(tmp_path):
    write(tmp_path / "_base.yaml", "section: {size: 2, name: base}\nprofiles: {small: {section: {size: 3}}}\n")
    recipe = write(tmp_path / "mine.yaml", "section: {name: mine}\n")
    config = load_config(recipe, schema=Schema)
    assert (config.name, config.section.size, config.section.name) == ("mine", 2, "mine")
    config = load_config(recipe, ["profile=small"], schema=Schema)
    assert config.section.size == 3, "the profile is applied after the file"
    config = load_config(recipe, ["profile=small", "section.size=9"], schema=Schema)
    assert config.section.size == 9, "the command line wins over the profile"
    assert load_config(recipe, schema=Schema, base=False).section.size == 1, "base=False skips _base.yaml"


def test_checker_and_errors_name_the_file_and_key(tmp_path):
    recipe = write(tmp_path / "r.yaml", "section: {sise: 2}\n")
    with pytest.raises(RecipeError, match=r"r.yaml: unknown key 'section.sise'"):
        load_config(recipe, schema=Schema)
    good = write(tmp_path / "g.yaml", "section: {size: 2}\n")
    with pytest.raises(RecipeError, match="invalid value for 'section.size'"):
        load_config(good, ["section.size=big"], schema=Schema)
    with pytest.raises(RecipeError, match="profile 'tiny' is not defined"):
        load_config(good, ["profile=tiny"], schema=Schema)
    with pytest.raises(RecipeError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", schema=Schema)
    seen = []
    load_config(good, schema=Schema, checker=lambda config, source: seen.append((config.section.size, source)))
    assert seen == [(2, str(good))]
    assert load_config(good, schema=Schema, checker=lambda c, s: seen.append(1), check=False) and len(seen) == 1


def test_a_resolved_file_gets_no_base_and_no_profile_again(tmp_path):
    write(tmp_path / "_base.yaml", "section: {size: 2}\n")
    resolved = write(tmp_path / "recipe.yaml", "profile: small\nsection: {size: 5, name: run}\nprofiles: {small: {section: {size: 3}}}\n")
    config = load_config(resolved, schema=Schema, resolved=True)
    assert config.section.size == 5 and config.profile == "small"
