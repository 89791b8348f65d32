"""Settings declared once: the dataclass field is the flag, its variable, default and help."""

from __future__ import annotations

import dataclasses

import pytest

from gpuscope.util.flags import parse_duration
from gpuscope.util.settings import Choice, LogLevel, declared, group, parser_for, setting, toggles


class Colour(Choice):
    RED = "red"
    GREEN = "green"


@dataclasses.dataclass(frozen=True)
class Inner:
    depth: int = setting("--inner.depth", 3, "how deep")


@dataclasses.dataclass(frozen=True)
class Demo:
    wait_s: float = setting("--run.wait", 1.5, "how long to wait", parse=parse_duration)
    name: str | None = setting("--run.name", None, "what to call it")
    colour: Colour = setting("--run.colour", Colour.RED, "which colour")
    loud: bool = setting("--run.loud", False, "shout")
    level: LogLevel = setting("--log.level", LogLevel.INFO, "log level")
    items: tuple[str, ...] = setting("--run.item", (), "repeatable", repeated=True)
    once: bool = setting("--once", False, "per run, no variable", env=False)
    inner: Inner = group(Inner)
    parts: frozenset[str] = toggles("part", {"a": (True, "part a"), "b": (False, "part b")})
    derived: str = ""  # not a flag: the parser leaves it alone


def parse(argv: list[str]) -> Demo:
    return parser_for(Demo, prog="demo").parse_settings(argv)


@pytest.fixture(autouse=True)
def _no_demo_variables(monkeypatch):
    for flag, _ in declared(Demo):
        monkeypatch.delenv(flag.env_var, raising=False)


