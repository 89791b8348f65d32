"""The fleet profile (gpuscope.ops.fleet, deploy/fleet/): configs, options, and a live fleet on loopback.

The live tests run two "hosts" (server, exporter, node_exporter and vmagent each) remote-writing to
one VictoriaMetrics, with vmalert evaluating the test profile's generated rules and Alertmanager
routing to the receiver. In order, on one fleet: the central store answers for both hosts; a host
whose server goes down alerts with its own labels and the other host does not; half a minute
without the central store loses no sample; every dashboard query returns data from the central store.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import requests
import yaml

from gpuscope.contract import uids
from gpuscope.dashboards import render as dashboards_render
from gpuscope.ops import fleet as fl
from gpuscope.ops import stack as st
from tests.conftest import require_binary, usage_error, wait_for
from tests.dashboards.conftest import SCRAPE_INTERVAL_S, TTFT_COUNT, LokiSink, send_traffic
from tests.dashboards.panels import queries
from tests.dashboards.test_live import query_problems
from tests.stack.conftest import StackCommand

ROOT = st.find_root()
FLEET = ROOT / "deploy" / "fleet"
HOSTS = ("hostA", "hostB")
BINARIES = ("victoria-metrics", "vmagent", "vmalert", "prometheus-alertmanager", "prometheus-node-exporter")
OUTAGE_S = 30.0
#: "No gap": consecutive samples of a series at most two scrape intervals apart (one late or
#: skipped scrape on a busy machine), where an undelivered buffer would leave a hole as long as the outage.
MAX_GAP_S = 2 * SCRAPE_INTERVAL_S + 1


def _say(line: str) -> None:
    print(f"fleet: {line}", file=sys.stderr, flush=True)  # the numbers of a run: pytest -s shows them


# --- configuration ------------------------------------------------------------------------------------


def test_agent_scrapes_what_the_single_host_prometheus_scrapes():
    agent = yaml.safe_load((FLEET / "vmagent.yml").read_text())
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert agent["global"]["scrape_interval"] == prometheus["global"]["scrape_interval"]
    assert agent["global"]["scrape_timeout"] == prometheus["global"]["scrape_timeout"]
    assert agent["global"]["external_labels"] == {"cluster": "%{GPUSCOPE_CLUSTER}",
                                                  "host": "%{GPUSCOPE_HOST}"}
    jobs = {j["job_name"]: j for j in agent["scrape_configs"]}
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prometheus["scrape_configs"]
               if "static_configs" in j}  # not the share profile's job (found through compose's DNS)
    for job in ("gpuscope-server", "gpuscope-exporter", "node"):
        assert jobs[job]["static_configs"][0]["targets"] == targets[job], job
    for job in jobs.values():  # instance is HOST:PORT on every job; no target label overrides host
        assert job["relabel_configs"][0]["target_label"] == "instance", job["job_name"]
        assert "host" not in job["static_configs"][0].get("labels", {}), job["job_name"]


def test_fleet_datasources_are_composes_with_victoria_metrics_for_prometheus():
    compose = yaml.safe_load((ROOT / dashboards_render.DATASOURCES).read_text())
    committed = (ROOT / dashboards_render.FLEET_DATASOURCES).read_text()
    assert committed == dashboards_render.fleet_datasources_yaml(), "stale: run gpuscope generate"
    fleet = yaml.safe_load(committed)
    prometheus = next(d for d in fleet["datasources"] if d["uid"] == uids.PROMETHEUS_DATASOURCE)
    assert prometheus["url"] == f"http://victoria-metrics:{fl.FLEET_PORTS['victoria-metrics']}"
    for config in (compose, fleet):
        for source in config["datasources"]:
            if source["uid"] == uids.PROMETHEUS_DATASOURCE:
                source.pop("url"), source.pop("name")
    assert fleet == compose


def test_render_rewrites_compose_addresses_and_the_cluster():
    addresses = {"victoria-metrics": "127.0.0.1:1", "alertmanager": "127.0.0.1:2", "vmalert": "127.0.0.1:3"}
    flags = fl.load_flags(ROOT)
    rendered = [fl.render(f, addresses, "c1") for f in flags["vmalert"]]
    assert "-datasource.url=http://127.0.0.1:1" in rendered
    assert "-notifier.url=http://127.0.0.1:2" in rendered
    assert "-external.url=http://127.0.0.1:3" in rendered
    assert "-external.label=cluster=c1" in rendered
    assert fl.render("-remoteWrite.url=http://victoria-metrics:8428/api/v1/write", addresses) == \
        "-remoteWrite.url=http://127.0.0.1:1/api/v1/write"


def test_rendered_configs_point_each_agent_at_its_own_host(tmp_path):
    fleet = fl.Fleet(fl.FleetOptions(hosts=HOSTS, ports="free", run_dir=tmp_path), log=lambda line: None)
    fleet.render_configs()
    for host in HOSTS:
        config = yaml.safe_load((tmp_path / host / "vmagent.yml").read_text())
        targets = {j["job_name"]: j["static_configs"][0]["targets"][0] for j in config["scrape_configs"]}
        assert targets == {"gpuscope-server": fleet.url(f"{host}/server")[7:],
                           "gpuscope-exporter": fleet.url(f"{host}/exporter")[7:],
                           "node": fleet.url(f"{host}/node-exporter")[7:],
                           "vmagent": fleet.url(f"{host}/vmagent")[7:]}
    central = yaml.safe_load((tmp_path / "central" / "victoria-metrics.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"][0] for j in central["scrape_configs"]}
    assert targets == {"victoria-metrics": fleet.url("victoria-metrics")[7:],
                       "vmalert": fleet.url("vmalert")[7:], "alertmanager": fleet.url("alertmanager")[7:],
                       "gpuscope-receiver": fleet.url("receiver")[7:]}


def test_default_ports_step_by_ten_per_host(tmp_path):
    # Constructing the fleet checks that no two parts of twenty hosts share a port.
    fleet = fl.Fleet(fl.FleetOptions(hosts=fl.MAX_HOSTS, run_dir=tmp_path), log=lambda line: None)
    assert fleet.url("host1/server").endswith(":8000") and fleet.url("host2/server").endswith(":8010")
    assert fleet.url("host2/vmagent").endswith(":8439")
    assert fleet.url("victoria-metrics").endswith(":8428") and fleet.url("alertmanager").endswith(":9093")


@pytest.mark.parametrize(("options", "needle"), [
    ({"hosts": 0}, "1 to 20 hosts"),
    ({"hosts": 21}, "1 to 20 hosts"),
    ({"hosts": ("a", "a")}, "unique"),
    ({"hosts": ("central",)}, "central"),
    ({"hosts": ("9lives",)}, "start with a letter"),
    ({"cluster": "a b"}, "cluster"),
    ({"ports": "random"}, "ports must be"),
])
def test_bad_options_raise_one_line(options, needle):
    with pytest.raises(st.StackError, match=needle) as err:
        fl.Fleet(fl.FleetOptions(**options), log=lambda line: None)
    assert "\n" not in str(err.value)


def test_unknown_part_names_the_parts(tmp_path):
    fleet = fl.Fleet(fl.FleetOptions(hosts=1, run_dir=tmp_path), log=lambda line: None)
    with pytest.raises(st.StackError, match="HOST/vmagent"):
        fleet.url("prometheus")


@pytest.mark.parametrize("argv", [["--stack.hosts", "21"], ["--stack.hosts", "two"],
                                  ["--stack.hosts", "2", "--no-stack.server"],
                                  ["--stack.hosts", "2", "--stack.port", "server=18000"]])
def test_bad_fleet_flags_exit_2_with_one_line(argv):
    usage_error("gpuscope", "stack", *argv)


@pytest.mark.distro
@pytest.mark.parametrize("profile", st.PROFILES)
def test_vmalert_accepts_the_generated_rules(profile):
    """vmalert parses every expression (MetricsQL) and annotation template of both profiles."""
    vmalert = require_binary("vmalert")
    result = subprocess.run([vmalert, "-dryRun", f"-rule={st.rule_dir(ROOT, profile) / '*.yml'}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.distro
@pytest.mark.parametrize(("binary", "config"), [("vmagent", "vmagent.yml"),
                                                ("victoria-metrics", "victoria-metrics.yml")])
def test_scrape_configs_load(binary, config):
    path = require_binary(binary)
    env = {**os.environ, "GPUSCOPE_CLUSTER": "c", "GPUSCOPE_HOST": "h"}
    result = subprocess.run([path, f"-promscrape.config={FLEET / config}", "-promscrape.config.dryRun"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distro
def test_command_starts_a_fleet_and_stops_on_sigterm(tmp_path):
    """`gpuscope stack --stack.hosts 1`: every part listed, the host's series in the central store,
    and a clean stop on SIGTERM."""
    for binary in BINARIES:
        require_binary(binary)
    args = ("--stack.hosts", "1", "--stack.profile", "test", "--stack.free-ports")
    with StackCommand(tmp_path, *args) as command:
        urls = command.urls(last="host1/vmagent")  # the summary lists the central parts, then the host's
        assert set(urls) == {*fl.CENTRAL_URLS, *(f"host1/{p}" for p in (*fl.HOST_PARTS, "vmagent"))}

        def host_up() -> bool:
            try:
                result = requests.get(urls["victoria-metrics"] + "/api/v1/query",
                                      params={"query": 'up{host="host1"} == 1', "nocache": "1"}, timeout=10)
                return len(result.json()["data"]["result"]) == 4
            except (requests.RequestException, ValueError, KeyError):
                return False

        wait_for(host_up, timeout=120, interval=0.5, what="host1's four targets up in the central store")
        children = command.children()
        assert len(children) == len(urls)
        command.stop_cleanly(children)
        assert (tmp_path / "central" / "logs" / "victoria-metrics.log").exists()
        assert (tmp_path / "host1" / "vmagent-queue").is_dir()


# --- a live fleet -------------------------------------------------------------------------------------


def query(fleet: fl.Fleet, expr: str, **params) -> list:
    """An instant query of the central store (``nocache``: late samples are read as they arrive)."""
    r = requests.post(fleet.url("victoria-metrics") + "/api/v1/query",
                      data={"query": expr, "nocache": "1", **params}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def try_query(fleet: fl.Fleet, expr: str, **params) -> list:
    try:
        return query(fleet, expr, **params)
    except requests.RequestException:  # a busy machine or a restarting store: ask again until the deadline
        return []


@pytest.fixture(scope="module")
def live_fleet():
    """Two hosts and the central parts (test profile, free ports), after traffic on both hosts and
    enough scrapes in the central store for the dashboards' rate() windows."""
    for binary in BINARIES:
        require_binary(binary)
    sink = LokiSink()  # the servers' log pipeline is live (its queue and drop panels need it)
    options = fl.FleetOptions(hosts=HOSTS, cluster="test", profile="test", ports="free",
                              server_args=["--loki.url", sink.url])
    with contextlib.closing(sink), fl.Fleet(options) as fleet:
        fleet.started_at = time.time()
        expected = 4 * len(HOSTS) + 4  # server, exporter, node, vmagent per host; the four central jobs
        wait_for(lambda: len(try_query(fleet, "up == 1")) == expected, timeout=90, interval=0.5,
                 what=f"{expected} targets up in the central store")
        for host in HOSTS:
            assert send_traffic(fleet.hosts[host]) == 2 * 12
        wait_for(lambda: len(try_query(fleet, f"sum by (host) (rate({TTFT_COUNT}[20s])) > 0")) == len(HOSTS),
                 timeout=90, interval=0.5, what="both hosts' server histograms in the central store")
        wait_for(lambda: try_query(fleet, "min(count_over_time(up[1m])) >= 5"), timeout=90, interval=0.5,
                 what="five scrapes of every target")
        for host in HOSTS:
            send_traffic(fleet.hosts[host], 4)  # fresh samples inside the last windows too
        yield fleet


