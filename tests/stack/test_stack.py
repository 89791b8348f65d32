"""`gpuscope stack`: config templating, option errors, and a live run of the command."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import requests
import yaml

from gpuscope.contract import profiles
from gpuscope.contract.parts import PORTS
from gpuscope.ops import stack as st
from gpuscope.util import freeport
from tests.conftest import require_binary, usage_error, wait_for
from tests.stack.conftest import StackCommand

ADDRESSES = {"server": "127.0.0.1:18000", "receiver": "127.0.0.1:19095", "alertmanager": "127.0.0.1:19093"}


def test_localize_rewrites_only_compose_addresses():
    text = ("url: http://receiver:9095/alerts\n- server:8000\n- gpuscope-server:8000\n- myserver:8000\n"
            "- server:80001\n- receiver:1234\n")
    out = st.localize(text, ADDRESSES)
    assert "http://127.0.0.1:19095/alerts" in out
    assert "- 127.0.0.1:18000\n" in out
    for untouched in ("gpuscope-server:8000", "myserver:8000", "server:80001", "receiver:1234"):
        assert untouched in out


def test_render_prometheus_config():
    source = (Path(st.find_root()) / "deploy" / "prometheus" / "prometheus.yml").read_text()
    addresses = {name: f"127.0.0.1:{20000 + i}" for i, name in enumerate(st.COMPONENTS)}
    config = yaml.safe_load(st.render_prometheus_config(source, addresses, ["/rules/*.yml"], "1s"))
    targets = {j["job_name"]: j["static_configs"][0]["targets"][0] for j in config["scrape_configs"]}
    assert targets["gpuscope-server"] == addresses["server"]
    assert targets["node"] == addresses["node-exporter"]
    assert config["rule_files"] == ["/rules/*.yml"]
    assert config["global"]["evaluation_interval"] == "1s"
    assert config["global"]["scrape_interval"] == "5s"  # everything else as in the compose file


@pytest.mark.parametrize("profile", st.PROFILES)
def test_prometheus_is_told_the_interval_its_rule_groups_run_at(tmp_path, profile):
    """Every generated rule group pins its profile's evaluation interval, which wins over Prometheus's
    global one: the stack's rendered prometheus.yml states that same interval, not another."""
    stack = st.Stack(st.StackOptions(profile=profile, run_dir=tmp_path, components=["prometheus"]),
                     log=lambda line: None)
    stack.render_configs()
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    pinned = {group.get("interval") for pattern in config["rule_files"]
              for path in sorted(Path("/").glob(pattern.lstrip("/")))
              for group in yaml.safe_load(path.read_text())["groups"]}
    expected = f"{profiles.PROFILES[profile].evaluation_interval}s"
    assert pinned == {expected}
    assert config["global"]["evaluation_interval"] == expected


def test_the_docs_give_the_test_profiles_evaluation_interval():
    text = (Path(st.find_root()) / "docs" / "stack.md").read_text()
    assert re.findall(r"rules evaluated every (\d+) s", text) == [str(profiles.TEST.evaluation_interval)] * 2
    assert not re.search(r"\d+ ?s (rule )?evaluation\b", text)  # no other wording with another number


def test_profiles_pick_their_rules_and_alertmanager_config():
    root = st.find_root()
    assert st.rule_dir(root, "test") == root / "alerts" / "prometheus" / "test"
    assert st.alertmanager_source(root, "production").name == "alertmanager.yml"
    assert st.alertmanager_source(root, "test").name == "alertmanager-test-profile.yml"
    for profile in st.PROFILES:
        assert list(st.rule_dir(root, profile).glob("*.yml")), profile
        assert st.alertmanager_source(root, profile).exists(), profile


@pytest.mark.parametrize(("options", "needle"), [
    ({"profile": "staging"}, "profile"),
    ({"ports": {"grafana": 1}}, "unknown parts"),
    ({"ports": "random"}, "ports must be"),
    ({"components": ["server", "loki"]}, "unknown parts"),
])
def test_bad_options_raise_one_line(options, needle):
    with pytest.raises(st.StackError, match=needle) as err:
        st.Stack(st.StackOptions(**options))
    assert "\n" not in str(err.value)


def test_missing_binary_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    stack = st.Stack(st.StackOptions(ports="free", run_dir=tmp_path, components=["alertmanager"]),
                     log=lambda line: None)
    with pytest.raises(st.StackError, match="apt-get install prometheus-alertmanager"):
        stack.start()


