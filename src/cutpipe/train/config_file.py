"""``cutpipe train --config FILE`` and ``--print-config``: a run's options in a TOML or YAML file.

The keys are the option names (``seq_len``, or the flag's spelling ``seq-len`` / ``metrics``),
the values what the option takes (a list for ``data``, a flag's text such as ``"2:3"`` or
``"F=1,B=2"`` where the option reads text). Every value goes through the same checks as the flag
does, so a file fails as the command line would, naming the file and the key. ``to_toml`` writes
resolved options back as a file that ``read_config`` reads to the same ``TrainOptions``.
Relative paths in a file are read from the working directory, as on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any

from cutpipe.arguments import Custom, Option, Real, Switch, option_of
from cutpipe.sim.costs import PARSED, Costs
from cutpipe.train.options import GROUPS, TrainOptions

ENDINGS = (".toml", ".yaml", ".yml")


def option_fields() -> dict[str, tuple[dataclasses.Field, Option]]:
    """Every option of ``TrainOptions``, by its field name, in the groups' order."""
    found = {}
    for group in GROUPS.values():
        for field in dataclasses.fields(group):
            spec = option_of(field)
            if spec is not None:
                found[field.name] = (field, spec)
    return found


def key_names() -> dict[str, str]:
    """What a file may call each option: its field name, that name with dashes, and its long
    flags without the dashes (``metrics`` and ``log``, ``from``), to the field name."""
    names = {}
    for name, (_, spec) in option_fields().items():
        names[name] = name
        names[name.replace("_", "-")] = name
        for flag in spec.flags:
            if flag.startswith("--"):
                names[flag[2:]] = name
    return names


def load(path: str | Path) -> dict[str, Any]:
    """The file's table of keys, as TOML or YAML read it (``ValueError``: why it cannot be)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in ENDINGS:
        raise ValueError(f"--config {path}: name a .toml, .yaml or .yml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror}") from None
    if suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the same reader, as a package
            import tomli as tomllib

        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path} is not valid TOML: {error}") from None
    else:
        import yaml

        try:
            table = yaml.safe_load(text)
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            raise ValueError(
                f"{path} is not valid YAML{line}: {getattr(error, 'problem', error)}"
            ) from None
        table = {} if table is None else table
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a table of option = value, got {type(table).__name__}")
    return table


def read_config(path: str | Path) -> dict[str, Any]:
    """The options ``path`` gives, by field name, each checked and converted as its flag would
    be; an unknown key is refused with the closest option's name."""
    names = key_names()
    fields = option_fields()
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in load(path).items():
        key = str(key)
        name = names.get(key)
        if name is None:
            closest = difflib.get_close_matches(key, list(names), n=1, cutoff=0.0)
            hint = f": did you mean {closest[0]}?" if closest else ""
            raise ValueError(f"{path}: unknown option {key!r}{hint}")
        if name in values:
            raise ValueError(
                f"{path}: {given_as[name]!r} and {key!r} are the same option: give one"
            )
        _, spec = fields[name]
        try:
            values[name] = convert(spec, value)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}: {key}: {error}") from None
        given_as[name] = key
    for name in fields:
        rivals = [other for other in values if other != name and _rivals(name, other)]
        if name in values and rivals:
            raise ValueError(
                f"{path}: {given_as[name]!r} and {given_as[rivals[0]]!r} exclude one another: "
                "give one"
            )
    return values


def _rivals(name: str, other: str) -> bool:
    """Whether two options exclude one another (``--schedule``, ``--from``, ``--plan``)."""
    fields = option_fields()
    group = fields[name][1].exclusive
    return group is not None and fields[other][1].exclusive == group


def overridden(name: str, given: set[str]) -> bool:
    """Whether the command line's options ``given`` replace a file's option ``name``: they
    name it, or an option that excludes it."""
    return name in given or any(_rivals(name, other) for other in given if other in option_fields())


def convert(spec: Option, value: Any) -> Any:
    """``value`` from a file as the option holds it (``ValueError``: what is wrong)."""
    if value is None:
        raise ValueError("has no value: give one, or leave the key out for the default")
    if not spec.many:
        return _one(spec, value)
    if isinstance(value, str):
        value = [value]  # one path needs no list
    if not isinstance(value, list):
        raise ValueError(f"takes a list of values, got {value!r}")
    return tuple(_one(spec, item) for item in value)


def _one(spec: Option, value: Any) -> Any:
    kind = spec.kind
    if isinstance(kind, Switch):
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value
    if isinstance(kind, Custom) and isinstance(value, dict) and kind.accepts is Costs:
        value = ",".join(f"{k}={v}" for k, v in value.items())  # a table of costs
    elif isinstance(kind, Custom) and isinstance(value, list) and kind.accepts is tuple:
        value = ":".join(map(str, value))  # profile_steps = [2, 3]
    if isinstance(value, str):
        return kind.parse(value)  # what the flag would read (YAML reads 3e-3 as text)
    if isinstance(kind, Real) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    problem = kind.problem(value)
    if problem:
        raise ValueError(problem)
    return value


# -- writing ---------------------------------------------------------------------------------


def to_toml(options: TrainOptions) -> str:
    """``options`` as a TOML file that ``read_config`` reads back to them: one key per option,
    grouped under comments; options that are None (their default applies) are left out."""
    lines = []
    for group_name, group in GROUPS.items():
        values = getattr(options, group_name)
        title = (group.__doc__ or group_name).strip().splitlines()[0].rstrip(".")
        block = []
        for field in dataclasses.fields(group):
            if option_of(field) is None:
                continue
            value = getattr(values, field.name)
            if value is None:
                continue
            block.append(f"{field.name} = {_toml_value(_text_form(value))}")
        if block:
            lines += ([""] if lines else []) + [f"# {title}", *block]
    return "\n".join(lines) + "\n"


def flat_options(options: TrainOptions) -> dict[str, Any]:
    """Every option that is not None by its name, as ``to_toml`` writes it (W&B's config)."""
    found = {}
    for name in option_fields():
        value = getattr(options, name)
        if value is not None:
            value = _text_form(value)
            found[name] = list(value) if isinstance(value, tuple) else value
    return found


def _text_form(value: Any) -> Any:
    """Values that TOML has no type for, as the text their flag reads."""
    if isinstance(value, Costs):
        default = Costs()
        parts = [
            f"{name}={getattr(value, name)!r}"
            for name in PARSED
            if getattr(value, name) != getattr(default, name)
        ]
        return ",".join(parts) or f"f={value.f!r}"
    if isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value):
        return f"{value[0]}:{value[1]}"  # profile_steps
    return value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML holds no {value}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string: the same escapes
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")
