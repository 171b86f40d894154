"""Where a command's option values come from, lowest priority first: the defaults of its options
dataclass, a recipe (``gpt2/recipes/NAME-cpu.yaml`` / ``NAME-gpu.yaml``, or any YAML path), the
example script's own defaults, ``--config FILE`` and the flags. All but the flags make the default
instance tyro parses the flags over, so ``--help`` shows the values a run would use. A YAML file
maps option names (``max_steps`` or ``max-steps``; a prefixed group such as ``lora`` is a mapping)
to values converted by tyro's rule for the field's type; ``--print-config`` writes that format.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Annotated, Any

import tyro
import yaml
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from gpt2.errors import Gpt2Error

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
RENAMED = {"gpt2-124m": "gpt2-124m-fineweb"}  # earlier recipe names (CHANGELOG.md)


class ConfigError(Gpt2Error, ValueError):
    """A recipe or config file that does not fit the command's options."""


class OptionError(Gpt2Error):
    """A value an options dataclass rejected while tyro built it (not a ValueError, so that tyro
    lets it through instead of drawing its own error box): one line, exit code 2.
    """


@dataclasses.dataclass
class Options:
    """The fields every command has: where the other values come from."""

    recipe: Annotated[str | None, tyro.conf.arg(metavar="NAME|FILE")] = None
    """a YAML file, or a packaged recipe NAME (gpt2/recipes/NAME-cpu.yaml or NAME-gpu.yaml for this
    machine's --device): shakespeare or gpt2-124m-fineweb (train), finetune, eval, bench; its values are the
    defaults shown"""
    config: Annotated[str | None, tyro.conf.arg(metavar="FILE")] = None
    """a YAML file of option values (keys: option names, as --print-config writes), over the recipe, under flags"""
    print_config: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """print the resolved options as YAML (a valid --config file) instead of running"""


# --------------------------------------------------------------------------- the dataclass tree
def _spec(hint: Any) -> PrimitiveConstructorSpec | None:
    """tyro's rule for a field that one flag sets (None for a nested group or an unsupported type)."""
    spec = ConstructorRegistry.get_primitive_spec(PrimitiveTypeInfo.make(hint, set()))
    return spec if isinstance(spec, PrimitiveConstructorSpec) else None


@functools.cache
def option_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Any]]:
    """``{YAML key: (attribute path, type)}`` for every option of ``cls``: a group marked
    ``OmitArgPrefixes`` is flat (``max_steps``), another opens a level (``lora.rank``).
    """
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        base, *extras = typing.get_args(hint) if typing.get_origin(hint) is typing.Annotated else (hint,)
        if dataclasses.is_dataclass(base):
            flat = tyro.conf.OmitArgPrefixes in extras
            for key, (path, t) in option_fields(base).items():
                out[key if flat else f"{name}.{key}"] = ((name, *path), t)
        elif _spec(base) is not None:
            out[name] = ((name,), base)
    return out


def dump_yaml(options: Any, header: str) -> str:
    """The resolved options as a YAML file that ``--config`` reads back."""
    nested: dict[str, Any] = {}
    for key, (path, _) in option_fields(type(options)).items():
        if key in ("recipe", "config", "print_config"):
            continue  # already applied: the values below are the whole story
        value = functools.reduce(getattr, path, options)
        *groups, name = key.split(".")
        functools.reduce(lambda level, g: level.setdefault(g, {}), groups, nested)[name] = (
            list(value) if isinstance(value, tuple) else value
        )
    return header + yaml.safe_dump(nested, sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------- YAML files
def read_yaml(path: Path, cls: type, what: str) -> dict[str, Any]:
    """The flat option values of a recipe / config file, each converted to its field's type."""
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
    fields = {k: v for k, v in option_fields(cls).items() if k not in ("config", "print_config")}
    values = {}
    for key, value in _flatten(data).items():
        key = key.replace("-", "_")
        if key not in fields:
            raise ConfigError(f"{what} {path}: unknown option {key!r}; the options are: {', '.join(sorted(fields))}")
        values[key] = _convert(value, fields[key][1], f"{what} {path}: {key}")
    return values


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _convert(value: Any, hint: Any, where: str) -> Any:
    """A YAML value as tyro converts the same text given as a flag (YAML 1.1 reads 6e-4 as a string)."""
    spec = _spec(hint)
    texts = [str(v) for v in (value if isinstance(value, list) else [value])]
    if isinstance(value, list) and spec.nargs == 1:
        raise ConfigError(f"{where}: expected one value ({spec.metavar}), got a list {value!r}")
    if spec.choices is not None and not set(texts) <= set(spec.choices):
        raise ConfigError(f"{where}: {value!r} is not one of {list(spec.choices)}")
    try:
        return spec.instance_from_str(texts)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: expected {spec.metavar}, got {value!r}") from e


def recipe_path(name: str, on_cuda: bool) -> Path:
    """A recipe name (``shakespeare`` -> the cpu or gpu file for this machine) or a YAML path."""
    name = RENAMED.get(name, name)
    if name.endswith((".yaml", ".yml")) or "/" in name:
        return Path(name).expanduser()  # read_yaml says if it is missing
    for stem in (f"{name}-{'gpu' if on_cuda else 'cpu'}", name):
        if (RECIPE_DIR / f"{stem}.yaml").is_file():
            return RECIPE_DIR / f"{stem}.yaml"
    names = sorted({p.stem.removesuffix("-cpu").removesuffix("-gpu") for p in RECIPE_DIR.glob("*.yaml")})
    raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join(names)}, or give a YAML path")


