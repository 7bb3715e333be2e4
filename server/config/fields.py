"""Flags and environment knobs declared on the config dataclasses; argparse built from them.

Each field of a config dataclass says in its metadata where its value comes from: ``flag``
(a command-line flag, possibly with an environment variable behind it), ``knob`` (an
environment variable only) or ``derived`` (neither: set from other settings), with its help
text. A field whose type is itself a config dataclass (``section``) contributes that
class's fields. The default is the field's own, written once: ``add_flags`` generates the
parser from the fields and ``build`` turns parsed flags plus the environment into the
dataclass, as vLLM's engine arguments do. This is the one module that reads ``os.environ``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# metadata keys of a field
_SPEC = "hpu_serve.spec"
_SECTION = "hpu_serve.section"


class Source(enum.Enum):
    """Where a field's value comes from."""

    FLAG = "flag"  # a command-line flag; an environment variable when the flag is unset
    KNOB = "knob"  # an environment variable only
    DERIVED = "derived"  # from other settings; no flag or variable of its own
    FIXED = "fixed"  # a constant of the code: no flag or variable (yet)


@dataclass(frozen=True, slots=True)
class Spec:
    """One field's flag or knob: everything argparse and the environment reader need."""

    source: Source
    help: str
    name: str | None = None  # the flag, without dashes, where it differs from the field
    aliases: tuple[str, ...] = ()  # further option strings, dashes included
    env: str | tuple[str, ...] | None = None  # a tuple: one variable per tuple element
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    group: str | None = None  # title of the help section
    exclusive: str | None = None  # flags with the same tag are mutually exclusive
    positional: bool = False  # also a hidden --NAME flag (vLLM's ``--model``)
    dest: str | None = None  # where the flag name is no identifier (``--from``)
    unit: int = 1  # the variable counts in these (GiB), the field in ones (bytes)
    env_reader: Callable[[Mapping[str, str]], Any] | None = None  # several variables

    def flag_name(self, field_name: str) -> str:
        return self.name or field_name.replace("_", "-")


def _field(default: Any, spec: Spec) -> Any:
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def flag(default: Any, *, help: str, name: str | None = None,
         aliases: tuple[str, ...] = (), env: str | None = None,
         choices: tuple[str, ...] | None = None, metavar: str | None = None,
         group: str | None = None, exclusive: str | None = None, positional: bool = False,
         dest: str | None = None,
         env_reader: Callable[[Mapping[str, str]], Any] | None = None) -> Any:
    """A field set by ``--NAME`` (the field's name with dashes unless ``name`` says). With
    ``env``, the variable applies when the flag is not given. A bool is ``store_true`` when
    its default is False, ``--NAME/--no-NAME`` when True, ``store_false`` when ``name``
    starts with ``no-``."""
    return _field(default, Spec(
        Source.FLAG, help, name=name, aliases=aliases, env=env, choices=choices,
        metavar=metavar, group=group, exclusive=exclusive, positional=positional, dest=dest,
        env_reader=env_reader))


def knob(default: Any, *, env: str | tuple[str, ...], help: str,
         unit: int = 1) -> Any:
    """A field set by an environment variable only (vLLM's ``VLLM_*`` knobs); ``unit``: the
    variable is a number of these (``VLLM_CPU_KVCACHE_SPACE`` in GiB for a field in bytes)."""
    return _field(default, Spec(Source.KNOB, help, env=env, unit=unit))


def derived(default: Any, *, help: str) -> Any:
    """A field that is no flag: ``build`` takes it from its ``derived`` mapping, if there."""
    return _field(default, Spec(Source.DERIVED, help))


def fixed(default: Any, *, help: str) -> Any:
    """A field that is no flag and no knob: its default is the value (a flag is one
    ``flag(...)`` away)."""
    return _field(default, Spec(Source.FIXED, help))


def section(cls: type, *, group: str | None = None) -> Any:
    """A nested config dataclass; its flags go to the help section ``group`` (if given)."""
    return dataclasses.field(default_factory=cls, metadata={_SECTION: group})


def spec_of(f: dataclasses.Field[Any]) -> Spec | None:
    return f.metadata.get(_SPEC)


