"""The comparison against endpoints it does not start: ``--target NAME=URL[#MODEL]``."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscope.loadtest import compare
from gpuscope.loadtest.serverproc import ServerProcess, free_port
from gpuscope.loadtest.targets import Target, TargetError, list_models, parse_target, resolve_model
from tests.conftest import usage_error


@pytest.mark.parametrize(("spec", "target"), [
    ("a=http://127.0.0.1:8000", Target("a", "http://127.0.0.1:8000")),
    ("vllm-0.9=http://gpu-1:8000/v1/#meta-llama/Llama-3.1-8B-Instruct",
     Target("vllm-0.9", "http://gpu-1:8000", "meta-llama/Llama-3.1-8B-Instruct")),
    ("gw=https://gateway.internal/llm/", Target("gw", "https://gateway.internal/llm")),
    ("c=http://h:8000/v1/chat/completions#m", Target("c", "http://h:8000", "m", "chat")),
    ("p=http://h:8000/v1/completions/", Target("p", "http://h:8000", "", "completions")),
])
def test_target_specs(spec, target):
    assert parse_target(spec) == target


@pytest.mark.parametrize(("spec", "needle"), [
    ("http://127.0.0.1:8000", "is not NAME=URL"),
    ("a=", "is not NAME=URL"),
    ("a b=http://x", "target name 'a b'"),
    ("a=127.0.0.1:8000", "is not an http:// or https:// URL"),
    ("a=http://x/?key=1", "must not have a query"),
])
def test_bad_target_specs(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_target(spec)


def _keys(settings: compare.Settings) -> list[str]:
    return [c.key for c in settings.configs]


def test_sets_and_targets_semantics(monkeypatch):
    monkeypatch.delenv("GPUSCOPE_TARGET", raising=False)
    monkeypatch.delenv("GPUSCOPE_SETS", raising=False)
    everything = compare.parse_settings(["--batch.sizes", "4"])
    assert _keys(everything)[0] == "timing-off" and not everything.targets  # no flag: every set
    only = compare.parse_settings(["--target", "a=http://127.0.0.1:1", "--target", "b=http://127.0.0.1:2#m"])
    assert _keys(only) == ["targets-a", "targets-b"]  # targets alone: no set unless asked for
    assert [(c.url, c.model) for c in only.targets] == [("http://127.0.0.1:1", ""),
                                                         ("http://127.0.0.1:2", "m")]
    both = compare.parse_settings(["--sets", "timing", "--target", "a=http://127.0.0.1:1"])
    assert _keys(both) == ["timing-off", "timing-budget", "timing-all", "targets-a"]
    assert [c.key for c in both.started_configs] == ["timing-off", "timing-budget", "timing-all"]
    none = compare.parse_settings(["--sets", "none", "--target", "a=http://127.0.0.1:1"])
    assert _keys(none) == ["targets-a"]
    # The environment variable holds several, space-separated; flags replace it.
    monkeypatch.setenv("GPUSCOPE_TARGET", "x=http://127.0.0.1:1 y=http://127.0.0.1:2")
    assert _keys(compare.parse_settings([])) == ["targets-x", "targets-y"]
    assert _keys(compare.parse_settings(["--target", "z=http://127.0.0.1:3"])) == ["targets-z"]


def test_each_repetition_has_its_own_seed_and_the_model_is_passed_to_locust(tmp_path):
    settings = compare.parse_settings(["--target", "a=http://127.0.0.1:1#m", "--load.seed", "40",
                                       "--no-load.ignore-eos"])
    command = compare.locust_command(settings, "http://127.0.0.1:1", tmp_path, "m", rep=3)
    assert command[command.index("--seed") + 1] == "42"
    assert command[command.index("--model") + 1] == "m"
    assert command[command.index("--ignore-eos") + 1] == "false"


def test_the_api_is_the_one_a_target_url_names_unless_load_api_says(tmp_path):
    chat_url = "c=http://127.0.0.1:1/v1/chat/completions"
    settings = compare.parse_settings(["--sets", "timing", "--target", chat_url, "--target", "p=http://127.0.0.1:2"])
    assert [settings.api_of(c) for c in settings.configs] == ["completions"] * 3 + ["chat", "completions"]
    chat = settings.configs[3]
    command = compare.locust_command(settings, chat.url, tmp_path, "m", api=settings.api_of(chat))
    assert command[command.index("--api") + 1] == "chat" and chat.url == "http://127.0.0.1:1"
    forced = compare.parse_settings(["--target", "c=http://127.0.0.1:1/v1/chat/completions",
                                     "--load.api", "completions"])
    assert forced.api_of(forced.configs[0]) == "completions"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--sets", "none"], "nothing to compare: --sets none and no --target"),
    (["--sets", "none,timing", "--target", "a=http://127.0.0.1:1"], "'none' cannot be combined"),
    (["--target", "a=http://127.0.0.1:1", "--target", "a=http://127.0.0.1:2"], "'a' is given twice"),
    (["--target", "a=ftp://x"], "is not an http:// or https:// URL"),
])
def test_bad_target_flags_fail_with_one_line(argv, needle):
    assert needle in usage_error("gpuscope.loadtest.compare", *argv)


def _compare_cli(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope.loadtest.compare", *argv, "--output.dir",
                           str(tmp_path), "--output.name", "x"], capture_output=True, text=True, timeout=120)


def test_target_that_does_not_answer_is_one_line_and_exit_2(tmp_path, paced_server):
    closed = f"http://127.0.0.1:{free_port()}"
    result = _compare_cli(["--target", f"up={paced_server.url}", "--target", f"down={closed}"], tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    # The first target has no /v1/models (the paced server's default): it is the one named.
    assert lines[0].startswith("gpuscope compare: error: target 'up': GET ")
    assert "/v1/models: HTTP 404" in lines[0]
    result = _compare_cli(["--target", f"down={closed}"], tmp_path)
    assert result.returncode == 2 and "target 'down': GET " + closed + "/v1/models: " in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_models_of_a_target(paced_server):
    paced_server.model = "org/m"
    assert list_models(paced_server.url + "/v1/") == ["org/m"]
    assert resolve_model(Target("a", paced_server.url)).model == "org/m"
    assert resolve_model(Target("a", paced_server.url, "org/m")).model == "org/m"
    with pytest.raises(TargetError, match=r"does not serve model 'other' \(it lists: org/m\)"):
        resolve_model(Target("a", paced_server.url, "other"))


@pytest.mark.slow
def test_comparison_of_two_servers_and_a_vllm_style_endpoint_given_as_targets(tmp_path, paced_server):
    paced_server.first_s, paced_server.gap_s = 0.05, 0.02
    paced_server.dialect, paced_server.model = "vllm", "org/paced-7b"
    with ServerProcess(["--model.layers", "1"], log_path=tmp_path / "a.log") as a, \
            ServerProcess(["--model.layers", "1", "--no-batching"], log_path=tmp_path / "b.log") as b:
        served = list_models(a.url)[0]
        progress = io.StringIO()
        code = compare.main(["--target", f"serve-a={a.url}", "--target", f"serve-b={b.url}/v1",
                             "--target", f"fake-vllm={paced_server.url}#org/paced-7b", "--repeats", "2",
                             "--run.duration", "2s", "--run.warmup", "1s", "--run.users", "2",
                             "--load.output-tokens", "uniform:min=4,max=12", "--output.dir", str(tmp_path),
                             "--output.name", "ci"], progress=progress)
    assert code == 0, progress.getvalue()
    md = (tmp_path / "compare-ci.md").read_text()
    assert "## targets" in md and "![targets](compare-ci-targets.png)" in md
    for name in ("serve-a", "serve-b", "fake-vllm"):
        assert f"| {name} |" in md
    assert f"fake-vllm = {paced_server.url} (model `org/paced-7b`)" in md
    assert "- **server**" not in md  # no gpuscope serve was started by the command
    rows = list(csv.DictReader((tmp_path / "compare-ci.csv").read_text().splitlines()))
    runs = {(r["configuration"], r["rep"]) for r in rows}
    assert runs == {(n, rep) for n in ("serve-a", "serve-b", "fake-vllm") for rep in ("1", "2")}
    assert all(r["set"] == "targets" and float(r["tps"]) > 0 and float(r["error_rate"]) == 0 for r in rows)
    urls = {r["configuration"]: (r["url"], r["model"]) for r in rows}
    assert urls == {"serve-a": (a.url, served), "serve-b": (b.url, served),
                    "fake-vllm": (paced_server.url, "org/paced-7b")}
    assert (tmp_path / "compare-ci-targets.png").stat().st_size > 10_000
    for name, rep in runs:
        html = tmp_path / "compare-ci-runs" / f"targets-{name}-r{rep}" / "locust.html"
        assert html.stat().st_size > 10_000
    # The vLLM-style endpoint got the model it serves and ignore_eos.
    bodies = paced_server.received
    assert bodies and all(body["model"] == "org/paced-7b" and body["ignore_eos"] is True for body in bodies)
    started = [line for line in progress.getvalue().splitlines() if line.startswith("[")]
    assert started == ["[1/6] targets/serve-a rep 1/2", "[2/6] targets/serve-b rep 1/2",
                       "[3/6] targets/fake-vllm rep 1/2", "[4/6] targets/serve-a rep 2/2",
                       "[5/6] targets/serve-b rep 2/2", "[6/6] targets/fake-vllm rep 2/2"]