# --------------------------------------------------------------------------- parsing
def _flag(argv: list[str], name: str) -> str | None:
    """The last value of ``--name X`` / ``--name=X`` in ``argv``: the files to read before tyro parses."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.partition("=")[2]
    return value


_registry = ConstructorRegistry()
_wrapping: list[bool] = []


@_registry.struct_rule
def _checked(info: Any) -> Any:
    """tyro's own rule for a dataclass, with the dataclass's ValueError raised as OptionError."""
    if _wrapping or not dataclasses.is_dataclass(info.type):
        return None
    _wrapping.append(True)
    try:
        spec = ConstructorRegistry.get_struct_spec(info)  # the rule below this one
    finally:
        _wrapping.pop()

    def instantiate(*args: Any, **kwargs: Any) -> Any:
        try:
            return spec.instantiate(*args, **kwargs)
        except ValueError as e:
            raise OptionError(str(e)) from e

    return dataclasses.replace(spec, instantiate=instantiate)


def parse(
    cls: type,
    argv: list[str],
    *,
    prog: str,
    recipe: str | None = None,
    defaults: dict[str, Any] | None = None,
    description: str | None = None,
) -> Any:
    """The options ``cls`` from its defaults < recipe < ``defaults`` < ``--config`` < ``argv``."""
    from gpt2.train.distributed import uses_cuda

    defaults = dict(defaults or {})
    config = _flag(argv, "--config")
    from_file = read_yaml(Path(config).expanduser(), cls, "config file") if config else {}
    recipe = _flag(argv, "--recipe") or from_file.pop("recipe", None) or defaults.pop("recipe", None) or recipe
    recipe_values = read_yaml(recipe_path(recipe, uses_cuda(_flag(argv, "--device"))), cls, "recipe") if recipe else {}
    values = {**recipe_values, **defaults, **from_file, "recipe": recipe}
    # A recipe's warmup belongs to its run length: with another --max-steps and no warmup of the
    # user's, it keeps its fraction of the run (tyro builds TrainConfig before we see --max-steps,
    # so it starts from no warmup, which fits any run).
    given = {*defaults, *from_file, *(a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--"))}
    if scale := {"max_steps", "warmup_steps"} <= recipe_values.keys() and "warmup_steps" not in given:
        values["warmup_steps"] = 0 if "max_steps" in given else _warmup(recipe_values, values["max_steps"])
    default = cls()  # unchecked: tyro builds (and so checks) the real one
    for key, value in values.items():
        path = option_fields(cls)[key][0]
        setattr(functools.reduce(getattr, path[:-1], default), path[-1], value)
    with _registry:
        options = tyro.cli(cls, args=argv, default=default, prog=prog, description=description or cls.__doc__)
    if scale:
        options.train = dataclasses.replace(options.train, warmup_steps=_warmup(recipe_values, options.train.max_steps))
    return options


def _warmup(recipe: dict[str, Any], steps: int) -> int:
    planned, warmup = recipe["max_steps"], recipe["warmup_steps"]
    return min(warmup, warmup * steps // planned) if planned > 0 else warmup
