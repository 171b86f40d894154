"""Where a command's option values come from, lowest priority first: the defaults of its options
dataclass, a recipe (``gpt2/recipes/NAME-cpu.yaml`` / ``NAME-gpu.yaml``, or any YAML path), the
example script's own defaults, ``--config FILE`` and the flags. :func:`parse` reads the flags itself
(:func:`convert` is the one rule for a flag's words and a YAML value), merges all of it in that order
and builds the options dataclasses with the result, so that their own checks run on the values a run
would use. tyro draws ``--help`` (:func:`show_help`), from the same values. A YAML file maps option
names (``max_steps`` or ``max-steps``; a group such as ``lora`` is a mapping) to values;
``--print-config`` writes that format. A flag the command does not have or a value it cannot read is
one :class:`UsageError` line (``gpt2 train: error: --max-steps: expected an integer, got 'ten'``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, NoReturn

import tyro
import yaml

from gpt2.errors import Gpt2Error

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"


class UsageError(Gpt2Error):
    """Bad options, values or files: the command line reports it in one line, exit code 2. The
    base of gpt2.cli's own errors.
    """


class ConfigError(UsageError, ValueError):
    """A recipe or config file that does not fit the command's options."""


class Flat:
    """Marks a group of options (a nested dataclass) whose fields are flags of their own:
    ``Annotated[TrainConfig, Flat]`` gives ``--max-steps``, not ``--train.max-steps``.
    """


class Short(NamedTuple):
    """A one-letter alias of a flag: ``Annotated[int, Short("-n")]``."""

    flag: str


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


# --------------------------------------------------------------------------- values
# What a flag of each type takes, as its error says.
KINDS = {int: "an integer", float: "a number", str: "a text", bool: "True or False", type(None): "None"}


def _alternatives(hint: Any) -> tuple[Any, ...]:
    """The types of a union (``int | None``: int, NoneType), or ``hint`` alone."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _supported(hint: Any) -> bool:
    """Whether :func:`convert` reads values of ``hint`` (a field of layer classes has no flag)."""
    try:
        return all(_describe(kind) for kind in _alternatives(hint))
    except KeyError:
        return False


def convert(texts: Sequence[str], hint: Any) -> Any:
    """A flag's words (or a YAML value, as text) as a value of ``hint``: ``None``, ``True``/``False``, a
    Literal's choice, a number, a text, or a tuple of them. ValueError: what ``hint`` takes instead.
    """
    alternatives = _alternatives(hint)
    # "None" is a text too: None is tried first.
    for kind in sorted(alternatives, key=lambda kind: kind is not type(None)):
        try:
            return _convert_as(list(texts), kind)
        except ValueError:
            continue
    # None named last: "an integer or None"
    raise ValueError(" or ".join(_describe(kind) for kind in sorted(alternatives, key=lambda kind: kind is type(None))))


def _convert_as(texts: list[str], kind: Any) -> Any:
    if typing.get_origin(kind) is tuple:
        parts = list(typing.get_args(kind))
        if parts[-1] is Ellipsis:
            parts = parts[:1] * len(texts)
        if len(parts) != len(texts):
            raise ValueError(texts)
        return tuple(_convert_as([text], part) for text, part in zip(texts, parts))
    if len(texts) != 1:
        raise ValueError(texts)
    text = texts[0]
    if kind is type(None) and text == "None":
        return None
    if typing.get_origin(kind) is Literal and text in typing.get_args(kind):
        return text
    if kind is bool and text in ("True", "False"):
        return text == "True"
    if kind in (int, float, str):
        return kind(text)
    raise ValueError(text)


def _describe(kind: Any) -> str:
    """``an integer``, ``one of auto, fp32``, ``2 values, each a number``."""
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if len(choices) == 1:
            return str(choices[0])
        return "one of " + ", ".join(map(str, choices))
    if typing.get_origin(kind) is tuple:
        parts = typing.get_args(kind)
        count = "" if parts[-1] is Ellipsis else f"{len(parts)} "
        return f"{count}values, each {_describe(parts[0])}"
    return KINDS[kind]


# --------------------------------------------------------------------------- the dataclass tree
@functools.cache
def option_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Any, tuple[Any, ...]]]:
    """``{YAML key: (attribute path, type, markers)}`` for every option of ``cls``: a group marked :class:`Flat`
    adds no level (``max_steps``), another one (``lora.rank``); the markers are those of its ``Annotated`` type
    (``Annotated[int, Short("-n")]``: int and ``(Short("-n"),)``).
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    bases = typing.get_type_hints(cls)  # without the markers
    out = {}
    for field in dataclasses.fields(cls):
        base, extras = bases[field.name], getattr(hints[field.name], "__metadata__", ())
        if dataclasses.is_dataclass(base):
            prefix = f"{field.name}."
            if Flat in extras:
                prefix = ""
            for key, (path, *kind) in option_fields(base).items():
                out[prefix + key] = ((field.name, *path), *kind)
        elif field.init and _supported(base):
            out[field.name] = ((field.name,), base, extras)
    return out