def test_a_field_is_its_flag_variable_default_and_help(monkeypatch, capsys):
    assert parse([]) == Demo()  # every default is the field's own
    assert parse([]).wait_s == 1.5 and parse([]).inner.depth == 3 and parse([]).parts == {"a"}
    with pytest.raises(SystemExit) as exit_info:
        parse(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for text in ("--run.wait RUN.WAIT how long to wait [env GPUSCOPE_RUN_WAIT]",
                 "--run.colour {red,green} which colour [env GPUSCOPE_RUN_COLOUR]",
                 "--run.loud, --no-run.loud shout [env GPUSCOPE_RUN_LOUD]",
                 "--inner.depth INNER.DEPTH how deep [env GPUSCOPE_INNER_DEPTH]",
                 "--part.b, --no-part.b part b (default off) [env GPUSCOPE_PART_B]",
                 "--once, --no-once per run, no variable"):
        assert text in help_text, text
    assert "GPUSCOPE_ONCE" not in help_text and "derived" not in help_text.lower()
    monkeypatch.setenv("GPUSCOPE_RUN_WAIT", "250ms")
    monkeypatch.setenv("GPUSCOPE_INNER_DEPTH", "7")
    monkeypatch.setenv("GPUSCOPE_PART_A", "false")
    monkeypatch.setenv("GPUSCOPE_ONCE", "true")  # no variable: ignored
    from_env = parse([])
    assert (from_env.wait_s, from_env.inner.depth, from_env.parts) == (0.25, 7, frozenset())
    assert not from_env.once
    flagged = parse(["--run.wait", "2s", "--inner.depth", "1", "--part.a", "--part.b", "--run.loud",
                     "--once"])
    assert (flagged.wait_s, flagged.inner.depth, flagged.parts) == (2.0, 1, {"a", "b"})  # flag beats variable
    assert flagged.loud and flagged.once


def test_declared_lists_every_flag_once_with_its_default():
    flags = {flag.name: default for flag, default in declared(Demo)}
    assert flags == {"--run.wait": 1.5, "--run.name": None, "--run.colour": Colour.RED, "--run.loud": False,
                     "--log.level": LogLevel.INFO, "--run.item": (), "--once": False, "--inner.depth": 3,
                     "--part.a": True, "--part.b": False}


def test_a_repeated_flag_collects_and_replaces_its_variable(monkeypatch):
    assert parse(["--run.item", "x", "--run.item", "y"]).items == ("x", "y")
    monkeypatch.setenv("GPUSCOPE_RUN_ITEM", "p q")
    assert parse([]).items == ("p", "q")
    assert parse(["--run.item", "x"]).items == ("x",)


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--run.wait", "soon"], {}, "argument --run.wait: 'soon' is not a duration"),
    (["--inner.depth", "deep"], {}, "argument --inner.depth: invalid int value: 'deep'"),
    ([], {"GPUSCOPE_RUN_WAIT": "soon"}, "GPUSCOPE_RUN_WAIT='soon': 'soon' is not a duration"),
    ([], {"GPUSCOPE_RUN_LOUD": "maybe"}, "GPUSCOPE_RUN_LOUD='maybe' is not a boolean"),
    (["--run.colour", "blue"], {}, "invalid choice: 'blue' (choose from 'red', 'green')"),
    ([], {"GPUSCOPE_RUN_COLOUR": "blue"}, "invalid choice: 'blue' (choose from 'red', 'green')"),
    (["--log.level", "loud"], {},
     "invalid choice: 'loud' (choose from 'debug', 'info', 'warning' (or 'warn'), 'error')"),
])
def test_a_bad_value_is_one_line_and_exit_2(argv, env, needle, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("demo: error:") and needle in err, err


def test_choices_are_their_text():
    colour = parse(["--run.colour", "green"]).colour
    assert colour is Colour.GREEN and colour == "green" and f"{colour}" == "green"
    assert {"green": 1}[colour] == 1  # a key spelled as text finds it


@pytest.mark.parametrize("text", ["warn", "warning", "WARN", "Warning"])
def test_every_spelling_of_warning_is_one_level(text):
    assert parse(["--log.level", text]).level is LogLevel.WARNING
    assert LogLevel.WARNING.number == 30


@pytest.mark.parametrize("text", ["warn", "warning"])
def test_server_and_exporter_accept_warn_and_warning_alike(text, monkeypatch):
    from gpuscope.nvml.config import parse as exporter_flags
    from gpuscope.server.main import build_parser as server_parser

    monkeypatch.delenv("GPUSCOPE_LOG_LEVEL", raising=False)
    assert exporter_flags(["--log.level", text]).log_level is LogLevel.WARNING
    assert server_parser().parse_settings(["--log.level", text]).log_level is LogLevel.WARNING


def _command_settings() -> dict[str, type]:
    from gpuscope.diagnose.main import DiagnoseSettings
    from gpuscope.loadtest.compare import CompareFlags
    from gpuscope.loadtest.fault_drill import DrillSettings
    from gpuscope.nvml.config import Config
    from gpuscope.ops.generate import GenerateSettings
    from gpuscope.ops.stack_command import StackSettings
    from gpuscope.receiver.main import ReceiverSettings
    from gpuscope.server.config import ServerConfig
    from gpuscope.share.settings import ShareSettings

    return {"serve": ServerConfig, "exporter": Config, "receiver": ReceiverSettings, "stack": StackSettings,
            "generate": GenerateSettings, "share": ShareSettings, "diagnose": DiagnoseSettings,
            "compare": CompareFlags, "drill": DrillSettings}


@pytest.mark.parametrize("command", sorted(_command_settings()))
def test_every_command_declares_each_flag_once_and_parses_its_defaults(command, monkeypatch):
    settings = _command_settings()[command]
    flags = [flag for flag, _ in declared(settings)]
    for flag in flags:
        monkeypatch.delenv(flag.env_var, raising=False)
    names = [flag.name for flag in flags]
    assert len(names) == len(set(names)), names
    assert all(flag.help for flag in flags), command
    parsed = parser_for(settings, prog=command).parse_settings([])
    if command == "serve":  # the parser builds the profile group; validate() keeps it only when enabled
        parsed = dataclasses.replace(parsed, profile=None)
    assert parsed == settings()
