"""Where a command's option values come from, lowest priority first: the defaults of its options
dataclass, a recipe (``gpt2/recipes/NAME-cpu.yaml`` / ``NAME-gpu.yaml``, or any YAML path), the
example script's own defaults, ``--config FILE`` and the flags. :func:`parse` merges all but the
flags, in that order, into the default instance tyro parses the flags over, so ``--help`` shows the
values a run would use. A YAML file maps option names (``max_steps`` or ``max-steps``; a prefixed
group such as ``lora`` is a mapping) to values converted by tyro's rule for the field's type;
``--print-config`` writes that format. A flag the command does not have (checked before tyro reads
the flags) or a value tyro cannot read is one :class:`ArgumentError` line, not tyro's error box.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import io
import re
import shlex
import sys
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
    StructFieldSpec,
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


class ArgumentError(UsageError):
    """A flag the command does not have, or a value it cannot read: the command line prints the
    message after the command's name alone (``gpt2 train: --max-steps: expected an integer, got 'ten'``).
    """


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
# A group of options whose flags lack its own name (--max-steps, not --train.max-steps); its own groups keep theirs.
FLAT = tyro.conf.arg(name="")


def _spec(hint: Any) -> PrimitiveConstructorSpec | None:
    """tyro's rule for a field that one flag sets (None for a nested group or an unsupported type)."""
    spec = ConstructorRegistry.get_primitive_spec(PrimitiveTypeInfo.make(hint, set()))
    if isinstance(spec, PrimitiveConstructorSpec):
        return spec
    return None


@functools.cache
def option_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Any]]:
    """``{YAML key: (attribute path, type)}`` for every option of ``cls``: a group marked
    ``FLAT`` is flat (``max_steps``), another opens a level (``lora.rank``, ``recovery.patience``).
    """
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        base, extras = hint, ()
        if typing.get_origin(hint) is typing.Annotated:
            base, *extras = typing.get_args(hint)
        if dataclasses.is_dataclass(base):
            prefix = f"{name}."
            if FLAT in extras:
                prefix = ""
            for key, (path, t) in option_fields(base).items():
                out[prefix + key] = ((name, *path), t)
        elif _spec(base) is not None:
            out[name] = ((name,), base)
    return out


@functools.cache
def flags(cls: type) -> tuple[str, ...]:
    """Every ``--flag`` of ``cls``: ``--help``, each option's, and a yes/no option's ``--no-`` form."""
    out = ["--help"]
    for key, (_, hint) in option_fields(cls).items():
        *group, name = key.split(".")
        out.append("--" + key.replace("_", "-"))
        if hint is bool:
            out.append("--" + ".".join([*group, f"no_{name}"]).replace("_", "-"))
    return tuple(out)


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
    """What the flags say before tyro reads them: each ``--flag`` given, with the words after its last
    occurrence (``--name X Y`` or ``--name=X``). This is the one place that reads ``argv`` by hand.
    """

    given: dict[str, tuple[str, ...]]

    @classmethod
    def read(cls, argv: Sequence[str]) -> CommandLine:
        given: dict[str, tuple[str, ...]] = {}
        flag = None
        for arg in argv:
            # As tyro reads them: a flag is dashes and a letter (a prompt "--- x" is a value).
            if arg.startswith("--") and arg[2:3].isalpha():
                flag, equals, value = arg.partition("=")
                given[flag] = ()
                if equals:
                    given[flag] = (value,)
            # A short option (-n), or the end of the options (--): words no --flag of ours takes.
            elif arg == "--" or _is_short_option(arg):
                flag = None
            elif flag is not None:
                given[flag] += (arg,)
        return cls(given)

    def value(self, flag: str) -> str | None:
        """The first word after the last ``flag`` (``--config``, ``--recipe``, ``--device``), if any."""
        return next(iter(self.given.get(flag, ())), None)

    @property
    def options(self) -> set[str]:
        """The option names of the flags (``max_steps`` for ``--max-steps``)."""
        return {flag[2:].replace("-", "_") for flag in self.given}


def _is_short_option(word: str) -> bool:
    """``-n``; not a value such as ``-1``, ``-.5`` or ``-inf``."""
    return word.startswith("-") and word[1:2].isalpha() and word[1:].lower() not in ("inf", "nan", "infinity")


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
    check_flags(cls, line, prog)
    script = dict(defaults or {})
    config = {}
    if line.value("--config"):
        config = read_yaml(Path(line.value("--config")).expanduser(), cls, "config file")
    # The recipe the flags name, else the config file, else the script, else the command's own.
    named = (line.value("--recipe"), config.pop("recipe", None), script.pop("recipe", None), recipe)
    recipe = next((name for name in named if name), None)
    planned = {}
    if recipe:
        planned = read_yaml(recipe_path(recipe, uses_cuda(line.value("--device"))), cls, "recipe")
    values = {**planned, **script, **config, "recipe": recipe}
    # A recipe's warmup belongs to its run length. With another max_steps and no warmup of the
    # user's, it keeps its share of the run: TrainConfig (which tyro builds before we see the final
    # max_steps) starts from no warmup, which fits any run, and gets that share after.
    user = {*script, *config, *line.options}
    rescale = {"max_steps", "warmup_steps"} <= planned.keys() and "max_steps" in user and "warmup_steps" not in user
    if rescale:
        values["warmup_steps"] = 0
    # Without its indentation, tyro joins a docstring's lines (it keeps a break before an indented one).
    description = description or inspect.cleandoc(cls.__doc__)
    with _COMMAND_LINE_RULES:
        options = _tyro_cli(cls, argv, line, default=_unchecked(cls, values), prog=prog, description=description)
    if rescale:
        warmup = _recipe_warmup(planned, options.train.max_steps)
        options.train = dataclasses.replace(options.train, warmup_steps=warmup)
    return options