@functools.cache
def flags(cls: type) -> dict[str, tuple[str, bool | None]]:
    """``{--flag: (option key, value)}`` for every flag of ``cls``: each option's, its alias (``-n``), and a
    yes/no option's ``--x`` (value True) and ``--no-x`` (False); value None: the words after the flag give it.
    """
    out: dict[str, tuple[str, bool | None]] = {}
    for key, (_, base, extras) in option_fields(cls).items():
        flag = "--" + key.replace("_", "-")
        out[flag] = (key, None)
        for extra in extras:
            if isinstance(extra, Short):
                out[extra.flag] = (key, None)
        if base is bool:
            *group, name = flag[2:].split(".")
            out[flag] = (key, True)
            out["--" + ".".join([*group, f"no-{name}"])] = (key, False)
    return out


def _nested(items: Iterable[tuple[Sequence[str], Any]]) -> dict[str, Any]:
    """``[(("lora", "rank"), 4)]`` as ``{"lora": {"rank": 4}}``."""
    nested: dict[str, Any] = {}
    for (*groups, name), value in items:
        functools.reduce(lambda level, group: level.setdefault(group, {}), groups, nested)[name] = value
    return nested


def dump_yaml(options: Any, header: str) -> str:
    """The resolved options as a YAML file that ``--config`` reads back."""
    items = []
    for key, (path, *_) in option_fields(type(options)).items():
        # Applied already: the values below are the whole story.
        if key in ("recipe", "config", "print_config"):
            continue
        value = functools.reduce(getattr, path, options)
        if isinstance(value, tuple):
            value = list(value)
        items.append((key.split("."), value))
    return header + yaml.safe_dump(_nested(items), sort_keys=False, default_flow_style=None)


def build(cls: type, values: dict[str, Any]) -> Any:
    """``cls()`` with ``values`` (option key -> value) set, each of its dataclasses built again with them,
    so that their own checks (``__post_init__``) see the values a run would use.
    """
    fields = option_fields(cls)
    return _replaced(cls(), _nested((fields[key][0], value) for key, value in values.items()))


def _replaced(instance: Any, changes: dict[str, Any]) -> Any:
    """``instance`` with ``changes`` made: a value per field, a mapping of changes per nested dataclass."""
    for name, change in changes.items():
        if isinstance(change, dict):
            changes[name] = _replaced(getattr(instance, name), change)
    return dataclasses.replace(instance, **changes)


# --------------------------------------------------------------------------- YAML files
class _StrictLoader(yaml.SafeLoader):
    """YAML without aliases (``*name``: a few lines of them expand to gigabytes) or a key given twice
    (which YAML readers settle by keeping the last one, silently).
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise ConfigError(f"line {line}: YAML aliases (*name) are not read; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        mapping = super().construct_mapping(node, deep=deep)
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: {key!r} is given twice; keep one")
            seen.add(key)
        return mapping


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
        texts = [str(value)]
        if isinstance(value, list):
            texts = [str(item) for item in value]
        try:
            values[key] = convert(texts, fields[key][1])
        except ValueError as e:
            raise ConfigError(f"{what} {path}: {key}: expected {e}, got {value!r}") from None
    return values


def _load_yaml(path: Path, what: str) -> Any:
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except OSError as e:  # missing, a folder, not readable...
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not a text file (binary data?); give a YAML file") from None
    except ConfigError as e:
        raise ConfigError(f"{what} {path}: {e}") from None
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


def recipe_path(name: str, on_cuda: bool) -> Path:
    """A recipe name (``shakespeare`` -> the cpu or gpu file for this machine) or a YAML path."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        return Path(name).expanduser()  # read_yaml says if it is missing
    machine = "gpu" if on_cuda else "cpu"
    for stem in (f"{name}-{machine}", name):
        if (RECIPE_DIR / f"{stem}.yaml").is_file():
            return RECIPE_DIR / f"{stem}.yaml"
    names = sorted({p.stem.removesuffix("-cpu").removesuffix("-gpu") for p in RECIPE_DIR.glob("*.yaml")})
    raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join(names)}, or give a YAML path")


