"""Every LogQL expression (dashboards, the exemplar link, Loki ruler rules) parses with Grafana's grammar.

Loki cannot run here. tools/logql/check.mjs parses with @grafana/lezer-logql, the grammar Grafana's
own Loki query editor uses; scripts/test.sh installs it with `npm ci` in tools/logql.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from gpuscope.dashboards import common
from tests.conftest import STRICT, require_binary
from tests.dashboards.panels import ROOT, queries, substitute

TOOL = ROOT / "tools" / "logql"


def check(exprs: list[str]) -> list[dict]:
    node = require_binary("node")
    if not (TOOL / "node_modules" / "@grafana" / "lezer-logql").is_dir():
        message = "tools/logql has no node_modules: run `npm ci` there (scripts/test.sh does)"
        if STRICT:
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run([node, str(TOOL / "check.mjs")], input=json.dumps(exprs), capture_output=True,
                            text=True, timeout=60, cwd=TOOL)
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def loki_rule_exprs() -> list[tuple[str, str]]:
    found = []
    for path in sorted((ROOT / "alerts" / "loki").glob("*/fake/*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                found.append((f"{path.relative_to(ROOT)}: {rule.get('alert') or rule.get('record')}",
                              rule["expr"]))
    return found


def test_checker_rejects_broken_logql():
    # A checker that accepts everything would make the tests below worthless.
    results = check(['{service="gpuscope-server"} |= "ok"', '{service="gpuscope-server" |= "x"',
                     'sum(rate({a="b"}[5m]) by'])
    assert [r["ok"] for r in results] == [True, False, False]


def test_dashboard_logql_parses():
    exprs = {f"{q.dashboard}/{q.panel}": substitute(q.expr, "20s", "5s", "3600s") for q in queries("loki")}
    assert len(exprs) >= 3
    bad = [(where, r) for (where, _), r in zip(exprs.items(), check(list(exprs.values())), strict=True)
           if not r["ok"]]
    assert not bad, bad


def test_exemplar_link_logql_parses():
    (result,) = check([common.EXEMPLAR_LOGQL.replace("TRACE_ID", "4bf92f3577b34da6a3ce929d0e0e4736")])
    assert result["ok"], result


def test_loki_ruler_rules_parse():
    rules = loki_rule_exprs()
    assert rules, "no Loki ruler rules under alerts/loki/<profile>/fake/"
    bad = [(where, r) for (where, _), r in zip(rules, check([e for _, e in rules]), strict=True)
           if not r["ok"]]
    assert not bad, bad
