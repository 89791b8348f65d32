"""Each command's settings, declared once: a dataclass whose fields carry their flag.

A field made with :func:`setting` names its flag (``--batch.max-size``), default, help and, where
the default's type does not say it, the function that parses its text. Its environment variable
follows from the flag (``GPUSCOPE_BATCH_MAX_SIZE``, :func:`gpuscope.util.flags.env_name`). From the
dataclass, :func:`parser_for` makes the command's parser, and :meth:`SettingsParser.parse_settings`
returns an instance of the dataclass: from argv to a typed attribute with no string-keyed hop.

- A ``bool`` default makes a ``--flag`` / ``--no-flag`` pair (environment: true/false).
- A :class:`~gpuscope.contract.choices.Choice` default (an enum of strings) accepts its members'
  text and nothing else.
- :func:`group` nests another settings dataclass (``ServerConfig.model`` holds the ``--model.*``).
- :func:`toggles` makes one ``--PREFIX.NAME`` pair per option and yields the set of those on.

A flag that is not given leaves the dataclass default in place (argparse never sees defaults), so
the default is written once, where the field is. Bad values exit 2 with one line
(:class:`gpuscope.util.flags.FlagParser`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from gpuscope.contract.choices import Choice
from gpuscope.util.flags import FlagParser, checked, env_name

T = TypeVar("T")

_SETTING = "gpuscope.setting"
_GROUP = "gpuscope.group"
_TOGGLES = "gpuscope.toggles"


class LogLevel(Choice):
    """``--log.level`` of every command: one spelling set (``warn`` and ``warning`` alike, any case)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        text = str(value).strip().lower()
        text = "warning" if text == "warn" else text
        return next((member for member in cls if member.value == text), None)

    @classmethod
    def listing(cls) -> str:
        return "'debug', 'info', 'warning' (or 'warn'), 'error'"

    @property
    def number(self) -> int:
        """The ``logging`` module's level (``logging.WARNING`` for ``warning``)."""
        return int(getattr(logging, self.name))


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one setting reaches the command line."""

    name: str
    help: str
    #: text → value; None: from the default's type (bool: a toggle, Choice, int, float, else text)
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    #: False: no environment variable (a one-shot switch such as ``generate --check``)
    env: bool = True
    #: the flag may be given several times; the value is a tuple (environment: separated by spaces)
    repeated: bool = False

    @property
    def env_var(self) -> str:
        return env_name(self.name)


@dataclasses.dataclass(frozen=True)
class Toggles:
    """A family of on/off flags (``--collector.NAME``): name → (on by default, help)."""

    prefix: str
    options: Mapping[str, tuple[bool, str]]


def setting(flag: str, default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
            metavar: str | None = None, env: bool = True, repeated: bool = False) -> Any:
    """A dataclass field that is also ``flag`` (and its environment variable)."""
    spec = Flag(flag, help, parse, metavar, env, repeated)
    return dataclasses.field(default=default, metadata={_SETTING: spec})


def group(settings: type, default: Any = dataclasses.MISSING) -> Any:
    """A field holding another settings dataclass, whose flags join the command's; its default is
    that dataclass's defaults unless ``default`` is given (the parser still builds the group)."""
    if default is dataclasses.MISSING:
        return dataclasses.field(default_factory=settings, metadata={_GROUP: settings})
    return dataclasses.field(default=default, metadata={_GROUP: settings})


def toggles(prefix: str, options: Mapping[str, tuple[bool, str]]) -> Any:
    """A field holding the frozenset of option names that are on, one ``--PREFIX.NAME`` pair each."""
    on = frozenset(name for name, (default, _) in options.items() if default)
    return dataclasses.field(default=on, metadata={_TOGGLES: Toggles(prefix, dict(options))})


def parse_int(text: str) -> int:
    # argparse's own wording for type=int, which operators and tests already know
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"invalid int value: {text!r}") from None


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"invalid float value: {text!r}") from None