# --------------------------------------------------------------------------- the flags
def _words(argv: Sequence[str], prog: str) -> dict[str, tuple[str, ...]]:
    """Each flag given (``--name`` or ``-n``, ``--max_steps`` read as ``--max-steps``) with the words after its
    last occurrence (``--name X Y`` or ``--name=X``); a word no flag takes is a :class:`UsageError`.
    """
    given: dict[str, tuple[str, ...]] = {}
    flag = None
    for arg in argv:
        # A flag is one or two dashes and a letter (a prompt "--- x" is a value, as are -1, -.5 and -inf).
        if re.match(r"--?[^\W\d_]", arg) and arg.lstrip("-").lower() not in ("inf", "nan", "infinity"):
            name, equals, value = arg.partition("=")
            flag = name[:2] + name[2:].replace("_", "-")
            given[flag] = ()
            if equals:
                given[flag] = (value,)
        elif flag is None:
            raise UsageError(f"{arg!r}: options are given as --name VALUE ({prog} --help lists them)")
        else:
            given[flag] += (arg,)
    return given


def flag_values(cls: type, given: dict[str, tuple[str, ...]], prog: str) -> dict[str, Any]:
    """The option values the flags ``given`` give (option key -> value); a flag ``cls`` does not have or a value
    that cannot be read is one :class:`UsageError`.
    """
    known = flags(cls)
    fields = option_fields(cls)
    values = {}
    for flag, words in given.items():
        if flag in ("--help", "-h"):
            continue
        if flag not in known:
            raise UsageError(_unknown(flag, known, prog))
        key, switch = known[flag]
        shown = " ".join(map(repr, words)) or "nothing"
        if switch is not None and words:
            raise UsageError(f"{flag}: takes no value, got {shown}")
        values[key] = switch
        if switch is None:
            try:
                values[key] = convert(words, fields[key][1])
            except ValueError as e:
                raise UsageError(f"--{key.replace('_', '-')}: expected {e}, got {shown}") from None
    return values


def _unknown(flag: str, known: Iterable[str], prog: str) -> str:
    """``--lr: unknown option; did you mean --min-lr, --max-lr or --muon-lr? (...)``: the closest flag by
    spelling, then those that hold every word of ``flag``; three at most.
    """
    known = [*known, "--help"]
    words = set(re.split(r"[-.]", flag.strip("-")))
    holding = [name for name in known if words <= set(re.split(r"[-.]", name.strip("-")))]
    near = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
    near += [name for name in difflib.get_close_matches(flag, holding, n=3, cutoff=0) if name not in near]
    near = near[:3]
    message = f"{flag}: unknown option"
    if len(near) > 1:
        message += f"; did you mean {', '.join(near[:-1])} or {near[-1]}?"
    elif near:
        message += f"; did you mean {near[0]}?"
    return f"{message} ({prog} --help lists every option)"


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
    may name another recipe) < the ``--config`` file < the flags in ``argv``; with ``--help``, the help
    (SystemExit 0) instead.
    """
    from gpt2.train.distributed import uses_cuda

    given = _words(argv, prog)
    flagged = flag_values(cls, given, prog)
    script = dict(defaults or {})
    config = {}
    if flagged.get("config"):
        config = read_yaml(Path(flagged["config"]).expanduser(), cls, "config file")
    # The recipe the flags name, else the config file, else the script, else the command's own.
    named = (flagged.get("recipe"), config.pop("recipe", None), script.pop("recipe", None), recipe)
    recipe = next((name for name in named if name), None)
    planned = {}
    if recipe:
        planned = read_yaml(recipe_path(recipe, uses_cuda(flagged.get("device"))), cls, "recipe")
    values = {**planned, **script, **config, **flagged, "recipe": recipe}
    # A recipe's warmup belongs to its run length: with another max_steps and no warmup of the
    # user's, it keeps its share of the run.
    user = {*script, *config, *flagged}
    if {"max_steps", "warmup_steps"} <= planned.keys() and "max_steps" in user and "warmup_steps" not in user:
        # At most its whole warmup (also for a recipe's max_steps below 1, refused if it were the run's).
        warmup = planned["warmup_steps"]
        values["warmup_steps"] = min(warmup, warmup * values["max_steps"] // max(planned["max_steps"], 1))
    options = build(cls, values)
    if "--help" in given or "-h" in given:
        show_help(options, prog, description or inspect.cleandoc(cls.__doc__))
    return options


# --------------------------------------------------------------------------- --help
def show_help(options: Any, prog: str, description: str) -> NoReturn:
    """Print the help of ``options``' flags, their values as defaults, through tyro; SystemExit 0."""
    names = {path: (key, extras) for key, (path, _, extras) in option_fields(type(options)).items()}
    view = _help_view(options, names, ())
    # tyro prints the help of args ["--help"] and raises SystemExit(0) itself.
    tyro.cli(type(view), args=["--help"], default=view, prog=prog, description=description)


