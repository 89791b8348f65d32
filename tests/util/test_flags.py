import pytest

from gpuscope.util.flags import FlagParser, checked, parse_duration


@pytest.mark.parametrize(("text", "seconds"), [("1s", 1.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_zero_only_when_allowed():
    assert parse_duration("0s", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match="greater than zero"):
        parse_duration("0s")
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_bad_environment_value_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("GPUSCOPE_RUN_DURATION", "soon")
    parser = FlagParser(prog="demo")
    with pytest.raises(SystemExit) as exit_info:
        parser.add_flag("--run.duration", type=checked(parse_duration), default=1.0)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPUSCOPE_RUN_DURATION='soon'" in err and "not a duration" in err


def test_bad_flag_value_message_reaches_the_user(capsys):
    parser = FlagParser(prog="demo")
    parser.add_flag("--interval", type=checked(parse_duration), default=1.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--interval=soon"])
    assert "is not a duration" in capsys.readouterr().err
