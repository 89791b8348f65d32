"""Every generated rule, evaluated by a real Prometheus over a realistic fleet, without an error.

Prometheus drops a rule whose evaluation errors (a many-to-many join, a duplicate series) and keeps
going: the alert then never fires, silently. This test backfills two hours of the fleet of
``tests/alerts/fleet.py`` (MIG, Kubernetes labels with a pod replacement, both ServiceMonitor modes,
dcgm-exporter's old and per-code XID, two vLLM data-parallel engines, the bundle's own server and
exporter) with ``promtool tsdb create-blocks-from openmetrics``, starts Prometheus on it with every
generated rule file of a profile (each source's layer and every alert), and reads ``/api/v1/rules``
once every group has been evaluated twice: any rule whose health is not ``ok`` fails the test, named
with its group and error.
"""

from __future__ import annotations

import calendar
import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from gpuscope.alerting import generate, sources
from gpuscope.contract import names
from gpuscope.contract.profiles import PROFILES, Profile
from gpuscope.ops import procs
from gpuscope.util.freeport import free_port
from tests.alerts import fleet
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]
HISTORY_S = 2 * 3600
#: The history ends when it is written: Prometheus' head takes no sample older than the newest block,
#: so every rule is evaluated after it, with the newest raw samples seconds old (inside the lookback).
FUTURE_S = 0
STEP_S = 30
#: Evaluation interval of the copies Prometheus loads: the rules as generated, evaluated often, so
#: two rounds of every group take seconds. The expressions (and their windows) are untouched.
EVAL_S = 2
DEADLINE_S = 90


def rule_files(p: Profile) -> list[str]:
    """Every rule file of a profile Prometheus can load at once: every alert and derived series, and
    each source's layer (``sources.rules.yml`` is two of those layers again)."""
    return [generate.prometheus_rules_path(p), *(generate.source_rules_path(p, s) for s in sources.SOURCES)]