@pytest.mark.slow
@pytest.mark.distro
def test_central_store_answers_for_every_host(live_fleet):
    for host in HOSTS:
        up = query(live_fleet, f'up{{host="{host}"}}')
        assert {r["metric"]["job"] for r in up} == {"gpuscope-server", "gpuscope-exporter", "node", "vmagent"}
        for r in up:
            assert r["metric"]["cluster"] == "test"
            assert r["metric"]["instance"].startswith(f"{host}:"), r["metric"]  # HOST:PORT, not 127.0.0.1
        requests_total = query(live_fleet, f'sum(gpuscope_requests_total{{host="{host}"}})')
        assert float(requests_total[0]["value"][1]) >= 2 * 12, host
        assert query(live_fleet, f'gpuscope_exporter_gpus{{host="{host}"}}'), host
    # The bottleneck recording rules keep host (node series carry it): vmalert writes them back per host.
    wait_for(lambda: {r["metric"].get("host") for r in try_query(live_fleet, "gpuscope:host_cpu_busy:ratio")}
             == set(HOSTS), timeout=90, interval=0.5, what="gpuscope:host_cpu_busy:ratio of both hosts")


@pytest.mark.slow
@pytest.mark.distro
def test_a_server_down_on_one_host_alerts_with_that_hosts_labels_only(live_fleet):
    """hostA's server stops: GPUServerDown (test profile: `for: 20s`) reaches Alertmanager and the
    receiver labelled host=hostA; hostB, whose server runs, has no such alert."""
    am, receiver = live_fleet.url("alertmanager"), live_fleet.url("receiver")
    stopped = time.monotonic()
    live_fleet.stop_part("hostA/server")

    def server_down_alerts() -> list[dict]:
        try:
            alerts = requests.get(am + "/api/v2/alerts", params={"filter": 'alertname="GPUServerDown"'},
                                  timeout=10).json()
        except (requests.RequestException, ValueError):
            return []
        return [a["labels"] for a in alerts if a["status"]["state"] == "active"]

    labels = wait_for(server_down_alerts, timeout=150, interval=0.5, what="GPUServerDown in Alertmanager")
    fired_s = time.monotonic() - stopped
    assert len(labels) == 1, labels
    assert labels[0]["host"] == "hostA" and labels[0]["cluster"] == "test", labels
    port = live_fleet.url("hostA/server").rsplit(":", 1)[1]
    assert labels[0]["instance"] == f"hostA:{port}", labels
    assert labels[0]["job"] == "gpuscope-server" and labels[0]["severity"] == "critical", labels

    def notified() -> list[dict]:
        try:
            notes = requests.get(receiver + "/alerts", timeout=10).json()["notifications"]
        except (requests.RequestException, ValueError):
            return []
        return [a["labels"] for n in notes for a in n["notification"]["alerts"]
                if a["labels"]["alertname"] == "GPUServerDown"]

    delivered = wait_for(notified, timeout=120, interval=0.5, what="GPUServerDown at the receiver")
    delivered_s = time.monotonic() - stopped
    assert {a["host"] for a in delivered} == {"hostA"}, delivered
    # hostB: no GPUServerDown anywhere, in vmalert's own view or in Alertmanager.
    answer = requests.get(live_fleet.url("vmalert") + "/api/v1/alerts", timeout=30).json()
    rules = answer["data"]["alerts"] or []  # vmalert answers null for none
    assert {a["labels"].get("host") for a in rules if a["name"] == "GPUServerDown"} == {"hostA"}, rules
    assert {a["host"] for a in server_down_alerts()} == {"hostA"}
    _say(f"GPUServerDown for hostA in Alertmanager {fired_s:.1f}s after its server stopped, "
         f"at the receiver after {delivered_s:.1f}s")
    live_fleet.start_part("hostA/server")  # the fleet whole again for the tests after this one


