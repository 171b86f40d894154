"""Where a command's option values come from, lowest priority first:

1. the defaults of its options dataclass (:mod:`gpt2.jobs.options`);
2. a recipe: a YAML file in ``gpt2/recipes/`` (``--recipe shakespeare`` picks
   ``shakespeare-gpu.yaml`` or ``shakespeare-cpu.yaml`` for this machine) or any path;
3. ``--config my.yaml``, the user's own file, in the same format;
4. the flags.

A YAML file holds the option names as keys (``max_steps: 100`` or ``max-steps: 100``); a group
with a prefix (``lora``) is a nested mapping (``lora: {rank: 8}``). ``--print-config`` writes
exactly that format, so its output is a valid ``--config`` file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"


class ConfigError(ValueError):
    """A recipe or config file that does not fit the command's options."""


# --------------------------------------------------------------------------- the dataclass tree
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _split_annotated(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        return base, tuple(extras)
    return hint, ()


def _is_flat(extras: tuple[Any, ...]) -> bool:
    import tyro

    return any(e is tyro.conf.OmitArgPrefixes for e in extras)


def _is_option_type(hint: Any) -> bool:
    """Types a flag or a YAML value can hold (LoRAConfig.target_types, classes, cannot)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType, tuple):
        return all(a is Ellipsis or a is type(None) or _is_option_type(a) for a in args)
    return origin is Literal or hint in (int, float, str, bool)


def option_fields(cls: type) -> list[tuple[tuple[str, ...], str, Any]]:
    """Every leaf option of ``cls``: (path of attribute names, YAML key path, type).

    A flattened group's fields sit at the level of their parent; a prefixed group (``lora``)
    opens a nested level."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        base, extras = _split_annotated(hints[f.name])
        if dataclasses.is_dataclass(base):
            for path, key, t in option_fields(base):
                out.append(((f.name, *path), key if _is_flat(extras) else f"{f.name}.{key}", t))
        elif f.init and _is_option_type(base):
            out.append(((f.name,), f.name, base))
    return out


def _dataclasses_in(cls: type) -> set[type]:
    found = {cls}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        base, _ = _split_annotated(hints[f.name])
        if dataclasses.is_dataclass(base):
            found |= _dataclasses_in(base)
    return found


@contextlib.contextmanager
def validation_off(cls: type):
    """Skip ``__post_init__`` of the dataclasses in ``cls``'s tree while tyro builds them.

    tyro constructs nested dataclasses itself and reports their ValueErrors in a box of its own,
    in the library's words (``TrainConfig.max_lr``). We let it parse without checks, then
    :func:`build` the real objects, so a bad value is reported like every other error: in one
    line, naming the flag."""
    saved = {c: c.__dict__["__post_init__"] for c in _dataclasses_in(cls) if "__post_init__" in c.__dict__}
    try:
        for c in saved:
            c.__post_init__ = lambda self: None
        yield
    finally:
        for c, method in saved.items():
            c.__post_init__ = method


def build(cls: type, values: dict[str, Any]) -> Any:
    """An instance of the options dataclass ``cls`` from flat ``{"a.b": value}`` values."""

    def make(c: type, path: tuple[str, ...]) -> Any:
        kwargs = {}
        hints = _hints(c)
        for f in dataclasses.fields(c):
            if not f.init:
                continue
            base, _ = _split_annotated(hints[f.name])
            if dataclasses.is_dataclass(base):
                kwargs[f.name] = make(base, (*path, f.name))
            elif (*path, f.name) in by_path:
                kwargs[f.name] = by_path[(*path, f.name)]
        return c(**kwargs)

    keys = {key: path for path, key, _ in option_fields(cls)}
    by_path = {keys[k]: v for k, v in values.items()}
    return make(cls, ())


def to_flat(options: Any) -> dict[str, Any]:
    """``{"yaml.key": value}`` for every option of an options instance (tuples as lists)."""
    out = {}
    for path, key, _ in option_fields(type(options)):
        value = options
        for name in path:
            value = getattr(value, name)
        out[key] = value
    return out


# --------------------------------------------------------------------------- YAML files
def read_yaml(path: Path, cls: type, what: str) -> dict[str, Any]:
    """The flat option values of a recipe / config file, converted and checked against ``cls``."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not a text file (binary data?); give a YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {' '.join(str(e).split())}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of option names to values, got {type(data).__name__}")
    types_by_key = {key: t for _, key, t in option_fields(cls)}
    if what == "config file":
        types_by_key["recipe"] = str  # a config file may name the recipe it builds on
    values = {}
    for key, value in _flatten(data).items():
        key = key.replace("-", "_")
        if key not in types_by_key:
            known = ", ".join(sorted(types_by_key))
            raise ConfigError(f"{what} {path}: unknown option {key!r}; the options are: {known}")
        values[key] = coerce(value, types_by_key[key], f"{what} {path}: {key}")
    return values


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        key = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, key + "."))
        else:
            out[key] = value
    return out


def coerce(value: Any, hint: Any, where: str) -> Any:
    """A YAML value as the field's type: YAML 1.1 reads ``6e-4`` as a string, lists as lists."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(f"{where}: unexpected value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is tuple:
        items = value if isinstance(value, list) else [value]
        inner = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if inner is None and len(args) != len(items):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(coerce(v, inner or args[i], where) for i, v in enumerate(items))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "on", "false", "no", "off"):
            return str(value).lower() in ("true", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, (bool, list, dict)) or value is None:
            raise ConfigError(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {value!r}")
        try:
            number = float(value) if hint is float else int(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}: expected {'an integer' if hint is int else 'a number'}, got {value!r}"
            ) from None
        if hint is int and float(value) != number:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, (list, dict)) or value is None:
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def dump_yaml(options: Any, header: str) -> str:
    """The resolved options as a YAML file that ``--config`` reads back."""
    nested: dict[str, Any] = {}
    for key, value in to_flat(options).items():
        value = list(value) if isinstance(value, tuple) else value
        *groups, name = key.split(".")
        level = nested
        for g in groups:
            level = level.setdefault(g, {})
        level[name] = value
    return header + yaml.safe_dump(nested, sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------- recipes
def recipe_names(cls: type | None = None) -> list[str]:
    """The packaged recipes (those whose keys are all options of ``cls``, when given); ``name``
    stands for ``name-cpu`` / ``name-gpu`` where both exist."""
    stems = []
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        if cls is not None:
            try:
                read_yaml(path, cls, "recipe")
            except ConfigError:
                continue  # a recipe of another command
        stems.append(path.stem)
    paired = {s.rsplit("-", 1)[0] for s in stems if s.endswith(("-cpu", "-gpu"))}
    return sorted((set(stems) - {f"{p}-{d}" for p in paired for d in ("cpu", "gpu")}) | paired)


RENAMED = {"gpt2-124m": "gpt2-124m-fineweb"}  # earlier names (CHANGELOG.md)


def recipe_path(name: str, on_cuda: bool) -> Path:
    """A recipe name (``shakespeare`` -> the cpu or gpu file for this machine) or a YAML path."""
    name = RENAMED.get(name, name)
    if name.endswith((".yaml", ".yml")) or "/" in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"recipe file {name!r} does not exist")
        return path
    for stem in (f"{name}-{'gpu' if on_cuda else 'cpu'}", name):
        if (RECIPE_DIR / f"{stem}.yaml").is_file():
            return RECIPE_DIR / f"{stem}.yaml"
    raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join(recipe_names())}, or give a YAML path")