class LowestFreePort:
    """A socket whose bind to port 0 gets the lowest port no open one of these holds: an OS may hand
    a port just closed to the next bind, which is how one-at-a-time picking gave two parts one port."""

    held: ClassVar[set[int]] = set()

    def __init__(self) -> None:
        self.port = 0

    def bind(self, address: tuple[str, int]) -> None:
        self.port = 40000
        while self.port in self.held:
            self.port += 1
        self.held.add(self.port)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def __enter__(self) -> LowestFreePort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.held.discard(self.port)


def test_free_ports_are_distinct_even_where_a_closed_port_comes_straight_back(monkeypatch):
    monkeypatch.setattr(freeport, "socket", SimpleNamespace(socket=LowestFreePort))
    stack = st.Stack(st.StackOptions(ports="free"), log=lambda line: None)
    chosen = [int(stack.url(name).rsplit(":", 1)[1]) for name in st.COMPONENTS]
    assert len(set(chosen)) == len(chosen) == len(st.COMPONENTS)
    assert not LowestFreePort.held, "every socket is closed once the ports are chosen"


def test_default_ports_are_the_parts_table():
    stack = st.Stack(st.StackOptions(), log=lambda line: None)
    assert {name: int(stack.url(name).rsplit(":", 1)[1]) for name in st.COMPONENTS} == \
        {name: PORTS[name] for name in st.COMPONENTS}


@pytest.mark.parametrize("argv", [["--stack.port", "nope"], ["--stack.port", "grafana=3000"],
                                  ["--stack.profile", "staging"], ["--bogus"]])
def test_bad_flags_exit_2_with_one_line(argv):
    usage_error("gpuscope", "stack", *argv)


@pytest.mark.slow
@pytest.mark.distro
def test_command_starts_everything_routes_an_alert_and_stops_on_sigterm(tmp_path):
    """The CLI end to end: parts healthy, Prometheus scraping all six jobs, an alert through
    Alertmanager (its templated webhook URL) to the receiver, and a clean stop on SIGTERM."""
    for binary in ("prometheus", "prometheus-alertmanager", "prometheus-node-exporter"):
        require_binary(binary)
    with StackCommand(tmp_path, "--stack.profile", "test", "--stack.free-ports") as command:
        lines = command.urls(last="prometheus")  # the summary lists every part, prometheus last
        assert set(lines) == set(st.COMPONENTS)
        prom, am, receiver = lines["prometheus"], lines["alertmanager"], lines["receiver"]

        jobs = {"gpuscope-server", "gpuscope-exporter", "node", "gpuscope-receiver", "prometheus",
                "alertmanager"}
        up: dict[str, str] = {}

        def all_jobs_up() -> bool:
            try:
                result = requests.get(prom + "/api/v1/query", params={"query": "up"}, timeout=10).json()
            except requests.RequestException:  # a busy machine: ask again until the deadline
                return False
            series = result["data"]["result"]
            up.clear()
            up.update({f'{r["metric"]["job"]} {r["metric"].get("instance")}': r["value"][1] for r in series})
            return {r["metric"]["job"] for r in series if r["value"][1] == "1"} == jobs

        try:
            wait_for(all_jobs_up, timeout=120, interval=0.5, what="all six jobs up in Prometheus")
        except pytest.fail.Exception:
            pytest.fail(f"not all six jobs up in Prometheus: {up}; see {tmp_path / 'logs'}")
        alert = [{"labels": {"alertname": "GpuscopeStackSmoke", "severity": "warning",
                             "service": "gpuscope-server", "instance": "smoke"},
                  "annotations": {"summary": "stack smoke test"}}]
        requests.post(am + "/api/v2/alerts", json=alert, timeout=30).raise_for_status()

        def delivered() -> bool:
            try:
                notes = requests.get(receiver + "/alerts", timeout=10).json()["notifications"]
            except requests.RequestException:
                return False
            return any(a["labels"]["alertname"] == "GpuscopeStackSmoke"
                       for n in notes for a in n["notification"]["alerts"])

        wait_for(delivered, timeout=120, interval=0.5, what="the alert at the receiver (after group_wait)")
        children = command.children()
        assert len(children) == len(st.COMPONENTS)
        command.stop_cleanly(children)
        assert (tmp_path / "logs" / "prometheus.log").exists()