def raw_samples(fleet: fl.Fleet, selector: str, start: float, end: float) -> dict[str, list[float]]:
    """Timestamps of the raw samples of every series in [start, end], keyed by its labels."""
    result = try_query(fleet, f"{selector}[{int(end - start) + 1}s]", time=end)
    return {",".join(f"{k}={v}" for k, v in sorted(r["metric"].items())): [float(t) for t, _ in r["values"]]
            for r in result}


def largest_gap(timestamps: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(timestamps)), default=float("inf"))


@pytest.mark.slow
@pytest.mark.distro
def test_half_a_minute_without_the_central_store_loses_no_sample(live_fleet):
    """VictoriaMetrics stops for half a minute while the agents keep scraping and queue on disk;
    midway hostB's agent restarts (its queue must survive that); after the store is back, every
    series of both hosts has its samples of that half minute: no gap."""
    selectors = [f'up{{host=~"{"|".join(HOSTS)}"}}', f'gpuscope_exporter_gpus{{host=~"{"|".join(HOSTS)}"}}']
    down = time.time()
    live_fleet.stop_part("victoria-metrics")
    deadline = down + OUTAGE_S
    time.sleep(OUTAGE_S / 2)
    live_fleet.stop_part("hostB/vmagent")
    live_fleet.start_part("hostB/vmagent")
    time.sleep(max(0.0, deadline - time.time()))
    pending = {}  # what each agent holds on disk for the store at the end of the outage
    for host in HOSTS:
        metrics = requests.get(live_fleet.url(f"{host}/vmagent") + "/metrics", timeout=30).text
        pending[host] = sum(float(v) for v in re.findall(
            r"^vmagent_remotewrite_pending_data_bytes\{[^}]*\} (\S+)$", metrics, re.M))
    up = time.time()
    live_fleet.start_part("victoria-metrics")
    window = (down - 3 * SCRAPE_INTERVAL_S, up + 2 * SCRAPE_INTERVAL_S)

    def complete() -> dict[str, list[float]] | None:
        if time.time() < window[1] + SCRAPE_INTERVAL_S:
            return None
        series = {k: v for s in selectors for k, v in raw_samples(live_fleet, s, *window).items()}
        if len(series) != 5 * len(HOSTS):  # up of 4 jobs and one gpuscope series per host
            return None
        whole = all(ts and ts[0] <= window[0] + MAX_GAP_S and ts[-1] >= window[1] - MAX_GAP_S
                    and largest_gap(ts) <= MAX_GAP_S for ts in series.values())
        return series if whole else None

    series = wait_for(complete, timeout=180, interval=1.0,
                      what=f"every series of both hosts without a gap over {MAX_GAP_S}s across the outage")
    delivered_s = time.time() - up
    in_outage = {k: sum(down <= t <= up for t in ts) for k, ts in series.items()}
    assert min(in_outage.values()) >= (up - down) / SCRAPE_INTERVAL_S - 2, in_outage
    counts = {r["metric"]["host"]: r["value"][1]
              for r in try_query(live_fleet, f'count by (host) ({{host=~"{"|".join(HOSTS)}"}})')}
    _say(f"series per host: {counts}")
    _say(f"central store down {up - down:.0f}s; {sum(in_outage.values())} samples of {len(series)} series "
         f"scraped meanwhile, all delivered {delivered_s:.1f}s after it came back (largest gap "
         f"{max(largest_gap(ts) for ts in series.values()):.1f}s); vmagent disk queues when it came back: "
         + ", ".join(f"{h} {b / 1024:.0f} KiB" for h, b in pending.items()))