@pytest.fixture(scope="module")
def backfill(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """TSDB blocks of the fleet's history, ending now (and the time the history ends)."""
    promtool = require_binary("promtool")
    work = tmp_path_factory.mktemp("fleet")
    now = time.time()
    source = work / "fleet.om"
    with source.open("w") as out:
        out.writelines(fleet.openmetrics(now, HISTORY_S, FUTURE_S, STEP_S))
    blocks = work / "blocks"
    done = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(blocks)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return blocks, now


def _copy_rules(p: Profile, into: Path) -> list[Path]:
    copies = []
    for rel in rule_files(p):
        doc = yaml.safe_load((ROOT / rel).read_text())
        for group in doc["groups"]:
            group["interval"] = f"{EVAL_S}s"
        path = into / rel.replace("/", "_")
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        copies.append(path)
    return copies


def _groups(url: str) -> list[dict]:
    return requests.get(f"{url}/api/v1/rules", timeout=5).json()["data"]["groups"]


def _evaluated_twice(groups: list[dict], since: float) -> bool:
    """Every group's last evaluation began at least one interval after ``since`` (a second round)."""
    def started(group: dict) -> float:
        match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", group.get("lastEvaluation", ""))
        return calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")) if match else 0
    return bool(groups) and all(started(g) >= since + EVAL_S for g in groups)


@contextlib.contextmanager
def evaluated(p: Profile, blocks: Path, work: Path) -> Iterator[tuple[str, list[dict]]]:
    """Prometheus on a copy of the blocks with the profile's rules, once every group has been evaluated
    twice: its URL and its rule groups as ``/api/v1/rules`` reports them."""
    data = work / "data"
    shutil.copytree(blocks, data)
    config = work / "prometheus.yml"
    files = _copy_rules(p, work)
    config.write_text(yaml.safe_dump({"global": {"evaluation_interval": f"{EVAL_S}s"},
                                      "rule_files": [str(f) for f in files]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = procs.Child([require_binary("prometheus"), f"--config.file={config}",
                         f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{port}",
                         "--storage.tsdb.retention.time=30d"],
                        name="prometheus", log_path=work / "prometheus.log", ready=f"{url}/-/ready",
                        grace_s=10)
    with child:
        child.wait_ready(60)
        started = time.time()
        deadline = started + DEADLINE_S
        groups = _groups(url)
        while not _evaluated_twice(groups, started) and time.time() < deadline:
            time.sleep(0.5)
            groups = _groups(url)
        assert _evaluated_twice(groups, started), "Prometheus did not evaluate every group twice in time"
        loaded = sum(len(g["rules"]) for g in groups)
        assert loaded == sum(len(g["rules"]) for f in files for g in yaml.safe_load(f.read_text())["groups"])
        yield url, groups


def query(url: str, expr: str) -> list[dict[str, str]]:
    """The label sets of an instant query's result (values as the ``value`` label)."""
    result = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert result["status"] == "success", result
    return [{**r["metric"], "value": r["value"][1]} for r in result["data"]["result"]]


@pytest.mark.distro
@pytest.mark.parametrize("profile", PROFILES.values(), ids=lambda p: p.name)
def test_every_rule_evaluates_without_error_over_the_fleet(profile: Profile, backfill,
                                                          tmp_path: Path) -> None:
    blocks, _ = backfill
    with evaluated(profile, blocks, tmp_path) as (url, groups):
        errors = [f"{g['name']} / {r.get('name')}: {r.get('lastError', '')}"
                  for g in groups for r in g["rules"] if r.get("health") != "ok"]
        assert not errors, "rules that error on the fleet (Prometheus drops them):\n" + "\n".join(errors)
        dcgm = f'{{job="{fleet.DCGM_JOB}"}}'
        # One series per GPU or MIG instance and target, through the pod replacements and in both
        # ServiceMonitor modes; the GPUs per target counted once each.
        gpus = {(r["instance"], r["value"]) for r in query(url, names.EXPORTER_GPUS + dcgm)}
        assert gpus == {("10.42.1.17:9400", "2"), ("10.42.2.23:9400", "3"), ("gpu-node-3:9400", "2")}
        for record in (names.GPU_MEMORY_USED, names.GPU_MEMORY_HEADROOM, names.GPU_XID_CODE):
            keys = [(r["instance"], r["gpu"]) for r in query(url, record + dcgm)]
            assert sorted(keys) == sorted(set(keys)) and len(keys) == 7, (record, keys)
        codes = {(r["instance"], r["gpu"]): r["value"] for r in query(url, names.GPU_XID_CODE + dcgm)}
        assert codes[("10.42.2.23:9400", "1")] == "79" and codes[("gpu-node-3:9400", "0")] == "48"
        # The bundle's exporter with pod attribution: one memory series per GPU through the replacement.
        own = [r["gpu"] for r in query(url, names.GPU_MEMORY_HEADROOM + '{job="gpuscope-exporter"}')]
        assert sorted(own) == ["0", "1"], own
        info = query(url, names.GPU_INFO + '{job="gpuscope-exporter"}')
        assert {(r["gpu"], r.get("pod", "")) for r in info} == {("0", "vllm-0-6b8d9f7c4-t7xvn"), ("1", "")}
        # The workload (who to call), whichever way the scrape wrote it; none for an idle GPU.
        owners = {(r["instance"], r["gpu"]): r.get("pod", "") for r in query(url, names.GPU_INFO + dcgm)}
        assert owners == {("10.42.1.17:9400", "0"): "vllm-7c9f6d5b8-x2x4q", ("10.42.1.17:9400", "1"): "",
                          ("10.42.2.23:9400", "0/gi1"): "embed-6d8f9c7b5-2mzqf",
                          ("10.42.2.23:9400", "0/gi2"): "rerank-5c7d8b6f4-h7t2v",
                          ("10.42.2.23:9400", "1"): "vllm-59b7f4c6d9-zr6kc",
                          ("gpu-node-3:9400", "0"): "", ("gpu-node-3:9400", "1"): ""}