def _base(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def walk(cls: type, prefix: str = "", group: str | None = None
         ) -> Iterator[tuple[str, dataclasses.Field[Any], Any, str | None]]:
    """(dotted path, field, resolved type, help section) of every leaf field of ``cls``,
    nested sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _SECTION in f.metadata:
            yield from walk(tp, f"{prefix}{f.name}.", f.metadata[_SECTION] or group)
        else:
            spec = spec_of(f)
            yield prefix + f.name, f, tp, (spec.group if spec and spec.group else group)


def dest_of(f: dataclasses.Field[Any], spec: Spec) -> str:
    """The argparse destination (and ``make_engine_config`` keyword) of a flag field."""
    if spec.dest:
        return spec.dest
    name = spec.flag_name(f.name)
    return f.name if name.startswith("no-") else name.replace("-", "_")


def option(cls: type, field_name: str) -> str:
    """How the user sets ``cls.field_name`` (``--flag`` or ``VARIABLE``), for messages."""
    spec = spec_of(next(f for f in dataclasses.fields(cls) if f.name == field_name))
    if spec is None or spec.source in (Source.DERIVED, Source.FIXED):
        return field_name
    if spec.source is Source.KNOB:
        return spec.env if isinstance(spec.env, str) else field_name
    return "--" + spec.flag_name(field_name)


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _help(spec: Spec) -> str:
    text = spec.help.replace("%", "%%")
    return f"{text} (env: {spec.env})" if isinstance(spec.env, str) else text


def add_flags(parser: argparse.ArgumentParser, *classes: type,
              only: Collection[str] | None = None,
              defaults: Mapping[str, Any] | None = None) -> None:
    """Adds the flags of ``classes`` to ``parser``: every ``flag`` field, or those named in
    ``only`` (by field path, e.g. ``max_num_seqs``); ``defaults`` overrides the shown and
    parsed default of some (by the same path)."""
    containers: dict[str | None, Any] = {None: parser}
    exclusive: dict[tuple[str | None, str], Any] = {}
    for cls in classes:
        for path, f, tp, group in walk(cls):
            spec = spec_of(f)
            if spec is None or spec.source is not Source.FLAG or (only and path not in only):
                continue
            if group not in containers:
                containers[group] = parser.add_argument_group(group)
            target = containers[group]
            if spec.exclusive:
                key = (group, spec.exclusive)
                if key not in exclusive:
                    exclusive[key] = target.add_mutually_exclusive_group()
                target = exclusive[key]
            default = (defaults or {}).get(path, _default(f))
            _add_flag(target, f, spec, _base(tp), default)


def _add_flag(target: Any, f: dataclasses.Field[Any], spec: Spec, tp: Any,
              default: Any) -> None:
    name, dest = spec.flag_name(f.name), dest_of(f, spec)
    if spec.positional:
        target.add_argument(dest, nargs="?", default=default, help=_help(spec))
        target.add_argument(f"--{name}", dest=f"{dest}_flag", default=None,
                            help=argparse.SUPPRESS)
        return
    kwargs: dict[str, Any] = {"dest": dest, "help": _help(spec)}
    if tp is bool:
        if default is False:
            kwargs["action"] = "store_true"
        elif name.startswith("no-"):
            kwargs["action"] = "store_false"
        else:
            kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(tp) is tuple:
        kwargs.update(nargs="*", type=typing.get_args(tp)[0])
        default = list(default)
    elif _is_enum(tp):
        kwargs.update(type=str, choices=[m.value for m in tp])
        default = default.value if isinstance(default, enum.Enum) else default
    else:
        kwargs.update(type=tp, choices=list(spec.choices) if spec.choices else None)
    if spec.metavar:
        kwargs["metavar"] = spec.metavar
    # unset flag, then the variable decides: None marks "unset"
    kwargs["default"] = None if spec.env or spec.env_reader else default
    target.add_argument(f"--{name}", *spec.aliases, **kwargs)


def build(cls: type[T], values: argparse.Namespace | Mapping[str, Any] | None = None,
          environ: Mapping[str, str] | None = None,
          derived: Mapping[str, Any] | None = None) -> T:
    """``cls`` from parsed flags (by destination; a missing or None one is unset), then the
    environment (``os.environ`` unless given), then ``derived`` values (by field path),
    then the field's default."""
    given = vars(values) if isinstance(values, argparse.Namespace) else dict(values or {})
    env = os.environ if environ is None else environ
    return _build(cls, given, env, derived or {}, "")


def _build(cls: type[T], given: Mapping[str, Any], env: Mapping[str, str],
           derived_values: Mapping[str, Any], prefix: str) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path, tp = prefix + f.name, hints[f.name]
        if _SECTION in f.metadata:
            kwargs[f.name] = _build(tp, given, env, derived_values, path + ".")
            continue
        spec = spec_of(f)
        if spec is None:
            continue
        value = None
        if spec.source is Source.FLAG:
            dest = dest_of(f, spec)
            value = given.get(dest)
            if spec.positional and value is None:
                value = given.get(f"{dest}_flag")
            if value == "" and spec.env:
                value = None
        if value is None and spec.source in (Source.FLAG, Source.KNOB):
            value = read_env(spec, tp, env)
        if spec.source is Source.DERIVED:
            value = derived_values.get(path)
        if value is not None:
            kwargs[f.name] = _convert(value, _base(tp), spec, f.name)
    return cls(**kwargs)


def _convert(value: Any, tp: Any, spec: Spec, field_name: str) -> Any:
    if _is_enum(tp):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(m.value for m in tp)
            raise ValueError(f"--{spec.flag_name(field_name)} must be one of {allowed}, "
                             f"got {value!r}") from None
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def env_value(cls: type, field_name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One field's value from its environment variable (None: unset)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == field_name)
    spec = spec_of(f)
    assert spec is not None, f"{cls.__name__}.{field_name} has no flag or knob"
    return read_env(spec, typing.get_type_hints(cls)[field_name],
                    os.environ if environ is None else environ)


def read_env(spec: Spec, tp: Any, env: Mapping[str, str]) -> Any:
    """The field's value from the environment, or None where no variable is set."""
    if spec.env_reader is not None:
        return spec.env_reader(env)
    if spec.env is None:
        return None
    base = _base(tp)
    if isinstance(spec.env, tuple):  # one variable per element of a tuple-typed field
        return tuple(read_variable(env, name, _parser_for(_base(t)))
                     for name, t in zip(spec.env, typing.get_args(base)))
    if spec.unit != 1:
        return read_variable(env, spec.env, lambda raw: int(parse_number(raw) * spec.unit))
    return read_variable(env, spec.env, _parser_for(base))


def read_variable(env: Mapping[str, str], name: str, parse: Callable[[str], Any]) -> Any:
    """A variable's parsed value, or None when unset or empty; a bad one names itself."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name} {exc}, got {raw!r}") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(raw: str) -> bool:
    if raw.lower() not in _TRUE + _FALSE:
        raise ValueError("must be true or false (1/0, yes/no, on/off)")
    return raw.lower() in _TRUE


def parse_count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("must be an integer") from None
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def parse_number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("must be a number") from None


def _parser_for(tp: Any) -> Callable[[str], Any]:
    if _is_enum(tp):
        return lambda raw: _parse_enum(tp, raw)
    parsers: dict[Any, Callable[[str], Any]] = {bool: parse_bool, int: parse_count,
                                                float: parse_number, str: str}
    return parsers[tp]


def _parse_enum(tp: type[enum.Enum], raw: str) -> enum.Enum:
    try:
        return tp(raw)
    except ValueError:
        raise ValueError(f"must be one of {', '.join(str(m.value) for m in tp)}") from None


def env_help(*classes: type) -> str:
    """The environment knobs of ``classes``, one per line, for a parser's epilog."""
    lines = ["environment variables:"]
    for cls in classes:
        for _, f, _, _ in walk(cls):
            spec = spec_of(f)
            if spec is not None and spec.source is Source.KNOB:
                names = spec.env if isinstance(spec.env, str) else ", ".join(spec.env or ())
                shown = _shown(_default(f) / spec.unit if spec.unit != 1 else _default(f))
                lines.append(f"  {names}")
                lines += textwrap.wrap(f"{spec.help} (default: {shown})", 92,
                                       initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "unset" if all(v is None for v in value) else str(value)
    return "unset" if value is None else str(value)