def check_flags(cls: type, line: CommandLine, prog: str) -> None:
    """Refuse a flag ``cls`` does not have, naming the closest one (tyro's box of near matches is
    ten lines or more).
    """
    known = flags(cls)
    for flag in line.given:
        # tyro reads --max_steps as --max-steps
        if flag.replace("_", "-") in known:
            continue
        message = f"{flag}: unknown option"
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        if close:
            message += f"; did you mean {close[0]}?"
        raise ArgumentError(f"{message} ({prog} --help lists every option)")


def _tyro_cli(cls: type, argv: list[str], line: CommandLine, *, prog: str, **kwargs: Any) -> Any:
    """``tyro.cli``, with its error box for a value it cannot read (``--max-steps ten``) turned into
    one :class:`ArgumentError`.
    """
    box = io.StringIO()
    failed = False
    try:
        with contextlib.redirect_stderr(box):
            return tyro.cli(cls, args=argv, prog=prog, **kwargs)
    except SystemExit as e:
        # 2: the input was refused (0: --help)
        failed = e.code == 2
        if failed:
            raise ArgumentError(_value_error(box.getvalue(), cls, line, prog)) from None
        raise
    finally:
        # Whatever else was written there (a warning) still reaches the user.
        if not failed:
            sys.stderr.write(box.getvalue())


def _value_error(box: str, cls: type, line: CommandLine, prog: str) -> str:
    """One line for tyro's error box: ``--max-steps: expected an integer, got 'ten'`` where the box
    names an option, else the box's first paragraph.
    """
    message = _first_paragraph(box)
    fields = option_fields(cls)
    # tyro names the flag as --help shows it (--max-steps for --max_steps, -n/--num-samples for -n).
    given = {flag.replace("_", "-"): words for flag, words in line.given.items()}
    for flag in re.findall(r"--[\w.-]*\w", message):
        key = flag[2:].replace("-", "_")
        if key not in fields:
            continue
        message = f"{flag}: expected {_expected(_spec(fields[key][1]))}"
        if flag in given:
            message += ", got " + (" ".join(repr(word) for word in given[flag]) or "nothing")
        return message
    return f"{message} ({prog} --help lists every option)"


def _first_paragraph(box: str) -> str:
    """The message of tyro's error box (after its title, up to the next rule or blank line) on one
    line; a box of ``│ ─ ╰`` on a UTF-8 terminal, of spaces and ``-`` elsewhere.
    """
    paragraph: list[str] = []
    for line in box.strip().splitlines()[1:]:
        text = line.strip().strip("│").strip()
        # a rule, a border or a blank line
        if set(text) <= set("─-╰╯"):
            if paragraph:
                break
            continue
        paragraph.append(text)
    return " ".join(" ".join(paragraph).split())


# How tyro's metavars read.
KINDS = {"INT": "an integer", "FLOAT": "a number", "STR": "a text", "{None}": "None"}


def _expected(spec: PrimitiveConstructorSpec) -> str:
    """What a flag takes: ``one of auto, fp32``, ``an integer or None``, or tyro's ``FLOAT FLOAT``."""
    if spec.choices:
        return "one of " + ", ".join(spec.choices)
    kinds = [KINDS.get(part) for part in spec.metavar.split("|")]
    if spec.nargs != 1 or None in kinds:
        return spec.metavar
    # None last: "an integer or None"
    return " or ".join(sorted(kinds, key=lambda kind: kind == "None"))


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
# It also makes each field's --help text read well (see _readable).
_COMMAND_LINE_RULES = ConstructorRegistry()
# The rule below finds tyro's own rule for a dataclass by asking the registry again with this marker
# among the field's markers; it passes such a look-up on (returns None) instead of answering itself.
_TYROS_RULE = object()


@_COMMAND_LINE_RULES.struct_rule
def _command_line_rule(info: StructTypeInfo) -> Any:
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

    return dataclasses.replace(spec, instantiate=instantiate, fields=tuple(map(_readable, spec.fields)))


def _readable(field: StructFieldSpec) -> StructFieldSpec:
    """``field`` with its help on one line (tyro keeps a docstring's line break before an indented or
    non-letter line: mid-sentence here) and its default as it would be typed (see :func:`_default_hint`).
    """
    helptext = field.helptext

    def one_line() -> str | None:
        text = helptext
        if callable(text):
            text = text()
        if text is None:
            return None
        return " ".join(text.split())

    field = dataclasses.replace(field, helptext=one_line)
    base = field.type
    if typing.get_origin(base) is Annotated:
        base = typing.get_args(base)[0]
    # A group of options (DataOptions...) has no default of its own to show.
    if dataclasses.is_dataclass(base):
        return field
    return dataclasses.replace(field, type=Annotated[field.type, tyro.conf.arg(help_behavior_hint=_default_hint)])


def _default_hint(label: str) -> str:
    """``(default: ...)`` for tyro's default ``label``, which quotes each word for a shell: a word as is,
    in double quotes where it holds a space (``"Hello, I'm a language model,"``); nothing for an empty list.
    """
    try:
        words = shlex.split(label)
    except ValueError:
        return f"(default: {label})"
    if not words:
        return ""
    return f"(default: {' '.join(map(_as_typed, words))})"


def _as_typed(word: str) -> str:
    """``word`` as is, or in double quotes where it is empty or holds a space."""
    if word and not any(c.isspace() for c in word):
        return word
    return f'"{word}"'