def _parse_of(spec: Flag, default: Any) -> Callable[[str], Any] | None:
    """The setting's parse function; None for a toggle."""
    if spec.parse is not None:
        return spec.parse
    if isinstance(default, Choice):
        return type(default).parse
    if isinstance(default, bool):
        return None
    if isinstance(default, int):
        return parse_int
    if isinstance(default, float):
        return parse_float
    return str


def declared(settings: type) -> Iterator[tuple[Flag, Any]]:
    """Every (flag, default) of a settings dataclass, groups included, in declaration order."""
    for f in dataclasses.fields(settings):
        if _SETTING in f.metadata:
            yield f.metadata[_SETTING], f.default
        elif _GROUP in f.metadata:
            yield from declared(f.metadata[_GROUP])
        elif _TOGGLES in f.metadata:
            family: Toggles = f.metadata[_TOGGLES]
            for name, (default, text) in family.options.items():
                yield Flag(f"--{family.prefix}.{name}", text), default


class _Repeated(argparse.Action):
    """Each use adds a value; the first one replaces the environment's (a tuple, not a list)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(current if isinstance(current, list) else []), values])


def _metavar(flag: str, default: Any) -> str:
    """``{a,b}`` for a choice (as argparse shows ``choices``), else the flag in capitals."""
    if isinstance(default, Choice):
        return "{" + ",".join(member.value for member in type(default)) + "}"
    return flag.lstrip("-").replace("-", "_").upper()


class SettingsParser(FlagParser, Generic[T]):
    """The parser of one settings dataclass; :meth:`parse_settings` returns an instance of it."""

    def __init__(self, settings: type[T], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings = settings
        self._add_fields(settings, "")

    def parse_settings(self, argv: Sequence[str] | None = None) -> T:
        """argv (and the environment) → the settings; exits 2 with one line on a bad value."""
        given = vars(self.parse_args(None if argv is None else list(argv)))
        return self._build(self.settings, "", given)

    def _add_fields(self, settings: type, path: str) -> None:
        for f in dataclasses.fields(settings):
            dest = path + f.name
            if _SETTING in f.metadata:
                self._add_setting(f.metadata[_SETTING], f.default, dest)
            elif _GROUP in f.metadata:
                self._add_fields(f.metadata[_GROUP], dest + ".")
            elif _TOGGLES in f.metadata:
                family: Toggles = f.metadata[_TOGGLES]
                for name, (default, text) in family.options.items():
                    self.add_flag(f"--{family.prefix}.{name}", dest=f"{dest}.{name}",
                                  action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                  help=f"{text} (default {'on' if default else 'off'})")

    def _add_setting(self, spec: Flag, default: Any, dest: str) -> None:
        parse = _parse_of(spec, default)
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": spec.help}
        if parse is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = checked(parse)
            kwargs["metavar"] = spec.metavar or _metavar(spec.name, default)
            if spec.repeated:
                kwargs["action"] = _Repeated
        if spec.env:
            self.add_flag(spec.name, **kwargs)
        else:
            self.add_argument(spec.name, **kwargs)

    def _env_value(self, action: argparse.Action, env: str, raw: str) -> Any:
        if isinstance(action, _Repeated):
            return tuple(super(SettingsParser, self)._env_value(action, env, part) for part in raw.split())
        return super()._env_value(action, env, raw)

    def _build(self, settings: type, path: str, given: Mapping[str, Any]) -> Any:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(settings):
            key = path + f.name
            if _SETTING in f.metadata and key in given:
                value = given[key]
                values[f.name] = tuple(value) if isinstance(value, list) else value
            elif _GROUP in f.metadata:
                values[f.name] = self._build(f.metadata[_GROUP], key + ".", given)
            elif _TOGGLES in f.metadata:
                on = set(f.default)
                for name in f.metadata[_TOGGLES].options:
                    if f"{key}.{name}" in given:
                        (on.add if given[f"{key}.{name}"] else on.discard)(name)
                values[f.name] = frozenset(on)
        return settings(**values)


def parser_for(settings: type[T], *, prog: str, description: str = "", **kwargs: Any) -> SettingsParser[T]:
    """The parser of ``settings``: one flag per setting, in declaration order."""
    return SettingsParser(settings, prog=prog, description=description, **kwargs)