@contextlib.contextmanager
def steady_traffic(stack: st.Stack, limit_s: float = 240.0) -> Iterator[None]:
    """Requests from both tenants, one at a time, from a thread, until the block ends (or ``limit_s``)."""
    stop = threading.Event()

    def send() -> None:
        deadline, i = time.monotonic() + limit_s, 0
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                requests.post(stack.url("server") + "/v1/completions", timeout=30,
                              json={"prompt": f"steady {i}", "max_tokens": 4},
                              headers={"X-Tenant": ("alpha", "beta")[i % 2]})
            i += 1
            stop.wait(0.5)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


#: Panels only a `gpuscope share` controller feeds: the fleet runs none, so they have no data here
#: (tests/dashboards/test_live.py checks them against a running controller).
SHARE_ONLY = {("gpuscope-tenants", "Device memory per tenant against its cap", "A"),
              ("gpuscope-tenants", "Device memory per tenant against its cap", "B"),
              ("gpuscope-tenants", "Memory cap held per tenant", "A"),
              ("gpuscope-tenants", "Allocations refused at the memory cap", "A")}


@pytest.mark.slow
@pytest.mark.distro
def test_every_dashboard_query_returns_data_from_the_central_store(live_fleet):
    """tests/dashboards/test_live.py's proof, against VictoriaMetrics instead of Prometheus.

    Under steady traffic: VictoriaMetrics leaves NaN points out of its answers where Prometheus
    returns them, so an instant ratio over an idle service (0/0, e.g. the tenants' share against
    quota) is "no data" here, and would show as such in Grafana, where Prometheus answers NaN.
    """

    class Central:  # what evaluate() reads of a stack: the query URL, and since when there is data
        started_at = live_fleet.started_at

        @staticmethod
        def url(part: str) -> str:
            return live_fleet.url("victoria-metrics")

    def problems() -> list[str]:
        failing, stale = query_problems(Central)
        return [p for p in failing if not any(p.startswith(f"{key}: no data") for key in SHARE_ONLY)] + stale

    assert len(queries("prometheus")) > 80
    with steady_traffic(live_fleet.hosts["hostB"]):
        wait_for(lambda: try_query(live_fleet, 'sum(rate(gpuscope_requests_total{host="hostB"}[20s])) > 0',
                                   nocache="0"),
                 timeout=60, interval=0.5, what="the steady traffic in the central store's instant answers")
        # Recording rules that vmalert writes back may still be filling their windows: ask again until then.
        deadline = time.monotonic() + 90
        while (found := problems()) and time.monotonic() < deadline:
            time.sleep(5)
    assert not found, "\n".join(found)
