"""The layered configuration loader shared by segmentation recipes and SynthX recipes.

A configuration is OmegaConf YAML merged onto a structured dataclass schema in struct mode, so a
mistyped key is an error rather than a silent no-op. Layers, later ones win: schema defaults ->
``_base.yaml`` from the recipe's folder (when ``base``) -> the recipe file -> its selected profile
(``profiles.<name>``, e.g. ``cpu``) -> command-line ``key=value`` overrides. See
``docs/explanation/architecture.md "Layering"``.

The segmentation schema lives in :mod:`lightning_modules.config.recipe`; SynthX passes its own
schema and checker.

Example::

    config = load_config("recipes/generator/synthx.yaml", ["profile=cpu"], schema=SynthXRecipe,
                         checker=check_synthx_recipe, base=False)
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

BASE_RECIPE = "_base.yaml"
# Free-form mappings inside a schema: their keys are checked elsewhere (builder signatures) or are free.
OPEN_KEYS = ("model.options", "tracking.tags", "profiles")


class RecipeError(ValueError):
    """A recipe that cannot be loaded: a mistyped key, a wrong type, a violated shape rule."""


class RecipeFileError(RecipeError):
    """A recipe path that names no file: missing, or a directory."""


def load_config(
    path: str | Path,
    overrides: Sequence[str] | None = None,
    *,
    schema: type,
    checker: Callable[[DictConfig, str], None] | None = None,
    check: bool = True,
    resolved: bool = False,
    base: bool = True,
    open_keys: Sequence[str] = OPEN_KEYS,
) -> DictConfig:
    """Load a layered configuration: schema <- _base.yaml <- file <- profile <- overrides, in struct mode.

    Args:
        path: the YAML file (its folder holds ``_base.yaml`` when ``base``).
        overrides: ``key=value`` strings (dotted keys), applied last.
        schema: the structured dataclass the layers are merged onto.
        checker: ``checker(config, source)``, run when ``check``, raising :class:`RecipeError`.
        check: run ``checker``.
        resolved: the file is an already resolved configuration (the ``recipe.yaml`` a run logs):
            no ``_base.yaml`` layer and no profile is applied again, only the overrides.
        base: merge ``_base.yaml`` from the file's folder.
        open_keys: dotted keys of free-form mappings inside the schema.

    Raises:
        RecipeError: naming the file and the key that is wrong.
    """
    path = Path(path)
    layers = _layers(path, list(overrides or []), base and not resolved)
    profiles, stripped = _split_profiles(layers)
    config = OmegaConf.structured(schema)
    _seal(config, open_keys)
    for source, layer in stripped:
        config = _merge(config, layer, source, open_keys)
    profile = config.profile
    if not resolved and profile not in ("full", "", None):
        if profile not in profiles:
            raise RecipeError(
                f"{path}: profile {profile!r} is not defined (available: full, {', '.join(profiles) or 'none'})"
            )
        config = _merge(config, profiles[profile], f"{path} profiles.{profile}", open_keys)
        config = _merge(config, stripped[-1][1], "command line", open_keys)
    OmegaConf.set_struct(config.profiles, False)
    config.profiles = profiles
    if "name" not in stripped[-2][1]:
        config.name = path.stem
    _check_resolvable(config, str(path))
    if check and checker is not None:
        checker(config, str(path))
    return config


def with_values(
    config: DictConfig,
    values: Mapping[str, Any],
    *,
    checker: Callable[[DictConfig, str], None] | None = None,
    source: str = "variant",
    open_keys: Sequence[str] = OPEN_KEYS,
) -> DictConfig:
    """A variant of a loaded configuration: ``values`` (nested and typed, e.g.
    ``{"synthx": {"ratio": 0.3}}``) merged in memory onto a copy, checked by the schema and by
    ``checker`` as a loaded file is. Nothing is written out and parsed back.

    Raises:
        RecipeError: naming ``source`` and the key that is wrong.
    """
    merged = _merge(config, OmegaConf.create(dict(values)), source, open_keys)
    _check_resolvable(merged, source)
    if checker is not None:
        checker(merged, source)
    return merged


def _check_resolvable(config: DictConfig, source: str) -> None:
    """Every ``${...}`` interpolation resolves now (an unset ``${oc.env:...}`` is named here, not mid-run)."""
    try:
        OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        raise RecipeError(f"{source}: cannot resolve {key!r}: {str(error).splitlines()[0]}") from error


def _layers(path: Path, overrides: list[str], with_base: bool) -> list[tuple[str, DictConfig]]:
    """(source, layer) pairs: the base file when asked, the file, then the command line."""
    layers: list[tuple[str, DictConfig]] = []
    base_path = path.parent / BASE_RECIPE
    if with_base and base_path.exists() and base_path.resolve() != path.resolve():
        layers.append((str(base_path), _load_yaml(base_path)))
    layers.append((str(path), _load_yaml(path)))
    try:
        layers.append(("command line", OmegaConf.from_dotlist(overrides)))
    except OmegaConfBaseException as error:
        raise RecipeError(f"bad override in {overrides}: {error}") from error
    return layers


def _split_profiles(layers: list[tuple[str, DictConfig]]) -> tuple[DictConfig, list[tuple[str, DictConfig]]]:
    """Profiles are sets of overrides, not values: collect them from every layer (later layers win)
    so the selected one is merged after the layers and the schema still checks every key it sets."""
    profiles = OmegaConf.create({})
    stripped = []
    for source, layer in layers:
        if "profiles" in layer:
            profiles = OmegaConf.merge(profiles, layer.profiles)
            layer = OmegaConf.masked_copy(layer, [k for k in layer if k != "profiles"])
        stripped.append((source, layer))
    return profiles, stripped


def _load_yaml(path: Path) -> DictConfig:
    """One layer: a YAML file whose top level is a mapping; anything else is a :class:`RecipeError`."""
    if not path.exists():
        raise RecipeFileError(f"recipe file {path} does not exist{_closest_file(path)}")
    if not path.is_file():
        raise RecipeFileError(f"recipe {path} is not a file (a directory?): name a YAML file such as recipes/unet.yaml")
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"{path}: not valid YAML{line}: {problem}") from error
    except (OSError, UnicodeDecodeError) as error:
        raise RecipeError(f"{path}: cannot be read: {error}") from error
    if not isinstance(layer, DictConfig):
        raise RecipeError(f"{path}: the top level must be a mapping of settings (key: value), not a list")
    return layer


def _closest_file(path: Path) -> str:
    """``"; did you mean <file>?"`` naming the YAML file beside ``path`` whose name is closest, else ``""``."""
    folder = path.parent
    if not folder.is_dir():
        return ""
    names = [child.name for child in folder.iterdir() if child.suffix in (".yaml", ".yml") and child.name != BASE_RECIPE]
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f"; did you mean {folder / close[0]}?" if close else ""


def _merge(config: DictConfig, layer: DictConfig, source: str, open_keys: Sequence[str]) -> DictConfig:
    try:
        merged = OmegaConf.merge(config, layer)
    except ConfigKeyError as error:
        raise RecipeError(f"{source}: unknown key {error.full_key!r} ({error.msg.splitlines()[0]})") from error
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        choices = _enum_choices(error)
        if choices:
            raise RecipeError(f"{source}: {key} must be {choices}, got {error.value!r}") from error
        raise RecipeError(f"{source}: invalid value for {key!r}: {str(error).splitlines()[0]}") from error
    _seal(merged, open_keys)
    return merged


def _enum_choices(error: OmegaConfBaseException) -> str:
    """``"a, b or c"`` when ``error`` refused a value of a schema field that is an Enum, else ``""``."""
    schema, key = getattr(error, "object_type", None), getattr(error, "key", None)
    if not (dataclasses.is_dataclass(schema) and isinstance(key, str)):
        return ""
    kind = typing.get_type_hints(schema).get(key)
    if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        return ""
    names = [member.name for member in kind]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def _seal(config: DictConfig, open_keys: Sequence[str]) -> None:
    OmegaConf.set_struct(config, True)
    for key in open_keys:
        node = OmegaConf.select(config, key)
        if node is not None:
            OmegaConf.set_struct(node, False)


def recipe_to_yaml(config: DictConfig) -> str:
    """The fully resolved configuration as YAML (the ``recipe.yaml`` artifact of a run)."""
    return OmegaConf.to_yaml(config, resolve=True)
