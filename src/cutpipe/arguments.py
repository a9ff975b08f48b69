"""Options declared once: a dataclass field says what values it takes, its help and its flag,
and both the command line and the code that builds the dataclass directly are checked by it.

A ``Kind`` (``Whole``, ``Real``, ``Choice``, ``Text``, ...) parses command-line text (an argparse
``type``, whose error argparse prints as ``argument --lr: must be a finite number > 0, got
'nan'``) and checks a value given in code (the same words, naming the field). ``option(...)``
makes a dataclass field that carries its kind, help text and flags; ``check_fields`` runs every
field's check (call it from ``__post_init__``); ``add_arguments`` turns a dataclass of option
groups (each a dataclass of options) into argparse argument groups, and ``from_arguments``
builds that dataclass back from the parsed namespace. So a new option is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

OPTION = "cutpipe.option"


class Kind:
    """What values an option takes."""

    metavar: ClassVar[str | None] = None

    def parse(self, text: str) -> Any:
        """The value of ``text`` from the command line; ``ValueError`` says what is wrong."""
        raise NotImplementedError

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` given in code (None: nothing)."""
        return None

    def argument_type(self) -> Callable[[str], Any]:
        """``parse`` as an argparse ``type``: its errors are usage errors."""

        def parse(text: str) -> Any:
            try:
                return self.parse(text)
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None

        parse.__name__ = type(self).__name__.lower()
        return parse


class _Number(Kind):
    """A number read by ``convert`` and then held to ``problem``; both errors say what is
    wanted (``_wanted``) and what was given."""

    convert: ClassVar[Callable[[str], Any]]

    def _wanted(self) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        try:
            value = type(self).convert(text)
        except ValueError:
            raise ValueError(f"{self._wanted()}, got {text!r}") from None
        if self.problem(value):
            raise ValueError(f"{self._wanted()}, got {text!r}")
        return value


@dataclass(frozen=True)
class Whole(_Number):
    """A whole number in [least, most]."""

    least: int = 1
    most: int | None = None
    metavar: ClassVar[str | None] = "N"
    convert: ClassVar[Callable[[str], Any]] = int

    def _wanted(self) -> str:
        bounds = (
            f">= {self.least}" if self.most is None else f"between {self.least} and {self.most:,}"
        )
        return f"must be a whole number {bounds}"

    def problem(self, value: Any) -> str | None:
        fits = isinstance(value, int) and not isinstance(value, bool)
        if fits and value >= self.least and (self.most is None or value <= self.most):
            return None
        return f"{self._wanted()}, got {value!r}"


@dataclass(frozen=True)
class Real(_Number):
    """A finite number above ``least`` (or from it, if not ``exclusive``), at most ``most``."""

    least: float = 0.0
    most: float | None = None
    exclusive: bool = True
    unit: str = ""
    metavar: ClassVar[str | None] = "X"
    convert: ClassVar[Callable[[str], Any]] = float

    def _wanted(self) -> str:
        low = f"> {self.least:g}" if self.exclusive else f">= {self.least:g}"
        bounds = low if self.most is None else f"{low} and <= {self.most:g}"
        return f"must be a finite number {bounds}{f' ({self.unit})' if self.unit else ''}"

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{self._wanted()}, got {value!r}"
        too_low = value <= self.least if self.exclusive else value < self.least
        if not math.isfinite(value) or too_low or (self.most is not None and value > self.most):
            return f"{self._wanted()}, got {value!r}"
        return None


@dataclass(frozen=True)
class Choice(Kind):
    """One of a few words."""

    values: tuple[str, ...]

    def parse(self, text: str) -> str:
        if text not in self.values:
            raise ValueError(f"must be one of {', '.join(self.values)}, got {text!r}")
        return text

    def problem(self, value: Any) -> str | None:
        if value in self.values:
            return None
        return f"must be one of {', '.join(self.values)}, got {value!r}"


@dataclass(frozen=True)
class Text(Kind):
    """Any text (a name, a path that is checked later)."""

    def parse(self, text: str) -> str:
        return text

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, str) else f"must be text, got {value!r}"


@dataclass(frozen=True)
class ReadableFile(Kind):
    """A file that exists, checked before any work."""

    metavar: ClassVar[str | None] = "FILE"

    def parse(self, text: str) -> str:
        if not os.path.isfile(text):
            raise ValueError(f"no such file: {text}")
        return text

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (str, os.PathLike)):
            return f"must be a path, got {value!r}"
        return None  # a library caller's file is opened (and its absence reported) where used


@dataclass(frozen=True)
class Switch(Kind):
    """On when the flag is given."""

    def parse(self, text: str) -> bool:  # pragma: no cover - argparse's store_true parses
        raise ValueError("takes no value")

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, bool) else f"must be True or False, got {value!r}"


@dataclass(frozen=True)
class Custom(Kind):
    """A value read by ``reads`` (``ValueError``/``TypeError`` say what is wrong) and accepted in
    code when it is of ``accepts``."""

    reads: Callable[[str], Any]
    accepts: type | tuple[type, ...] = object

    def parse(self, text: str) -> Any:
        try:
            return self.reads(text)
        except TypeError as error:
            raise ValueError(str(error)) from None

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, self.accepts) else f"got {value!r}"


