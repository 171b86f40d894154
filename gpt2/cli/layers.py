"""Where a command's option values come from, lowest priority first: the defaults of its options
dataclass, a recipe (``gpt2/recipes/NAME-cpu.yaml`` / ``NAME-gpu.yaml``, or any YAML path), the
example script's own defaults, ``--config FILE`` and the flags. :func:`parse` merges all but the
flags, in that order, into the default instance tyro parses the flags over, so ``--help`` shows the
values a run would use. A YAML file maps option names (``max_steps`` or ``max-steps``; a prefixed
group such as ``lora`` is a mapping) to values converted by tyro's rule for the field's type;
``--print-config`` writes that format.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import tyro
import yaml
from tyro.constructors import (
    ConstructorRegistry,
    PrimitiveConstructorSpec,
    PrimitiveTypeInfo,
    StructConstructorSpec,
    StructTypeInfo,
)

from gpt2.errors import Gpt2Error

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
RENAMED = {"gpt2-124m": "gpt2-124m-fineweb"}  # earlier recipe names (CHANGELOG.md)


class UsageError(Gpt2Error):
    """Bad options, values or files: the command line reports it in one line, exit code 2. The
    base of gpt2.cli's own errors (commands import it from :mod:`gpt2.cli.common`).
    """


class ConfigError(UsageError, ValueError):
    """A recipe or config file that does not fit the command's options."""


class OptionError(UsageError):
    """A value an options dataclass rejected while tyro built it (not a ValueError, so that tyro
    lets it through instead of drawing its own error box).
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
    if isinstance(spec, PrimitiveConstructorSpec):
        return spec
    return None


@functools.cache
def option_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Any]]:
    """``{YAML key: (attribute path, type)}`` for every option of ``cls``: a group marked
    ``OmitArgPrefixes`` is flat (``max_steps``), another opens a level (``lora.rank``).
    """
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        base, extras = hint, ()
        if typing.get_origin(hint) is typing.Annotated:
            base, *extras = typing.get_args(hint)
        if dataclasses.is_dataclass(base):
            prefix = f"{name}."
            if tyro.conf.OmitArgPrefixes in extras:
                prefix = ""
            for key, (path, t) in option_fields(base).items():
                out[prefix + key] = ((name, *path), t)
        elif _spec(base) is not None:
            out[name] = ((name,), base)
    return out


def dump_yaml(options: Any, header: str) -> str:
    """The resolved options as a YAML file that ``--config`` reads back."""
    nested: dict[str, Any] = {}
    for key, (path, _) in option_fields(type(options)).items():
        if key in ("recipe", "config", "print_config"):
            # Applied already: the values below are the whole story.
            continue
        value = functools.reduce(getattr, path, options)
        if isinstance(value, tuple):
            value = list(value)
        *groups, name = key.split(".")
        functools.reduce(lambda level, g: level.setdefault(g, {}), groups, nested)[name] = value
    return header + yaml.safe_dump(nested, sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------- YAML files
def read_yaml(path: Path, cls: type, what: str) -> dict[str, Any]:
    """The flat option values of a recipe / config file, each converted to its field's type."""
    data = _load_yaml(path, what)
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


def _load_yaml(path: Path, what: str) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
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


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"lora": {"rank": 4}}`` as ``{"lora.rank": 4}``."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _convert(value: Any, hint: Any, where: str) -> Any:
    """A YAML value as tyro converts the same text given as a flag (YAML 1.1 reads 6e-4 as a string)."""
    spec = _spec(hint)
    if not isinstance(value, list):
        texts = [str(value)]
    elif spec.nargs == 1:
        raise ConfigError(f"{where}: expected one value ({spec.metavar}), got a list {value!r}")
    else:
        texts = [str(v) for v in value]
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
    machine = "gpu" if on_cuda else "cpu"
    for stem in (f"{name}-{machine}", name):
        if (RECIPE_DIR / f"{stem}.yaml").is_file():
            return RECIPE_DIR / f"{stem}.yaml"
    names = sorted({p.stem.removesuffix("-cpu").removesuffix("-gpu") for p in RECIPE_DIR.glob("*.yaml")})
    raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join(names)}, or give a YAML path")