def _help_view(options: Any, names: dict[tuple[str, ...], tuple[str, tuple[Any, ...]]], path: tuple[str, ...]) -> Any:
    """A copy of ``options`` (at ``path`` in the options) for tyro to draw: each flag named by its option key in
    ``names`` (with its markers: a :class:`Short` alias), with its help on one line (:func:`field_help`) and its
    default as typed; a group keeps its box.
    """
    cls = type(options)
    hints = typing.get_type_hints(cls, include_extras=True)
    helps = field_help(cls)
    fields, values = [], {}
    for field in dataclasses.fields(cls):
        value = getattr(options, field.name)
        if (*path, field.name) in names:
            key, extras = names[(*path, field.name)]
            aliases = tuple(extra.flag for extra in extras if isinstance(extra, Short)) or None
            names_arg = dict(name=key, prefix_name=False, aliases=aliases)
            arg = tyro.conf.arg(help=helps.get(field.name), help_behavior_hint=_default_hint(value), **names_arg)
            hint = Annotated[hints[field.name], arg]
        elif dataclasses.is_dataclass(value):
            value = _help_view(value, names, (*path, field.name))
            # prefix_name=False: the box is named after this group alone
            hint = Annotated[type(value), tyro.conf.arg(prefix_name=False, help=helps.get(field.name, ""))]
        else:
            continue
        fields.append((field.name, hint))
        values[field.name] = value
    return dataclasses.make_dataclass(cls.__name__, fields)(**values)


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Each field's help on one line: the docstring below it, else the comment at the end of its line,
    else the comment lines right above it (without a section rule ``# --- name ---``); its bases' too.
    """
    helps = {}
    for klass in reversed(cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        helps.update(_own_field_help(source))
    return helps


def _own_field_help(source: str) -> dict[str, str]:
    """:func:`field_help` of the class whose source is ``source``."""
    lines = source.splitlines()
    body = ast.parse(source).body[0].body
    helps = {}
    for node, after in zip(body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above = []
        for line in reversed(lines[: node.lineno - 1]):
            comment = line.strip()
            if not comment.startswith("#") or comment.lstrip("# ").startswith("---"):
                break
            above.insert(0, comment.lstrip("#"))
        # what follows the field on its last line: its comment, if it has one (ast's offsets count UTF-8 bytes)
        tail = lines[node.end_lineno - 1].encode()[node.end_col_offset :].decode()
        text = tail.strip().lstrip("#") or " ".join(above)
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            text = after.value.value
        helps[node.target.id] = " ".join(text.split())
    return helps


def _default_hint(value: Any) -> str:
    """``(default: ...)`` for ``value`` as typed: each word as is, in double quotes where it is empty or holds a
    space (``"Hello, I'm a language model,"``), a tuple's words one after another; nothing for an empty tuple.
    """
    words = value if isinstance(value, tuple) else (value,)
    if not words:
        return ""
    shown = [
        f'"{word}"' if isinstance(word, str) and (not word or any(c.isspace() for c in word)) else str(word)
        for word in words
    ]
    return f"(default: {' '.join(shown)})"
