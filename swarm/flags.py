"""Config fields that are also command-line flags, declared once. Standard library only.

Owns: ``option`` (a field that carries its flag), ``add_flags`` / ``add_sections`` (the argparse arguments) and
``from_args`` / ``build`` (the config from parsed arguments), so a flag's name, type, default and help live on
the field. The types it takes: docs/architecture.md, "Notes by module".
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    Args:
        help: the ``--help`` text. flag: the option string (default ``--`` + the field's name with
            dashes). metavar, choices: as argparse's. negate: for a bool defaulting to True, the
            ``--no-...`` flag that sets it False. required: argparse refuses a command without it.
            convert: applied to a given value by ``from_args`` (the flag takes a string; what
            ``convert`` raises, e.g. a ConfigError, reaches the caller).
    """

    help: str
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    negate: str | None = None
    required: bool = False
    convert: typing.Callable | None = None


def option(default, help: str, **kw) -> dataclasses.Field:
    """A dataclass field that is also the flag ``Flag(help, **kw)``; its parsed argument is named as the
    field."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **kw)})


def _flags(cls) -> list[tuple[dataclasses.Field, Flag, object]]:
    """``(field, its Flag, its resolved annotation)`` for every flag field of ``cls``, in order."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["flag"], hints[f.name]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _base(annotation) -> type:
    """``int | None`` -> int; ``tuple[str, ...]`` -> tuple; a plain type -> itself."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return tuple
    if args and origin is not None:
        return args[0]
    return annotation


def flag_name(field: dataclasses.Field, flag: Flag) -> str:
    """The option string of a flag field."""
    return flag.flag or "--" + field.name.replace("_", "-")


def add_flags(parser, cls, title: str | None = None):
    """Add ``cls``'s flag fields to ``parser`` (in an argument group when ``title`` is given);
    returns where they went."""
    target = parser.add_argument_group(title) if title else parser
    for field, flag, annotation in _flags(cls):
        base = _base(annotation)
        kw: dict = {"help": flag.help, "dest": field.name}
        if flag.required:
            kw["required"] = True
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if base is bool:
            if flag.negate:
                target.add_argument(flag.negate, action="store_false", **kw)
            else:
                target.add_argument(flag_name(field, flag), action="store_true", **kw)
            continue
        if base is tuple:
            kw.update(action="append", default=[])
        elif flag.convert is not None:
            kw.update(default=None)
        else:
            kw.update(type=base, default=field.default if field.default is not dataclasses.MISSING else None)
        if flag.choices:
            kw["choices"] = list(flag.choices)
        elif "metavar" not in kw:  # named after the flag, not the field: --key KEY
            kw["metavar"] = flag_name(field, flag).lstrip("-").replace("-", "_").upper()
        target.add_argument(flag_name(field, flag), **kw)
    return target


def from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` built from the parsed ``args`` of its flag fields; ``overrides`` set the others (or
    replace a parsed value). Raises what ``cls`` raises on construction."""
    values = {}
    for field, flag, annotation in _flags(cls):
        value = getattr(args, field.name)
        if _base(annotation) is tuple:
            value = tuple(value)
        elif flag.convert is not None and value is not None:
            value = flag.convert(value)
        values[field.name] = value
    values.update(overrides)
    return cls(**values)


def sections(cls) -> dict[str, type]:
    """``{field name: section class}`` of a config made of sections (every field a dataclass)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def add_sections(parser, cls) -> dict:
    """Every section's flags of the sectioned config ``cls``, an argument group per section with a
    ``TITLE`` (the others' flags among the parser's own); returns ``{section name: where its flags went}``."""
    return {name: add_flags(parser, section, getattr(section, "TITLE", None))
            for name, section in sections(cls).items()}


def build(cls, flat: dict, args: argparse.Namespace | None = None):
    """The sectioned config ``cls`` from flat field names (each goes to the section declaring it),
    over the parsed flags ``args`` when given.

    Raises:
        TypeError: a name no section declares. What a section raises on construction.
    """
    parts = {name: (section, {}) for name, section in sections(cls).items()}
    for key, value in flat.items():
        name = next((n for n, (section, _) in parts.items()
                     if key in {f.name for f in dataclasses.fields(section)}), None)
        if name is None:
            raise TypeError(f"{cls.__name__} has no setting called {key!r}")
        parts[name][1][key] = value
    return cls(**{name: from_args(section, args, **values) if args is not None else section(**values)
                  for name, (section, values) in parts.items()})