# --------------------------------------------------------------------------- parsing
class CommandLine(NamedTuple):
    """What the flags say before tyro reads them: the files to read (the recipe's for ``--device``'s
    machine) and which options they set. This is the one place that reads ``argv`` by hand.
    """

    config: str | None
    recipe: str | None
    device: str | None
    options: frozenset[str]

    @classmethod
    def read(cls, argv: Sequence[str]) -> CommandLine:
        """The last value of each of ``--config``, ``--recipe``, ``--device`` (``--name X`` or
        ``--name=X``), and the option names of every ``--flag``.
        """
        values: dict[str, str] = {}
        names = set()
        for i, arg in enumerate(argv):
            if not arg.startswith("--"):
                continue
            flag, equals, value = arg.partition("=")
            names.add(flag[2:].replace("-", "_"))
            if flag not in ("--config", "--recipe", "--device"):
                continue
            if equals:
                values[flag] = value
            elif i + 1 < len(argv):
                values[flag] = argv[i + 1]
        return cls(values.get("--config"), values.get("--recipe"), values.get("--device"), frozenset(names))


def parse(
    cls: type,
    argv: list[str],
    *,
    prog: str,
    recipe: str | None = None,
    defaults: dict[str, Any] | None = None,
    description: str | None = None,
) -> Any:
    """The options ``cls`` from its defaults < the recipe < ``defaults`` (an example script's, which
    may name another recipe) < the ``--config`` file < the flags in ``argv``.
    """
    from gpt2.train.distributed import uses_cuda

    line = CommandLine.read(argv)
    script = dict(defaults or {})
    config = {}
    if line.config:
        config = read_yaml(Path(line.config).expanduser(), cls, "config file")
    # The recipe the flags name, else the config file, else the script, else the command's own.
    named = (line.recipe, config.pop("recipe", None), script.pop("recipe", None), recipe)
    recipe = next((name for name in named if name), None)
    planned = {}
    if recipe:
        planned = read_yaml(recipe_path(recipe, uses_cuda(line.device)), cls, "recipe")
    values = {**planned, **script, **config, "recipe": recipe}
    # A recipe's warmup belongs to its run length. With another max_steps and no warmup of the
    # user's, it keeps its share of the run: TrainConfig (which tyro builds before we see the final
    # max_steps) starts from no warmup, which fits any run, and gets that share after.
    user = {*script, *config, *line.options}
    rescale = {"max_steps", "warmup_steps"} <= planned.keys() and "max_steps" in user and "warmup_steps" not in user
    if rescale:
        values["warmup_steps"] = 0
    with _LIBRARY_ERRORS:
        options = tyro.cli(
            cls, args=argv, default=_unchecked(cls, values), prog=prog, description=description or cls.__doc__
        )
    if rescale:
        warmup = _recipe_warmup(planned, options.train.max_steps)
        options.train = dataclasses.replace(options.train, warmup_steps=warmup)
    return options


def _recipe_warmup(recipe: dict[str, Any], steps: int) -> int:
    """The recipe's warmup for a run of ``steps`` steps: its share of the recipe's run, at most
    the recipe's warmup.
    """
    planned, warmup = recipe["max_steps"], recipe["warmup_steps"]
    if planned <= 0:
        return warmup
    return min(warmup, warmup * steps // planned)


def _unchecked(cls: type, values: dict[str, Any]) -> Any:
    """``cls()`` with ``values`` (option name -> value) set, unchecked: tyro builds, and so
    checks, the instance the command gets.
    """
    default = cls()
    for key, value in values.items():
        *groups, name = option_fields(cls)[key][0]
        setattr(functools.reduce(getattr, groups, default), name, value)
    return default


# tyro builds each options dataclass from the parsed values; a ValueError its __post_init__
# raises (TrainConfig's and LoRAConfig's checks raise gpt2's InvalidValueError) becomes tyro's
# multi-line error box. The rule below gives tyro its usual constructor of each dataclass, wrapped
# so that such an error leaves tyro as an OptionError: the command line's one line, exit code 2.
_LIBRARY_ERRORS = ConstructorRegistry()
# The rule below finds tyro's own rule for a dataclass by asking the registry again with this marker
# among the field's markers; it passes such a look-up on (returns None) instead of answering itself.
_TYROS_RULE = object()


@_LIBRARY_ERRORS.struct_rule
def _raise_option_error(info: StructTypeInfo) -> Any:
    if not dataclasses.is_dataclass(info.type) or _TYROS_RULE in info.markers:
        return None
    spec = ConstructorRegistry.get_struct_spec(dataclasses.replace(info, markers=(*info.markers, _TYROS_RULE)))
    if not isinstance(spec, StructConstructorSpec):
        return spec

    def instantiate(*args: Any, **kwargs: Any) -> Any:
        try:
            return spec.instantiate(*args, **kwargs)
        except ValueError as e:
            raise OptionError(str(e)) from e

    return dataclasses.replace(spec, instantiate=instantiate)