@dataclass(frozen=True)
class Option:
    """How a field appears on the command line."""

    help: str
    kind: Kind
    flags: tuple[str, ...] = ()  # default: --field-name
    metavar: str | None = None
    many: bool = False  # several values (nargs="+"), held as a tuple
    optional: bool = True  # None allowed (it means: the default the help text names)
    exclusive: str | None = None  # options sharing this name exclude one another
    required_one: bool = False  # one of the exclusive options must be given


def option(
    default: Any,
    help: str,
    kind: Kind | None = None,
    *,
    flags: Sequence[str] = (),
    metavar: str | None = None,
    many: bool = False,
    exclusive: str | None = None,
    required_one: bool = False,
    optional: bool | None = None,
) -> Any:
    """A dataclass field that is also a command-line option (see the module); ``optional``
    (default: when the default is None) lets code pass None, which the help text explains."""
    if kind is None:
        kind = Switch() if isinstance(default, bool) else Text()
    if optional is None:
        optional = default is None
    spec = Option(help, kind, tuple(flags), metavar, many, optional, exclusive, required_one)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    return dataclasses.field(default=default, metadata={OPTION: spec})


def option_of(field: dataclasses.Field) -> Option | None:
    return field.metadata.get(OPTION)


def flags_of(field: dataclasses.Field) -> tuple[str, ...]:
    spec = option_of(field)
    assert spec is not None
    return spec.flags or ("--" + field.name.replace("_", "-"),)


def check_fields(value: Any) -> list[str]:
    """Every option field's problem, as ``name: what is wrong``."""
    problems = []
    for field in dataclasses.fields(value):
        spec = option_of(field)
        if spec is None:
            continue
        given = getattr(value, field.name)
        if given is None and spec.optional:
            continue
        items = given if spec.many else (given,)
        if spec.many and not isinstance(given, tuple):
            problems.append(f"{field.name}: must be a tuple, got {given!r}")
            continue
        for item in items:
            problem = spec.kind.problem(item)
            if problem:
                problems.append(f"{field.name} {problem}")
                break
    return problems


def _title(group: type) -> str:
    return (group.__doc__ or group.__name__).strip().splitlines()[0].rstrip(".")


def add_arguments(parser: argparse.ArgumentParser, options: type, *, required: bool = True) -> None:
    """One argument group per option group of the dataclass ``options``; ``required=False``
    leaves ``required_one`` to the caller (when the value may come from elsewhere, a file)."""
    exclusive: dict[str, Any] = {}
    for group_field in dataclasses.fields(options):
        group = group_field.type if isinstance(group_field.type, type) else None
        group = group or _resolve(options, group_field)
        arguments = parser.add_argument_group(_title(group))
        for field in dataclasses.fields(group):
            spec = option_of(field)
            if spec is None:
                continue
            target: Any = arguments
            if spec.exclusive is not None:
                if spec.exclusive not in exclusive:
                    exclusive[spec.exclusive] = arguments.add_mutually_exclusive_group(
                        required=spec.required_one and required
                    )
                target = exclusive[spec.exclusive]
            _add(target, field, spec)


def _add(target: Any, field: dataclasses.Field, spec: Option) -> None:
    settings: dict[str, Any] = {"dest": field.name, "help": _help(field, spec)}
    if isinstance(spec.kind, Switch):
        settings["action"] = "store_true"
    elif isinstance(spec.kind, Choice):  # argparse lists them in the usage and checks them
        settings["choices"] = spec.kind.values
    else:
        settings["type"] = spec.kind.argument_type()
        metavar = spec.metavar or spec.kind.metavar
        if metavar:
            settings["metavar"] = metavar
        if spec.many:
            settings["nargs"] = "+"
    settings["default"] = field.default
    target.add_argument(*flags_of(field), **settings)


def _help(field: dataclasses.Field, spec: Option) -> str:
    text = spec.help.replace("%", "%%")
    if field.default is None or isinstance(field.default, bool) or "default" in spec.help:
        return text
    shown = ", ".join(map(str, field.default)) if spec.many else field.default
    if shown in ("", ()):
        return text
    return f"{text} (default {shown})"


def _resolve(owner: type, field: dataclasses.Field) -> type:
    """The class a field annotated by name (``from __future__ import annotations``) holds."""
    import sys
    import typing

    hints = typing.get_type_hints(owner, vars(sys.modules[owner.__module__]))
    return hints[field.name]


def from_arguments(options: type, namespace: argparse.Namespace) -> Any:
    """The dataclass ``options`` built from a namespace that ``add_arguments`` filled."""
    groups = {}
    for group_field in dataclasses.fields(options):
        group = _resolve(options, group_field)
        values = {}
        for field in dataclasses.fields(group):
            if option_of(field) is None or not hasattr(namespace, field.name):
                continue
            value = getattr(namespace, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
        groups[group_field.name] = group(**values)
    return options(**groups)
